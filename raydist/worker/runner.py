"""Paddle's static ``DistModel`` inside one rank.

Builds each mode's program once (through `raydist.compat.engine`, which keeps
Paddle 3.3.1's predict and eval-only defects away), feeds the rank's local
shard of each batch and fetches the rank's local results.

Feeding: Paddle's ``shard_dataloader`` wraps each local batch into a dist
tensor and ``DistModel._make_feeds`` unwraps it again to its local
DenseTensor; the rank feeds that local array directly, which is what the
executor receives either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.auto_parallel.static.dist_input_spec import DistributedInputSpec

from ..compat import disabled_fixes
from ..compat import engine as compat_engine
from ..compat import executor as compat_executor
from ..compat.collectives import flush as flush_sends
from ..errors import UsageError
from ..handover import global_shape
from ..specs import TensorSpec
from ..strategy import micro_batches
from ..topology import Layout, Mesh, ModePlan

Values = dict[str, np.ndarray]  # FULL values by name

_REDUCE_NAMES = {0: "sum", 1: "max", 2: "min", 3: "prod", 4: "avg"}


def layout_of_tensor(tensor) -> Layout:
    """Layout of a dist tensor (from its placements)."""
    dims_mapping = [-1] * len(tensor.shape)
    partial = []
    for mesh_dim, p in enumerate(tensor.placements):
        if p.is_shard():
            dims_mapping[p.get_dim()] = mesh_dim
        elif p.is_partial():
            partial.append((mesh_dim, _reduce_name(p.reduce_type())))
    return Layout(Mesh.of_paddle(tensor.process_mesh), tuple(dims_mapping), tuple(partial))


def layout_of_value(value) -> Layout:
    """Layout of a value of a PIR dist program (from its dist attribute)."""
    attr = value.dist_attr()
    partial = tuple(sorted((int(d), _reduce_name(r)) for d, r in attr.partial_status.items()))
    return Layout(Mesh.of_paddle(attr.process_mesh), tuple(attr.dims_mapping), partial)


def _reduce_name(reduce_type) -> str:
    return _REDUCE_NAMES.get(int(getattr(reduce_type, "value", reduce_type)), str(reduce_type))


def placements(layout: Layout) -> list:
    """Paddle's placements of a layout without partial values (a batch's)."""
    out: list = [dist.Replicate() for _ in layout.mesh.shape]
    for tensor_dim, mesh_dim in enumerate(layout.dims_mapping):
        if mesh_dim >= 0:
            out[mesh_dim] = dist.Shard(tensor_dim)
    return out


def paddle_spec(spec: TensorSpec, micro_batches: int = 1) -> DistributedInputSpec:
    """Paddle's spec of a GLOBAL input; programs that split batches into
    ``micro_batches`` (gradient merge, pipelines) are built for one micro-batch,
    as Paddle's ``Engine._validate_spec`` does."""
    mesh = spec.laid.mesh.to_paddle()
    shape = list(spec.dims)
    shape[0] //= micro_batches
    # Data takes no gradient, as in Paddle's own specs from a DataLoader: the default (False)
    # differentiates the program through its inputs and labels, which costs each step the
    # gradient ops of the first layer's input and, on a column-parallel one, an all-reduce.
    return DistributedInputSpec(shape, spec.dtype, spec.name, stop_gradient=True, mesh=mesh,
                                placements=placements(spec.laid))


