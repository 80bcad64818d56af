"""Paddle's static ``DistModel`` inside one rank. Rank-only: imports Paddle.

Builds each mode's program once (through `raydist.compat.engine`, which keeps
Paddle 3.3.1's predict and eval-only defects away), feeds the rank's local
shard of each batch and fetches the rank's local results.

Feeding: Paddle's ``shard_dataloader`` wraps each local batch into a dist
tensor and ``DistModel._make_feeds`` unwraps it again to its local
DenseTensor; the rank feeds that local array directly, which is what the
executor receives either way.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.base.framework import _dygraph_guard
from paddle.distributed.auto_parallel.static.dist_input_spec import DistributedInputSpec

from .compat import engine as compat_engine
from .specs import TensorSpec
from .topology import Layout, Mesh, ModePlan

MODES = ("train", "eval", "predict")
_REDUCE_NAMES = {0: "sum", 1: "max", 2: "min", 3: "prod", 4: "avg"}


def mesh_of(process_mesh) -> Mesh:
    return Mesh(tuple(process_mesh.shape), tuple(process_mesh.process_ids), tuple(process_mesh.dim_names))


def layout_of_tensor(tensor) -> Layout:
    """Layout of a dist tensor (from its placements)."""
    dims_mapping = [-1] * len(tensor.shape)
    partial = []
    for mesh_dim, p in enumerate(tensor.placements):
        if p.is_shard():
            dims_mapping[p.get_dim()] = mesh_dim
        elif p.is_partial():
            partial.append((mesh_dim, _reduce_name(p.reduce_type())))
    return Layout(mesh_of(tensor.process_mesh), tuple(dims_mapping), tuple(partial))


def layout_of_value(value) -> Layout:
    """Layout of a value of a PIR dist program (from its dist attribute)."""
    attr = value.dist_attr()
    partial = tuple(sorted((int(d), _reduce_name(r)) for d, r in attr.partial_status.items()))
    return Layout(mesh_of(attr.process_mesh), tuple(attr.dims_mapping), partial)


def _reduce_name(reduce_type) -> str:
    return _REDUCE_NAMES.get(int(getattr(reduce_type, "value", reduce_type)), str(reduce_type))


def paddle_spec(spec: TensorSpec) -> DistributedInputSpec:
    mesh = dist.ProcessMesh(np.array(spec.layout.mesh.process_ids).reshape(spec.layout.mesh.shape).tolist(),
                            dim_names=list(spec.layout.mesh.dim_names))  # fmt: skip
    placements = [dist.Replicate() for _ in spec.layout.mesh.shape]
    for tensor_dim, mesh_dim in enumerate(spec.layout.dims_mapping):
        if mesh_dim >= 0:
            placements[mesh_dim] = dist.Shard(tensor_dim)
    return DistributedInputSpec(list(spec.shape), spec.dtype, spec.name, mesh=mesh, placements=placements)


class StaticRunner:
    """One rank's static DistModel: modes, steps, programs and state."""

    def __init__(self, layer, loss, optimizer, strategy, metrics):
        model = dist.to_static(layer, None, loss, optimizer, strategy, input_spec=[[], []])
        if not isinstance(model, dist.DistModel):
            raise ValueError("strategy.full_graph=False makes Paddle return a dygraph model; raydist runs DistModel")
        self.model = model
        self.engine = model._engine
        self.mode: str | None = None
        self._fetch: dict[str, list] = {}  # mode -> values to fetch
        self._feed: dict[str, list[str]] = {}  # mode -> feed names
        self._plans: dict[str, ModePlan] = {}
        self.specs: tuple[list[TensorSpec], list[TensorSpec]] = ([], [])

    def set_specs(self, inputs: list[TensorSpec], labels: list[TensorSpec]) -> None:
        """The global specs of inputs and labels (labels may come later, before train/eval)."""
        self.specs = (inputs, labels)
        self.engine._inputs_spec = [paddle_spec(s) for s in inputs]
        self.engine._labels_spec = [paddle_spec(s) for s in labels]

    def set_mode(self, mode: str) -> ModePlan:
        if mode not in self._plans:
            names = compat_engine.build(self.engine, mode, first=not self._plans)
            dist_program = self.engine._pir_dist_main_progs[mode]
            dense_program = self.engine._pir_dense_main_progs[mode]
            values = [dist_program.get_output_value_by_name(n) for n in names]
            self._fetch[mode] = [dense_program.get_output_value_by_name(n) for n in names]
            specs = self.engine._inputs_spec + ([] if mode == "predict" else self.engine._labels_spec)
            self._feed[mode] = [s.name for s in specs]
            self._plans[mode] = ModePlan([layout_of_value(v) for v in values])
        self.engine.to_mode(mode)
        self.mode = mode
        return self._plans[mode]

    def local(self, arrays, rank: int) -> list:
        """This rank's pieces of a global batch (views), by the current mode's specs."""
        inputs, labels = self.specs
        specs = inputs if self.mode == "predict" else inputs + labels
        return [spec.layout.local(a, rank) for spec, a in zip(specs, arrays)]

    def step(self, arrays, collect: bool):
        """Run one step on this rank's local batch; the local results if ``collect``."""
        mode = self.mode
        feed = dict(zip(self._feed[mode], arrays))
        fetch = self._fetch[mode] if collect else []
        # static mode for this thread only (steps may run on a Ray thread;
        # paddle.enable_static() does nothing outside the thread that imported Paddle)
        with _dygraph_guard(None):
            outs = self.engine._executor.run(
                self.engine._pir_dense_main_progs[mode], feed=feed, fetch_list=fetch, return_numpy=True
            )
        return outs if collect else None

    def program(self, kind: str, mode: str | None) -> str:
        mode = mode or self.mode
        if mode not in self._plans:
            raise ValueError(f"mode {mode!r} has no program yet: switch to it and run a step first")
        return str(compat_engine.program(self.engine, kind, mode))

    def state_dict(self, mode: str) -> dict[str, tuple[np.ndarray, Layout]]:
        """This rank's pieces of the state: {structured name: (local array, layout)}."""
        state = self.model.state_dict(mode)
        out = {}
        for name, tensor in state.items():
            if tensor.is_dist():
                out[name] = (np.array(tensor._local_value().numpy()), layout_of_tensor(tensor))
            else:
                out[name] = (np.array(tensor.numpy()), None)
        return out
