"""One Step per strategy (train/step.py's protocol), each named by a row of strategies.py."""
