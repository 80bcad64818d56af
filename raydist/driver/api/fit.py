"""A training loop: Paddle's callbacks, evaluation, learning-rate schedules, and recovery from rank failures.

`DistModel.fit` runs epochs of a `raydist.ShardDataloader` with a progress bar
and Paddle's own callbacks (``paddle.callbacks.Callback``: ProgBarLogger,
EarlyStopping, ReduceLROnPlateau, VisualDL, ... take a raydist model as they
take a ``paddle.Model``). It steps the learning-rate schedule as Paddle's
``paddle.callbacks.LRScheduler`` asks (every step by default, as Paddle's
``Engine.fit``), evaluates on ``eval_loader``, saves a checkpoint every
``checkpoint_every`` steps and, when a rank fails, starts a fresh group of
ranks, restores the newest state (the surviving ranks' after the last
completed step, if they hold all of it, else the latest checkpoint; the
schedule's position included), resumes the data at its epoch and step, and
goes on, up to ``max_failures`` times. The data's order depends only on the epoch (and the loader's seed), so
a run that lost a rank ends where an undisturbed one does.

Steps run ahead of the loop (``max_in_flight``): a step's ``on_train_batch_end``
comes once its loss is known, without waiting for the steps after it. A
schedule step is sent with the next step, so the next step uses it, as in one
process. An elastic model grows at the first step boundary after room for a
larger size shows (`raydist.driver.lifecycle.moves.RoomWatch`). The loop is a client
of the model's public methods (calls, ``evaluate``, ``save``, ``lr_scheduler``) and of
`Training`: the few things a loop needs that a user does not (the run's events and
metrics, a restart after a failure, the step boundary, the learning rate), which the
model's `Lifecycle` provides.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import posixpath
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tqdm.auto import tqdm

from ... import checkpoint
from ...errors import RankError
from ...options import check_positive_int
from ..watching.events import EVENTS_FILE, JsonLines
from . import resume as runs

if TYPE_CHECKING:
    from ...data import ShardDataloader
    from ..lifecycle.restart import Restored
    from ..model.rates import LearningRate
    from ..model.schedule import RankScheduler
    from ..watching.events import Events
    from ..watching.metrics import RunMetrics

log = logging.getLogger("raydist")


class Trainee(Protocol):
    """What `fit` calls of the model it trains: `raydist.DistModel`'s public methods."""

    @property
    def mode(self) -> str: ...

    @property
    def lr_scheduler(self) -> RankScheduler | None: ...

    def __call__(self, *args: Any) -> Any: ...

    def train(self) -> None: ...

    def evaluate(self, data: Any, steps: int | None = None, callbacks: Any = None) -> dict[str, float]: ...

    def save(self, path: str, position: tuple[int, int] | None = None, record: dict[str, Any] | None = None,
             background: bool = False) -> None: ...  # fmt: skip

    def load(self, path: str) -> None: ...


class Training(Protocol):
    """What `fit` uses of a model beyond `DistModel`'s public methods (its `Lifecycle` is one)."""

    events: Events  # the run's events (fit adds its checkpoint directory's events.jsonl as a sink)
    metrics: RunMetrics  # the run's Ray metrics (fit tells it the batch size and each step's loss)
    rates: LearningRate  # the ranks' learning rate (its value, for callbacks that read or set it)

    peer_memory: int | None  # train steps between copies of the ranks' state in peer memory (None: off)

    def restart(self) -> Restored:
        """A fresh group of ranks after a failure, with the newest state: how many completed train
        steps it stands behind the last completed one (``behind``; 0: the survivors' state, or peer
        memory's with the steps since replayed; the loop feeds that many again), or None (the state
        of ``checkpoint``, or the initial one with none: the loop goes back to it)."""

    def verify(self, wait: bool = False) -> None:
        """Compare the replica checks that came back (``wait``: all of the steps sent); raise a
        `raydist.ReplicaMismatchError` if replicas disagree."""

    def at_boundary(self, look: bool = False, before: Callable[[], Any] | None = None) -> str | None:
        """Between two train steps: act on a preemption notice, else grow if there is room
        (``before`` runs first). What was done: "moved", "noticed", "grew", or None."""

    def state_meta(self, mode: str) -> dict[str, Any]:
        """The model state's names, shapes and dtypes (``mode``: "param", "opt" or "all")."""

    def trained(self) -> int:
        """The train steps sent to the model over its life (its state is after them once they complete)."""

    def wait_saved(self) -> None:
        """Wait until the checkpoint being written in the background is complete."""


