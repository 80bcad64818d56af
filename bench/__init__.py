"""raydist benchmarks: run with `python -m bench` (see bench/run.py)."""
