"""Which rank holds which piece of a tensor: meshes, layouts, split and assemble.

Pure numpy, no Paddle: the driver uses it to cut a global batch into the
data-parallel shards each rank reads, and to put full tensors back together
from the local pieces ranks return (losses, predictions, state).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A process mesh: ``process_ids`` laid out row-major in ``shape``."""

    shape: tuple[int, ...]
    process_ids: tuple[int, ...]
    dim_names: tuple[str, ...]

    def __post_init__(self):
        if int(np.prod(self.shape)) != len(self.process_ids):
            raise ValueError(f"mesh shape {self.shape} does not hold {len(self.process_ids)} processes")
        if len(self.dim_names) != len(self.shape):
            raise ValueError(f"mesh dim_names {self.dim_names} do not match shape {self.shape}")

    @classmethod
    def of(cls, process_ids: Sequence | np.ndarray, dim_names: Sequence[str]) -> Mesh:
        arr = np.asarray(process_ids)
        return cls(tuple(int(s) for s in arr.shape), tuple(int(p) for p in arr.ravel()), tuple(dim_names))

    @classmethod
    def of_paddle(cls, process_mesh) -> Mesh:
        """The mesh of a ``paddle.distributed.ProcessMesh``."""
        return cls(tuple(process_mesh.shape), tuple(process_mesh.process_ids), tuple(process_mesh.dim_names))

    def to_paddle(self):
        """This mesh as a ``paddle.distributed.ProcessMesh`` (imports Paddle)."""
        import paddle.distributed as dist

        return dist.ProcessMesh(np.array(self.process_ids).reshape(self.shape).tolist(), dim_names=list(self.dim_names))

    def coord(self, rank: int) -> tuple[int, ...]:
        return self._coords[rank]

    @functools.cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:  # every step's loss asks, for each rank read
        return {rank: tuple(int(c) for c in np.unravel_index(i, self.shape)) for i, rank in enumerate(self.process_ids)}

    def dim(self, name: str) -> int:
        return self.dim_names.index(name)

    def __contains__(self, rank: int) -> bool:
        return rank in self.process_ids


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a tensor lies on a mesh, in Paddle's terms.

    ``dims_mapping[i]`` is the mesh dim that shards tensor dim ``i`` (-1: not
    sharded); ``partial`` lists the mesh dims along which ranks hold partial
    values, with the reduction that completes them ("sum", "avg", "max", "min").
    """

    mesh: Mesh
    dims_mapping: tuple[int, ...]
    partial: tuple[tuple[int, str], ...] = ()

    def key(self, rank: int) -> tuple[int, ...]:
        """Ranks with equal keys hold the same local piece."""
        return self._keys[rank]

    @functools.cached_property
    def _keys(self) -> dict[int, tuple[int, ...]]:  # every step's loss asks, for each rank read
        keys = {}
        for rank in self.mesh.process_ids:
            c = self.mesh.coord(rank)
            keys[rank] = tuple(c[m] for m in self.dims_mapping if m >= 0) + tuple(c[m] for m, _ in self.partial)
        return keys

    def holders(self) -> dict[tuple[int, ...], list[int]]:
        """One entry per distinct local piece: the ranks holding it, in rank order."""
        return {k: list(ranks) for k, ranks in self._holders.items()}

    @functools.cached_property
    def _holders(self) -> dict[tuple[int, ...], list[int]]:
        out: dict[tuple[int, ...], list[int]] = {}
        for r in sorted(self.mesh.process_ids):
            out.setdefault(self.key(r), []).append(r)
        return out

    @functools.cached_property
    def _whole(self) -> bool:
        """Not split along any mesh dim, and partial in at most one way: each reader holds the whole shape."""
        return all(m < 0 for m in self.dims_mapping) and len({op for _, op in self.partial}) <= 1

    def readers(self) -> list[int]:
        """One rank per distinct piece: the ranks to read results from."""
        return list(self.reader_tuple)

    @functools.cached_property
    def reader_tuple(self) -> tuple[int, ...]:
        return tuple(ranks[0] for ranks in self._holders.values())

    @property
    def reduced_whole(self) -> str | None:
        """The reduction that completes this tensor when each reader holds a whole partial value
        (a data-parallel loss: "avg"); None otherwise."""
        return self.partial[0][1] if self._whole and self.partial else None

    def local(self, array: np.ndarray, rank: int) -> np.ndarray:
        """``rank``'s piece of a full array (a view): an even split along the sharded dims."""
        index = [slice(None)] * array.ndim
        coord = self.mesh.coord(rank) if rank in self.mesh else (0,) * len(self.mesh.shape)
        for d, m in enumerate(self.dims_mapping):
            if m >= 0:
                step = array.shape[d] // self.mesh.shape[m]
                index[d] = slice(coord[m] * step, (coord[m] + 1) * step)
        return array[tuple(index)]

    def assemble(self, local: Mapping[int, np.ndarray]) -> np.ndarray:
        """The full array from local pieces (one per distinct piece is enough)."""
        if self._whole:  # every step's loss: no split, at most a reduction (kept cheap: ranks x steps)
            if self.partial:
                distinct: dict[tuple[int, ...], np.ndarray] = {}
                for r, arr in local.items():
                    distinct.setdefault(self._keys[r], arr)
                pieces = list(distinct.values())
            else:
                pieces = [next(iter(local.values()))]
            if len(pieces) == 1:
                return np.asarray(pieces[0])
            return REDUCTIONS[self.partial[0][1]](np.stack(pieces), axis=0).astype(np.asarray(pieces[0]).dtype)
        by_key: dict[tuple[int, ...], np.ndarray] = {}
        for r, arr in local.items():
            by_key.setdefault(self.key(r), np.asarray(arr))
        n_shard = sum(1 for m in self.dims_mapping if m >= 0)
        if self.partial:
            reductions = {op for _, op in self.partial}
            if len(reductions) > 1:
                raise ValueError(f"cannot complete a tensor partial in several ways: {self.partial}")
            reduce = REDUCTIONS[reductions.pop()]
            groups: dict[tuple[int, ...], list[np.ndarray]] = {}
            for k, arr in by_key.items():
                groups.setdefault(k[:n_shard], []).append(arr)
            by_key = {k: reduce(np.stack(v), axis=0).astype(v[0].dtype) for k, v in groups.items()}
        sharded_dims = [d for d, m in enumerate(self.dims_mapping) if m >= 0]
        return _concat(by_key, sharded_dims)


