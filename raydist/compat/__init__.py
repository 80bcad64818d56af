"""Fixes for Paddle defects, and every use of Paddle's private members. The fixes are applied
inside rank processes only; `callbacks` is the driver's (`fit`'s callback list).

Each fix names the Paddle defect it answers, was written for
``PADDLE_VERSION``, and checks that the code it replaces still looks as
expected (`expect_source`): when Paddle changes under a fix, the rank fails
with a clear `CompatError` instead of running a stale patch, and a test in
``tests/test_compat.py`` shows whether the defect itself is still there.

- `rings`: auto-parallel process groups on CPU/gloo (CPU builds only).
- `collectives`: collectives that pick their gloo ring by id (CPU builds only).
- `stages`: parameters of other pipeline stages, resharded eagerly (CPU builds only).
- `degree`: a pipeline's ``pp_degree`` from its stage meshes when left at 1 (CPU builds only).
- `groups`: gloo process groups after the global one, each with a rendezvous of its own (CPU builds only).
- `reshard`: eager partial-to-sharded resharding (sharding in dynamic mode) without reduce-scatter (CPU builds only).
- `engine`: the static engine's predict and eval-only defects (all devices).
- `executor`: the executor's per-step printing of the whole program (all devices).
- `dy2static`: PaddleFormers' configs, whose inherited ``super()`` calls dy2static turns into a recursion (all devices).
- `callbacks`: Paddle's callback list for `fit` and `evaluate`, built as ``Model.fit`` builds it (the driver).

Paddle's private members raydist reads (the engine's programs, specs, strategy, executor; the
thread's place) are read through `engine`'s functions, each guarded in `engine.apply`.

Every rank applies them through `apply`, whoever drives it: raydist's ranks
(`raydist.worker.join`) and the scripts `raydist launch` runs
(`raydist.integrations.spmd`).
- `store`: the TCP store client's 3-second connect retry (all devices; before
  ``init_parallel_env``, not a patch: see `wait_for_master`).
"""

from __future__ import annotations

import inspect
import os
import warnings

PADDLE_VERSION = "3.3.1"

# Names of fixes to leave out, comma-separated: for showing a defect in tests.
DISABLE_ENV = "RAYDIST_COMPAT_DISABLE"


class CompatError(RuntimeError):
    """Paddle changed under one of raydist's fixes."""


def expect_source(obj, *markers: str, fix: str) -> None:
    """Raise `CompatError` unless ``obj``'s source still contains every marker."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as e:  # pragma: no cover - source always ships in Paddle wheels
        raise CompatError(f"raydist fix {fix!r}: cannot read the source of {obj!r}: {e}") from e
    missing = [m for m in markers if m not in source]
    if missing:
        import paddle

        raise CompatError(
            f"raydist fix {fix!r} was written for Paddle {PADDLE_VERSION}; Paddle "
            f"{paddle.__version__} changed {getattr(obj, '__qualname__', obj)} (no longer contains "
            f"{missing}). Check whether the defect it answers is fixed and update raydist.compat."
        )


def disabled_fixes() -> set[str]:
    """The fixes ``RAYDIST_COMPAT_DISABLE`` leaves out."""
    return {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}


def apply(use_gpu: bool) -> list[str]:
    """Apply the fixes this process needs; returns their names. Idempotent."""
    import paddle

    if paddle.__version__ != PADDLE_VERSION:
        warnings.warn(
            f"raydist's Paddle fixes were written for Paddle {PADDLE_VERSION}, this is {paddle.__version__}",
            stacklevel=2,
        )
    disabled = disabled_fixes()
    from . import collectives, degree, dy2static, engine, executor, groups, reshard, rings, stages

    fixes = [("engine", engine.apply), ("executor", executor.apply), ("dy2static", dy2static.apply)]
    if not use_gpu:
        fixes += [("rings", rings.apply), ("collectives", collectives.apply), ("stages", stages.apply),
                  ("degree", degree.apply), ("groups", groups.apply), ("reshard", reshard.apply)]  # fmt: skip
    applied = []
    for name, fix in fixes:
        if name not in disabled:
            fix()
            applied.append(name)
    return applied
