"""A model's state at the driver: full tensors from the ranks' shards, and distributed checkpoints.

The ranks hold shards; the driver assembles full values (`ModelState.state_dict`),
hands full values back for every rank to keep its shard (`set_state_dict`),
and orchestrates checkpoints: every rank writes its own shards, the driver
writes the manifest and commits (`raydist.checkpoint`). A checkpoint's
optimizer state that the model does not have yet (before its train program
is built) is restored when it is built (`ModelState.built`).
After a rank died, `live_state` reads what its surviving peers hold, for a
restart that loses nothing but the failed steps.
"""

from __future__ import annotations

from typing import Any

import logging
import time

import numpy as np
import ray

from .. import checkpoint
from ..protocol import RankActor
from .client import RankClient
from .group import call_on

log = logging.getLogger(__name__)

# How long the survivors of a rank's death have to finish or break off their step
# and hand over their state; past it, the group is torn down without it.
LIVE_STATE_WAIT_S = 3.0


class ModelState:
    """State and checkpoints of the model behind ``client`` (replaced on restart)."""

    def __init__(self, client: RankClient, has_optimizer: bool):
        self.client = client
        self.has_optimizer = has_optimizer
        self.last_checkpoint: str | None = None  # the latest saved or loaded, for restart()
        self._pending: tuple[str, dict] | None = None  # (path, {name: manifest entry}) still to restore
        self.names: set[str] = set()  # every tensor of the state, as of the last build

    def meta(self, mode: str = "all") -> dict[str, tuple]:
        """{name: (global shape, dtype, layout)} of the state."""
        return self._meta(mode)[0]

    def _meta(self, mode: str) -> tuple[dict[str, tuple], dict[str, list[int]]]:
        # each rank knows its own tensors: a pipeline stage's are on its ranks only
        meta: dict[str, tuple] = {}
        holders: dict[str, list[int]] = {}
        for rank, mine in enumerate(self.client.call(RankActor.state_meta, mode)):
            for name, entry in mine.items():
                meta.setdefault(name, entry)
                holders.setdefault(name, []).append(rank)
        return meta, holders

    def state_dict(self, mode: str) -> dict[str, np.ndarray]:
        return _full(dict(enumerate(self.client.call(RankActor.state_dict, mode))))

    def set_state_dict(self, state: dict[str, Any]) -> None:
        meta = self.meta()
        unknown = sorted(set(state) - set(meta))
        if unknown:
            raise ValueError(f"set_state_dict: the model has no {unknown} (it has {sorted(meta)})")
        full = {}
        for name, value in state.items():
            array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
            shape, dtype, _ = meta[name]
            if tuple(array.shape) != tuple(shape):
                raise ValueError(f"set_state_dict: {name!r} has shape {array.shape}, the model's is {tuple(shape)}")
            if array.dtype != np.dtype(dtype):
                if array.dtype.kind != np.dtype(dtype).kind:
                    raise TypeError(f"set_state_dict: {name!r} has dtype {array.dtype}, the model's is {dtype}")
                array = array.astype(dtype)
            full[name] = array
        self.client.call(RankActor.set_state, ray.put(full))

    def save(self, path: str, **info: Any) -> None:
        """Every rank writes its shards to a staging directory; then the manifest, and the commit.

        ``info``: what the manifest records besides the tensors (step, mode...).
        """
        if checkpoint.exists(path):
            raise ValueError(f"{path} exists: raydist never overwrites a checkpoint; save to a new directory")
        meta, holders = self._meta("all")
        plan = checkpoint.writers(meta, holders)
        staged = checkpoint.staging_dir(path)
        ranks = sorted(plan)
        try:
            written = self.client.call_each(RankActor.save_pieces, {r: (staged, plan[r]) for r in ranks})
        except BaseException:
            checkpoint.remove(staged)  # an incomplete save leaves nothing behind
            raise
        files: dict[str, dict[int, str]] = {name: {} for name in meta}
        for rank, file in zip(ranks, written):
            for name in plan[rank]:
                files[name][rank] = file
        checkpoint.commit(staged, path, checkpoint.manifest(meta, files, num_workers=self.client.size, **info))
        self.last_checkpoint = path

    def load(self, path: str, train_built: bool) -> dict:
        """Restore the tensors of the checkpoint at ``path``; its manifest (for what else it keeps)."""
        manifest = checkpoint.read_manifest(path)
        tensors = dict(manifest["tensors"])
        meta = self.meta()
        params = self.meta("param")
        missing = sorted(set(params) - set(tensors))
        wrong = sorted(n for n in set(meta) & set(tensors) if tuple(tensors[n]["shape"]) != tuple(meta[n][0]))
        if missing or wrong:
            raise ValueError(
                f"{path} is a checkpoint of another model: it lacks {missing} and has other shapes for {wrong}"
            )
        self._pending = (path, tensors)
        self._restore(meta, train_built)
        self.last_checkpoint = path
        return manifest

    def built(self, train_built: bool) -> None:
        """A mode was just built: note the state's tensors, restore what it brought of a
        checkpoint being loaded."""
        meta = self.meta()
        self.names = set(meta)
        if self._pending is not None:
            self._restore(meta, train_built)

    def _restore(self, meta: dict, train_built: bool) -> None:
        path, tensors = self._pending
        now = {n: tensors.pop(n) for n in list(tensors) if n in meta}
        if now:
            self.client.call(RankActor.load_state, path, now)
        if not tensors or not self.has_optimizer or train_built:
            if tensors and self.has_optimizer:
                log.warning("raydist: %s holds tensors this model does not have; not loaded: %s", path, sorted(tensors))
            self._pending = None  # what is left, this model will never have


