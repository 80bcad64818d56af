"""A pipeline's degree, from its stage meshes. CPU builds only.

Paddle 3.3.1 behaviour that breaks on CPU: the pipeline passes read
``strategy.pipeline.pp_degree`` (``pir_pass.py``: ``pass_attr["pp_degree"] =
pipeline_strategy.pp_degree``) and place rank r in stage ``r // (world_size //
pp_degree)`` (``get_pp_stage_by_pp_degree``); the stage meshes of the model are
not consulted. Paddle's own pipeline tests leave ``pp_degree`` at its default
of 1, so every rank orders its jobs as stage 0 does. With 1F1B on 2 CPU ranks
both ranks then block in their first send/receive until gloo's timeout (on CPU
the jobs of a step run one after the other, on one thread). ``FThenB`` runs.

Fix: when an engine is made (``dist.to_static``) with ``pipeline.enable`` and
``pp_degree`` left at 1, it is set from the model's stage meshes (distinct
process sets of its parameters' meshes, in order), as raydist's own path has
always done, by the same function (`raydist.strategy.pipeline_stages`), which
also refuses stages Paddle's schedules would deadlock on.
"""

from __future__ import annotations

import functools

from . import expect_source

_applied = False


def fill_in(engine) -> None:
    """Set ``engine``'s ``strategy.pipeline.pp_degree`` from its model's stage meshes (if left at 1)."""
    import paddle.distributed as dist

    from ..strategy import pipeline_stages
    from ..topology import Mesh

    pipeline = engine._strategy.pipeline
    if not pipeline.enable or pipeline.pp_degree != 1:
        return
    meshes = []
    for p in engine._model.parameters():
        if p.is_dist():
            mesh = Mesh.of_paddle(p.process_mesh)
            if mesh not in meshes:
                meshes.append(mesh)
    pipeline_stages(engine._strategy, meshes, dist.get_world_size())


def apply() -> None:
    global _applied
    if _applied:
        return
    from paddle.distributed.auto_parallel.static import engine, pir_pass

    expect_source(pir_pass, 'pass_attr["pp_degree"] = pipeline_strategy.pp_degree', fix="degree")
    original = engine.Engine.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):  # the layer is still a dygraph one here (parameters readable)
        original(self, *args, **kwargs)
        fill_in(self)

    engine.Engine.__init__ = __init__
    _applied = True
