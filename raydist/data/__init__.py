"""Sharded data loaders: a dataset split per data-parallel group, read by the ranks themselves.

`shard_dataloader` (driver side, `raydist.data.loader`) hands out handles;
each group's reader rank reads its split (`raydist.data.sources`) in a
thread of its own (`raydist.worker.data`).
"""

from .loader import Handle, ShardDataloader, shard_dataloader

__all__ = ["Handle", "ShardDataloader", "shard_dataloader"]
