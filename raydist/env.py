"""The environment one rank needs, as ``paddle.distributed.launch`` would set it.

A pure function of the group's layout, so the GPU path (NCCL, device
selection) is unit-tested on machines without GPUs: CPU and GPU differ only in
the backend and the device variables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

# Paddle's C++ (glog) log level in ranks unless Paddle's logs are asked for:
# warnings and errors only (Paddle's default prints every INFO line).
QUIET_GLOG_LEVEL = "2"


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where a rank runs, as its actor reports it."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...] = ()  # what Ray assigned this actor (ray.get_gpu_ids())
    actor_id: str = ""  # the actor's id (hex), as Ray's errors name it


def paddle_env(
    rank: int,
    places: Sequence[RankPlace],
    endpoints: Sequence[str],
    master: str,
    *,
    use_gpu: bool,
    paddle_logs: bool = False,
) -> dict[str, str]:
    """Environment variables for ``rank`` (Paddle reads them in ``init_parallel_env``).

    ``places`` and ``endpoints`` are indexed by rank. On GPU every rank sees the
    GPUs Ray gave the ranks of its node, sorted as Ray Train sorts them
    (``CUDA_VISIBLE_DEVICES``, so NCCL can use peer links between them), and
    selects the one Ray gave IT by its position there (``FLAGS_selected_gpus``),
    as Ray Train's ``get_devices()`` does: Ray's accounting and the device a
    rank uses agree.
    """
    me = places[rank]
    local = [r for r, p in enumerate(places) if p.node_id == me.node_id]
    env = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(places)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_MASTER": master,
        "PADDLE_GLOBAL_RANK": str(rank),
        "PADDLE_GLOBAL_SIZE": str(len(places)),
        "PADDLE_LOCAL_RANK": str(local.index(rank)),
        "PADDLE_LOCAL_SIZE": str(len(local)),
        "PADDLE_RANK_IN_NODE": str(local.index(rank)),
        "PADDLE_NNODES": str(len({p.node_id for p in places})),
        "PADDLE_DISTRI_BACKEND": "nccl" if use_gpu else "gloo",
    }
    if not paddle_logs:
        env["GLOG_minloglevel"] = QUIET_GLOG_LEVEL
    if use_gpu:
        if not me.gpu_ids:
            raise ValueError(f"rank {rank} on node {me.node_ip} has no GPU from Ray: give each rank {{'GPU': 1}}")
        node_gpus = sorted({g for r in local for g in places[r].gpu_ids})  # Ray Train's order
        env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
        env["FLAGS_selected_gpus"] = str(node_gpus.index(me.gpu_ids[0]))
    return env


def executor_flags(use_gpu: bool, environ: Mapping[str, str]) -> dict[str, bool | str | float]:
    """Paddle flags a rank sets once it has imported Paddle, unless ``environ`` (the rank's
    environment: a ``runtime_env``'s ``env_vars``) sets them itself.

    On CPUs, ``FLAGS_new_executor_serial_run``: Paddle's executor runs a program's ops on
    the calling thread rather than handing them to its pool of threads. Between two of the
    driver's messages the pool's threads go to sleep, and waking them for the next step
    costs a small step more than they save; a step that computes for long enough keeps the
    same speed (BENCHMARKS.md, "Paddle's executor pool"). GPUs keep Paddle's default.
    """
    flags = {} if use_gpu else {"FLAGS_new_executor_serial_run": True}
    return {name: value for name, value in flags.items() if name not in environ}


# What `raydist launch` leaves out of the launching shell's environment when it gives it to every
# rank (README, "raydist launch"): variables that describe the launching machine, not the run. The
# rank's own process has them from its node. By name:
MACHINE_VARIABLES = frozenset({
    # paths on the launching machine
    "PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX", "LD_LIBRARY_PATH",
    "LD_PRELOAD", "LIBRARY_PATH", "CPATH", "MANPATH", "INFOPATH", "PKG_CONFIG_PATH", "TMPDIR", "TMP", "TEMP", "PWD",
    "OLDPWD",
    # its user
    "HOME", "USER", "LOGNAME", "USERNAME", "MAIL", "KRB5CCNAME",
    # its shell, terminal and desktop session
    "SHELL", "SHLVL", "TERM", "COLORTERM", "PS1", "PS2", "_", "HOSTNAME", "HOSTTYPE", "OSTYPE", "MACHTYPE", "DISPLAY",
    "WAYLAND_DISPLAY", "LS_COLORS", "LESSOPEN", "LESSCLOSE", "EDITOR", "VISUAL", "PAGER", "TMUX", "TMUX_PANE", "STY",
    "WINDOWID", "DBUS_SESSION_BUS_ADDRESS", "MOTD_SHOWN",
    # its Python environment
    "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "PIPENV_ACTIVE", "POETRY_ACTIVE", "UV_PROJECT_ENVIRONMENT",
    # the devices it shows (Ray gives each rank its own)
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "XPU_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "FLAGS_selected_gpus",
})  # fmt: skip
# ... and by prefix: Ray's own (RAY_ADDRESS, RAY_JOB_ID...), conda, pyenv, ssh, desktop sessions,
# terminals and IDEs, a Jupyter kernel's, a Kubernetes pod's service addresses.
MACHINE_PREFIXES = ("RAY_", "RAYLET_", "CONDA_", "_CONDA", "PYENV", "SSH_", "XDG_", "TERM_", "VSCODE_", "JPY_",
                    "GPG_", "KUBERNETES_")  # fmt: skip


def launching_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What of ``environ`` (the launching shell's) `raydist launch` gives every rank: all but the
    variables that describe the launching machine (`MACHINE_VARIABLES`, `MACHINE_PREFIXES`)."""
    return {k: v for k, v in environ.items() if k not in MACHINE_VARIABLES and not k.startswith(MACHINE_PREFIXES)}
