"""What a run tells while it goes: its events (`events`), Ray metrics (`metrics`) and the ranks'
timeline (`timeline`). Imports `cluster` only.
"""
