"""State that moves rank to rank: where each piece of a model's state lies, and how a rank cuts its shards from them.

A restart from the survivors or from peer memory, and a move to another size, hand the state
from the ranks (or keepers) that hold it to the new ranks without the driver holding it:
the holders put their pieces in Ray's object store (as the returns of a driver's call, so
the driver owns them and they outlive the rank that made them, on its node's store until
the node goes), the driver makes a `StateMap` of references and layouts, and each new
rank fetches the pieces that overlap its own shards (`cut`), one tensor at a time, from
wherever they lie. A 7B model's 84 GB of AdamW state never passes through the driver.

Both sides import this module: numpy and Ray, no Paddle.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import ray

from .topology import Layout


@dataclasses.dataclass(frozen=True)
class Piece:
    """What a holder says of its piece of a tensor (no data): the tensor's global ``shape`` and
    ``dtype``, its ``layout`` (None: whole on every rank that has it), the piece's ``key`` in the
    layout, and its ``code`` (CRC-32, to tell replicas apart; None: not computed)."""

    shape: tuple[int, ...]
    dtype: str
    layout: Layout | None
    key: tuple[int, ...]
    code: int | None = None


@dataclasses.dataclass(frozen=True)
class Kept:
    """A piece a keeper holds (`raydist.driver.lifecycle.peers.Keeper`): the rank that needs it asks
    the keeper for it, so it travels from the keeper's node to the rank's."""

    keeper: Any
    copy: tuple[int, int, int]  # (generation, rank, train-step index)
    name: str

    def fetch(self) -> np.ndarray:
        return ray.get(self.keeper.pieces.remote(self.copy, [self.name]))


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor of the state to hand over: its global ``shape``, ``dtype`` and ``layout`` on the
    mesh that holds it, and where each distinct piece lies (layout key -> an object reference or
    a `Kept`)."""

    shape: tuple[int, ...]
    dtype: str
    layout: Layout | None
    pieces: dict[tuple[int, ...], Any]

    def needed(self, target: Layout | None, rank: int) -> list[tuple[int, ...]]:
        """The keys of the pieces that ``rank``'s piece under ``target`` overlaps."""
        if self.layout is None or self.layout.partial:
            return list(self.pieces)
        box = shard_box(target, rank, self.shape)
        return [key for key in self.pieces if overlaps(box, _piece_box(self.layout, key, self.shape))]

    def cut(self, target: Layout | None, rank: int) -> np.ndarray:
        """``rank``'s piece under ``target`` (None: the whole tensor), from the pieces that overlap it."""
        box = shard_box(target, rank, self.shape)
        layout = self.layout
        if layout is None or layout.partial:  # whole, or partial values (not state): the whole tensor
            if layout is None:
                whole = fetch(self.pieces[()])
            else:
                holders = layout.holders()
                whole = layout.assemble({holders[k][0]: fetch(src) for k, src in self.pieces.items()})
            return np.asarray(whole)[tuple(slice(a, b) for a, b in box)]
        out = np.empty([b - a for a, b in box], dtype=self.dtype)
        if out.size == 0:
            return out
        for key in self.needed(target, rank):
            paste(out, box, fetch(self.pieces[key]), _piece_box(layout, key, self.shape))
        return out


def overlaps(box: list[tuple[int, int]], other: list[tuple[int, int]]) -> bool:
    """Whether two boxes ([start, stop) per dim) share any element."""
    return all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(box, other))


def paste(out: np.ndarray, box: list[tuple[int, int]], piece: np.ndarray, piece_box: list[tuple[int, int]]) -> None:
    """Copy into ``out`` (the values of ``box``) the part of ``piece`` (the values of ``piece_box``) inside it."""
    shared = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, piece_box)]
    out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(shared, box))] = \
        piece[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(shared, piece_box))]  # fmt: skip


StateMap = dict[str, Tensor]


