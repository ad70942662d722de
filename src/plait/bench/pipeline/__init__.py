"""`plait bench pipeline`: the pipeline runtime's throughput and bubble against theory and
torch.distributed.pipelining.

config.py the options; job.py the parent side; ranks.py a worker rank (one per stage),
peer.py torch's schedule of the same model; tables.py the report.
"""
