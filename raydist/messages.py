"""What the driver sends the ranks, typed: step messages and a loader's reading orders.

Both sides import this module; it holds data only (numpy, no Paddle).
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class LrChange:
    """A change to every rank's learning rate, made before the step it travels with.

    ``kind``: "step" (``scheduler.step(*args, **kwargs)``), "state"
    (``scheduler.set_state_dict(args[0])``) or "value" (a float learning rate,
    ``args[0]``).
    """

    kind: str
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ArraysStep:
    """A step on a GLOBAL batch from the driver: every rank takes its own shard (a view).

    ``arrays``: inputs then labels, in the model's order; ``lr``: learning-rate
    changes to make first.
    """

    arrays: list[np.ndarray]
    lr: tuple[LrChange, ...] = ()

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
    lr: tuple[LrChange, ...] = ()

    nbytes = 0


StepMessage = ArraysStep | LoaderStep


# Messages up to this size travel inside each call instead of through the
# object store: a put costs more than pickling a few KiB per rank.
INLINE_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Parcel:
    """Consecutive steps in one message, numbered from ``first``: every rank runs them back to back."""

    first: int
    steps: tuple[StepMessage, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.steps)


def pack(message: Any) -> Any:
    """``message`` pickled once, to cross Ray as bytes (the object itself if pickle cannot take it).

    Ray passes bytes through as they are, but runs any other object through its
    serializer (cloudpickle, and its numpy handling) for each call and again on
    the other side: for a loop that reads its loss every step that is CPU on
    the driver and on every rank at each step.
    """
    try:
        return pickle.dumps(message, protocol=5)
    except Exception:  # noqa: BLE001 - Ray's own serializer takes what pickle does not
        return message


def unpack(message: Any) -> Any:
    """What `pack` packed (anything else as it is)."""
    return pickle.loads(message) if isinstance(message, bytes) else message


@dataclasses.dataclass(frozen=True)
class StepResults:
    """A rank's results of a parcel's steps: ``results[i]`` is step i's list of fetched values
    (None: a value this rank does not hold). Each value is one array over the steps when the
    steps' arrays stack (one object to send and to read per message, not one per step and value)."""

    columns: tuple[Any, ...]  # per value: an array with the steps first, a list of the steps' arrays, or None
    steps: int

    @classmethod
    def of(cls, per_step: list[list]) -> StepResults:
        columns: list[Any] = []  # a value's: None, stacked, or a list by step
        for j in range(len(per_step[0]) if per_step else 0):
            values = [step[j] for step in per_step]
            if values[0] is None:
                columns.append(None)
            elif all(isinstance(v, np.ndarray) and v.shape == values[0].shape and v.dtype == values[0].dtype
                     for v in values):  # fmt: skip
                columns.append(np.stack(values))
            else:
                columns.append(values)
        return cls(tuple(columns), len(per_step))

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> list:
        return [None if c is None else c[i] for c in self.columns]

    @property
    def nbytes(self) -> int:
        """The arrays' bytes (what packing them would copy)."""
        return sum(getattr(v, "nbytes", 0) for c in self.columns if c is not None
                   for v in (c if isinstance(c, list) else [c]))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RankAnswers:
    """Several ranks' `StepResults` for one message, as one object: each value's columns stacked
    over the ranks when they stack. What a relay tree sends up, so that the driver reads one array
    per value whatever the number of ranks, not one `StepResults` per rank."""

    ranks: tuple[int, ...]
    columns: tuple[Any, ...]  # per value: an array [ranks, steps, ...], or by rank a `StepResults` column
    steps: int

    @classmethod
    def of(cls, rank: int, results: StepResults) -> RankAnswers:
        columns = tuple(c[None] if isinstance(c, np.ndarray) else [c] for c in results.columns)
        return cls((rank,), columns, results.steps)

    @classmethod
    def merge(cls, parts: list[RankAnswers]) -> RankAnswers:
        """One answer for the ranks of ``parts`` (answers to one message), in their order."""
        if len(parts) == 1:
            return parts[0]
        columns = []
        for j, first in enumerate(parts[0].columns):
            cols = [p.columns[j] for p in parts]
            if all(isinstance(c, np.ndarray) and c.shape[1:] == first.shape[1:] and c.dtype == first.dtype
                   for c in cols):  # fmt: skip
                columns.append(np.concatenate(cols))
            else:
                columns.append([v for c in cols for v in (list(c) if isinstance(c, np.ndarray) else c)])
        return cls(tuple(r for p in parts for r in p.ranks), tuple(columns), parts[0].steps)

    @functools.cached_property
    def _row(self) -> dict[int, int]:
        return {rank: i for i, rank in enumerate(self.ranks)}

    def __getitem__(self, rank: int) -> StepResults | None:
        """``rank``'s results (None if it did not answer)."""
        i = self._row.get(rank)
        return None if i is None else StepResults(tuple(c[i] for c in self.columns), self.steps)

    def stacked(self, value: int, ranks: tuple[int, ...]) -> np.ndarray | None:
        """Value ``value`` of ``ranks``, one array [ranks, steps, ...] (None if its columns do not stack)."""
        column = self.columns[value]
        return column[[self._row[r] for r in ranks]] if isinstance(column, np.ndarray) else None


@dataclasses.dataclass(frozen=True)
class Progress:
    """A rank's answer to a ping beside its steps: the step it runs (or waits for the data of),
    and for how many seconds so far, by its own clock."""

    step: int
    for_s: float


@dataclasses.dataclass(frozen=True)
class BuildReport:
    """What a rank built: the meshes of the layer's parameters, in order, and the
    optimizer's learning rate (a float, a pickled ``LRScheduler``, or None)."""

    meshes: list[Any]
    learning_rate: float | bytes | None


@dataclasses.dataclass(frozen=True)
class Reattached:
    """Where a rank stands when a new driver attaches to it (`raydist.attach`): its mode, the
    modes it has built (its mode last), the number of its next step, the train steps it completed
    (and whether the last one broke off), and its learning rate as `BuildReport` gives it."""

    mode: str | None
    built: list[str]
    next_step: int
    trained: int
    broke_off: bool
    learning_rate: float | bytes | None


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


@dataclasses.dataclass(frozen=True)
class MirrorPlan:
    """What the driver tells a rank of its peer memory and replica check (`RankActor.mirror`,
    `raydist.worker.mirror`, `raydist.worker.replicas`)."""

    every: int | None  # train steps between copies (None: no peer memory)
    generation: int  # the group's number: copies of different groups never mix
    base: int  # the model's train steps so far (its state is after them): the rank's count goes on from it
    keeper: Any = None  # the handle of the keeper on another node
    check_every: int | None = None  # train steps between two replica checks (None: none)
    in_flight: int = 1  # messages the driver may have in flight: what it saw complete may be that far behind
