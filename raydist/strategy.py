"""What raydist does with a ``paddle.distributed.Strategy``, decided at the driver.

Paddle 3.3.1's static engine (PIR mode, the default) uses the Strategy's
``amp``, ``recompute``, ``gradient_merge``, ``pipeline``,
``mp_optimization`` and ``fused_passes`` sections, and ignores
``dp_optimization`` and ``sp_optimization``; raydist applies ``sharding``
itself (see `raydist.compat.engine`). Some sections cannot run on CPU: those
are refused here, before any rank starts, with the reason, instead of
segfaulting or silently training something else. The facts behind each
refusal are canaries in ``tests/test_compat.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

from .errors import UsageError
from .topology import stages

# Sections of Strategy's config dict (Strategy({...}) ignores unknown ones silently).
SECTIONS = {
    "sharding", "gradient_merge", "pipeline", "amp", "fused_passes", "recompute", "mp_optimization",
    "dp_optimization", "sp_optimization", "full_graph", "auto_mode", "gradient_scale",
    "gradient_scale_using_allreduce_avg", "use_cache", "return_numpy", "all_ranks", "split_data", "seed", "reinit",
}  # fmt: skip


def check(strategy: Any, use_gpu: bool) -> None:
    """Refuse what cannot run on this device; warn about what Paddle ignores."""
    if strategy is None:
        return
    unknown = sorted(set(getattr(strategy, "_config_dict", None) or {}) - SECTIONS)
    if unknown:
        warnings.warn(f"Paddle ignores these Strategy sections, which it does not know: {unknown}", stacklevel=3)
    if strategy._dp_optimization.enable:
        warnings.warn("Paddle 3.3.1's static engine (PIR) ignores strategy.dp_optimization", stacklevel=3)
    if use_gpu:
        return
    if strategy.amp.enable:
        raise UsageError(
            f"strategy.amp ({strategy.amp.dtype}) is not supported on CPU: Paddle 3.3.1's CPU build has no "
            "float16 or bfloat16 matmul kernel, and paddle.amp.auto_cast turns AMP off on CPU without an "
            "error, so the model would train in float32. Run AMP with use_gpu=True."
        )
    mp = strategy._mp_optimization
    for option in ("replace_with_c_embedding", "replace_with_parallel_cross_entropy"):
        if getattr(mp, option):
            raise UsageError(
                f"strategy mp_optimization.{option} is not supported on CPU: Paddle's pass needs fleet's "
                "hybrid communicate group (fleet.init), which DistModel does not create, and its c_* ops "
                "have no gloo kernels."
            )


# Sections only static programs apply: a dynamic model's ranks run the layer as written.
_STATIC_PASSES = ("recompute", "fused_passes", "mp_optimization", "sp_optimization")


def check_dynamic(strategy: Any) -> None:
    """Refuse what dynamic mode (``dynamic=True``, `raydist.worker.eager`) cannot run; warn about
    the static passes it leaves out."""
    if strategy is None:
        return
    for section, why in (("pipeline", "its schedules (1F1B, VPP...) are built into static programs"),
                         ("gradient_merge", "its accumulation over micro-batches is built into static programs"),
                         ("amp", "dynamic mode does not yet cast (use paddle.amp.auto_cast in the layer's forward)")):
        if getattr(strategy, section).enable:
            raise UsageError(f"strategy.{section} runs in the static mode only ({why}): build the model with "
                             "dynamic=False, or leave the section off")
    for section in _STATIC_PASSES:
        config = getattr(strategy, "_" + section, None) or getattr(strategy, section, None)
        if getattr(config, "enable", False):
            warnings.warn(f"dynamic mode runs the layer as written and leaves out strategy.{section}, a pass "
                          "of static programs", stacklevel=3)


def micro_batches(strategy: Any, mode: str) -> int:
    """How many micro-batches a step of ``mode`` splits each rank's batch into.

    Gradient merge splits train steps into ``k_steps``; a pipeline splits
    every step into ``accumulate_steps`` (Paddle's ``Engine._acc_steps``).
    """
    if strategy is None:
        return 1
    merge, pipeline = strategy.gradient_merge, strategy.pipeline
    if merge.enable and (mode == "train" or pipeline.enable):
        return int(merge.k_steps)
    return int(pipeline.accumulate_steps) if pipeline.enable else 1


def micro_batch_size(strategy: Any) -> int | None:
    """The rows of a pipeline's micro-batch, if the strategy names them (Paddle's static engine
    ignores ``pipeline.micro_batch_size`` and splits each rank's rows into ``accumulate_steps``;
    raydist holds batches to both). None: not named (left at its default, 1)."""
    if strategy is None or not strategy.pipeline.enable or strategy.pipeline.micro_batch_size == 1:
        return None
    return int(strategy.pipeline.micro_batch_size)


def pipeline_stages(strategy: Any, meshes: list, world_size: int) -> None:
    """Check a pipeline's stages against what Paddle's schedules assume; fill in
    ``strategy.pipeline.pp_degree`` when it was left at its default (1).

    Paddle places rank r in stage ``r // (world_size // pp_degree)``
    (``get_pp_stage_by_rank``) and orders each stage's jobs by it, whatever the
    model's meshes say. Stages given otherwise would deadlock, so they are
    refused. ``meshes``: `raydist.topology.Mesh` of the layer's parameters, in order.
    """
    if strategy is None or not strategy.pipeline.enable:
        return
    order: list[tuple[int, ...]] = []
    for mesh in meshes:
        ranks = tuple(sorted(mesh.process_ids))
        if ranks not in order:
            order.append(ranks)
    if not stages(meshes):
        return  # one stage: the schedule only splits the batch into micro-batches
    pipeline = strategy.pipeline
    if pipeline.pp_degree == 1:
        pipeline.pp_degree = len(order)
    size = world_size // pipeline.pp_degree
    expected = [tuple(range(k * size, (k + 1) * size)) for k in range(pipeline.pp_degree)]
    if order != expected or world_size % pipeline.pp_degree:
        raise UsageError(
            f"strategy.pipeline.pp_degree is {pipeline.pp_degree} and the group has {world_size} ranks, so Paddle's "
            f"schedules put ranks {expected} in stages 0.."
            f"{pipeline.pp_degree - 1}, but the model's stages (its parameters' meshes, in order) are on ranks "
            f"{order}: place stage k on ranks k*{size} .. (k+1)*{size}-1"
        )
