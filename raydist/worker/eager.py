"""One rank's model in dynamic mode: the layer run eagerly in Paddle's auto-parallel, no program.

``to_static(..., dynamic=True)``. For models dy2static cannot convert (Python control
flow on tensor values, config objects, calls it refuses), the rank runs the layer as
Paddle users run auto-parallel models in eager mode: parameters are dist tensors
(``dist.shard_tensor``, ``parallelize_model``), each rank's shard of the batch becomes
a dist tensor (``dtensor_from_local``), ``loss.backward()`` and ``optimizer.step()``
communicate as the placements ask, and ``dist.shard_optimizer`` shards for
``strategy.sharding``. It answers the driver as `raydist.worker.runner.StaticRunner`
does: the same plans, results, state names and layouts, so checkpoints, peer memory,
replica checks and restarts are the same for both.

A mode's plan (the layouts of the values its steps fetch) is known only once the layer
has run: entering a mode the first time runs one forward pass (no gradient, the layer in
eval mode, so dropout draws nothing) on zeros of the batch's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from ..errors import UsageError
from ..handover import global_shape
from ..specs import TensorSpec
from ..topology import Layout, Mesh, ModePlan
from .runner import Runner, layout_of_tensor, placements

# Paddle names a parameter on a mesh "<name>.dist" ("linear_0.w_0.dist"), and its optimizer
# state after it ("linear_0.w_0.dist_moment1_0"); static state names drop it (compat.engine), so do these.
_DIST = ".dist_"


class EagerRunner(Runner):
    """One rank's dynamic-mode model: modes, steps and state, the interface of `StaticRunner`."""

    updates_last = False  # the optimizer's communication (sharding's gathers) may follow some updates

    def __init__(self, layer, loss, optimizer, metrics):
        self.layer = layer
        self.loss = loss
        self.optimizer = optimizer
        self.metrics = list(metrics or [])
        self.mode: str | None = None
        self._plans: dict[str, ModePlan] = {}
        self.specs: tuple[list[TensorSpec], list[TensorSpec]] = ([], [])
        self._placed: dict[Layout, tuple] = {}  # an input's layout -> Paddle's mesh and placements
        if optimizer is not None:
            _create_accumulators(optimizer)  # the optimizer's state exists before the first step, as in static

    def set_mode(self, mode: str) -> ModePlan:
        if mode not in self._plans:
            specs = self.mode_specs(mode)
            zeros = [s.laid.local(np.broadcast_to(np.zeros((), s.dtype), s.dims), 0) for s in specs]  # views
            self.layer.eval()
            with paddle.no_grad():
                groups = self._run(mode, [self._tensor(z, s) for z, s in zip(zeros, specs)])
            values = [v for g in groups for v in g]
            self._plans[mode] = ModePlan([layout_of_tensor(_on_mesh(v, specs)) for v in values],
                                         tuple(len(g) for g in groups))  # fmt: skip
        self.layer.train() if mode == "train" else self.layer.eval()
        self.mode = mode
        return self._plans[mode]

    def step(self, arrays, collect: bool):
        """Run one step on this rank's local batch; the local results if ``collect``."""
        specs = self.mode_specs()
        tensors = [self._tensor(a, s) for a, s in zip(arrays, specs)]
        if self.mode == "train":
            groups = self._run("train", tensors)
            groups[0][0].backward()
            self.optimizer.step()
            self.optimizer.clear_grad()
        else:
            with paddle.no_grad():
                groups = self._run(self.entered(), tensors)
        if not collect:
            return None
        return [_local(_on_mesh(v, specs)) for g in groups for v in g]

    def _run(self, mode: str, tensors: list) -> list[list]:
        """The layer on a batch: the values a step of ``mode`` fetches, in groups (as `compat.engine.build`)."""
        count = len(self.specs[0])
        outputs = _flat(self.layer(*tensors[:count]))
        if mode == "predict":
            return [outputs]
        labels = tensors[count:]
        groups = [[_flat(self.loss(*outputs, *labels))[0]]]
        if mode == "eval":
            groups += [_flat(m.compute(*outputs, *labels)) for m in self.metrics]
        return groups

    def _tensor(self, local: np.ndarray, spec: TensorSpec):
        """This rank's piece of an input as a dist tensor of the global batch."""
        placed = self._placed.get(spec.laid)
        if placed is None:  # a ProcessMesh costs more to make than the rest of this together
            placed = self._placed[spec.laid] = (spec.laid.mesh.to_paddle(), placements(spec.laid))
        return dist.auto_parallel.api.dtensor_from_local(paddle.to_tensor(np.ascontiguousarray(local)), *placed)

    def program(self, kind: str, mode: str | None) -> str:
        raise UsageError("a dynamic-mode model (dynamic=True) runs its layer eagerly: it has no programs")

    def _tensors(self, mode: str) -> dict[str, Any]:  # paddle Tensors
        """{name: tensor} of the state, named as static state is (``mode``: "param", "opt", "all")."""
        out = {}
        if mode in ("param", "all"):
            out.update(self.layer.state_dict())
        if mode in ("opt", "all") and self.optimizer is not None:
            inner = getattr(self.optimizer, "_inner_opt", self.optimizer)
            for by_param in inner._accumulators.values():
                for tensor in by_param.values():
                    out[tensor.name.replace(_DIST, "_", 1)] = tensor
            for tensor in getattr(inner, "_master_weights", {}).values():
                out[tensor.name.replace(_DIST, "_", 1)] = tensor
        return out

    def state_dict(self, mode: str) -> dict[str, tuple[np.ndarray, Layout | None]]:
        """This rank's pieces of the state: {name: (local array, layout)}."""
        return {name: (_local(t), layout_of_tensor(t) if t.is_dist() else None)
                for name, t in self._tensors(mode).items()}  # fmt: skip

    def state_meta(self, mode: str = "all") -> dict[str, tuple[tuple[int, ...], str, Layout | None]]:
        out = {}
        for name, tensor in self._tensors(mode).items():
            layout = layout_of_tensor(tensor) if tensor.is_dist() else None
            local = tensor._local_value() if tensor.is_dist() else tensor
            dtype = str(np.dtype(paddle.base.data_feeder.convert_dtype(local.dtype)))
            out[name] = (global_shape(tuple(local.shape), layout), dtype, layout)
        return out

    def set_pieces(self, pieces: Callable[[dict[str, Layout | None]], Iterable[tuple[str, np.ndarray]]]) -> None:
        tensors = self._tensors("all")
        held = {n: layout_of_tensor(t) if t.is_dist() else None for n, t in tensors.items()}
        for name, local in pieces(held):
            tensor = tensors[name]
            (tensor._local_value() if tensor.is_dist() else tensor).set_value(np.array(local, order="C"))


