"""Eager resharding from partial to sharded values on CPU (CPU builds only).

Paddle 3.3.1 turns a partial dist tensor into a sharded one (``dist.reshard``, in
dygraph) with a reduce-scatter, and its CPU build has no reduce-scatter kernel
("Unimplemented cpu kernel for CReduceScatterOp", ``phi/kernels/cpu/reduce_scatter_kernel.cc``).
Eager sharding (``dist.shard_optimizer`` with ``ShardingStage1/2/3``) reshards every
gradient that way, so it fails on CPU at the first step. (Static programs have the same
gap; `raydist.compat.collectives` answers it there.)

Fix: in dygraph, a reshard that takes a mesh dim from partial to sharded goes in two
steps, partial to replicated (an all-reduce, which gloo has) and then replicated to
sharded (each rank keeps its slice, no communication): the same values as a
reduce-scatter, for twice its traffic. Sharding's gradients reach ``reshard`` both as
``dist.reshard`` and as the module's own name, so both are replaced.

Canary: ``tests/test_dynamic.py::test_reshard_defect_eager_sharding_has_no_cpu_reduce_scatter``.
"""

from __future__ import annotations

from . import expect_source

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.auto_parallel import api

    original = api.reshard
    expect_source(original, "paddle.base.core.reshard(dist_tensor, dist_attr)", fix="reshard")

    def reshard(dist_tensor, mesh, placements):
        if paddle.in_dynamic_mode() and dist_tensor.is_dist() and mesh == dist_tensor.process_mesh:
            source = list(dist_tensor.placements)
            between = [dist.Replicate() if s.is_partial() and p.is_shard() else s for s, p in zip(source, placements)]
            if between != source:
                dist_tensor = original(dist_tensor, mesh, between)
        return original(dist_tensor, mesh, placements)

    reshard.__doc__ = original.__doc__
    reshard.__wrapped__ = original
    api.reshard = reshard
    dist.reshard = reshard
    _applied = True