def fit(
    dm: Trainee,
    training: Training,
    loader: ShardDataloader | Any,
    epochs: int = 1,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    checkpoint_dir: str | None = None,
    max_failures: int = 0,
    progress: bool = True,
    callbacks: Sequence[Any] | None = None,
    eval_loader: Any = None,
    eval_every: int | None = None,
    resume: bool = False,
    keep_last: int | None = None,
    flops_per_sample: float | None = None,
    peak_flops: float | None = None,
) -> list[float]:
    for name, value in (("flops_per_sample", flops_per_sample), ("peak_flops", peak_flops)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if peak_flops is not None and flops_per_sample is None:
        raise ValueError("peak_flops (for MFU) needs flops_per_sample")
    if (checkpoint_every or resume or keep_last) and not checkpoint_dir:
        raise ValueError("checkpoint_every, resume and keep_last need a checkpoint_dir")
    if max_failures and not checkpoint_dir and not training.peer_memory:
        raise ValueError("max_failures needs a checkpoint_dir, or a model with peer memory "
                         "(to_static(..., peer_memory=K))")
    check_positive_int("keep_last", keep_last, what="the newest checkpoints to keep", optional=True)
    if eval_every is not None and eval_loader is None:
        raise ValueError("eval_every needs an eval_loader")
    if eval_loader is not None and eval_loader is loader:
        raise ValueError("eval_loader must be a loader of its own: evaluating on the training loader ends its epoch")
    loader = _epochs(loader, max_failures, resume)
    found = _found(checkpoint_dir, resume)
    total = len(loader) * epochs if steps is None else min(steps, len(loader) * epochs)
    if dm.mode != "train":
        dm.train()
    identity = runs.identity(loader, training.state_meta("param"))
    training.metrics.batch_size = loader.batch_size
    if found is not None and checkpoint_dir is not None:
        _check_same_run(found, identity, checkpoint_dir)
        dm.load(found.path)
        if found.finished:
            log.warning("raydist: the run in %s has finished (%d steps); nothing to do", checkpoint_dir, found.steps)
            return found.history
    sink = JsonLines(checkpoint_dir) if checkpoint_dir else None
    if sink is not None:  # the run's events survive the driver; a resumed run goes on with the same file
        training.events.add_sink(sink)
    try:
        with tqdm(total=total, unit="step", disable=not progress, desc="fit") as bar:
            run = _Run(dm, training, loader, epochs, total, checkpoint_every, checkpoint_dir, eval_loader,
                       eval_every, keep_last, Pace(loader.batch_size, flops_per_sample, peak_flops), identity,
                       list(callbacks or []), bar)  # fmt: skip
            if found is None and max_failures and checkpoint_dir:
                run.checkpoint(epoch=0, step=0)  # a failure before the first checkpoint resumes from here
            return _fit(run, training, found, max_failures, checkpoint_dir)
    finally:
        if sink is not None:
            training.events.remove_sink(sink)


def _fit(run: _Run, training: Training, found: runs.CheckpointInfo | None, max_failures: int,
         checkpoint_dir: str | None) -> list[float]:  # fmt: skip
    failures = 0
    run.callbacks.on_begin("train", {})
    if found is not None:
        run.go_on_from(found)
    run.base = training.trained() - len(run.history)  # the model's count of train steps before this run's first
    while True:
        try:
            run.go()
            break
        except _Regrouped:
            continue
        except RankError as e:
            if run.preempted:  # the node of the notice went: expected, checkpointed, not a failure
                run.preempted = False
                log.warning("raydist: %s; restarting the ranks after the preemption notice", e)
            else:
                failures = _counted(e, failures, max_failures, "restarting the ranks")
            run.keep_completed()
            while True:
                try:
                    restored = training.restart()
                    break
                except RankError as again:  # a node lost while the ranks are placed: one more failure
                    failures = _counted(again, failures, max_failures, "the restart failed; restarting again")
            if restored.behind is None:
                run.rewind(restored.checkpoint)
            else:
                run.go_back(restored.trained - run.base)
    if checkpoint_dir:
        run.finish()
    run.callbacks.on_end("train", run.logs)
    return run.history


def _counted(error: RankError, failures: int, max_failures: int, doing: str) -> int:
    """One more failure: raises ``error`` past ``max_failures``, else says what is done about it."""
    failures += 1
    if failures > max_failures:
        raise error
    log.warning("raydist: %s; %s (failure %d of %d)", error, doing, failures, max_failures)
    return failures


def _epochs(loader: Any, max_failures: int, resume: bool) -> Any:
    """What fit reads batches from: a `raydist.ShardDataloader`, or a ``paddle.io.DataLoader`` that
    the driver iterates (`raydist.data.epochs`); anything else is refused here, before a step."""
    from ...data import ShardDataloader

    if isinstance(loader, ShardDataloader):
        return loader
    import paddle

    if not isinstance(loader, paddle.io.DataLoader):
        hint = " (for a list of batches, loop yourself: `for x, y in batches: dm(x, y)`)" \
            if isinstance(loader, (list, tuple)) else ""  # fmt: skip
        raise TypeError(f"fit wants a raydist.shard_dataloader(...) or a paddle.io.DataLoader, got "
                        f"{type(loader).__name__}{hint}")  # fmt: skip
    from ...data.epochs import DataLoaderEpochs

    epochs = DataLoaderEpochs(loader)
    if epochs.shuffle and (max_failures or resume):
        raise ValueError("fit: a shuffling paddle.io.DataLoader gives another order on every pass, so a run cannot "
                         "go back into an epoch after a failure or a resume: use raydist.shard_dataloader(dataset, "
                         "meshes, ..., shuffle=True, seed=S), whose order each epoch is the same on every pass")
    return epochs


def _found(directory: str | None, resume: bool) -> runs.CheckpointInfo | None:
    """With ``resume``: the run in ``directory`` to go on with (None: start one); without it, an empty directory."""
    if not directory or not checkpoint.exists(directory):
        return None
    names = checkpoint.listing(directory)
    if not names:
        return None
    if not resume:
        raise ValueError(f"checkpoint_dir {directory} is not empty: give each fit a directory of its own, "
                         "or pass resume=True to go on with the run in it")  # fmt: skip
    found = runs.latest_checkpoint(directory)
    leftovers = checkpoint.staged(directory)
    # a run that died before its first checkpoint left its events
    others = [n for n in names if n != EVENTS_FILE and checkpoint.ABANDONED not in n]
    if found is None and len(leftovers) < len(others):
        raise ValueError(f"checkpoint_dir {directory} holds no complete raydist checkpoint, but other files: "
                         f"{sorted(names)[:5]}")  # fmt: skip
    if found is not None and "fit" not in found.record:
        raise ValueError(f"{found.path} was not written by fit (DistModel.save): resume=True goes on with a fit's run")
    for staged in leftovers:  # saves a dead driver never completed
        checkpoint.remove(staged)
    return found


def _check_same_run(found: runs.CheckpointInfo, identity: dict[str, Any], directory: str) -> None:
    differ = runs.differences(found.record["fit"]["identity"], identity)
    if differ:
        raise ValueError(f"checkpoint_dir {directory} holds a run of another model or loader ({found.path}); "
                         + "; ".join(differ))  # fmt: skip


class _Regrouped(Exception):
    """The model moved to a larger group; the run goes on from `_Run.position`."""


@dataclasses.dataclass
class _Pending:
    """A train step of the run whose loss is not collected yet."""

    loss: Any  # raydist.Loss
    epoch: int
    step: int  # in its epoch
    lr: float | None  # the learning rate it ran with


class _Run:
    def __init__(self, dm: Trainee, training: Training, loader: Any, epochs: int, total: int, every: int | None,
                 directory: str | None, eval_loader: Any, eval_every: int | None, keep_last: int | None, pace: Pace,
                 identity: dict[str, Any], user_callbacks: list[Any], bar: Any) -> None:  # fmt: skip
        self.dm, self.training, self.rates = dm, training, training.rates
        self.loader, self.epochs, self.total = loader, epochs, total
        self.every, self.directory = every, directory
        self.eval_loader, self.eval_every = eval_loader, eval_every
        self.history: list[float] = []
        self.position: tuple[int, ...] = (0, 0)  # (epoch, step) to go on from
        self.begun = -1  # the last epoch whose on_epoch_begin was called
        self.ended = -1  # the last epoch whose end (evaluation, schedule, callbacks) was done
        self.pending: collections.deque[_Pending] = collections.deque()  # sent, loss not yet collected
        self.stood_still = False  # whether a save or an evaluation ran since the last step
        self.bar = bar  # the progress bar (tqdm)
        self.by_step, self.by_epoch = True, False  # when the schedule steps (paddle.callbacks.LRScheduler)
        self.stop_training = False  # set by callbacks (EarlyStopping), through the model they see
        self.logs: dict[str, Any] = {}
        self.keep_last = keep_last
        self.preempted = False  # a preemption notice came that the group could not move off
        self.identity = identity
        self.user_callbacks = user_callbacks
        self.pace = pace
        self.saving: str | None = None  # the last checkpoint this run began to save
        self.base = 0  # the model's train steps before this run's first (its history counts from there)
        self.callbacks = _callbacks(user_callbacks, self, loader, epochs, total)  # Paddle's, seeing this run

    def go_on_from(self, found: runs.CheckpointInfo) -> None:
        """Where a checkpoint of this run left it (the model was loaded from it)."""
        record = found.record["fit"]
        self.history = list(record["history"])
        self.position = tuple(record["position"])
        self.ended = record["ended"]
        runs.restore_callbacks(self.user_callbacks, record["callbacks"])
        self.bar.n = len(self.history)
        self.bar.refresh()
        log.warning("raydist: resuming the run in %s after %d steps, at epoch %d step %d", self.directory,
                    len(self.history), *self.position)  # fmt: skip

    def go(self) -> None:
        epoch0, step0 = self.position
        pending = self.pending = collections.deque()
        if step0 == 0 and 0 < epoch0 and self.ended < epoch0 - 1:  # a failure came before the epoch's end
            self._end_epoch(epoch0 - 1)
        for epoch in range(epoch0, self.epochs):
            first = step0 if epoch == epoch0 else 0
            if self.begun < epoch:
                self.begun = epoch
                self.callbacks.on_epoch_begin(epoch, {})
            for step, batch in enumerate(self.loader.epoch(epoch, first), first):
                if step > first:
                    self._boundary(pending, epoch, step)
                self.callbacks.on_batch_begin("train", step, {})
                lr = self.rates.now()
                loss = self.dm(*(batch.values() if isinstance(batch, dict) else batch))
                pending.append(_Pending(loss, epoch, step, lr))
                if self.by_step and self.dm.lr_scheduler is not None:
                    self.dm.lr_scheduler.step()  # travels with the next step
                self._collect(pending, wait=False)
                done = len(self.history) + len(pending)
                last = step + 1 == len(self.loader)
                if self.eval_every and done % self.eval_every == 0:
                    self._collect(pending, wait=True)
                    self.evaluate()
                if self.every and done % self.every == 0:  # after the evaluation: its callbacks' state is kept
                    self._collect(pending, wait=True)
                    self.checkpoint(epoch + 1 if last else epoch, 0 if last else step + 1)
                if done >= self.total or self.stop_training:
                    self._collect(pending, wait=True)
                    if last:
                        self._end_epoch(epoch)
                    return
            self._collect(pending, wait=True)
            self._end_epoch(epoch)
            if self.stop_training:
                return

    def _boundary(self, pending: collections.deque[_Pending], epoch: int, step: int) -> None:
        """Between two steps: let the lifecycle act on a preemption notice or grow (`Lifecycle.at_boundary`),
        the losses in flight collected first. A move or a growth goes on from ``step`` with the new group;
        a notice it could not act on is a checkpoint now (and the node's loss that follows no failure)."""
        # the loop stood still for a save or an evaluation: a node may have joined meanwhile
        look, self.stood_still = self.stood_still, False
        done = self.training.at_boundary(look=look, before=lambda: self._collect(pending, wait=True))
        if done in ("moved", "grew"):
            self.position = (epoch, step)
            raise _Regrouped
        if done == "noticed":
            self.preempted = True
            if self.directory:
                log.warning("raydist: saving a checkpoint after step %d, before the node goes", len(self.history))
                self.checkpoint(epoch, step, background=False)  # complete before the node, and its shards, go

    def _end_epoch(self, epoch: int) -> None:
        self.training.verify(wait=True)  # the replica checks of the epoch's last steps, before its end is told
        if self.eval_loader is not None and self.eval_every is None:
            self.evaluate()
        if self.by_epoch and self.dm.lr_scheduler is not None:
            self.dm.lr_scheduler.step()
        self.ended = epoch
        self.callbacks.on_epoch_end(epoch, dict(self.logs))

    def evaluate(self) -> None:
        self.stood_still = True
        result = self.dm.evaluate(self.eval_loader, callbacks=self.callbacks)
        self.logs.update({f"eval_{k}": v for k, v in result.items()})

    def _collect(self, pending: collections.deque[_Pending], wait: bool) -> None:
        while pending and (wait or pending[0].loss.done):
            sent = pending.popleft()
            self.history.append(float(sent.loss))
            self.logs = {"loss": self.history[-1], "lr": sent.lr, "batch_size": self.loader.batch_size,
                         **self.pace.step()}  # fmt: skip
            self.training.metrics.read(self.history[-1], sent.lr)
            self.callbacks.on_batch_end("train", sent.step, dict(self.logs))
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{self.history[-1]:.4f}", **self.pace.postfix(self.logs), refresh=False)

    def _directory(self) -> str:
        if self.directory is None:
            raise RuntimeError("fit saves checkpoints only into a checkpoint_dir")
        return self.directory

    def checkpoint(self, epoch: int, step: int, background: bool = True) -> None:
        """Save, with where the run stands (data position, history, ended epochs, callbacks' state): in the
        background, the ranks writing their snapshots while the next steps run (`ModelState.save`)."""
        done = len(self.history)
        self.stood_still = True
        path = posixpath.join(self._directory(), f"step-{done:08d}")
        if path == self.saving:  # a notice's save right after the schedule's: that one, complete
            self.training.wait_saved()
        if checkpoint.exists(path):  # saved on this timeline (a restart moves aside those of others)
            return
        self.saving = path
        record = {"identity": self.identity, "position": [epoch, step], "steps": done, "history": list(self.history),
                  "ended": self.ended, "callbacks": runs.callback_states(self.user_callbacks)}  # fmt: skip
        self.dm.save(path, position=(epoch, step), record={"fit": record}, background=background)
        self._keep_last()

    def _keep_last(self) -> None:
        if self.keep_last:  # of the complete ones (a save in the background is not one yet)
            for old in checkpoint.complete(self._directory())[: -self.keep_last]:
                checkpoint.remove(old)

    def finish(self) -> None:
        """The run's end: its state saved (unless the newest checkpoint has it), then finished.json naming it."""
        done = len(self.history)
        self.training.wait_saved()
        newest = checkpoint.complete(self._directory())
        if not newest or posixpath.basename(newest[-1]) != f"step-{done:08d}":
            self.checkpoint(*divmod(done, len(self.loader)), background=False)
        self._keep_last()
        checkpoint.write_json(posixpath.join(self._directory(), runs.FINISHED),
                              {"checkpoint": f"step-{done:08d}", "steps": done})  # fmt: skip

    def keep_completed(self) -> None:
        """After a failure: the losses of the steps that completed before it, every one of them (a
        callback that calls the failed ranks raises here: the next loss is kept all the same)."""
        while self.pending and self.pending[0].loss.done:
            try:
                self._collect(self.pending, wait=False)
            except RankError as e:
                log.debug("raydist: after the failure, a step's loss or callback raised: %s", e)
        self.pending.clear()

    def go_back(self, done: int) -> None:
        """On from this run's step ``done``, where the state the restart restored stands (the survivors',
        after the last completed step; peer memory's, before it: the steps since are fed again)."""
        if done > len(self.history):  # a completed step whose loss the history lacks: it cannot go on truly
            raise RuntimeError(f"raydist: the restart's state is after step {done} of this run, whose history holds "
                               f"{len(self.history)} steps (a bug: please report it)")  # fmt: skip
        del self.history[done:]
        self.position = divmod(done, len(self.loader))
        self.bar.n = done
        self.bar.refresh()

    def rewind(self, path: str | None) -> None:
        """Back to the checkpoint at ``path`` (None: the start), whose state the restart restored."""
        found = runs.checkpoint_info(path) if path is not None else None
        if found is not None and "fit" not in found.record:
            raise RuntimeError(f"the restart went back to {path}, a checkpoint from before this fit: the run cannot "
                               "go on from it (its data position is not this run's)")  # fmt: skip
        self.position, done = (tuple(found.position or (0, 0)), found.steps) if found is not None else ((0, 0), 0)
        del self.history[done:]
        self.bar.n = done
        self.bar.refresh()


class Pace:
    """Throughput over the last `PACE_STEPS` steps the driver saw done: samples/s; with the
    FLOPs of a sample (forward and backward), FLOP/s; with the hardware's peak FLOP/s (all
    ranks together), MFU (achieved / peak), as Lightning's ThroughputMonitor has them."""

    def __init__(self, batch_size: int, flops_per_sample: float | None = None, peak_flops: float | None = None):
        self.batch_size, self.flops, self.peak = batch_size, flops_per_sample, peak_flops
        self._times: collections.deque[float] = collections.deque(maxlen=PACE_STEPS + 1)

    def step(self) -> dict[str, float]:
        """A step is done: the figures now (none before two steps)."""
        now = time.monotonic()
        self._times.append(now)
        if len(self._times) < 2 or now <= self._times[0]:
            return {}
        samples = (len(self._times) - 1) * self.batch_size / (now - self._times[0])
        out = {"samples_per_s": samples}
        if self.flops:
            out["flops_per_s"] = samples * self.flops
            if self.peak:
                out["mfu"] = out["flops_per_s"] / self.peak
        return out

    @staticmethod
    def postfix(logs: dict[str, float]) -> dict[str, str]:
        out = {"samples/s": f"{logs['samples_per_s']:.0f}"} if "samples_per_s" in logs else {}
        if "mfu" in logs:
            out["MFU"] = f"{logs['mfu']:.1%}"
        return out


PACE_STEPS = 50


def _callbacks(callbacks: Sequence[Any] | None, run: _Run, loader: Any, epochs: int, total: int) -> Any:
    """Paddle's CallbackList over ``callbacks``, seeing the model through `_CallbackModel`.

    A ``paddle.callbacks.LRScheduler`` among them says when the schedule steps
    (by step, the default, or by epoch); the loop steps it as each step is sent
    rather than when the step's end is reported, which may be later.
    """
    from paddle.callbacks import LRScheduler

    from ...compat.callbacks import configured

    callbacks = list(callbacks or [])
    for cb in callbacks:
        if not hasattr(cb, "on_train_batch_end"):
            raise TypeError(f"callbacks must be paddle.callbacks.Callback objects, got {type(cb).__name__}")
    schedulers = [cb for cb in callbacks if isinstance(cb, LRScheduler)]
    if schedulers:
        run.by_step, run.by_epoch = schedulers[-1].by_step, schedulers[-1].by_epoch
    cbks = configured(callbacks, model=_CallbackModel(run), batch_size=loader.batch_size, epochs=epochs,
                      steps=len(loader), verbose=0, metrics=["loss"])  # fmt: skip
    cbks.callbacks = [cb for cb in cbks.callbacks if not isinstance(cb, LRScheduler)]  # the loop steps it
    return cbks


class _CallbackModel:
    """What Paddle's callbacks use of a ``paddle.Model``, for a raydist model in fit."""

    def __init__(self, run: _Run):
        self._run = run
        self._optimizer = _OptimizerView(run.dm, run.rates)

    @property
    def stop_training(self) -> bool:
        return self._run.stop_training

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        self._run.stop_training = bool(value)

    def save(self, path: str, training: bool = True) -> None:
        self._run.dm.save(path)


class _OptimizerView:
    """``model._optimizer`` for callbacks: its learning rate is the ranks'."""

    def __init__(self, dm: Trainee, rates: LearningRate):
        self._dm, self._rates = dm, rates

    @property
    def _learning_rate(self) -> Any:  # the schedule, or the float rate
        return self._rates.scheduler if self._rates.scheduler is not None else self._rates.now()

    @_learning_rate.setter
    def _learning_rate(self, value: float) -> None:  # ReduceLROnPlateau
        self._rates.set(value)

    def get_lr(self) -> float | None:
        return self._rates.now()
