"""`plait bench auth`: what proving the job secret costs, beside the plain forms.

config.py the options and bar; job.py the benchmark, in this process: engine.py the engine
and the store, ps.py the parameter server, init_rank.py a rank of the timed plait.init();
tables.py the report.
"""
