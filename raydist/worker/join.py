"""Joining Paddle's process group from a Ray worker: rank actors, and Ray Train's workers.

Paddle is imported here, not earlier: it reads ``CUDA_VISIBLE_DEVICES`` and
its ``FLAGS_*`` at import, and a rank's environment is known only once every
rank has been placed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import os
import warnings

from ..env import QUIET_GLOG_LEVEL, executor_flags

# Paddle warnings every rank repeats and no user can act on.
NOISE = ("Tensor do not have 'place' interface",)
NOISE_LOGS = ("is not built by `lazy init`",)

@functools.cache
def load(quiet: bool, use_gpu: bool) -> list[str]:
    """Import Paddle (quietly) and apply raydist's fixes; the fixes. Once per process.

    Nothing here depends on the rank: on CPUs a rank does it while the group is
    still being placed (`warm_up`), which takes seconds off its start. In the
    thread that will build the layer: Paddle sets its dygraph mode at import, for
    the importing thread (and whichever thread looks first).
    """
    if quiet:
        os.environ["GLOG_minloglevel"] = QUIET_GLOG_LEVEL
        logging.disable(logging.INFO)
        for text in NOISE:
            warnings.filterwarnings("ignore", message=f".*{text}")
    hush = _stderr_to_nowhere if quiet else contextlib.nullcontext
    with hush(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time noise (e.g. "No ccache found")
        import paddle  # noqa: F401

    from .. import compat

    if quiet:
        logging.getLogger("auto_parallel").addFilter(lambda r: not any(t in r.getMessage() for t in NOISE_LOGS))
    return compat.apply(use_gpu)


def warm_up(quiet: bool, modules: tuple[str, ...] = ()) -> None:
    """`load` for a CPU rank, then import ``modules`` (e.g. ``ray.data`` for a rank that
    will read a loader's split)."""
    load(quiet, False)
    for name in modules:
        importlib.import_module(name)


def join(env: dict[str, str], use_gpu: bool) -> tuple[list[str], str]:
    """Join Paddle's process group with ``env`` (`raydist.env.paddle_env`), raydist's Paddle
    fixes applied; returns (the fixes, the device).

    Quiet unless ``env`` asks for Paddle's logs (no ``GLOG_minloglevel``): then
    Paddle's Python INFO logs, its import noise and ``init_parallel_env``'s
    listing of every non-default FLAG are dropped too.
    """
    quiet = env.get("GLOG_minloglevel") == QUIET_GLOG_LEVEL
    os.environ.update(env)
    fixes = load(quiet, use_gpu)
    import paddle
    import paddle.distributed as dist

    device = f"gpu:{env['FLAGS_selected_gpus']}" if use_gpu else "cpu"
    paddle.set_device(device)
    try:
        paddle.set_flags(executor_flags(use_gpu, os.environ))  # after the import: CPU ranks import Paddle early
    except ValueError:  # a Paddle without the flag (tests/test_fast_steps.py says so): its default
        pass
    from .. import compat
    from ..compat import store

    if "store" not in compat.disabled_fixes():
        fixes = [*fixes, "store"]
        if env["PADDLE_TRAINER_ID"] != "0":
            store.wait_for_master(env["PADDLE_MASTER"])
    with _stderr_to_nowhere() if quiet else contextlib.nullcontext():
        dist.init_parallel_env()
    # Paddle's handler prints a C++ "FatalError" dump when a rank is killed on
    # shutdown or after a peer's failure; that death is expected.
    paddle.base.core.disable_signal_handler()
    return fixes, device


def _stderr_to_nowhere():
    return contextlib.redirect_stderr(io.StringIO())