class Runner:
    """What every kind of rank model shares: the modes entered, the batch's specs, setting state.
    `StaticRunner` runs converted programs, `raydist.worker.eager.EagerRunner` the layer itself."""

    mode: str | None
    specs: tuple[list[TensorSpec], list[TensorSpec]]
    _plans: dict[str, ModePlan]

    @property
    def modes(self) -> set[str]:
        """The modes built (entered) so far."""
        return set(self._plans)

    def entered(self) -> str:
        """The mode entered last (a step runs in it)."""
        if self.mode is None:
            raise UsageError("the rank is in no mode yet: the driver sets one before a step")
        return self.mode

    def set_specs(self, inputs: list[TensorSpec], labels: list[TensorSpec]) -> None:
        """The global specs of inputs and labels (labels may come later, before train/eval)."""
        self.specs = (inputs, labels)

    def mode_specs(self, mode: str | None = None) -> list[TensorSpec]:
        """The specs of what a step of ``mode`` (default: the current one) is fed: predict takes no labels."""
        inputs, labels = self.specs
        return inputs if (mode or self.mode) == "predict" else inputs + labels

    def local(self, arrays, rank: int) -> list:
        """This rank's pieces of a global batch (views), by the current mode's specs."""
        return [spec.laid.local(a, rank) for spec, a in zip(self.mode_specs(), arrays)]

    def set_state(self, full: Values | Callable[[set[str]], Values], rank: int) -> None:
        """Set the named tensors from FULL values; this rank keeps its own shard. ``full``: the
        values, or a function that reads those of the names it is given (a checkpoint's):
        the tensors this rank holds."""

        def pieces(held: dict[str, Layout | None]) -> Iterator[tuple[str, np.ndarray]]:
            for name, value in (full(set(held)) if callable(full) else full).items():
                if name in held:  # not another pipeline stage's
                    layout = held[name]
                    yield name, value if layout is None else layout.local(value, rank)

        self.set_pieces(pieces)

    def set_pieces(self, pieces: Callable[[dict[str, Layout | None]], Iterable[tuple[str, np.ndarray]]]) -> None:
        """Set this rank's own pieces: ``pieces({name: layout})``, given the tensors this rank holds and their
        layouts (None: whole), gives (name, local array) of those to set, one at a time."""
        raise NotImplementedError


