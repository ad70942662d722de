"""`plait bench train`: plait DataParallel against torch DDP, training throughput.

config.py the options; job.py the parent side; ranks.py a worker rank; tables.py the report.
"""
