"""The driver-side ``DistModel``: Paddle's DistModel API, run by a group of Ray ranks."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from . import pickling
from .data import Handle, ShardDataloader, handles_in
from .errors import UsageError
from .group import GroupConfig, RankGroup, init_ray
from .specs import TensorSpec, from_input_spec, spec_of
from .dispatch import message_bytes
from .steps import Loss, Window
from .strategy import check as check_strategy
from .strategy import check_meshes, micro_batches
from .topology import Mesh, data_layout, stages

log = logging.getLogger("raydist")

MODES = ("train", "eval", "predict")
_PROGRAMS = ("dist_main", "dist_startup", "serial_main", "serial_startup")


class DistModel:
    """Paddle's static auto-parallel ``DistModel``, one Ray actor per rank.

    Takes Paddle's arguments in Paddle's order, except that what would live on
    the ranks is given as something that makes it there:

    Args:
        layer: a picklable callable returning the ``paddle.nn.Layer``; it runs
            on every rank after the process group exists, so it can use
            ``dist.ProcessMesh`` and ``dist.shard_tensor``.
        loader: a `raydist.ShardDataloader`, or None (batches come from the driver).
        loss: a ``paddle.nn.Layer`` or callable ``(outputs..., labels...) -> loss``.
        optimizer: a callable ``parameters -> paddle.optimizer.Optimizer``
            (e.g. ``lambda p: paddle.optimizer.AdamW(1e-3, parameters=p)``).
        strategy: a ``paddle.distributed.Strategy``, passed to every rank.
        metrics: as in Paddle (Paddle 3.3.1's static engine ignores them).
        input_spec: as in Paddle, ``[[inputs...], [labels...]]`` of ``InputSpec``
            or ``DistributedInputSpec`` with GLOBAL shapes; None infers them from
            the first batch.
        num_workers: number of ranks; default: the processes of ``input_spec``'s mesh.
        use_gpu: one GPU per rank and NCCL (otherwise CPU and gloo).
        shard_dims: the mesh dim along which batches are split across ranks
            (data parallel). The default "dp" splits along the mesh dim named
            "dp" if the model's mesh has one, else every rank gets the whole batch.
        resources_per_rank, placement_strategy, master_port, placement_timeout_s,
        name, paddle_logs, runtime_env: see `raydist.group.GroupConfig`.
        max_in_flight: how many steps may run before the driver waits for the
            oldest (see `raydist.steps`); 1 makes every call wait for its step.
        dispatch: how steps reach the ranks: "compiled" (a Ray Compiled
            Graph: the least driver work per step, but its channels busy-wait,
            a core per waiting process), "calls" (one actor call per rank),
            or "auto": compiled with GPUs, calls on CPUs, where ranks need
            every core (see `raydist.dispatch` and BENCHMARKS.md).
        step_timeout_s: how long a step may take before its ranks count as
            stuck (a collective that never returns): then `RankError`, and the
            ranks are torn down. None: no limit. A dead rank is reported at
            once, whatever this is.

    Default mode follows Paddle: loss and optimizer -> "train"; loss only ->
    "eval"; neither -> "predict".
    """

    def __init__(
        self,
        layer: Callable[[], Any],
        loader: Any = None,
        loss: Any = None,
        optimizer: Callable[[Sequence[Any]], Any] | None = None,
        strategy: Any = None,
        metrics: Sequence[Any] | None = None,
        input_spec: Sequence[Sequence[Any]] | None = None,
        *,
        num_workers: int | None = None,
        use_gpu: bool = False,
        shard_dims: str | None = "dp",
        resources_per_rank: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        master_port: int | None = None,
        placement_timeout_s: float | None = 300.0,
        name: str | None = None,
        paddle_logs: bool = False,
        runtime_env: dict | None = None,
        max_in_flight: int = 2,
        dispatch: str = "auto",
        step_timeout_s: float | None = 900.0,
    ) -> None:
        _check_arguments(layer, loader, loss, optimizer, strategy, metrics)
        check_strategy(strategy, use_gpu)
        self._micro_batches = {mode: micro_batches(strategy, mode) for mode in MODES}
        inputs, labels = from_input_spec(input_spec) if input_spec is not None else (None, None)
        if inputs is None and loader is not None:  # as Paddle: the last column is the label
            specs = loader.specs()
            inputs, labels = (specs[:-1], specs[-1:]) if len(specs) > 1 else (specs, None)
        num_workers = _num_workers(num_workers, (inputs or []) + (labels or []))
        payload = pickling.dumps((layer, loss, optimizer, strategy, list(metrics or [])),
                                 "the layer builder, loss, optimizer or strategy")

        self._loss, self._optimizer = loss is not None, optimizer is not None
        self._shard_dims = shard_dims
        self._inputs: list[TensorSpec] | None = inputs
        self._labels: list[TensorSpec] | None = labels
        self._mode = "train" if (self._loss and self._optimizer) else ("eval" if self._loss else "predict")
        self._rank_mode: str | None = None  # the mode the ranks are in
        self._plans: dict[str, Any] = {}  # mode -> ModePlan from rank 0
        self._specs_changed = True  # the ranks have not seen the latest specs
        self._pending = None  # (path, {name: manifest entry}) of a checkpoint still to restore
        self._window = Window(max_in_flight)
        if dispatch not in ("auto", "compiled", "calls"):
            raise ValueError(f"dispatch must be 'auto', 'compiled' or 'calls', got {dispatch!r}")
        self._compiled = dispatch == "compiled" or (dispatch == "auto" and use_gpu)
        self._step_timeout = step_timeout_s
        self._last_checkpoint: str | None = None  # the latest saved or loaded, for restart()
        self._payload = payload
        self._config = GroupConfig(num_workers, use_gpu, resources_per_rank, placement_strategy, master_port,
                                   placement_timeout_s, name, paddle_logs, runtime_env)  # fmt: skip

        init_ray(num_workers, resources_per_rank, use_gpu)
        self._start()
        if loader is not None:
            loader.bind(self._group)
        self._inputs = self._with_layouts(self._inputs)
        self._labels = self._with_layouts(self._labels, self._label_mesh)
        if self._specs_known(self._mode):
            self._sync_mode()

    def _start(self) -> None:
        """A new group of ranks with the model built on it."""
        self._group = RankGroup(self._config)
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        reports = self._group.run("build", ray.put(self._payload))
        try:
            check_meshes(reports[0]["meshes"], self._config.use_gpu)
        except UsageError:
            self._group.shutdown()
            raise
        self._mesh, self._label_mesh = _data_meshes(reports[0]["meshes"], self._config.num_workers)

    def restart(self) -> None:
        """Start a fresh group of ranks (after a failure) and restore the last checkpoint.

        The last checkpoint is the one this model saved or loaded last; with
        none, the model starts from its initial parameters again. Steps in
        flight are dropped.
        """
        self._finalizer()
        self._window = Window(self._window.size)
        self._plans, self._rank_mode, self._specs_changed, self._pending = {}, None, True, None
        self._start()
        if self._specs_known(self._mode):
            self._sync_mode()
        if self._last_checkpoint is not None:
            self.load(self._last_checkpoint)

    # -- modes -----------------------------------------------------------------

    def train(self) -> None:
        """Switch every rank to "train": calls update the parameters and return the loss."""
        if not (self._loss and self._optimizer):
            raise ValueError("train mode needs both a loss and an optimizer")
        self._switch("train")

    def eval(self) -> None:
        """Switch every rank to "eval": calls return the loss, nothing is updated."""
        if not self._loss:
            raise ValueError("eval mode needs a loss")
        self._switch("eval")

    def predict(self) -> None:
        """Switch every rank to "predict": calls return the model's outputs."""
        self._switch("predict")

    @property
    def mode(self) -> str:
        return self._mode

    def _switch(self, mode: str) -> None:
        self._window.drain()
        self._mode = mode
        if self._specs_known(mode):
            self._sync_mode()

    def _specs_known(self, mode: str) -> bool:
        needed = [self._inputs] if mode == "predict" else [self._inputs, self._labels]
        return all(specs is not None and all(s.complete for s in specs) for specs in needed)

    def _sync_mode(self) -> None:
        """Build (once) and enter the current mode on every rank; waits, so build errors show here."""
        if self._specs_changed:
            self._group.run("set_specs", self._inputs or [], self._labels or [])
            self._specs_changed = False
        if self._rank_mode != self._mode:
            plans = self._group.run("set_mode", self._mode)
            self._plans[self._mode] = plans[0]
            self._rank_mode = self._mode
            self._apply_pending()  # a checkpoint's tensors this mode's program brought

    def _with_layouts(self, specs: list[TensorSpec] | None, mesh: Mesh | None = None) -> list[TensorSpec] | None:
        """Give specs without a layout the default data layout on ``mesh`` (default: the inputs' mesh)."""
        if specs is None:
            return None
        mesh = mesh or self._mesh
        shard_dims = self._shard_dims
        if shard_dims == "dp" and "dp" not in mesh.dim_names:
            shard_dims = None
        return [s if s.layout else s.resolved(layout=data_layout(mesh, shard_dims, len(s.shape))) for s in specs]

    # -- steps -----------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        """One step on a GLOBAL batch: the loss (train, eval) or the outputs (predict).

        Arguments are numpy arrays or paddle Tensors (or lists of them), inputs
        then labels, as for Paddle's DistModel; or the handles a
        `raydist.shard_dataloader` yields, which the ranks read themselves.
        Predict takes inputs only and returns the outputs as numpy. Train and
        eval return a `raydist.Loss` at once, while the step runs: it acts as
        the float loss of the batch, waiting for it when read.
        """
        handles = handles_in(args)
        message = self._loader_message(args, handles) if handles else self._arrays_message(_to_arrays(args))
        plan, mode = self._plans[self._mode], self._mode
        steps = self._group.steps(self._window.size, self._compiled, self._step_timeout)
        nbytes = message_bytes(message)
        step = self._window.submit(
            lambda: steps.send(message, nbytes),
            lambda refs, what: _combine(plan, mode, steps.receive(refs, what)),
        )
        return step.result() if mode == "predict" else Loss(step)

    def _arrays_message(self, arrays: list[np.ndarray]) -> tuple:
        self._take_specs([spec_of(a, f"#{i}") for i, a in enumerate(arrays)])
        self._sync_mode()
        return ("arrays", arrays)  # every rank takes its own shard (a view)

    def _loader_message(self, args: Sequence[Any], handles: list[Handle]) -> tuple:
        first = handles[0]
        if len(handles) != _count_args(args):
            raise TypeError("pass either loader handles or arrays to a DistModel call, not both")
        if any((h.loader, h.epoch, h.step) != (first.loader, first.epoch, first.step) for h in handles):
            raise ValueError("the handles of one call must come from the same batch of one loader")
        loader = first.loader
        by_key = loader.specs_by_key()
        self._take_specs([by_key[h.key] for h in handles])
        loader.bind(self._group)
        self._sync_mode()
        loader.take(first)
        return ("loader", loader._id, first.epoch, first.step, [h.key for h in handles])

    def _take_specs(self, given: list[TensorSpec]) -> list[TensorSpec]:
        """The model's specs for a call with these arguments, inferred the first time; checked.

        Nothing is remembered from arguments that fail the checks.
        """
        mode = self._mode
        inputs, labels = self._inputs, self._labels
        if inputs is None:
            n_inputs = len(given) if mode == "predict" else len(given) - 1
            if n_inputs < 1:
                raise ValueError(f"{mode} takes inputs and labels: got {len(given)} argument(s)")
            inputs = self._with_layouts([_named(g, f"input{i}") for i, g in enumerate(given[:n_inputs])])
        if mode != "predict" and labels is None:
            labels = self._with_layouts([_named(g, f"label{i}") for i, g in enumerate(given[len(inputs):])],
                                        self._label_mesh)  # fmt: skip
        specs = inputs + ([] if mode == "predict" else labels)
        if len(given) != len(specs):
            what = "inputs" if mode == "predict" else "inputs and labels"
            raise ValueError(
                f"{mode} takes {len(specs)} {what} ({', '.join(s.name for s in specs)}), got {len(given)}"
            )
        for i, (spec, g) in enumerate(zip(specs, given)):
            spec.check(g, "label" if i >= len(inputs) else "input")
            _check_divides(spec, g.shape, self._micro_batches[mode])
        if not all(s.complete for s in specs):  # dims an input_spec left open
            inputs = [s.resolved(g) for s, g in zip(inputs, given)]
            if mode != "predict":
                labels = [s.resolved(g) for s, g in zip(labels, given[len(inputs):])]
        if (inputs, labels) != (self._inputs, self._labels):
            self._inputs, self._labels, self._specs_changed = inputs, labels, True
        return inputs + ([] if mode == "predict" else labels)

    # -- programs and state ----------------------------------------------------

    def dist_main_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s distributed main program of ``mode`` (default: current)."""
        return self._program("dist_main", mode, rank)

    def dist_startup_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s distributed startup program of ``mode``."""
        return self._program("dist_startup", mode, rank)

    def serial_main_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s serial (undistributed) main program of ``mode``."""
        return self._program("serial_main", mode, rank)

    def serial_startup_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s serial startup program of ``mode``."""
        return self._program("serial_startup", mode, rank)

    def _program(self, kind: str, mode: str | None, rank: int) -> str:
        self._window.drain()
        mode = mode or self._mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= rank < len(self._group):
            raise ValueError(f"rank must be in [0, {len(self._group)}), got {rank}")
        if mode not in self._plans:
            if not self._specs_known(mode):
                raise ValueError(f"the {mode} program is built at the first {mode} step (or pass input_spec)")
            current = self._mode
            self._switch(mode)
            self._switch(current)
        return self._group.gather([self._group.actors[rank].program.remote(kind, mode)], "program", [rank])[0]

    def state_dict(self, mode: str = "all") -> dict[str, np.ndarray]:
        """The FULL (unsharded) state as numpy arrays, keyed like Paddle's ``DistModel.state_dict``.

        ``mode``: "param" (the model's parameters), "opt" (the optimizer's
        state) or "all".
        """
        if mode not in ("all", "opt", "param"):
            raise ValueError(f"mode must be 'all', 'opt' or 'param', got {mode!r}")
        self._window.drain()
        pieces = self._group.run("state_dict", mode)
        state = {}
        for name, (array, layout) in pieces[0].items():
            if layout is None:
                state[name] = array
            else:
                state[name] = layout.assemble({r: pieces[r][name][0] for r in layout.readers()})
        return state

    def set_state_dict(self, state: dict[str, Any]) -> None:
        """Set parameters (and optimizer state) from FULL values; every rank keeps its own shard.

        ``state`` maps names as `state_dict` gives them to numpy arrays or
        paddle Tensors; a subset is fine, e.g. a plain single-process
        ``paddle.nn.Layer.state_dict()`` to start from pretrained weights.
        Unknown names and wrong shapes are errors, before anything is sent.
        """
        self._window.drain()
        meta = self._group.run("state_meta")[0]
        unknown = sorted(set(state) - set(meta))
        if unknown:
            raise ValueError(f"set_state_dict: the model has no {unknown} (it has {sorted(meta)})")
        full = {}
        for name, value in state.items():
            array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
            shape, dtype, _ = meta[name]
            if tuple(array.shape) != tuple(shape):
                raise ValueError(f"set_state_dict: {name!r} has shape {array.shape}, the model's is {tuple(shape)}")
            if array.dtype != np.dtype(dtype):
                if array.dtype.kind != np.dtype(dtype).kind:
                    raise TypeError(f"set_state_dict: {name!r} has dtype {array.dtype}, the model's is {dtype}")
                array = array.astype(dtype)
            full[name] = array
        self._group.run("set_state", ray.put(full))

    def save(self, path: str) -> None:
        """Write a distributed checkpoint to ``path`` (a new local directory or a pyarrow.fs URI).

        Every rank writes its own shards, in parallel; see `raydist.checkpoint`.
        """
        from . import checkpoint

        self._window.drain()
        if checkpoint.exists(path):
            raise ValueError(f"{path} exists: raydist never overwrites a checkpoint; save to a new directory")
        meta = self._group.run("state_meta")[0]
        plan = checkpoint.writers(meta)
        staged = checkpoint.staging_dir(path)
        ranks = sorted(plan)
        try:
            written = self._group.gather(
                [self._group.actors[r].save_pieces.remote(staged, plan[r]) for r in ranks], "save", ranks
            )
        except BaseException:
            checkpoint.remove(staged)  # an incomplete save leaves nothing behind
            raise
        files: dict[str, dict[int, str]] = {name: {} for name in meta}
        for rank, file in zip(ranks, written):
            for name in plan[rank]:
                files[name][rank] = file
        import paddle

        from . import __version__

        checkpoint.commit(staged, path, checkpoint.manifest(
            meta, files, step=self._window.submitted, mode=self._mode, num_workers=len(self._group),
            raydist=__version__, paddle=paddle.__version__,
        ))  # fmt: skip
        self._last_checkpoint = path

    def load(self, path: str) -> None:
        """Restore parameters and optimizer state from a checkpoint `save` wrote, on any mesh.

        What the model does not have yet (the optimizer's state before the
        train program is built) is restored when it is built.
        """
        from . import checkpoint

        self._window.drain()
        tensors = dict(checkpoint.read_manifest(path)["tensors"])
        meta = self._group.run("state_meta")[0]
        params = self._group.run("state_meta", "param")[0]
        missing = sorted(set(params) - set(tensors))
        wrong = sorted(n for n in set(meta) & set(tensors) if tuple(tensors[n]["shape"]) != tuple(meta[n][0]))
        if missing or wrong:
            raise ValueError(
                f"{path} is a checkpoint of another model: it lacks {missing} and has other shapes for {wrong}"
            )
        self._pending = (path, tensors)
        self._apply_pending(meta)
        self._last_checkpoint = path

    def _apply_pending(self, meta: dict | None = None) -> None:
        """Load what the model has (``meta``, if known) of a checkpoint being restored."""
        if self._pending is None:
            return
        path, tensors = self._pending
        meta = meta if meta is not None else self._group.run("state_meta")[0]
        now = {n: tensors.pop(n) for n in list(tensors) if n in meta}
        if now:
            self._group.run("load_state", path, now)
        if not tensors or not self._optimizer or "train" in self._plans:
            self._pending = None  # what is left, this model will never have

    def fit(
        self,
        loader: ShardDataloader,
        epochs: int = 1,
        steps: int | None = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | None = None,
        max_failures: int = 0,
        progress: bool = True,
    ) -> list[float]:
        """Train on ``loader`` for ``epochs`` (or ``steps``), surviving up to ``max_failures`` rank failures.

        Shows a progress bar (loss, steps/s); saves a checkpoint to
        ``checkpoint_dir/step-NNNNNNNN`` every ``checkpoint_every`` steps; on a
        `RankError` restarts the ranks, restores the latest checkpoint and
        resumes the data where it stood. Returns the loss of every step.
        See `raydist.fit`.
        """
        from .fit import fit

        return fit(self, loader, epochs, steps, checkpoint_every, checkpoint_dir, max_failures, progress)

    # -- lifetime --------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return len(self._group)

    def shutdown(self) -> None:
        """Complete the steps in flight, then stop every rank and free their resources. Idempotent."""
        try:
            if self._group.alive:
                self._window.drain()
        finally:
            self._finalizer()

    def wait(self) -> None:
        """Complete every step in flight; raises the first failure."""
        self._window.drain()

    def __enter__(self) -> "DistModel":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.shutdown()  # raises a failure of the last steps
        else:
            self._finalizer()  # the exception on its way out says what went wrong


def to_static(
    layer: Callable[[], Any],
    loader: Any = None,
    loss: Any = None,
    optimizer: Callable[[Sequence[Any]], Any] | None = None,
    strategy: Any = None,
    input_spec: Sequence[Sequence[Any]] | None = None,
    **kwargs: Any,
) -> DistModel:
    """Build a `DistModel` on a group of Ray ranks, as ``paddle.distributed.to_static`` would.

    See `DistModel` for the arguments; keyword arguments (``num_workers``,
    ``use_gpu``, ...) go to it.
    """
    return DistModel(layer, loader, loss, optimizer, strategy, None, input_spec, **kwargs)


# -- argument checks (all before any actor starts) ---------------------------------


def _check_arguments(layer, loader, loss, optimizer, strategy, metrics) -> None:
    import paddle

    if isinstance(layer, paddle.nn.Layer):
        raise TypeError(
            "raydist builds the layer on every rank: pass a function that returns it "
            "(e.g. `lambda: MyNet(mesh)`), not a Layer built on the driver"
        )
    if not callable(layer):
        raise TypeError(f"layer must be a callable that returns a paddle.nn.Layer, got {type(layer).__name__}")
    if loader is not None and not isinstance(loader, ShardDataloader):
        raise TypeError(f"loader must be a raydist.shard_dataloader(...) or None, got {type(loader).__name__}")
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a paddle.nn.Layer or a callable, got {type(loss).__name__}")
    if isinstance(optimizer, paddle.optimizer.Optimizer) or (optimizer is not None and not callable(optimizer)):
        raise TypeError(
            "optimizer must be a callable that makes the optimizer on each rank from the rank's "
            "parameters, e.g. `lambda params: paddle.optimizer.AdamW(1e-3, parameters=params)`; "
            f"got {type(optimizer).__name__}"
        )
    if strategy is not None:
        if not isinstance(strategy, paddle.distributed.Strategy):
            raise TypeError(f"strategy must be a paddle.distributed.Strategy, got {type(strategy).__name__}")
        if not strategy.full_graph:
            raise ValueError("strategy.full_graph=False asks Paddle for a dygraph model; raydist runs the static DistModel")
    if metrics is not None and not isinstance(metrics, (list, tuple)):
        raise TypeError(f"metrics must be a list, got {type(metrics).__name__}")


def _num_workers(num_workers: int | None, specs: list[TensorSpec]) -> int:
    spec_ranks = {i for s in specs if s.layout is not None for i in s.layout.mesh.process_ids}
    if num_workers is None:
        if not spec_ranks:
            raise ValueError("num_workers is required unless input_spec gives the mesh")
        return max(spec_ranks) + 1
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    if spec_ranks and max(spec_ranks) >= num_workers:
        raise ValueError(
            f"input_spec's mesh uses processes up to {max(spec_ranks)}, but num_workers={num_workers}"
        )
    return num_workers


def _data_meshes(meshes: list[Mesh], num_workers: int) -> tuple[Mesh, Mesh]:
    """The meshes inputs and labels are laid on by default.

    Pipeline stages (disjoint meshes, in the order of the layer's
    parameters): inputs on the first, labels on the last, as Paddle's
    ``shard_dataloader`` lays them. Otherwise both on the layer's largest
    mesh, or on all ranks as "dp" if the layer has no dist parameters.
    """
    if not meshes:
        mesh = Mesh.of(list(range(num_workers)), ["dp"])
        return mesh, mesh
    if stages(meshes):
        return meshes[0], meshes[-1]
    mesh = max(meshes, key=lambda m: len(m.process_ids))
    return mesh, mesh


def _to_arrays(args: Sequence[Any]) -> list[np.ndarray]:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_to_arrays(a))
        elif isinstance(a, np.ndarray):
            out.append(a)
        elif hasattr(a, "numpy") and callable(a.numpy):  # paddle.Tensor
            out.append(np.asarray(a.numpy()))
        else:
            raise TypeError(f"DistModel inputs must be numpy arrays or paddle Tensors, got {type(a).__name__}")
    return out


def _check_divides(spec: TensorSpec, shape: tuple[int, ...], micro_batches: int) -> None:
    layout = spec.layout
    for d, m in enumerate(layout.dims_mapping):
        if m >= 0 and shape[d] % layout.mesh.shape[m]:
            raise ValueError(
                f"the global batch of {spec.name!r} has {shape[d]} rows along dim {d}, which does not "
                f"divide by the {layout.mesh.shape[m]} ranks of mesh dim {layout.mesh.dim_names[m]!r} "
                "(the data-parallel degree)"
            )
    if micro_batches > 1 and shape:
        split = layout.mesh.shape[layout.dims_mapping[0]] if layout.dims_mapping and layout.dims_mapping[0] >= 0 else 1
        if (shape[0] // split) % micro_batches:
            raise ValueError(
                f"the global batch of {spec.name!r} has {shape[0]} rows, {shape[0] // split} per rank, which do "
                f"not divide into the strategy's {micro_batches} micro-batches (gradient_merge.k_steps or "
                "pipeline.accumulate_steps)"
            )


def _combine(plan, mode: str, results: list) -> Any:
    """A step's result from the ranks': the loss, or the outputs (predict)."""
    values = [layout.assemble({r: results[r][i] for r in layout.readers()}) for i, layout in enumerate(plan.layouts)]
    if mode == "predict":
        return values[0] if len(values) == 1 else values
    return float(np.mean(values[0]))


def _named(spec: TensorSpec, name: str) -> TensorSpec:
    """An inferred spec: an array's gets a Paddle-style name, a loader's keeps its column name."""
    return spec if spec.layout is not None else dataclasses.replace(spec, name=name)


def _count_args(args) -> int:
    return sum(_count_args(a) if isinstance(a, (list, tuple)) else 1 for a in args)