def _mean(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.mean`` (the same float32 sum), without its Python overhead (15 µs, paid per step)."""
    return np.add.reduce(a, axis=axis) / a.shape[axis]


REDUCTIONS: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.add.reduce, "avg": _mean, "max": np.maximum.reduce, "min": np.minimum.reduce, "prod": np.multiply.reduce,
}  # fmt: skip


@dataclasses.dataclass
class ModePlan:
    """What a mode's step fetches: the layout of each fetched value on the mesh, and how
    they group (predict: the outputs; train: the loss; eval: the loss, then each metric's values)."""

    layouts: list[Layout | None]  # None: this rank holds no piece of the value (another pipeline stage's)
    groups: tuple[int, ...] = ()

    def readers(self) -> set[int]:
        """The ranks whose results a step reads: one per distinct piece of each fetched value."""
        return {r for layout in self.layouts if layout is not None for r in layout.readers()}

    @classmethod
    def merge(cls, plans: Sequence[ModePlan]) -> ModePlan:
        """The whole plan from every rank's: each value's layout from the ranks that hold it."""
        layouts = [next((p.layouts[i] for p in plans if p.layouts[i] is not None), None)
                   for i in range(len(plans[0].layouts))]  # fmt: skip
        missing = [i for i, layout in enumerate(layouts) if layout is None]
        if missing:
            raise RuntimeError(f"no rank holds the fetched values {missing}")
        return cls(layouts, plans[0].groups)


def _concat(pieces: Mapping[tuple[int, ...], np.ndarray], dims: Sequence[int]) -> np.ndarray:
    if not dims:
        (only,) = pieces.values()
        return only
    groups: dict[int, dict] = {}
    for k, arr in pieces.items():
        groups.setdefault(k[0], {})[k[1:]] = arr
    parts = [_concat(groups[c], dims[1:]) for c in sorted(groups)]
    return np.concatenate(parts, axis=dims[0])


def data_layout(mesh: Mesh, shard_dims: str | Iterable[str] | None, ndim: int) -> Layout:
    """Layout of a batch on ``mesh``: dim 0 sharded along the named mesh dims.

    Like ``paddle.distributed.shard_dataloader``'s ``shard_dims``: None means
    every rank reads the whole batch.
    """
    names = [shard_dims] if isinstance(shard_dims, str) else list(shard_dims or [])
    unknown = [n for n in names if n not in mesh.dim_names]
    if unknown:
        raise ValueError(f"shard_dims {unknown} are not dims of the mesh {list(mesh.dim_names)}")
    if len(names) > 1:
        raise ValueError("sharding the batch along more than one mesh dim is not supported yet")
    first = mesh.dim(names[0]) if names else -1
    return Layout(mesh, (first,) + (-1,) * max(ndim - 1, 0))


def widest(meshes: Sequence[Mesh], num_workers: int) -> Mesh:
    """The layer's largest mesh, or all ranks as "dp" if the layer has no dist parameters: where
    batches lie by default, and where a dynamic model's plain parameters are placed whole."""
    return max(meshes, key=lambda m: len(m.process_ids)) if meshes else Mesh.of(list(range(num_workers)), ["dp"])


def stages(meshes: Sequence[Mesh]) -> bool:
    """Whether some of ``meshes`` share no process: pipeline stages (activations
    cross between them by send/recv)."""
    return any(not set(a.process_ids) & set(b.process_ids) for i, a in enumerate(meshes) for b in meshes[i + 1:])
