"""`plait bench collectives`: every allreduce row of the routing table against torch.distributed.

config.py the options; job.py the parent side (launch, --device cuda's launches merged);
ranks.py a worker rank, allreduces.py the timed allreduces, calibrate.py --calibrate;
tables.py the report.
"""
