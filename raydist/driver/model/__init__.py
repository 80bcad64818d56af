"""The model's own bookkeeping, on the driver: its input specs (`inputs`), modes (`modes`), argument
checks (`validation`), results (`results`), learning rate (`rates`, `schedule`) and state (`state`).
Imports `cluster` and `dispatch`.
"""
