"""`plait bench elastic`: a rank killed, frozen and joining under plait.elastic.run, and the
same kill handled by restarting from a disk checkpoint under torchrun (issue 33's bars).

config.py the options and the bars; job.py the parent side (the two jobs, the joiner);
ranks.py the training script every process runs; events.py what the processes write;
figures.py the figures from a job's events; tables.py the report.
"""
