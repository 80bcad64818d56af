"""Parameters on another pipeline stage's mesh, at initialisation. CPU builds only.

Paddle 3.3.1 defect: ``paddle.base.core.reshard`` of a dist tensor asks for a
default device context (``SameStatusReshardFunction`` -> ``GetDefaultPlace``),
and on a CPU build that lookup segfaults in ``phi::DeviceManager``.
``ProgramHelper.init_pir`` reshards every parameter this way when the engine
initialises, to the dist attribute the program gives it, so every rank of a
pipeline died there without a Python trace, in two cases:

1. a parameter of another stage, which this rank holds no piece of (it is
   not in the parameter's mesh). On GPU builds the reshard returns an empty
   tensor, which ``init_pir`` then releases.
2. a parameter the program moves to another stage's mesh: VPP with
   ``vpp_seg_method`` assigns segment i to stage ``i % pp_degree``, whatever
   mesh the script put the segment's parameters on (blocks placed stage 0,
   stage 0, stage 1, stage 1 are segments 0 and 1 of stage 0's mesh, and
   segment 1 is stage 1's). On GPU the reshard sends the value across.

Fix: while ``init_pir`` runs, (1) such a reshard returns the tensor itself, as
empty as the GPU build's; (2) a replicated parameter that moves to another
mesh is broadcast from the first rank of its mesh over the global group (every
rank initialises the same parameters in the same order) and laid on the new
mesh, where its ranks keep it; every other reshard is Paddle's.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.auto_parallel.static import helper as _helper

from . import expect_source

_applied = False


def _held(tensor) -> bool:
    return not tensor.is_dist() or tensor._is_initialized() or \
        paddle.distributed.get_rank() in tensor.process_mesh.process_ids


def _moves(tensor, attr) -> bool:
    """Whether a reshard of ``tensor`` to ``attr`` moves a replicated value to another mesh."""
    if not tensor.is_dist():
        return False
    return sorted(tensor.process_mesh.process_ids) != sorted(attr.process_mesh.process_ids) and \
        all(p.is_replicated() for p in tensor.placements) and \
        all(d == -1 for d in attr.dims_mapping) and not attr._is_partial()


def _move(tensor, attr):
    """``tensor``'s value on ``attr``'s mesh, replicated: the ranks there hold it, the others nothing."""
    static = not paddle.in_dynamic_mode()  # init_pir runs between programs being built: eager calls here
    if static:
        paddle.disable_static()
    try:
        return _moved(tensor, attr)
    finally:
        if static:
            paddle.enable_static()


def _moved(tensor, attr):
    source = sorted(tensor.process_mesh.process_ids)
    if dist.get_rank() == source[0]:
        value = tensor._local_value().numpy()
    else:
        value = np.zeros(tensor.shape, dtype=str(tensor.dtype).split(".")[-1])
    dense = paddle.to_tensor(value)
    dist.broadcast(dense, src=source[0])
    mesh = attr.process_mesh
    target = dist.ProcessMesh(np.array(mesh.process_ids).reshape(mesh.shape).tolist(), dim_names=mesh.dim_names)
    return dist.shard_tensor(dense, target, [dist.Replicate() for _ in mesh.shape])


def apply() -> None:
    global _applied
    if _applied:
        return
    expect_source(_helper.ProgramHelper.init_pir, "tmp = paddle.base.core.reshard(param, var_dist_attr)",
                  "if tmp._is_initialized():", fix="stages")  # fmt: skip
    original_init = _helper.ProgramHelper.init_pir

    @functools.wraps(original_init)
    def init_pir(self, *args, **kwargs):
        core = paddle.base.core
        reshard = core.reshard

        def stage_reshard(tensor, attr):
            if _moves(tensor, attr):
                return _move(tensor, attr)
            return reshard(tensor, attr) if _held(tensor) else tensor

        core.reshard = stage_reshard
        try:
            return original_init(self, *args, **kwargs)
        finally:
            core.reshard = reshard

    _helper.ProgramHelper.init_pir = init_pir
    _applied = True