def ask_keepers(state: StateMap, targets: dict[str, Layout | None], rank: int) -> StateMap:
    """``state`` with each kept piece that ``rank``'s shards under ``targets`` ({name: layout})
    overlap asked of its keeper beforehand: one call per copy, not one per piece (its pieces come
    back as objects this process owns, read one tensor at a time by `Tensor.cut`)."""
    asks: dict[tuple[int, int, int], list[tuple[str, tuple[int, ...]]]] = {}
    keepers: dict[tuple[int, int, int], Any] = {}
    for name, target in targets.items():
        tensor = state[name]
        for key in tensor.needed(target, rank):
            source = tensor.pieces[key]
            if isinstance(source, Kept):
                asks.setdefault(source.copy, []).append((name, key))
                keepers[source.copy] = source.keeper
    pieces = {name: dict(tensor.pieces) for name, tensor in state.items()}
    for copy, wanted in asks.items():
        refs = keepers[copy].pieces.options(num_returns=len(wanted)).remote(copy, [name for name, _ in wanted])
        for (name, key), ref in zip(wanted, listed(refs)):
            pieces[name][key] = ref
    return {name: dataclasses.replace(tensor, pieces=pieces[name]) for name, tensor in state.items()}


def returns(values: list) -> Any:
    """``values`` as the returns of a call made with ``num_returns=len(values)`` (Ray takes one value,
    not a list of one, when that is 1)."""
    return values if len(values) != 1 else values[0]


def listed(refs: Any) -> list:
    """The references of a call made with ``num_returns=n``, as a list (Ray gives one, not a list, for 1)."""
    return refs if isinstance(refs, list) else [refs]


def fetch(source: Any) -> np.ndarray:
    """A piece's value: from the object store, or from the keeper that holds it."""
    return ray.get(source) if isinstance(source, ray.ObjectRef) else source.fetch()


def shard_box(layout: Layout | None, rank: int, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) per dim of ``rank``'s piece under ``layout`` (`Layout.local`'s even split)."""
    box = [(0, n) for n in shape]
    if layout is None:
        return box
    coord = layout.mesh.coord(rank)
    for d, m in enumerate(layout.dims_mapping):
        if m >= 0:
            step = shape[d] // layout.mesh.shape[m]
            box[d] = (coord[m] * step, (coord[m] + 1) * step)
    return box


def _piece_box(layout: Layout, key: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) per dim of the piece ``key`` of ``layout`` (a key lists the coordinate along
    each sharded dim, in the tensor's dim order)."""
    box, i = [(0, n) for n in shape], 0
    for d, m in enumerate(layout.dims_mapping):
        if m >= 0:
            step = shape[d] // layout.mesh.shape[m]
            box[d] = (key[i] * step, (key[i] + 1) * step)
            i += 1
    return box


def code(array: np.ndarray) -> int:
    """A piece's CRC-32: equal bits, equal codes; any single flipped bit changes it."""
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).data)


def half_updated(state: dict[str, tuple[np.ndarray, Any]]) -> str | None:
    """Why a rank's state (``{name: (local, layout)}``) may hold some of a broken-off step's updates
    and not others; None if not.

    Paddle's train program updates each parameter right after its gradient's
    all_reduce, so a peer's death between two all_reduces leaves the first
    parameters updated. Adam-like optimizers count steps per parameter (their
    beta pow accumulators): equal counts show that no update, or every update,
    ran. Optimizers without such counts (SGD, Momentum) cannot show it.
    """
    counts: dict[str, set] = {}
    for name, (array, _) in state.items():
        for kind in ("beta1_pow_acc", "beta2_pow_acc"):
            if kind in name:
                counts.setdefault(kind, set()).add(float(np.asarray(array).ravel()[0]))
    if not counts:
        return "its optimizer keeps no per-parameter step count (Adam's beta pows) to show no update of it ran"
    if any(len(values) > 1 for values in counts.values()):
        return "some of its parameters were updated and others not"
    return None


def describe(state: dict[str, tuple[np.ndarray, Any]], rank: int, codes: bool = True) -> dict[str, Piece]:
    """What a holder says of ``rank``'s pieces (``{name: (local, layout)}``), without their data."""
    return {name: Piece(global_shape(array.shape, layout), str(array.dtype), layout,
                        layout.key(rank) if layout is not None else (), code(array) if codes else None)
            for name, (array, layout) in state.items()}  # fmt: skip


def global_shape(local: tuple[int, ...], layout: Layout | None) -> tuple[int, ...]:
    """The full tensor's shape from a piece's under ``layout`` (an even split)."""
    shape = list(local)
    if layout is not None:
        for d, m in enumerate(layout.dims_mapping):
            if m >= 0:
                shape[d] *= layout.mesh.shape[m]
    return tuple(shape)
