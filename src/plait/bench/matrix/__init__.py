"""`plait bench matrix`: every cell of `plait train`'s option matrix (train/matrix.py) run,
each trained cell's losses against its reference cell's.

config.py the options; job.py the parent side (one `plait train` job per cell that trains,
the real checks in process for a refused one: no bench workers); tables.py the report.
"""
