"""A training loop that survives rank failures: checkpoints, restart, resume.

`DistModel.fit` runs epochs of a `raydist.ShardDataloader` with a progress bar,
saves a checkpoint every ``checkpoint_every`` steps and, when a rank fails,
starts a fresh group of ranks (on other nodes if needed), restores the latest
checkpoint, resumes the data at its epoch and step, and goes on, up to
``max_failures`` times. The data's order depends only on the epoch (and the
loader's seed), so a run that lost a rank ends where an undisturbed one does.
The loop uses the model's public API only (calls, ``save``, ``restart``).
"""

from __future__ import annotations

import collections
import logging
import posixpath
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from .. import checkpoint
from ..errors import RankError

if TYPE_CHECKING:
    from ..data import ShardDataloader
    from .model import DistModel

log = logging.getLogger("raydist")


def fit(
    dm: "DistModel",
    loader: "ShardDataloader",
    epochs: int = 1,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    checkpoint_dir: str | None = None,
    max_failures: int = 0,
    progress: bool = True,
) -> list[float]:
    if (checkpoint_every or max_failures) and not checkpoint_dir:
        raise ValueError("checkpoint_every and max_failures need a checkpoint_dir")
    if checkpoint_dir and checkpoint.exists(checkpoint_dir) and checkpoint.listing(checkpoint_dir):
        raise ValueError(f"checkpoint_dir {checkpoint_dir} is not empty: give each fit a directory of its own")
    total = len(loader) * epochs if steps is None else min(steps, len(loader) * epochs)
    if dm.mode != "train":
        dm.train()
    run = _Run(dm, loader, epochs, total, checkpoint_every, checkpoint_dir)
    if max_failures:
        run.checkpoint(epoch=0, step=0)  # a failure before the first checkpoint resumes from here
    failures = 0
    with tqdm(total=total, unit="step", disable=not progress, desc="fit") as bar:
        run.bar = bar
        while True:
            try:
                run.go()
                return run.history
            except RankError as e:
                failures += 1
                if failures > max_failures:
                    raise
                log.warning("raydist: %s; restarting the ranks (failure %d of %d)", e, failures, max_failures)
                dm.restart()
                run.rewind()


class _Run:
    def __init__(self, dm, loader, epochs, total, every, directory):
        self.dm, self.loader, self.epochs, self.total = dm, loader, epochs, total
        self.every, self.directory = every, directory
        self.history: list[float] = []
        self.resume = (0, 0, 0)  # (epoch, step, steps done) where the latest checkpoint stands
        self.bar = None

    def go(self) -> None:
        epoch0, step0, _ = self.resume
        pending: collections.deque = collections.deque()
        for epoch in range(epoch0, self.epochs):
            for step, batch in enumerate(self.loader.epoch(epoch, step0 if epoch == epoch0 else 0),
                                         step0 if epoch == epoch0 else 0):  # fmt: skip
                pending.append(self.dm(*(batch.values() if isinstance(batch, dict) else batch)))
                self._collect(pending, wait=False)
                done = len(self.history) + len(pending)
                if self.every and done % self.every == 0:
                    self._collect(pending, wait=True)
                    last = step + 1 == len(self.loader)
                    self.checkpoint(epoch + 1 if last else epoch, 0 if last else step + 1)
                if done >= self.total:
                    self._collect(pending, wait=True)
                    return
        self._collect(pending, wait=True)

    def _collect(self, pending: collections.deque, wait: bool) -> None:
        while pending and (wait or pending[0].done):
            self.history.append(float(pending.popleft()))
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{self.history[-1]:.4f}", refresh=False)

    def checkpoint(self, epoch: int, step: int) -> None:
        done = len(self.history)
        self.dm.save(posixpath.join(self.directory, f"step-{done:08d}"))
        self.resume = (epoch, step, done)

    def rewind(self) -> None:
        """Back to the latest checkpoint (the restart restored its state)."""
        done = self.resume[2]
        del self.history[done:]
        self.bar.n = done
        self.bar.refresh()
