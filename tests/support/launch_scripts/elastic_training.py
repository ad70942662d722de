"""Started by `plait run -n 3 --min-np 2`: the elastic run of support/elastic_training.py
in which rank 0 (the one that would host the store without --min-np) dies in step 3."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for support

import plait
from support import elastic_training

plait.init()
result = elastic_training.train(dies=0, at=3)
print("RESULT " + json.dumps(result), flush=True)
plait.shutdown()