class StaticRunner(Runner):
    """One rank's static DistModel: modes, steps, programs and state."""

    def __init__(self, layer, loss, optimizer, strategy, metrics):
        model = dist.to_static(layer, None, loss, optimizer, strategy, input_spec=[[], []])
        if not isinstance(model, dist.DistModel):
            raise ValueError("strategy.full_graph=False makes Paddle return a dygraph model; raydist runs DistModel")
        self.engine = compat_engine.engine_of(model)
        compat_engine.set_metrics(self.engine, metrics)  # to_static takes none (compat.engine, defect 7)
        self.model = model
        self.layer = layer
        self.mode: str | None = None
        self._fetch: dict[str, list] = {}  # mode -> values to fetch
        self._feed: dict[str, list[str]] = {}  # mode -> feed names
        self._held: dict[str, list[bool]] = {}  # mode -> whether this rank holds each value to fetch
        self._plans: dict[str, ModePlan] = {}
        self._prepared: dict[tuple[str, bool], compat_executor.Prepared] = {}  # (mode, collect) -> its runs
        self._prepare = "executor" not in disabled_fixes()  # else Paddle's Executor.run, as a canary shows it
        self.specs: tuple[list[TensorSpec], list[TensorSpec]] = ([], [])
        # whether a train step that fails in a collective has updated nothing (compat.engine, behaviour 8)
        self.updates_last = False

    def set_mode(self, mode: str) -> ModePlan:
        if mode not in self._plans:
            engine = self.engine
            micro = micro_batches(compat_engine.strategy_of(engine), mode)
            inputs, labels = self.specs
            compat_engine.set_specs(engine, [paddle_spec(s, micro) for s in inputs],
                                    [paddle_spec(s, micro) for s in labels])  # fmt: skip
            groups = compat_engine.build(engine, mode, first=not self._plans)
            if mode == "train" and not compat_engine.has_plan(engine, mode):  # jobs (gradient merge): as built
                self.updates_last = compat_engine.updates_last(compat_engine.dense_program(engine, mode))
            names = [name for group in groups for name in group]
            dist_program = compat_engine.program(engine, "dist_main", mode)
            values = [dist_program.get_output_value_by_name(n) for n in names]
            # only a pipeline's last stage holds the loss and the outputs: the others' are fake values
            held = [not paddle.pir.is_fake_value(v) for v in values]
            fetch_program = compat_engine.fetch_program(self.engine, mode)
            self._fetch[mode] = [fetch_program.get_output_value_by_name(n) for n, h in zip(names, held) if h]
            self._held[mode] = held
            paddle_inputs, paddle_labels = compat_engine.specs_of(engine)
            specs = paddle_inputs + ([] if mode == "predict" else paddle_labels)
            self._feed[mode] = [s.name for s in specs]
            layouts = [layout_of_value(v) if h else None for v, h in zip(values, held)]
            self._plans[mode] = ModePlan(layouts, tuple(len(g) for g in groups))
            compat_executor.freeze(compat_engine.dense_program(engine, mode))  # built: it will not change
        compat_engine.use_mode(self.engine, mode)
        self.mode = mode
        return self._plans[mode]

    def step(self, arrays, collect: bool):
        """Run one step on this rank's local batch; the local results if ``collect``."""
        mode = self.entered()
        # static mode for this thread only (steps may run on a Ray thread;
        # paddle.enable_static() does nothing outside the thread that imported Paddle)
        with compat_engine.in_static_mode():
            program = compat_engine.dense_program(self.engine, mode)
            feed = dict(zip(self._feed[mode], arrays))
            fetch = self._fetch[mode] if collect else []
            if self._prepare:
                run = self._prepared.get((mode, collect))
                if run is None or run.source is not program:
                    run = self._prepared[(mode, collect)] = compat_executor.Prepared(
                        compat_engine.executor_of(self.engine), program, self._feed[mode], fetch
                    )
                outs = run(feed)
            else:
                outs = compat_engine.executor_of(self.engine).run(program, feed=feed, fetch_list=fetch,
                                                                  return_numpy=True)  # fmt: skip
        flush_sends()
        if not collect:
            return None
        fetched = iter(outs)
        return [next(fetched) if h else None for h in self._held[mode]]

    def program(self, kind: str, mode: str | None) -> str:
        mode = mode or self.mode
        if mode not in self._plans:
            raise ValueError(f"mode {mode!r} has no program yet: switch to it and run a step first")
        return str(compat_engine.program(self.engine, kind, mode))

    def _state(self, mode: str) -> dict[str, tuple[str, np.ndarray, Layout | None, tuple[int, ...]]]:
        """{structured name: (variable name, local array, layout or None, global shape)}: the
        program's state once a mode is built, before that the layer's parameters (no
        optimizer state yet)."""
        out = {}
        if self._plans:
            for name, (var, array, mesh, dims_mapping) in compat_engine.local_state(self.model, mode).items():
                layout = None if mesh is None else Layout(Mesh(*mesh), dims_mapping)
                out[name] = (var, array, layout, global_shape(array.shape, layout))
            return out
        if mode == "opt":
            return out
        for name, tensor in self.layer.state_dict().items():
            if not holds_piece(tensor):
                continue
            local = tensor._local_value() if tensor.is_dist() else tensor
            layout = layout_of_tensor(tensor) if tensor.is_dist() else None
            out[name] = (name, np.array(local.numpy()), layout, tuple(int(d) for d in tensor.shape))
        return out

    def state_dict(self, mode: str) -> dict[str, tuple[np.ndarray, Layout | None]]:
        """This rank's pieces of the state: {structured name: (local array, layout)}."""
        return {name: (array, layout) for name, (_, array, layout, _) in self._state(mode).items()}

    def state_meta(self, mode: str = "all") -> dict[str, tuple[tuple[int, ...], str, Layout | None]]:
        """{structured name: (global shape, dtype, layout)} of the state (``mode`` as `state_dict`)."""
        state = self._state(mode)
        return {name: (shape, str(array.dtype), layout) for name, (_, array, layout, shape) in state.items()}

    def set_pieces(self, pieces: Callable[[dict[str, Layout | None]], Iterable[tuple[str, np.ndarray]]]) -> None:
        if not self._plans:  # the layer's dygraph parameters, before the first build
            params = {name: t for name, t in self.layer.state_dict().items() if holds_piece(t)}
            for name, local in pieces({n: layout_of_tensor(t) if t.is_dist() else None for n, t in params.items()}):
                tensor = params[name]
                (tensor._local_value() if tensor.is_dist() else tensor).set_value(np.array(local, order="C"))
            return
        from paddle.base import core

        state = self._state("all")
        place = compat_engine.expected_place()
        local_state = {}
        for name, local in pieces({name: layout for name, (_, _, layout, _) in state.items()}):
            dense = core.DenseTensor()
            dense.set(np.array(local, order="C"), place)
            local_state[state[name][0]] = dense
        program = compat_engine.program(self.engine, "dist_main", self.entered())
        program.set_state_dict(local_state, paddle.static.global_scope(), True)


def holds_piece(tensor) -> bool:
    """Whether this rank holds a piece of a layer's tensor (not: another pipeline stage's)."""
    return not tensor.is_dist() or dist.get_rank() in tensor.process_mesh.process_ids

