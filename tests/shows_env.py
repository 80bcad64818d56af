"""A launched script that prints, as one JSON line, what its rank sees of the launching shell's environment."""

import json
import os

KEYS = ["FOO", "BAZ", "PADDLE_TRAINER_ID", "VIRTUAL_ENV", "CUDA_VISIBLE_DEVICES", "RAY_RAYDIST_PROBE", "HOME"]
print("env", json.dumps({k: os.environ.get(k) for k in KEYS} | {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}))
