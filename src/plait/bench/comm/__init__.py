"""`plait bench comm`: the communication wall, FIFO against priority scheduling,
compression and DDP on slow links; --to-target, each way trained to its recipe's end.

config.py the options; job.py the parent side; ranks.py a worker rank; target.py
--to-target's `plait train` runs; tables.py both reports.
"""
