"""The driver's side of a sharded data loader: handles, epochs, and who reads what.

``raydist.shard_dataloader`` is Paddle's ``shard_dataloader`` for Ray. The
driver iterates the loader as in Paddle, but what it gets are `Handle`s, not
data: one rank per data-parallel group (the group's *reader*) reads that
group's split of the dataset and stores each local batch once in Ray's object
store; every rank of the group is handed the same object reference. Data goes
from storage to the ranks without passing through the driver.

- A ``ray.data.Dataset`` is split with ``streaming_split(dp, equal=True)``,
  with ``preserve_order`` on, so the split is the same in every run (a new
  split per epoch; with ``shuffle`` a ``random_shuffle`` first, seeded by the
  epoch and ``seed`` together: `sources.shuffle_seed`).
- A picklable ``paddle.io.Dataset`` is read by each reader through Paddle's
  ``DistributedBatchSampler``, as ``paddle.distributed.shard_dataloader`` does.

Every split holds the same number of rows, so every epoch ends at the same
step on every rank, and the driver knows that step in advance (`len`).

The splits are the data's *shards*: one per data-parallel group of the loader's
mesh. An elastic model below its largest size (`raydist.driver.cluster.sizes`) has
fewer groups: each reads several shards joined (`sources.JoinedSplit`), so
global batch k holds the same rows, in the same order, at every size.
Readers read up to ``prefetch`` steps ahead of the model, in a thread of
their own, while the current step runs; the driver sends them nothing per
step (see `raydist.worker.data`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UsageError
from ..messages import ReadOrder
from ..options import check_positive_int
from ..protocol import RankActor
from ..specs import TensorSpec
from ..topology import Layout, Mesh, data_layout
from .sources import Field, JoinedSplit, source_of

if TYPE_CHECKING:
    from ..driver.dispatch.client import RankClient

_ids = itertools.count()

# Size of the chunks readers hand out (a chunk is at most `prefetch` batches).
CHUNK_BYTES = 4 * 1024 * 1024
# prefetch="auto": as many local batches as fill a chunk, within these bounds. A reader's
# costs are per chunk (a Ray Data read, a hand-out call), so small batches go in large chunks.
AUTO_PREFETCH = (8, 64)

# numpy kinds/dtypes Paddle has no tensor type for
_BAD_KINDS = {"O": "object", "S": "bytes", "U": "str", "V": "void", "M": "datetime", "m": "timedelta"}
_BAD_DTYPES = {np.dtype("uint16"), np.dtype("uint32"), np.dtype("uint64")}


@dataclasses.dataclass(frozen=True)
class Handle:
    """Stands for one column of one local batch that the ranks read themselves.

    Pass handles to a `raydist.DistModel` call as you would tensors.
    """

    loader: ShardDataloader = dataclasses.field(repr=False, compare=False)
    epoch: int
    step: int
    key: str | int

    def __repr__(self) -> str:
        return f"raydist.Handle(epoch={self.epoch}, step={self.step}, key={self.key!r})"


class ShardDataloader:
    """Paddle's ``ShardDataloader`` over a Ray Dataset (see `shard_dataloader`)."""

    def __init__(
        self,
        dataset: Any,
        meshes: Any,
        input_keys: Sequence[str] | None = None,
        shard_dims: Any = None,
        batch_size: int = 1,
        shuffle: bool = False,
        seed: int | None = None,
        drop_last: bool = True,
        prefetch: int | str = "auto",
    ) -> None:
        self.meshes = [_as_mesh(m) for m in (meshes if isinstance(meshes, (list, tuple)) else [meshes])]
        if not self.meshes:
            raise ValueError("meshes must name at least one ProcessMesh")
        dims = shard_dims if isinstance(shard_dims, (list, tuple)) else [shard_dims] * len(self.meshes)
        if len(dims) != len(self.meshes):
            raise ValueError(f"shard_dims must have one entry per mesh: {len(dims)} != {len(self.meshes)}")
        self.shard_dims = [_dim_name(m, d) for m, d in zip(self.meshes, dims)]
        check_positive_int("batch_size", batch_size, what="the global batch")
        self._own = _View(self.meshes, self.shard_dims)  # the loader's own meshes: its data shards
        self.layout, self.dp = self._own.layout, self._own.groups
        for mesh, dim in zip(self.meshes[1:], self.shard_dims[1:]):
            if len(data_layout(mesh, dim, 1).holders()) != self.dp:
                raise ValueError("every mesh must split the data into the same number of data-parallel groups")
        if batch_size % self.dp:
            raise ValueError(
                f"batch_size {batch_size} (the global batch) does not divide by the {self.dp} data-parallel groups"
            )
        self.batch_size = batch_size
        self.local_batch_size = batch_size // self.dp
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
        self.shuffle, self.seed, self.drop_last = bool(shuffle), None if seed is None else int(seed), bool(drop_last)
        check_positive_int("prefetch", prefetch, also=("auto",))
        self._source = source_of(dataset)
        fields = {f.key: f for f in self._source.fields()}
        keys = list(input_keys) if input_keys is not None else list(fields)
        missing = [k for k in keys if k not in fields]
        if missing:
            raise ValueError(f"input_keys {missing} are not columns of the dataset (it has {list(fields)})")
        for k in keys:
            _check_dtype(fields[k])
        self.fields = [fields[k] for k in keys]
        self.prefetch: int = self._auto_prefetch() if isinstance(prefetch, str) else prefetch
        self.dict_rows = self._source.dict_rows
        self._id = next(_ids)
        self._rows: int | None = None
        self._specs_by_key: dict[str | int, TensorSpec] | None = None
        self._client: RankClient | None = None  # the ranks that read (set by the DistModel)
        self._view = self._own  # the meshes of the ranks that read
        self._epoch: _Epoch | None = None
        self._next = 0  # the epoch `loader()` starts next
        self._prepared: tuple[int, list[Any]] | None = None  # (epoch, its splits), made ahead

    # -- what Paddle's loader offers ----------------------------------------------

    def __call__(self) -> Iterator[Any]:
        """Start a new epoch (as ``iter(loader)``)."""
        return self.__iter__()

    def __iter__(self) -> Iterator[Any]:
        return self.epoch(self._next)

    def epoch(self, number: int, start: int = 0) -> Iterator[Any]:
        """Epoch ``number`` (its shuffle depends on it), from step ``start`` on: to resume."""
        if len(self) == 0:
            raise ValueError(
                f"the dataset has {self.rows()} rows: fewer than one global batch of {self.batch_size} "
                f"({self.dp} data-parallel groups of {self.local_batch_size})"
            )
        self._next = number + 1
        self._epoch = _Epoch(self, number, start)
        return self._epoch

    def prepare(self) -> None:
        """Split the next epoch now, ahead of its first step: a Ray Dataset's split starts a
        coordinator actor, which takes seconds, and its start then overlaps the ranks'.
        (Not done for later epochs while one runs: a process start beside the steps
        costs them more, on a machine whose cores the ranks use, than it saves.)"""
        if self._prepared is None or self._prepared[0] != self._next:
            self._prepared = (self._next, self._source.splits(self.dp, self._next, self.shuffle, self.seed))

    def _splits(self, epoch: int) -> list[Any]:
        """Epoch ``epoch``'s splits: the prepared ones if they are its."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == epoch:
            return prepared[1]
        return self._source.splits(self.dp, epoch, self.shuffle, self.seed)

    def __len__(self) -> int:
        """Steps per epoch (every data-parallel group takes the same number)."""
        per_group = self._source.rows_per_group(self.rows(), self.dp)
        if self.drop_last:
            return per_group // self.local_batch_size
        return math.ceil(per_group / self.local_batch_size)

    def rows_at(self, step: int) -> int:
        """Rows of the global batch of ``step`` (the last one may be short unless drop_last)."""
        per_group = self._source.rows_per_group(self.rows(), self.dp)
        return min(self.local_batch_size, per_group - step * self.local_batch_size) * self.dp

    def rows(self) -> int:
        """Rows in the dataset (counted once; may run a Ray Data pipeline)."""
        if self._rows is None:
            self._rows = self._source.count()
        return self._rows

    # -- for the DistModel ----------------------------------------------------------

    def chunk(self) -> int:
        """Local batches a reader reads and hands out at once: up to `prefetch`, about CHUNK_BYTES."""
        return max(1, min(self.prefetch, CHUNK_BYTES // self._batch_bytes()))

    def _batch_bytes(self) -> int:
        row_bytes = sum(int(np.prod(f.shape, dtype=np.int64)) * f.dtype.itemsize for f in self.fields)
        return max(1, row_bytes * self.local_batch_size)

    def _auto_prefetch(self) -> int:
        low, high = AUTO_PREFETCH
        return max(low, min(high, CHUNK_BYTES // self._batch_bytes()))

    def specs_by_key(self) -> dict[str | int, TensorSpec]:
        """`specs`, keyed by field key (computed once)."""
        if self._specs_by_key is None:
            self._specs_by_key = {f.key: s for f, s in zip(self.fields, self.specs())}
        return self._specs_by_key

    def specs(self) -> list[TensorSpec]:
        """The global spec of each key: the last goes to the last mesh (labels), the rest to the first."""
        view, out = self._view, []
        for i, f in enumerate(self.fields):
            mesh_index = -1 if (i == len(self.fields) - 1 and len(self.fields) > 1) else 0
            layout = data_layout(view.meshes[mesh_index], view.shard_dims[mesh_index], 1 + len(f.shape))
            out.append(TensorSpec(str(f.key), (self.batch_size, *f.shape), str(f.dtype), layout))
        return out

    def bind(self, client: RankClient, meshes: Sequence[Mesh] | None = None) -> None:
        """Read with ``client``'s ranks from now on (a DistModel binds its loader).

        ``meshes``: the model's (inputs', labels') meshes. An elastic model running on
        fewer ranks than the loader's mesh holds reads through them: each of its
        data-parallel groups reads several of the loader's shards (`JoinedSplit`).
        """
        if self._client is not client:
            if self._epoch is not None and self._epoch.opened:
                # its readers were the other group's ranks: the new group's read on from the next step
                # (the rest of the epoch re-split among its data-parallel groups; the global batches are the same)
                self._epoch.reopen()
            self._client = client
            own = meshes is None or len(meshes[0].process_ids) == len(self.meshes[0].process_ids)
            dims = [self.shard_dims[0], self.shard_dims[-1]]
            view = self._own if own or meshes is None else _View(list(meshes), dims)
            if self.dp % view.groups:
                raise ValueError(
                    f"the loader's {self.dp} data shards do not split evenly over the model's {view.groups} "
                    "data-parallel groups"
                )
            self._view, self._specs_by_key = view, None

    def take(self, handle: Handle) -> None:
        """A DistModel call consumes the batch ``handle`` stands for (the epoch's next)."""
        epoch = self._epoch
        if epoch is None or handle.epoch != epoch.number:
            raise ValueError(f"{handle!r} belongs to a finished epoch: start a new one with loader()")
        if self._client is None:
            raise RuntimeError("the loader is not bound to a DistModel")
        epoch.take(handle.step)

    def readers(self) -> list[int]:
        """One rank per data-parallel group of the reading ranks: the group's first rank in the first mesh."""
        return self._view.layout.readers()

    def members(self, group: int, world_size: int) -> list[int]:
        """The ranks that read group ``group``'s batches."""
        return [r for r in range(world_size) if self.reader_of(r) == group]

    def reader_of(self, rank: int) -> int:
        """Index (into `readers`) of the group whose batches ``rank`` reads."""
        for mesh, dim in zip(self._view.meshes, self._view.shard_dims):
            if rank in mesh:
                layout = data_layout(mesh, dim, 1)
                return list(layout.holders()).index(layout.key(rank))
        return 0  # a rank outside every mesh reads nothing; give it group 0's batch


@dataclasses.dataclass
class _View:
    """The meshes of the ranks reading a loader, and their data-parallel groups."""

    meshes: list[Mesh]
    shard_dims: list[str | None]
    layout: Layout = dataclasses.field(init=False)  # the first mesh's data layout
    groups: int = dataclasses.field(init=False)  # data-parallel groups

    def __post_init__(self) -> None:
        for mesh, dim in zip(self.meshes, self.shard_dims):
            if dim is not None and dim not in mesh.dim_names:
                raise ValueError(f"the model's mesh {list(mesh.dim_names)} has no dim {dim!r} to split the data along")
        self.layout = data_layout(self.meshes[0], self.shard_dims[0], 1)
        self.groups = len(self.layout.holders())


class _Epoch:
    """One pass over the data: yields handles; the readers read ahead on their own."""

    def __init__(self, loader: ShardDataloader, number: int, start: int = 0):
        self.loader = loader
        self.number = number
        self.steps = len(loader)
        self.start = start
        self.step = start  # the next step to yield
        self.taken = start  # the next step a DistModel call may take
        self.opened = False

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> list[Handle] | dict[str | int, Handle]:  # (a dataset of dicts: by key)
        if self.step >= self.steps:
            raise StopIteration
        step, self.step = self.step, self.step + 1
        handles = [Handle(self.loader, self.number, step, f.key) for f in self.loader.fields]
        if self.loader.dict_rows:
            return {h.key: h for h in handles}
        return handles

    def take(self, step: int) -> None:
        """A DistModel call is about to consume ``step``: the readers must be reading.

        Opening reads the epoch from `start` (after a restart, or the first call).
        """
        if step != self.taken:
            raise ValueError(
                f"step {step} of the epoch comes out of order (the next is {self.taken}): "
                "pass each batch to the DistModel once, in order"
            )
        if not self.opened:
            self._open()
        self.taken += 1

    def reopen(self) -> None:
        """Read the rest of the epoch, from the next step to take, with the ranks bound next."""
        self.start, self.opened = self.taken, False

    def _open(self) -> None:
        loader, client = self.loader, self.loader._client
        if client is None:
            raise UsageError("the loader is read by no model: pass it to raydist.to_static(..., loader) or to fit")
        shards = loader._splits(self.number)
        readers = loader.readers()
        per_group = len(shards) // len(readers)  # more than one for an elastic model below its largest size
        keys = tuple(f.key for f in loader.fields)
        for g, reader in enumerate(readers):
            mine = shards[g * per_group : (g + 1) * per_group]
            split = mine[0] if per_group == 1 else JoinedSplit(tuple(mine))
            order = ReadOrder(loader._id, self.number, self.start, self.steps, split,
                              loader.local_batch_size * per_group, loader.drop_last, keys, loader.prefetch,
                              loader.chunk())  # fmt: skip
            members = [None if r == reader else client.actor(r) for r in loader.members(g, client.size)]
            client.tell(reader, RankActor.data_open, order, members)
        self.opened = True


def _check_dtype(field: Field) -> None:
    kind = _BAD_KINDS.get(field.dtype.kind)
    if kind or field.dtype in _BAD_DTYPES:
        raise TypeError(
            f"column {field.key!r} has dtype {field.dtype} ({kind or 'unsigned'}), which Paddle has no tensor for: "
            "convert it in the dataset (e.g. with map_batches) first"
        )


def _as_mesh(mesh: Any) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    try:
        return Mesh.of_paddle(mesh)
    except AttributeError:
        raise TypeError(f"meshes must be paddle.distributed.ProcessMesh objects, got {type(mesh).__name__}") from None


def _dim_name(mesh: Mesh, dim: Any) -> str | None:
    if dim is None or isinstance(dim, str):
        if dim is not None and dim not in mesh.dim_names:
            raise ValueError(f"shard_dims {dim!r} is not a dim of the mesh {list(mesh.dim_names)}")
        return dim
    if isinstance(dim, int) and 0 <= dim < len(mesh.dim_names):
        return mesh.dim_names[dim]
    raise ValueError(f"shard_dims must be a mesh dim name or index, got {dim!r}")


def shard_dataloader(
    dataset: Any,
    meshes: Any,
    input_keys: Sequence[str] | None = None,
    shard_dims: Any = None,
    batch_size: int = 1,
    shuffle: bool = False,
    seed: int | None = None,
    drop_last: bool = True,
    prefetch: int | str = "auto",
) -> ShardDataloader:
    """Paddle's ``shard_dataloader``, fed by Ray: each data-parallel group reads its split.

    Args:
        dataset: a ``ray.data.Dataset`` (any source or pipeline Ray Data reads:
            parquet, CSV, numpy, images, ``map_batches``...) or a picklable
            ``paddle.io.Dataset``.
        meshes: the ``ProcessMesh`` (or one per pipeline stage: the first gets
            the inputs, the last the labels).
        input_keys: the columns to feed, in order (default: all); the last is
            the label.
        shard_dims: the mesh dim (name or index) along which batches are split
            across data-parallel groups; None: every rank reads every row.
        batch_size: the GLOBAL batch size (split evenly over the groups).
        shuffle, seed: reshuffle every epoch, reproducibly with ``seed`` (a
            non-negative int: each (seed, epoch) pair shuffles its own way).
        drop_last: drop the last incomplete batch of an epoch.
        prefetch: how many local batches each reader reads ahead of its
            rank (in chunks of up to 4 MiB); "auto": as many as fill 4 MiB,
            at least 8 and at most 64 (a reader's costs are per chunk, so
            small batches go in large chunks).

    Iterate ``loader()`` (or ``loader``) for an epoch, and pass what it yields
    to the DistModel: ``for batch in loader(): dm(batch["x"], batch["y"])``.
    """
    return ShardDataloader(dataset, meshes, input_keys, shard_dims, batch_size, shuffle, seed, drop_last, prefetch)
