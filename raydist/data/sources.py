"""Where a loader's rows come from: a Ray Dataset or a paddle.io.Dataset, and its splits.

The driver asks a source for its columns and length and for one split per
data-parallel group each epoch; a split travels to its group's reader rank,
which reads it in chunks of local batches (`Split.chunks`). Paddle is
imported only where a paddle dataset is read.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import pickling


def shuffle_seed(seed: int, epoch: int) -> int:
    """Epoch ``epoch``'s shuffle seed under the loader's ``seed``: the same on every run and
    rank, and a stream of its own for every (seed, epoch) pair (``seed + epoch`` would
    shuffle seed 5's epoch 1 as seed 6's epoch 0). A uint32: what Ray Data's
    ``random_shuffle`` and numpy's ``RandomState`` (Paddle's sampler) take."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class Field:
    """One column of the rows: its key, per-row shape and dtype."""

    key: str | int
    shape: tuple[int, ...]
    dtype: np.dtype


class RaySource:
    """A ``ray.data.Dataset``: split with ``streaming_split(dp, equal=True)``, in order."""

    dict_rows = True

    def __init__(self, dataset):
        self.dataset = dataset

    def fields(self) -> list[Field]:
        schema = self.dataset.schema()
        if schema is None:
            raise ValueError("the dataset has no schema (is it empty?)")
        out = []
        for name, typ in zip(schema.names, schema.types):
            shape = tuple(getattr(typ, "shape", None) or ())  # Ray's tensor columns: the per-row shape
            scalar = getattr(typ, "value_type", typ)  # their element type
            out.append(Field(name, shape, _np_dtype(scalar)))
        return out

    def count(self) -> int:
        return int(self.dataset.count())  # from the files' metadata when Ray Data has it (parquet), without a read

    @staticmethod
    def rows_per_group(rows: int, dp: int) -> int:
        return rows // dp  # streaming_split(equal=True) drops the remainder

    def splits(self, dp: int, epoch: int, shuffle: bool, seed: int | None) -> list[RaySplit]:
        from ray.data import Dataset

        ds = self.dataset
        if shuffle:
            ds = ds.random_shuffle(seed=None if seed is None else shuffle_seed(seed, epoch))
        ds = Dataset.copy(ds, _deep_copy=True)  # leave the user's dataset's context alone
        ds.context.execution_options.preserve_order = True  # the same split in every run
        ds.context.enable_progress_bars = False  # the training loop has its own
        return [RaySplit(it) for it in ds.streaming_split(dp, equal=True)]


@dataclasses.dataclass(frozen=True)
class RaySplit:
    """One group's ``streaming_split`` iterator."""

    iterator: Any

    def chunks(self, batch_size: int, drop_last: bool, keys: list, chunk: int) -> Iterator[list[dict]]:
        """Lists of up to ``chunk`` local batches, in order: one Ray Data batch per chunk."""
        # prefetch_batches=0: this runs in the reader's thread, which reads ahead of the steps
        # itself; Ray Data's prefetch threads would only add threads contending for the GIL
        for block in self.iterator.iter_batches(batch_size=batch_size * chunk, batch_format="numpy", drop_last=False,
                                                prefetch_batches=0):  # fmt: skip
            n = len(block[keys[0]])
            starts = list(range(0, n - n % batch_size, batch_size))
            group = [{k: np.ascontiguousarray(block[k][a : a + batch_size]) for k in keys} for a in starts]
            if n % batch_size and not drop_last:  # only the split's last block can be short
                group.append({k: np.ascontiguousarray(block[k][len(starts) * batch_size :]) for k in keys})
            if group:
                yield group


