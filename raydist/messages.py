"""What the driver sends the ranks, typed: step messages and a loader's reading orders.

Both sides import this module; it holds data only (numpy, no Paddle).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import numpy as np


@dataclasses.dataclass(frozen=True)
class ArraysStep:
    """A step on a GLOBAL batch from the driver: every rank takes its own shard (a view).

    ``arrays``: inputs then labels, in the model's order.
    """

    arrays: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclasses.dataclass(frozen=True)
class LoaderStep:
    """A step on the batch a loader's readers staged on every rank: ``keys`` of step ``step``."""

    loader: int
    epoch: int
    step: int
    keys: tuple[Any, ...]

    nbytes = 0


StepMessage = Union[ArraysStep, LoaderStep]


@dataclasses.dataclass(frozen=True)
class ReadOrder:
    """What a data-parallel group's reader reads: one epoch of its split, from step ``start``.

    ``split``: a `raydist.data.sources` split (a Ray Data iterator, or a
    paddle dataset's sampler); ``chunk``: local batches per hand-out.
    """

    loader: int
    epoch: int
    start: int
    steps: int
    split: Any
    batch_size: int
    drop_last: bool
    keys: tuple[Any, ...]
    prefetch: int
    chunk: int
