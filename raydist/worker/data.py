"""A rank's data service, for `raydist.shard_dataloader`.

- `Reader`: on a data-parallel group's reader rank, one thread per open epoch
  reads the group's split a chunk of local batches at a time, stores each
  chunk ONCE in Ray's object store (a small one goes inline in the calls) and
  hands it to every rank of its group (itself included), up to ``prefetch``
  steps ahead of this rank's steps. Chunks amortise the per-read and per-call costs over several steps.
  The driver sends nothing per step for it.
- `Staging`: on every rank, turns the batches it is handed into Paddle
  tensors ahead of time, so a step only takes them; how long a step waits
  for its data is measured where it happens. A reader's failure is handed
  out like a batch, so no rank waits for data that will not come.

A batch is a dict of numpy arrays keyed like the loader's fields (column
names, or positions for tuple rows).
"""

from __future__ import annotations

import functools
import threading
import time
import traceback

import numpy as np
import ray

from ..messages import INLINE_BYTES, LoaderStep, ReadOrder

Key = tuple[int, int, int]  # (loader, epoch, step)


class DataService:
    """This rank's staged batches, and its reading threads if it reads for its group."""

    def __init__(self, device: str, timeout: float | None):
        import paddle

        place = paddle.CPUPlace() if device == "cpu" else paddle.CUDAPlace(int(device.split(":")[1]))
        self.staging = Staging(place)
        self.timeout = timeout  # how long a step waits for its batch (None: no limit)
        self.reader = Reader(self.staging)
        self._wait = 0.0

    def open(self, order: ReadOrder, members: list) -> None:
        self.reader.open(order, members)

    def stage(self, loader: int, epoch: int, first_step: int, batches: list) -> None:
        self.staging.put(loader, epoch, first_step, batches)

    def fail(self, loader: int, epoch: int, error: str) -> None:
        self.staging.fail(loader, epoch, error)

    def close(self) -> None:
        """Stop reading (a new driver attached: its loaders are new to the ranks)."""
        self.reader.close()

    def take(self, message: LoaderStep) -> list:
        """The staged batch of a loader step, its columns in ``message.keys`` order."""
        key = (message.loader, message.epoch, message.step)
        batch, waited = self.staging.take(key, self.timeout)
        self.reader.consumed(*key)
        self._wait += waited
        return [batch[k] for k in message.keys]

    def take_wait(self) -> float:
        """Seconds steps waited for their batches since the last call."""
        wait, self._wait = self._wait, 0.0
        return wait


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
            # not a reason to drop an older epoch's batches: the driver runs ahead of the steps, so the
            # next epoch's may come while this rank still has the last steps of this one to take
            self._batches.update(staged)
            self._ready.notify_all()

    def fail(self, loader: int, epoch: int, error: str) -> None:
        with self._ready:
            self._failed[(loader, epoch)] = error
            self._ready.notify_all()

    def take(self, key: Key, timeout: float | None) -> tuple[dict, float]:
        """The batch for ``key`` and how long this waited for it (``timeout`` None: no limit)."""
        start = time.monotonic()
        with self._ready:
            self._ready.wait_for(lambda: key in self._batches or key[:2] in self._failed, timeout=timeout)
            if key in self._batches:  # read before the reader failed on a later one
                for old in [k for k in self._batches if k[0] == key[0] and k[1] < key[1]]:
                    del self._batches[old]  # read ahead for an epoch that was left early: no step takes it now
                return self._batches.pop(key), time.monotonic() - start
            if key[:2] in self._failed:
                raise RuntimeError(f"the reader of this rank's data-parallel group failed:\n{self._failed[key[:2]]}")
            raise TimeoutError(
                f"no batch for step {key[2]} of epoch {key[1]} within {timeout} s (step_timeout_s): "
                "the group's reader is slower than that, or stuck"
            )