def _full(pieces: dict[int, dict]) -> dict[str, np.ndarray]:
    """Full tensors from ranks' ``{rank: {name: (local, layout)}}`` (each holds its own)."""
    full = {}
    for rank, state in pieces.items():
        for name, (array, layout) in state.items():
            if name in full:
                continue
            full[name] = array if layout is None else layout.assemble({r: pieces[r][name][0] for r in layout.readers()})
    return full


def live_state(actors: list, names: set[str]) -> tuple[int, dict[str, np.ndarray]] | str:
    """After a rank died: the FULL state its surviving peers hold, and the train steps it is
    after; or, if they do not hold all of it, why not.

    Asked beside their steps (`RankActor.live_state`): the dead ranks' calls fail at
    once, a survivor blocked in a collective that never returns gives nothing.
    """
    refs = call_on(actors, RankActor.live_state, LIVE_STATE_WAIT_S)
    deadline = time.monotonic() + LIVE_STATE_WAIT_S + 2.0
    answers, pending = {}, list(refs)
    while pending:
        # the first answers that hold all of it will do: a survivor blocked in a collective with
        # a peer that broke off its step would keep the restart waiting for LIVE_STATE_WAIT_S
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            answer = ray.get(ready[0])
        except Exception:  # noqa: BLE001 - a dead rank: it holds nothing
            continue
        if answer is not None:
            answers[refs.index(ready[0])] = answer
            if _why_not(answers, names) is None:
                found = assemble_live(answers, names)
                if not isinstance(found, str):
                    return found
    return assemble_live(answers, names)


def assemble_live(answers: dict[int, tuple[int, bool, dict]],
                  names: set[str]) -> tuple[int, dict[str, np.ndarray]] | str:  # fmt: skip
    """The full state (tensors ``names``) from the surviving ranks' ``{rank: (train steps,
    broke off, {name: (local, layout)})}``; or why it cannot be had: no survivor, survivors
    at different steps, a step that may have been broken off halfway through its updates,
    a piece or a tensor no survivor holds, or replicas that differ."""
    why = _why_not(answers, names)
    if why is not None:
        return why
    steps = {rank: t for rank, (t, _, _) in answers.items()}
    pieces = {rank: state for rank, (_, _, state) in answers.items()}
    full = {}
    for name in names:
        array, layout = next(state[name] for state in pieces.values() if name in state)
        if layout is None:
            full[name] = array
            continue
        local = {}
        for key, holders in layout.holders().items():
            alive = [r for r in holders if r in pieces]
            value = pieces[alive[0]][name][0]
            if any(not np.array_equal(pieces[r][name][0], value) for r in alive[1:]):
                return f"the surviving replicas of {name!r} differ"
            local[alive[0]] = value
        full[name] = layout.assemble(local)
    return next(iter(steps.values())), full


def _why_not(answers: dict[int, tuple[int, bool, dict]], names: set[str]) -> str | None:
    """Why the surviving ranks' answers cannot give the full state (short of comparing replicas); None if they can."""
    if not answers:
        return "no surviving rank answered"
    steps = {rank: t for rank, (t, _, _) in answers.items()}
    if len(set(steps.values())) > 1:
        return f"the surviving ranks stand at different steps ({steps})"
    pieces = {rank: state for rank, (_, _, state) in answers.items()}
    for rank, (_, broke_off, state) in answers.items():
        why = _half_updated(state) if broke_off else None
        if why:
            return f"rank {rank} broke off a train step, and {why}"
    missing = sorted(names - {name for state in pieces.values() for name in state})
    if missing:
        return f"no surviving rank holds {missing}"
    for name in names:
        _, layout = next(state[name] for state in pieces.values() if name in state)
        for key, holders in (layout.holders().items() if layout is not None else ()):
            if not any(r in pieces for r in holders):
                return f"no surviving rank holds piece {key} of {name!r} (held by ranks {holders})"
    return None


def _half_updated(state: dict) -> str | None:
    """Why a rank's state may hold some of a broken-off step's updates and not others; None if not.

    Paddle's train program updates each parameter right after its gradient's
    all_reduce, so a peer's death between two all_reduces leaves the first
    parameters updated. Adam-like optimizers count steps per parameter (their
    beta pow accumulators): equal counts show that no update, or every update,
    ran. Optimizers without such counts (SGD, Momentum) cannot show it.
    """
    counts: dict[str, set] = {}
    for name, (array, _) in state.items():
        for kind in ("beta1_pow_acc", "beta2_pow_acc"):
            if kind in name:
                counts.setdefault(kind, set()).add(float(np.asarray(array).ravel()[0]))
    if not counts:
        return "its optimizer keeps no per-parameter step count (Adam's beta pows) to show no update of it ran"
    if any(len(values) > 1 for values in counts.values()):
        return "some of its parameters were updated and others not"
    return None