class PaddleSource:
    """A picklable ``paddle.io.Dataset``, read as Paddle's ``DistributedBatchSampler`` reads it."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.sample = dataset[0]
        self.dict_rows = isinstance(self.sample, dict)
        self.pickled = pickling.dumps(dataset, "the paddle.io.Dataset")
        self.ref = None

    def fields(self) -> list[Field]:
        items = self.sample.items() if self.dict_rows else enumerate(_as_tuple(self.sample))
        return [Field(k, np.shape(v), np.asarray(v).dtype) for k, v in items]

    def count(self) -> int:
        return len(self.dataset)

    @staticmethod
    def rows_per_group(rows: int, dp: int) -> int:
        return math.ceil(rows / dp)  # DistributedBatchSampler pads with repeated samples

    def splits(self, dp: int, epoch: int, shuffle: bool, seed: int | None) -> list[PaddleSplit]:
        if self.ref is None:
            import ray

            self.ref = ray.put(self.pickled)  # once, for every reader and epoch
        # no seed: the sampler's own epoch order, as Paddle's shard_dataloader shuffles
        order = epoch if seed is None else shuffle_seed(seed, epoch)
        return [PaddleSplit(self.ref, dp, g, shuffle, order) for g in range(dp)]


@dataclasses.dataclass(frozen=True)
class PaddleSplit:
    """Group ``rank`` of ``num_replicas`` of a paddle dataset (put once in Ray's object store)."""

    dataset: Any  # ObjectRef of the pickled dataset
    num_replicas: int
    rank: int
    shuffle: bool
    epoch: int  # what the sampler's ``set_epoch`` gets: it seeds the shuffle (`shuffle_seed`)

    def chunks(self, batch_size: int, drop_last: bool, keys: list, chunk: int) -> Iterator[list[dict]]:
        batches = self._batches(batch_size, drop_last, keys)
        while group := [b for _, b in zip(range(chunk), batches)]:
            yield group

    def _batches(self, batch_size: int, drop_last: bool, keys: list) -> Iterator[dict]:
        import ray
        from paddle.io import DistributedBatchSampler
        from paddle.io.dataloader.collate import default_collate_fn

        dataset = pickling.loads(ray.get(self.dataset))
        sampler = DistributedBatchSampler(dataset, batch_size=batch_size, num_replicas=self.num_replicas,
                                          rank=self.rank, shuffle=self.shuffle, drop_last=drop_last)  # fmt: skip
        sampler.set_epoch(self.epoch)
        for indices in sampler:
            batch = default_collate_fn([_as_row(dataset[i]) for i in indices])  # numpy in, numpy out
            yield {k: np.asarray(batch[k]) for k in keys}


@dataclasses.dataclass(frozen=True)
class JoinedSplit:
    """Several shards' splits read as one group's: local batch k is the concatenation of
    every shard's batch k, in shard order (an elastic model on fewer data-parallel groups
    than the loader has shards reads exactly the rows of the full-size run)."""

    parts: tuple

    def chunks(self, batch_size: int, drop_last: bool, keys: list, chunk: int) -> Iterator[list[dict]]:
        per_part = batch_size // len(self.parts)
        # Each part is read in a thread of its own: a Ray Data streaming split starts its
        # epoch only when every split of the dataset has asked for it (a barrier).
        streams = [_in_thread(_batches_of(p.chunks(per_part, drop_last, keys, chunk))) for p in self.parts]
        batches = ({k: np.concatenate([b[k] for b in group]) for k in keys} for group in zip(*streams))
        while group := list(itertools.islice(batches, chunk)):
            yield group


def _batches_of(chunks: Iterator[list[dict]]) -> Iterator[dict]:
    for group in chunks:
        yield from group


def _in_thread(items: Iterator, ahead: int = 2) -> Iterator:
    """``items``, produced by a daemon thread (started now) up to ``ahead`` in advance;
    its exception re-raised to the consumer."""
    out: queue.Queue = queue.Queue(maxsize=ahead)
    end = object()

    def produce() -> None:
        try:
            for item in items:
                out.put((item, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            out.put((end, e))
            return
        out.put((end, None))

    def consume() -> Iterator:
        while True:
            item, error = out.get()
            if item is end:
                if error is not None:
                    raise error
                return
            yield item

    threading.Thread(target=produce, name="raydist-shard", daemon=True).start()
    return consume()


def source_of(dataset) -> RaySource | PaddleSource:
    import ray.data

    if isinstance(dataset, ray.data.Dataset):
        return RaySource(dataset)
    import paddle

    if isinstance(dataset, paddle.io.IterableDataset):
        raise TypeError("iterable paddle datasets have no length to split; use a ray.data.Dataset")
    if isinstance(dataset, paddle.io.Dataset):
        return PaddleSource(dataset)
    raise TypeError(f"dataset must be a ray.data.Dataset or a paddle.io.Dataset, got {type(dataset).__name__}")


def _as_tuple(sample):
    return sample if isinstance(sample, (list, tuple)) else (sample,)


def _as_row(sample):
    return sample if isinstance(sample, (dict, list, tuple)) else (sample,)


def _np_dtype(arrow_type) -> np.dtype:
    try:
        return np.dtype(arrow_type.to_pandas_dtype())
    except (AttributeError, TypeError, NotImplementedError):
        return np.dtype(object)
