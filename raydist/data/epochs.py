"""A ``paddle.io.DataLoader`` as `DistModel.fit` reads a `raydist.ShardDataloader`: by epoch, from a step.

The driver iterates the DataLoader and sends each batch whole: it is the global
batch, split among the ranks as any batch given to the model is. Going back into
an epoch at step k (after a failure, or a resumed run) iterates it again and
skips k batches, which gives the same batches only if the loader's order is the
same on every pass: fit refuses ``max_failures`` and ``resume`` for a shuffling
DataLoader (`raydist.shard_dataloader`'s ``shuffle`` and ``seed`` are exact).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any


class DataLoaderEpochs:
    """``loader`` (a ``paddle.io.DataLoader``) with what fit reads of a loader: ``epoch``,
    ``batch_size`` (the global one), ``len``, ``shuffle`` and ``seed`` (None: Paddle's samplers
    take no seed)."""

    def __init__(self, loader: Any):
        self.loader = loader
        sampler = getattr(loader, "batch_sampler", None)
        self.batch_size = getattr(loader, "batch_size", None) or getattr(sampler, "batch_size", None)
        if not self.batch_size:
            raise ValueError("fit: the paddle.io.DataLoader has no batch size (batch_size=None yields single rows): "
                             "give it a batch_size, or a batch_sampler")  # fmt: skip
        self.shuffle = bool(getattr(sampler, "shuffle", False))
        self.seed = None

    def __len__(self) -> int:
        return len(self.loader)

    def epoch(self, number: int, start: int = 0) -> Iterator:
        """The batches of epoch ``number`` from its step ``start`` (the DataLoader's own order)."""
        return itertools.islice(iter(self.loader), start, None)
