"""A model's ranks over time: starting, failing and restarting them (`lifecycle`, `recovery`),
preemption notices (`preemption`) and detached models that outlive their driver (`detached`).
Imports the packages above.
"""
