"""`plait bench memory`: model-state memory of plait's DataParallel and ZeRO stages against
torch's DDP, ZeRO-1 and FSDP2, and the --limit demonstration.

config.py the options; job.py the parent side (one job per way and world size, and
--limit's search); ranks.py a worker rank; tables.py the reports.
"""
