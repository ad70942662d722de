"""`plait bench horovod`: the Horovod facade's calls against their peers.

config.py the options and the rows; job.py the parent side; ranks.py a worker rank,
cases.py what it times; tables.py the report.
"""
