"""The reading side of a ShardDataloader, inside a rank. Rank-only.

A data-parallel group's reader rank iterates its split of the dataset in the
rank actor's "data" thread, so the next batches are read and stored while
the current step runs. Each `next` returns one local batch, a dict of numpy
arrays keyed like the loader's fields (column names, or positions for tuple
rows), which Ray stores once in the object store for every rank of the group.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np

from .rank import READY


class Reader:
    """This rank's open epochs, one per loader."""

    def __init__(self):
        self._epochs: dict[int, tuple[int, Iterator | BaseException]] = {}

    def open(self, loader_id: int, epoch: int, source, batch_size: int, drop_last: bool, keys: Sequence) -> None:
        try:
            batches = _batches(source, batch_size, drop_last, list(keys))
        except BaseException as e:  # reported by the first `next`, which a step waits on
            batches = e
        self._epochs[loader_id] = (epoch, batches)

    def next(self, loader_id: int, epoch: int):
        current, batches = self._epochs.get(loader_id, (None, None))
        if current != epoch:
            raise RuntimeError(f"loader {loader_id}: epoch {epoch} is not open on this reader (open: {current})")
        if isinstance(batches, BaseException):
            raise batches
        try:
            batch = next(batches)
        except StopIteration:
            raise RuntimeError(f"loader {loader_id}: the split ran out of rows before the epoch's last step") from None
        batch[READY] = time.time()
        return batch


def _batches(source, batch_size: int, drop_last: bool, keys: list) -> Iterator:
    if isinstance(source, tuple) and source[0] == "paddle":
        return _paddle_batches(source[1], source[2], batch_size, drop_last, keys)
    return _ray_batches(source, batch_size, drop_last, keys)


def _ray_batches(split, batch_size: int, drop_last: bool, keys: list) -> Iterator:
    for batch in split.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=drop_last):
        yield {k: np.ascontiguousarray(batch[k]) for k in keys}


def _paddle_batches(dataset_ref, sampler: dict, batch_size: int, drop_last: bool, keys: list) -> Iterator:
    import ray
    from paddle.io import DistributedBatchSampler

    dataset = ray.get(dataset_ref)  # put once by the driver, shared by the readers
    batch_sampler = DistributedBatchSampler(
        dataset, batch_size=batch_size, num_replicas=sampler["num_replicas"], rank=sampler["rank"],
        shuffle=sampler["shuffle"], drop_last=drop_last,
    )  # fmt: skip
    batch_sampler.set_epoch(sampler["epoch"])
    for indices in batch_sampler:
        samples = [dataset[i] for i in indices]
        rows = [s if isinstance(s, (dict, list, tuple)) else (s,) for s in samples]
        yield {k: np.stack([np.asarray(r[k]) for r in rows]) for k in keys}