def replicate_dense(layer, mesh: Mesh) -> None:
    """Put the layer's parameters that are on no mesh on ``mesh``, whole on every rank (as a static
    program places them): an eager step between dist tensors and plain parameters would leave each
    rank's gradient of them its own."""
    placements = [dist.Replicate() for _ in mesh.shape]
    paddle_mesh = mesh.to_paddle()
    placed: dict[int, object] = {}  # a parameter two sublayers share (tied weights) stays one
    for sub in layer.sublayers(include_self=True):
        for name, param in list(sub._parameters.items()):
            if param is not None and not param.is_dist():
                if id(param) not in placed:
                    placed[id(param)] = dist.shard_tensor(param, paddle_mesh, placements)
                sub._parameters[name] = placed[id(param)]


def _create_accumulators(optimizer) -> None:
    """Make the optimizer's state (moments, step counts) now; eager Paddle makes it at the first step."""
    inner = getattr(optimizer, "_inner_opt", optimizer)
    params = [p for p in inner._parameter_list if not p.stop_gradient]
    if isinstance(params[0], dict) if params else False:  # parameter groups
        params = [p for group in params for p in group["params"] if not p.stop_gradient]
    block = paddle.base.framework.default_main_program().global_block()
    optimizer._create_accumulators(block, params)  # a sharded optimizer shards them as it makes them


def _flat(value) -> list:
    return [v for item in value for v in _flat(item)] if isinstance(value, (list, tuple)) else [value]


def _on_mesh(value, specs: list[TensorSpec]):
    """A fetched value as a dist tensor (a loss or metric computed from plain tensors is replicated)."""
    if value.is_dist():
        return value
    mesh = specs[0].laid.mesh.to_paddle()
    return dist.shard_tensor(value, mesh, [dist.Replicate() for _ in mesh.shape])


def _local(tensor) -> np.ndarray:
    return np.array((tensor._local_value() if tensor.is_dist() else tensor).numpy())
