"""`plait bench infer`: trained networks applied side by side (fp32, int8, bf16, students).

config.py the options, tasks and bars; job.py the whole benchmark, in this process; runs.py
the runs it trains; timings.py the variants and `plait infer` timed; tables.py the report.
"""
