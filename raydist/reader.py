"""The data side of a rank, for ShardDataloaders. Rank-only.

- `Reader`: on a data-parallel group's reader rank, one thread per open epoch
  iterates the group's split of the dataset a chunk of local batches at a
  time, stores each chunk ONCE in Ray's object store and hands the reference
  to every rank of its group (itself included), up to ``prefetch`` steps
  ahead of this rank's steps. Chunks amortise the per-read and per-call costs
  over several steps. The driver sends nothing per step for it.
- `Staging`: on every rank, turns the batches it is handed into Paddle
  tensors ahead of time, so a step only takes them (fetching and converting
  are off the step's critical path); how long a step waits for its data is
  measured where it happens. A reader's failure is handed out like a batch,
  so no rank waits for data that will not come.

A batch is a dict of numpy arrays keyed like the loader's fields (column
names, or positions for tuple rows).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import ray

Key = tuple[int, int, int]  # (loader, epoch, step)


class Staging:
    """Batches handed to this rank, already Paddle tensors, until a step takes them."""

    def __init__(self, place):
        self._place = place
        self._ready = threading.Condition()
        self._batches: dict[Key, dict] = {}
        self._failed: dict[tuple[int, int], str] = {}  # (loader, epoch) -> the reader's traceback

    def put(self, loader: int, epoch: int, first_step: int, batches: list[dict]) -> None:
        """Stage ``batches`` as the steps from ``first_step`` on."""
        from paddle.base import core

        staged = {}
        for step, batch in enumerate(batches, first_step):
            tensors = {}
            for name, array in batch.items():
                tensor = core.DenseTensor()
                tensor.set(np.ascontiguousarray(array), self._place)
                tensors[name] = tensor
            staged[(loader, epoch, step)] = tensors
        with self._ready:
            for old in [k for k in self._batches if k[0] == loader and k[1] < epoch]:
                del self._batches[old]  # read ahead for an epoch that was left early
            self._batches.update(staged)
            self._ready.notify_all()

    def fail(self, loader: int, epoch: int, error: str) -> None:
        with self._ready:
            self._failed[(loader, epoch)] = error
            self._ready.notify_all()

    def take(self, key: Key, timeout: float) -> tuple[dict, float]:
        """The batch for ``key`` and how long this waited for it."""
        start = time.monotonic()
        with self._ready:
            self._ready.wait_for(lambda: key in self._batches or key[:2] in self._failed, timeout=timeout)
            if key in self._batches:  # read before the reader failed on a later one
                return self._batches.pop(key), time.monotonic() - start
            if key[:2] in self._failed:
                raise RuntimeError(f"the reader of this rank's data-parallel group failed:\n{self._failed[key[:2]]}")
            raise TimeoutError(f"no batch for loader {key[0]} epoch {key[1]} step {key[2]} in {timeout} s")


class Reader:
    """The reading threads of this rank, one per loader it reads for."""

    def __init__(self, staging: Staging):
        self._staging = staging
        self._threads: dict[int, _ReadThread] = {}

    def open(self, loader: int, epoch: int, start: int, steps: int, source, batch_size: int, drop_last: bool,
             keys: Sequence, members: list, prefetch: int, chunk: int) -> None:  # fmt: skip
        """Start reading ``epoch`` from step ``start`` (ending the loader's previous epoch);
        ``members``: the actor handles of the group's ranks, None for this one."""
        old = self._threads.pop(loader, None)
        if old is not None:
            old.stop()
        thread = _ReadThread(self._staging, loader, epoch, start, steps,
                             (source, batch_size, drop_last, list(keys), chunk), members, prefetch)  # fmt: skip
        self._threads[loader] = thread
        try:
            thread.start()
        except BaseException:
            thread.fail()

    def consumed(self, loader: int, epoch: int, step: int) -> None:
        """This rank took ``step``: its reader may read one more ahead."""
        thread = self._threads.get(loader)
        if thread is not None and thread.epoch == epoch:
            thread.consumed(step)


class _ReadThread(threading.Thread):
    def __init__(self, staging, loader, epoch, start, steps, what, members, prefetch):
        super().__init__(name=f"raydist-reader-{loader}-{epoch}", daemon=True)
        self.staging, self.loader, self.epoch, self.first, self.steps = staging, loader, epoch, start, steps
        self.what, self.members, self.prefetch = what, members, prefetch
        self._window = threading.Condition()
        self._taken = start  # steps this rank has taken
        self._stopped = False

    def consumed(self, step: int) -> None:
        with self._window:
            self._taken = max(self._taken, step + 1)
            self._window.notify_all()

    def stop(self) -> None:
        with self._window:
            self._stopped = True
            self._window.notify_all()

    def run(self) -> None:
        try:
            chunks = _chunks(*self.what)
            step = 0
            while step < self.first:  # resuming: the epoch's first steps were taken before a restart
                chunk = next(chunks, None)
                if chunk is None:
                    raise RuntimeError("the split ran out of rows before the step to resume from")
                if step + len(chunk) > self.first:
                    self._hand_out(self.first, chunk[self.first - step :])
                step += len(chunk)
            while step < self.steps:
                with self._window:
                    self._window.wait_for(lambda: self._stopped or step - self._taken < self.prefetch)
                    if self._stopped:
                        return
                chunk = next(chunks, None)
                if chunk is None:
                    raise RuntimeError("the split ran out of rows before the epoch's last step")
                chunk = chunk[: self.steps - step]
                self._hand_out(step, chunk)
                step += len(chunk)
        except BaseException:
            self.fail()

    def fail(self) -> None:
        """Hand the exception being handled to the group, in place of the batches."""
        import traceback

        error = traceback.format_exc()
        self.staging.fail(self.loader, self.epoch, error)
        for member in self.members:
            if member is not None:
                member.data_fail.remote(self.loader, self.epoch, error)

    def _hand_out(self, step: int, batches: list[dict]) -> None:
        remote = [m for m in self.members if m is not None]
        ref = ray.put(batches) if remote else None  # once, for every other rank of the group
        for member in remote:
            member.data_stage.remote(self.loader, self.epoch, step, ref)
        self.staging.put(self.loader, self.epoch, step, batches)


def _chunks(source, batch_size: int, drop_last: bool, keys: list, chunk: int) -> Iterator[list[dict]]:
    """Lists of up to ``chunk`` local batches, in order."""
    if isinstance(source, tuple) and source[0] == "paddle":
        batches = _paddle_batches(source[1], source[2], batch_size, drop_last, keys)
        while group := [b for _, b in zip(range(chunk), batches)]:
            yield group
        return
    # one Ray Data batch per chunk; only the split's last one can be short
    for block in source.iter_batches(batch_size=batch_size * chunk, batch_format="numpy", drop_last=False):
        n = len(block[keys[0]])
        starts = list(range(0, n - n % batch_size, batch_size))
        group = [{k: np.ascontiguousarray(block[k][a : a + batch_size]) for k in keys} for a in starts]
        if n % batch_size and not drop_last:
            group.append({k: np.ascontiguousarray(block[k][len(starts) * batch_size :]) for k in keys})
        if group:
            yield group


def _paddle_batches(dataset_ref, sampler: dict, batch_size: int, drop_last: bool, keys: list) -> Iterator[dict]:
    from paddle.io import DistributedBatchSampler

    from . import pickling

    dataset = pickling.loads(ray.get(dataset_ref))  # put once by the driver, shared by the readers
    batch_sampler = DistributedBatchSampler(
        dataset, batch_size=batch_size, num_replicas=sampler["num_replicas"], rank=sampler["rank"],
        shuffle=sampler["shuffle"], drop_last=drop_last,
    )  # fmt: skip
    batch_sampler.set_epoch(sampler["epoch"])
    for indices in batch_sampler:
        samples = [dataset[i] for i in indices]
        rows = [s if isinstance(s, (dict, list, tuple)) else (s,) for s in samples]
        yield {k: np.stack([np.asarray(r[k]) for r in rows]) for k in keys}
