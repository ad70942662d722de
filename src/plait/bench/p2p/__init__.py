"""`plait bench p2p`: point-to-point messages between ranks of one host, three ways.

config.py the options; job.py the parent side; ranks.py a worker rank; tables.py the report.
"""
