"""`plait bench plan`: the planner's predictions checked against real runs.

config.py the options and bars; job.py the parent side (ask the planner, choose, run in
rounds); runs.py one run of a plan; tables.py the report.
"""
