"""`plait bench ps`: the parameter server's modes against allreduce, with a straggler.

config.py the options, configurations and bars; job.py the parent side (one `plait train`
job per configuration and repeat: no bench workers); tables.py the report.
"""
