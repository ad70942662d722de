"""`plait bench`: each benchmark measures plait against its peer in the same run.

Every benchmark NAME is one package, bench/NAME/: its options (config.py, one config
dataclass, the defaults of CLI and workers alike), its parent side (job.py: launch the
workers or run the jobs, collect, and the package's `BENCHMARK`), its measuring ranks
(ranks.py, which imports torch) and its report (tables.py). What they share is written once
here: the protocol and the one runner (runner.py), the report as data and its one renderer
(render.py), the paired-median statistics (stats.py), the ways taking turns (turns.py),
the workers' hand-off and one entry point (workers.py), timing the slowest rank
(timing.py), the table of ways a model is wrapped data-parallel (wrapping.py), the
configs' shared fields (fields.py), the benchmarks by name (registry.py), and what the
`--device cuda` runs share (gpu.py).
"""
