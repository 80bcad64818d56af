"""Parameters on another pipeline stage's mesh. CPU builds only.

Paddle 3.3.1 defect: ``paddle.base.core.reshard`` of a dist tensor this
process holds no piece of (a parameter of another stage: the rank is not in
its mesh) asks for a default device context (``GetDistTensorDeviceContext``
-> ``GetDefaultPlace``), and on a CPU build that lookup segfaults in
``phi::DeviceManager``. ``ProgramHelper.init_pir`` reshards every parameter
this way when the engine initialises, so every rank of a pipeline died there
without a Python trace. On GPU builds the same call returns an empty tensor,
which ``init_pir`` then releases.

Fix: while ``init_pir`` runs, such a reshard returns the empty tensor itself,
as the GPU build's does; every other reshard is Paddle's.
"""

from __future__ import annotations

import functools

import paddle
from paddle.distributed.auto_parallel.static import helper as _helper

from . import expect_source

_applied = False


def _held(tensor) -> bool:
    return not tensor.is_dist() or tensor._is_initialized() or \
        paddle.distributed.get_rank() in tensor.process_mesh.process_ids


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
        core.reshard = lambda tensor, attr: reshard(tensor, attr) if _held(tensor) else tensor
        try:
            return original_init(self, *args, **kwargs)
        finally:
            core.reshard = reshard

    _helper.ProgramHelper.init_pir = init_pir
    _applied = True
