"""`plait bench`: each benchmark measures plait against its peer in the same run.

Where a benchmark NAME lives: its options in configs/ (one config dataclass, the
defaults of CLI and workers alike), its parent side in jobs/NAME.py (launch, repeats,
collect, tables), its measuring ranks in NAME.py (`python -m plait.bench.NAME`, which
imports torch), the JSON hand-off between them in worker_io.py, and what every report
shares (paired ratios, medians, tables, Markdown) in report.py. What the `--device cuda`
runs share (the check before launching, NCCL's limits, the device facts a report names,
timing that waits for the GPU) is in gpu.py.
"""
