"""The parent side of each `plait bench NAME`: start the workers, collect, print the report.

`run(config) -> exit status` in module NAME; the CLI (cli/bench.py) calls it. Nothing here
imports torch: the measuring happens in the workers (plait.bench.NAME).
"""