class Reader:
    """The reading threads of this rank, one per loader and epoch it reads for."""

    def __init__(self, staging: Staging):
        self._staging = staging
        self._threads: dict[tuple[int, int], _ReadThread] = {}  # (loader, epoch) -> its reader
        self._lock = threading.Lock()  # opened from the data thread, consumed from the step thread

    def open(self, order: ReadOrder, members: list) -> None:
        """Start reading ``order``'s epoch (ending a reading of the same epoch); ``members``:
        the actor handles of the group's ranks, None for this one.

        The epoch before goes on: the driver opens an epoch with its first step, which may
        be sent while this rank still has the last steps of the one before to run."""
        thread = _ReadThread(self._staging, order, members)
        with self._lock:
            old = self._threads.pop((order.loader, order.epoch), None)
            self._threads[(order.loader, order.epoch)] = thread
        if old is not None:
            old.stop()
        try:
            thread.start()
        except BaseException:
            thread.fail()

    def close(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, {}
        for thread in threads.values():
            thread.stop()

    def consumed(self, loader: int, epoch: int, step: int) -> None:
        """This rank took ``step``: its reader may read one more ahead, and a reader of an
        earlier epoch of the loader stops (that epoch was left: no step takes its batches)."""
        with self._lock:
            thread = self._threads.get((loader, epoch))
            left = [k for k in self._threads if k[0] == loader and k[1] < epoch]
            done = [self._threads.pop(k) for k in left]
        if thread is not None:
            thread.consumed(step)
        for old in done:
            old.stop()


class _ReadThread(threading.Thread):
    def __init__(self, staging: Staging, order: ReadOrder, members: list):
        super().__init__(name=f"raydist-reader-{order.loader}-{order.epoch}", daemon=True)
        self.staging, self.order, self.members = staging, order, members
        self._window = threading.Condition()
        self._taken = order.start  # steps this rank has taken
        self._stopped = False

    def consumed(self, step: int) -> None:
        with self._window:
            self._taken = max(self._taken, step + 1)
            self._window.notify_all()

    def stop(self) -> None:
        with self._window:
            self._stopped = True
            self._window.notify_all()

    def _room(self, step: int, prefetch: int) -> bool:
        """Whether the reader may read ``step`` (at most ``prefetch`` ahead of the model), or must stop."""
        return self._stopped or step - self._taken < prefetch

    def run(self) -> None:
        order = self.order
        try:
            chunks = order.split.chunks(order.batch_size, order.drop_last, list(order.keys), order.chunk)
            step = 0
            while step < order.start:  # resuming: the epoch's first steps were taken before a restart
                chunk = next(chunks, None)
                if chunk is None:
                    raise RuntimeError("the split ran out of rows before the step to resume from")
                if step + len(chunk) > order.start:
                    self._hand_out(order.start, chunk[order.start - step :])
                step += len(chunk)
            while step < order.steps:
                with self._window:
                    self._window.wait_for(functools.partial(self._room, step, order.prefetch))
                    if self._stopped:
                        return
                chunk = next(chunks, None)
                if chunk is None:
                    raise RuntimeError("the split ran out of rows before the epoch's last step")
                chunk = chunk[: order.steps - step]
                self._hand_out(step, chunk)
                step += len(chunk)
        except BaseException:
            self.fail()

    def fail(self) -> None:
        """Hand the exception being handled to the group, in place of the batches."""
        error = traceback.format_exc()
        self.staging.fail(self.order.loader, self.order.epoch, error)
        for member in self.members:
            if member is not None:
                member.data_fail.remote(self.order.loader, self.order.epoch, error)

    def _hand_out(self, step: int, batches: list[dict]) -> None:
        remote = [m for m in self.members if m is not None]
        nbytes = sum(a.nbytes for batch in batches for a in batch.values())
        # a large chunk is stored once for every other rank of the group; a small one goes in the
        # calls themselves, which costs less than a put into the object store (bench/profile.py)
        ref = ray.put(batches) if remote and nbytes > INLINE_BYTES else batches
        for member in remote:
            member.data_stage.remote(self.order.loader, self.order.epoch, step, ref)
        self.staging.put(self.order.loader, self.order.epoch, step, batches)
