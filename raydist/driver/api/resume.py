"""Where a run stands in its checkpoint directory, for a driver that starts after the last one died.

`fit` with a ``checkpoint_dir`` writes ``step-NNNNNNNN`` checkpoints whose manifests
keep a record of the run besides the tensors: the data's position (the epoch and the
step in it to go on from), the loss history, which epochs have ended, the callbacks'
state, and what makes the run this run (the model's parameters, the loader's global
batch, steps per epoch, shuffle and seed). When the run ends, fit writes one more
checkpoint (unless the newest is already at the end) and then ``finished.json``,
which names it. `latest_checkpoint` reads this back, for ``fit(..., resume=True)``
and for a user's own loop (with ``loader.epoch(epoch, step)``).
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections.abc import Sequence
from typing import Any

from ... import checkpoint

log = logging.getLogger("raydist")

FINISHED = "finished.json"

# What Paddle's own callbacks learn during a run (they have no state_dict): the attributes
# that on_train_begin resets and later epochs read. Others with state_dict()/set_state_dict() use those.
CALLBACK_STATE = {
    "EarlyStopping": ("wait_epoch", "best_value", "stopped_epoch"),
    "ReduceLROnPlateau": ("wait", "best", "cooldown_counter", "epoch"),
}


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """The newest complete checkpoint of a directory, and where the run that wrote it stands.

    ``steps``: the train steps done (fit's; for a `DistModel.save` outside fit, the
    model's step count then). ``position``: the epoch and the step in it that the data
    goes on from (fit's, or what `DistModel.save` was given), else None. ``record``:
    what the saver recorded (fit's under ``"fit"``). ``finished``: fit ended the run.
    """

    path: str
    steps: int
    position: tuple[int, int] | None
    record: dict[str, Any]
    finished: bool

    @property
    def history(self) -> list[float]:
        """fit's loss of every step so far (empty for a checkpoint saved outside fit)."""
        return list(self.record.get("fit", {}).get("history", []))


def latest_checkpoint(directory: str) -> CheckpointInfo | None:
    """The newest complete checkpoint in ``directory`` (a path or pyarrow.fs URI) and where its run
    stands; None if there is none. A finished fit's is the one its ``finished.json`` names."""
    finished = checkpoint.read_json(posixpath.join(directory, FINISHED)) if checkpoint.exists(directory) else None
    if finished is not None:
        path = posixpath.join(directory, finished["checkpoint"])
    else:
        done = checkpoint.complete(directory)
        if not done:
            return None
        path = done[-1]
    return checkpoint_info(path)


def checkpoint_info(path: str) -> CheckpointInfo:
    """The checkpoint at ``path`` and where the run that wrote it stands."""
    finished = checkpoint.read_json(posixpath.join(posixpath.dirname(path.rstrip("/")), FINISHED))
    manifest = checkpoint.read_manifest(path)
    record = manifest.get("record") or {}
    position = record.get("fit", {}).get("position") or manifest.get("position")
    steps = record["fit"]["steps"] if "fit" in record else int(manifest.get("step", 0))
    done = finished is not None and finished.get("checkpoint") == posixpath.basename(path.rstrip("/"))
    return CheckpointInfo(path, steps, tuple(position) if position else None, record, done)


def identity(loader: Any, params: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """What a resumed run must share with the one that wrote the checkpoint."""
    return {
        "global_batch": loader.batch_size,
        "steps_per_epoch": len(loader),
        "shuffle": loader.shuffle,
        "seed": loader.seed,
        "parameters": {name: list(shape) for name, (shape, *_) in sorted(params.items())},
    }


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the run in a checkpoint differs from this one (empty: the same run)."""
    out = []
    for key, what in (("global_batch", "global batch size"), ("steps_per_epoch", "loader length (steps per epoch)"),
                      ("shuffle", "loader shuffle"), ("seed", "loader seed")):  # fmt: skip
        if saved.get(key) != now[key]:
            out.append(f"{what}: {saved.get(key)!r} there, {now[key]!r} here")
    there, here = saved.get("parameters", {}), now["parameters"]
    missing, extra = sorted(set(here) - set(there)), sorted(set(there) - set(here))
    shapes = sorted(n for n in set(here) & set(there) if list(here[n]) != list(there[n]))
    if missing:
        out.append(f"parameters only here: {_few(missing)}")
    if extra:
        out.append(f"parameters only there: {_few(extra)}")
    if shapes:
        out.append("other shapes: " + _few([f"{n} {there[n]} there, {here[n]} here" for n in shapes]))
    return out


def callback_states(callbacks: Sequence[Any]) -> list[dict[str, Any]]:
    """What each callback has learned so far, for the checkpoint's record."""
    out = []
    for cb in callbacks:
        if callable(getattr(cb, "state_dict", None)) and callable(getattr(cb, "set_state_dict", None)):
            state = cb.state_dict()
        else:
            state = {k: getattr(cb, k) for k in _state_names(cb) if hasattr(cb, k)}
        out.append({"class": type(cb).__qualname__, "state": state})
    return out


def restore_callbacks(callbacks: Sequence[Any], states: Sequence[dict[str, Any]]) -> None:
    """Give callbacks what the same callbacks had learned when the checkpoint was written: each
    takes the next saved state of its class, in order (one with none starts afresh)."""
    saved: dict[str, list[dict[str, Any]]] = {}
    for entry in states:
        saved.setdefault(entry["class"], []).append(entry["state"])
    for cb in callbacks:
        mine = saved.get(type(cb).__qualname__)
        if not mine:
            if _state_names(cb) or callable(getattr(cb, "set_state_dict", None)):
                log.warning("raydist: the checkpoint has no state for callback %s; it starts afresh",
                            type(cb).__qualname__)  # fmt: skip
            continue
        state = mine.pop(0)
        if callable(getattr(cb, "set_state_dict", None)) and callable(getattr(cb, "state_dict", None)):
            cb.set_state_dict(state)
        else:
            for name, value in state.items():
                setattr(cb, name, value)


def _state_names(cb: Any) -> tuple[str, ...]:
    for klass in type(cb).__mro__:
        if klass.__module__.startswith("paddle.") and klass.__name__ in CALLBACK_STATE:
            return CALLBACK_STATE[klass.__name__]
    return ()


def _few(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
