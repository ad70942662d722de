"""`plait bench plan`: the planner's predictions checked against real runs.

config.py the options and bars; job.py the parent side (ask the planner, choose); runs.py
the runs of plans, in rounds; tables.py the report. --per-layer (issue 36): per_layer.py
the three plans it measures, per_layer_tables.py their report.
"""
