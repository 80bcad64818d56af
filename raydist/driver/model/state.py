"""A model's state at the driver: full tensors from the ranks' shards, and distributed checkpoints.

The ranks hold shards; the driver assembles full values when the user asks
(`ModelState.state_dict`), hands full values back for every rank to keep its shard
(`set_state_dict`), has a new group take a state from where it lies (`take`),
and orchestrates checkpoints: every rank writes its own shards, the driver
writes the manifest and commits (`raydist.checkpoint`). A checkpoint's
optimizer state that the model does not have yet (before its train program
is built) is restored when it is built (`ModelState.built`).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

import numpy as np
import ray

from ... import checkpoint, weights
from ...handover import StateMap, Tensor
from ...protocol import RankActor
from ..cluster.config import call_on
from ..dispatch.client import LiveGroup, RankClient, live
from .changes import Changes
from .rates import LearningRate
from .saves import Saves

log = logging.getLogger(__name__)


class ModelState:
    """State and checkpoints of the model behind ``client`` (replaced on restart); checkpoints
    keep the learning rate's position too (``rates``)."""

    def __init__(self, has_optimizer: bool, rates: LearningRate, group: LiveGroup, changes: Changes):
        self._group = group  # the live group of ranks, from its start on
        self.rates = rates
        self.has_optimizer = has_optimizer
        self._told = changes  # "checkpoint" when last_checkpoint changes
        self.saves = Saves(self._changed)  # the checkpoints of the current timeline
        self._pending: tuple[str, dict] | None = None  # (path, {name: manifest entry}) still to restore
        self.names: set[str] = set()  # every tensor of the state, as of the last build
        self._saving: threading.Thread | None = None  # a background save's commit

    @property
    def last_checkpoint(self) -> str | None:
        """The latest checkpoint saved or loaded on the current timeline."""
        last = self.saves.last
        return last.path if last is not None else None

    def adopt_checkpoint(self, path: str | None) -> None:
        """A detached model's last checkpoint, as the driver before knew it (its count from its manifest)."""
        if path is not None:
            self.saves.loaded(int(checkpoint.read_manifest(path).get("trained", 0)), path)

    @property
    def client(self) -> RankClient | None:
        return self._group.client

    def _changed(self) -> None:
        self._told.changed("checkpoint")

    def meta(self, mode: str = "all") -> dict[str, tuple]:
        """{name: (global shape, dtype, layout)} of the state."""
        return self._meta(mode)[0]

    def _meta(self, mode: str) -> tuple[dict[str, tuple], dict[str, list[int]]]:
        # each rank knows its own tensors: a pipeline stage's are on its ranks only
        meta: dict[str, tuple] = {}
        holders: dict[str, list[int]] = {}
        for rank, mine in enumerate(live(self.client).call(RankActor.state_meta, mode)):
            for name, entry in mine.items():
                meta.setdefault(name, entry)
                holders.setdefault(name, []).append(rank)
        return meta, holders

    def state_dict(self, mode: str) -> dict[str, np.ndarray]:
        return _full(dict(enumerate(live(self.client).call(RankActor.state_dict, mode))))

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
        live(self.client).call(RankActor.set_state, ray.put(full))

    def take(self, state: StateMap) -> None:
        """Every rank takes its shards of ``state`` from where its pieces lie (`raydist.handover`:
        the ranks fetch them; the driver sends references only)."""
        live(self.client).call(RankActor.take_state, state)

    def export(self, path: str, format: str, max_shard_bytes: int, prefix: str = "") -> list[str]:
        """Write the FULL parameters (those under ``prefix``, named without it) to a new directory ``path``
        in ``format`` (`raydist.weights`); the files.

        Each distinct piece is put in the object store by one rank that holds it, and each file is
        written by one rank, which fetches the pieces of its tensors from wherever they lie: the
        driver plans, and holds references only. Written under a temporary name, renamed once whole.
        """
        self.wait_saved()
        if os.path.exists(path):
            raise ValueError(f"{path} exists: raydist never overwrites; export to a new directory")
        meta, holders = self._meta("param")
        meta = {n: entry for n, entry in meta.items() if n.startswith(prefix)}
        if not meta:
            raise ValueError(f"export: no parameter's name starts with prefix={prefix!r}")
        files = weights.plan_files({n: (shape, dtype) for n, (shape, dtype, _) in meta.items()}, format,
                                   max_shard_bytes)  # fmt: skip
        asks: dict[int, list[str]] = {}  # rank -> the tensors it offers a piece of
        for name, (_, _, layout) in meta.items():
            for ranks in layout.holders().values() if layout is not None else [holders[name]]:
                asks.setdefault(ranks[0], []).append(name)
        offers = live(self.client).call_each(RankActor.export_offer, {r: (names,) for r, names in asks.items()})
        pieces: dict[str, dict] = {name: {} for name in meta}
        for offer in offers:
            for name, (piece, ref) in offer.items():
                pieces[name][piece.key] = ref
        state = {n: Tensor(shape, dtype, layout, pieces[n]) for n, (shape, dtype, layout) in meta.items()}
        staged = f"{path.rstrip('/')}.exporting-{uuid.uuid4().hex[:8]}"
        os.makedirs(staged)
        plan: dict[int, list] = {}
        for i, (file, names) in enumerate(files):  # the files in turn over the ranks
            plan.setdefault(i % live(self.client).size, []).append((file, names))
        try:
            live(self.client).call_each(RankActor.write_weights, {
                rank: (staged, format, mine, {n: state[n] for _, names in mine for n in names}, prefix)
                for rank, mine in plan.items()})  # fmt: skip
            total = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                        for shape, dtype, _ in meta.values())  # fmt: skip
            weights.write_index(staged, format, [(f, [n[len(prefix):] for n in names]) for f, names in files], total)
            os.replace(staged, path)
        except BaseException:
            checkpoint.remove(staged)
            raise
        return [file for file, _ in files]

    def save(self, path: str, trained: int, background: bool = False, **info: Any) -> None:
        """Every rank writes its shards to a staging directory; then the manifest, and the commit.

        ``trained``: the train steps the state is after (over the model's life; the manifest keeps
        it); ``info``: what the manifest records besides the tensors (step, mode...). ``background``:
        return once every rank holds a copy of its shards in host memory; they are written
        beside the next steps, and a thread of the driver commits once all are written (or
        removes the staging directory if one failed: nothing that looks complete is left).
        A save first waits for the one before it.
        """
        self.wait_saved()
        if checkpoint.exists(path):
            raise ValueError(f"{path} exists: raydist never overwrites a checkpoint; save to a new directory")
        meta, holders = self._meta("all")
        plan = checkpoint.writers(meta, holders)
        staged = checkpoint.staging_dir(path)
        ranks = sorted(plan)
        try:
            asks = {r: (staged, plan[r], background) for r in ranks}
            written = live(self.client).call_each(RankActor.save_pieces, asks)
        except BaseException:
            checkpoint.remove(staged)  # an incomplete save leaves nothing behind
            raise
        files: dict[str, dict[int, str]] = {name: {} for name in meta}
        for rank, file in zip(ranks, written):
            for name in plan[rank]:
                files[name][rank] = file
        manifest = checkpoint.manifest(meta, files, num_workers=live(self.client).size,
                                       learning_rate=self.rates.manifest(), trained=trained, **info)  # fmt: skip
        if not background:
            checkpoint.commit(staged, path, manifest)
            self.saves.saved(trained, path)
            return
        writes = call_on([live(self.client).actor(r) for r in ranks], RankActor.saved, staged)  # waited for in _commit
        self._saving = threading.Thread(target=self._commit, args=(writes, staged, path, manifest, trained),
                                        name="raydist-save", daemon=True)  # fmt: skip
        self._saving.start()

    def _commit(self, writes: list, staged: str, path: str, manifest: dict, trained: int) -> None:
        try:
            ray.get(writes)
            checkpoint.commit(staged, path, manifest)
        except Exception as e:  # noqa: BLE001 - a rank's death, a full disk...: the previous checkpoint stands
            checkpoint.remove(staged)
            log.warning("raydist: the checkpoint %s was not written (%s: %s); %s stands", path, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "", self.last_checkpoint)  # fmt: skip
            return
        self.saves.saved(trained, path)

    def wait_saved(self) -> None:
        """Wait for a background save to end (committed, or removed after a failure)."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.join()

    def load(self, path: str, train_built: bool, trained: int | None) -> dict:
        """Restore the tensors of the checkpoint at ``path``; its manifest (for what else it keeps).
        ``trained``: the model's count of train steps from here on, where a new timeline begins
        (a user's load); None: the checkpoint is of the current timeline (a restart's)."""
        self.wait_saved()
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
        self._restore(self._pending, meta, train_built)
        if trained is not None:
            self.saves.loaded(trained, path)
        self.rates.restore(manifest.get("learning_rate") or {})
        return manifest

    def built(self, train_built: bool) -> None:
        """A mode was just built: note the state's tensors, restore what it brought of a
        checkpoint being loaded."""
        meta = self.meta()
        self.names = set(meta)
        if self._pending is not None:
            self._restore(self._pending, meta, train_built)

    def _restore(self, pending: tuple[str, dict], meta: dict, train_built: bool) -> None:
        path, tensors = pending
        now = {n: tensors.pop(n) for n in list(tensors) if n in meta}
        if now:
            live(self.client).call(RankActor.load_state, path, now)
        if not tensors or not self.has_optimizer or train_built:
            if tensors and self.has_optimizer:
                log.warning("raydist: %s holds tensors this model does not have; not loaded: %s", path, sorted(tensors))
            self._pending = None  # what is left, this model will never have


def _full(pieces: dict[int, dict]) -> dict[str, np.ndarray]:
    """Full tensors from ranks' ``{rank: {name: (local, layout)}}`` (each holds its own)."""
    full = {}
    for state in pieces.values():
        for name, (array, layout) in state.items():
            if name in full:
                continue
            full[name] = array if layout is None else layout.assemble({r: pieces[r][name][0] for r in layout.readers()})
    return full
