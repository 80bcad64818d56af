"""The driver-side ``DistModel``: Paddle's DistModel API, run by a group of Ray ranks.

A thin facade: the inputs' specs live in `raydist.driver.inputs`, the state and
checkpoints in `raydist.driver.state`, and every exchange with the ranks goes
through one `raydist.driver.client.RankClient`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from .. import pickling
from ..data.loader import Handle, ShardDataloader
from ..messages import ArraysStep, LoaderStep, LrChange, StepMessage
from ..protocol import RankActor
from ..specs import from_input_spec
from ..strategy import check as check_strategy
from ..strategy import micro_batch_size, micro_batches
from ..topology import Layout, Mesh, ModePlan, stages
from .client import RankClient
from .connect import init_ray
from .elastic import Sizes, size_now, sizes_of
from .group import GroupConfig, RankGroup
from .spares import SparePool
from .inputs import InputSpecs, Specs, array_specs, leaves, to_array
from .placement import placeable_now
from .state import ModelState, live_state
from .steps import Evaluated, Loss, check_window

if TYPE_CHECKING:
    from .schedule import RankScheduler

log = logging.getLogger("raydist")

MODES = ("train", "eval", "predict")
GROW_PLACEMENT_S = 30.0  # how long growing waits for the room it saw before settling for what fits
DISPATCH = ("auto", "compiled", "calls", "tree")


class DistModel:
    """Paddle's static auto-parallel ``DistModel``, one Ray actor per rank.

    Takes Paddle's arguments in Paddle's order, except that what would live on
    the ranks is given as something that makes it there:

    Args:
        layer: a picklable callable returning the ``paddle.nn.Layer``; it runs
            on every rank after the process group exists, so it can use
            ``dist.ProcessMesh`` and ``dist.shard_tensor``.
        loader: a `raydist.ShardDataloader`, or None (batches come from the driver).
        loss: a ``paddle.nn.Layer`` or callable ``(outputs..., labels...) -> loss``.
        optimizer: a callable ``parameters -> paddle.optimizer.Optimizer``
            (e.g. ``lambda p: paddle.optimizer.AdamW(1e-3, parameters=p)``).
        strategy: a ``paddle.distributed.Strategy``, passed to every rank.
        metrics: ``paddle.metric.Metric`` objects, as in Paddle (whose 3.3.1 static
            engine ignores them): `evaluate` reports them; the ranks that hold the
            outputs compute each step's values (``Metric.compute`` in the eval
            program), the driver updates and accumulates them.
        input_spec: as in Paddle, ``[[inputs...], [labels...]]`` of ``InputSpec``
            or ``DistributedInputSpec`` with GLOBAL shapes; None infers them from
            the first batch.
        num_workers: number of ranks; default: the processes of ``input_spec``'s mesh.
            ``(min, max)``: an elastic model (see `raydist.driver.elastic`): it starts
            at the largest accepted size the cluster holds now, ``fit`` goes on at a
            smaller size when a node is lost and grows when room returns, and
            ``restart()`` comes back at the size that fits. The layer builder makes
            its mesh from ``dist.get_world_size()``; a loader is made with the mesh
            of size ``max``, and the global batch is the same at every size.
        use_gpu: one GPU per rank and NCCL (otherwise CPU and gloo).
        shard_dims: the mesh dim along which batches are split across ranks
            (data parallel). The default "dp" splits along the mesh dim named
            "dp" if the model's mesh has one, else every rank gets the whole batch.
        resources_per_rank, placement_strategy, master_port, placement_timeout_s,
        name, paddle_logs, runtime_env: see `raydist.driver.group.GroupConfig`.
        max_in_flight: how many messages of steps may be outstanding before the
            driver waits for the oldest (see `raydist.driver.steps`); 1 with
            ``steps_per_message=1`` makes every call wait for its step.
        steps_per_message: calls made while ``max_in_flight`` messages are
            outstanding are held and sent together, up to this many steps in one
            message (the ranks run them back to back, the same numbers as one at
            a time). "auto": as many as make about 0.5 s of steps, up to 64, from
            the steps' measured pace; 1: a message per call.
        dispatch: how steps reach the ranks: "compiled" (a Ray Compiled
            Graph: the least driver work per step, but its channels busy-wait,
            a core per waiting process), "calls" (one actor call per rank),
            "tree" (the driver sends each message to rank 0, the ranks pass it
            on from node to node and within nodes, and the results come back
            the same way: the driver's cost does not grow with the ranks), or
            "auto": compiled with GPUs; on CPUs, where ranks need every core,
            calls below 8 ranks and tree from 8 (see `raydist.driver.transport`
            and BENCHMARKS.md).
        step_timeout_s: how long a step may take (and a rank may wait for its
            loader batch) before its ranks count as stuck: then `RankError`, and
            the ranks are torn down. None: no limit. A dead rank is reported at
            once, whatever this is.
        spare_ranks: rank actors kept started (process up, Paddle imported on
            CPUs) and joined to nothing, each holding one rank's resources, for
            the next `restart` (a failure, in `fit` too) or resize to use instead
            of starting processes (`python -m bench restart`). 0: none.

    Default mode follows Paddle: loss and optimizer -> "train"; loss only ->
    "eval"; neither -> "predict".
    """

    def __init__(
        self,
        layer: Callable[[], Any],
        loader: Any = None,
        loss: Any = None,
        optimizer: Callable[[Sequence[Any]], Any] | None = None,
        strategy: Any = None,
        metrics: Sequence[Any] | None = None,
        input_spec: Sequence[Sequence[Any]] | None = None,
        *,
        num_workers: int | tuple[int, int] | None = None,
        use_gpu: bool = False,
        shard_dims: str | None = "dp",
        resources_per_rank: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        master_port: int | None = None,
        placement_timeout_s: float | None = 300.0,
        name: str | None = None,
        paddle_logs: bool = False,
        runtime_env: dict | None = None,
        max_in_flight: int = 2,
        steps_per_message: int | str = "auto",
        dispatch: str = "auto",
        step_timeout_s: float | None = 900.0,
        spare_ranks: int = 0,
    ) -> None:
        _check_arguments(layer, loader, loss, optimizer, strategy, metrics, max_in_flight, dispatch, steps_per_message)
        if not isinstance(spare_ranks, int) or isinstance(spare_ranks, bool) or spare_ranks < 0:
            raise ValueError(f"spare_ranks must be an int >= 0, got {spare_ranks!r}")
        check_strategy(strategy, use_gpu)
        inputs, labels = from_input_spec(input_spec) if input_spec is not None else (None, None)
        if inputs is None and loader is not None:  # as Paddle: the last column is the label
            specs = loader.specs()
            inputs, labels = (specs[:-1], specs[-1:]) if len(specs) > 1 else (specs, None)
        self._sizes = _num_workers(num_workers, (inputs or []) + (labels or []), loader)
        if spare_ranks and _in_placement_group():
            raise ValueError("spare_ranks inside a placement group (a Ray Tune trial, say): spares hold resources "
                             "outside it; leave spare_ranks at 0 there")  # fmt: skip
        if self._sizes.elastic and _in_placement_group():
            raise ValueError(
                "an elastic num_workers=(min, max) inside a placement group (a Ray Tune trial, say): the group's "
                "bundles fix the size; give num_workers an int"
            )
        num_workers = self._sizes.max
        self._payload = pickling.dumps((layer, loss, optimizer, strategy, list(metrics or [])),
                                       "the layer builder, loss, optimizer or strategy")  # fmt: skip
        self._specs = InputSpecs(inputs, labels, shard_dims, {m: micro_batches(strategy, m) for m in MODES},
                                  micro_batch_size(strategy))
        self._has_loss, self._has_optimizer = loss is not None, optimizer is not None
        self._metrics = list(metrics or [])
        self._mode = "train" if (self._has_loss and self._has_optimizer) else ("eval" if self._has_loss else "predict")
        self._max_in_flight = max_in_flight
        self._steps_per_message = steps_per_message
        self._dispatch = "compiled" if dispatch == "auto" and use_gpu else dispatch
        self._config = GroupConfig(num_workers, use_gpu, resources_per_rank, placement_strategy, master_port,
                                   placement_timeout_s, name, paddle_logs, runtime_env, step_timeout_s,
                                   preload=("ray.data",) if loader is not None else ())  # fmt: skip
        init_ray(num_workers, resources_per_rank, use_gpu)
        self._state: ModelState | None = None
        self._lr_scheduler: RankScheduler | None = None
        self._restored_live = False  # whether the last restart() went on from the survivors' state
        if loader is not None:
            loader.prepare()  # the first epoch's split starts while the ranks do
        self._spares = SparePool(self._config, spare_ranks)
        self._stop_spares = weakref.finalize(self, _on_a_thread(self._spares.shutdown))
        self._start(first_step=0)
        if loader is not None:
            loader.bind(self._client, self._data_meshes)
        if self._specs.known(self._mode):
            self._enter(self._mode, self._specs.current())
        self._client.after_first_step(self._spares.fill)  # spares' Paddle import would slow the start

    def _start(self, first_step: int, size: int | None = None, freed: int = 0,
               placement_timeout_s: float | None = None) -> None:  # fmt: skip
        """A new group of ranks with the model built on it: of ``size`` ranks, or the largest
        accepted size the cluster holds now (``freed``: ranks a group just let go of); spare
        ranks first, if there are any."""
        spares = self._spares.take(size or self._sizes.max)
        if size is None:
            size = size_now(self._sizes, self._config.bundle(), freed, held=len(spares))
        spares, extra = spares[:size], spares[size:]
        self._spares.give_back(extra)
        self._config = dataclasses.replace(self._config, num_workers=size)
        config = self._config
        if placement_timeout_s is not None:
            config = dataclasses.replace(config, placement_timeout_s=placement_timeout_s)
        group = RankGroup(config, spares)
        group.on_death(_weakly(self._salvage))
        self._salvaged: tuple[dict, Any, int] | None = None  # what the survivors of a death held
        self._trained_here = 0  # train steps sent to this group
        # the latest of them: (index, step number, learning rate it ran with); the steps in
        # flight are among them
        self._client = RankClient(group, max_in_flight=self._max_in_flight, dispatch=self._dispatch,
                                  step_timeout=self._config.step_timeout_s, first_step=first_step,
                                  steps_per_message=self._steps_per_message)  # fmt: skip
        most = self._client.window.most
        self._sent_train: collections.deque = collections.deque(maxlen=(self._max_in_flight + 1) * most + 2)
        self._finalizer = weakref.finalize(self, _on_a_thread(self._client.close))
        try:
            report = self._client.call(RankActor.build, ray.put(self._payload))[0]
        except BaseException:
            self._client.close()
            raise
        self._data_meshes = _data_meshes(report.meshes, size)
        self._specs.place(*self._data_meshes)
        self._start_learning_rate(report.learning_rate)
        self._rank_mode: str | None = None  # the mode the ranks are in
        self._rank_specs: Specs | None = None  # the specs the ranks have
        self._plans: dict[str, ModePlan] = {}  # mode -> what its steps fetch (rank 0's)
        if self._state is None:
            self._state = ModelState(self._client, self._has_optimizer)
        else:
            self._state.client = self._client

    def _start_learning_rate(self, learning_rate: float | bytes | None) -> None:
        """The ranks' learning rate as they built it (a new group starts from the first)."""
        self._lr_changes: list[LrChange] = []  # to send with the next step
        self._learning_rate = learning_rate if isinstance(learning_rate, float) else None
        if isinstance(learning_rate, bytes):
            from .schedule import RankScheduler  # a paddle LRScheduler: imported with Paddle, when needed

            replica = pickling.loads(learning_rate)
            if self._lr_scheduler is None:
                self._lr_scheduler = RankScheduler(replica, self._lr_changes.append)
            else:  # the same handle for the user across restarts
                self._lr_scheduler.__dict__.update(_replica=replica, _send=self._lr_changes.append)

    @property
    def lr_scheduler(self) -> RankScheduler | None:
        """The ranks' ``LRScheduler`` (None when the learning rate is a float): ``step()``,
        ``step(metrics)``, ``last_lr``, ``get_lr()``, ``state_dict()``; a change takes
        effect from the next call on. See `raydist.driver.schedule`."""
        return self._lr_scheduler

    def _set_learning_rate(self, value: float) -> None:
        """A float learning rate for the ranks, from the next call on (Paddle's ReduceLROnPlateau callback)."""
        if self._lr_scheduler is not None:
            raise ValueError("the optimizer's learning rate is an LRScheduler: change it with dm.lr_scheduler")
        self._learning_rate = float(value)
        self._lr_changes.append(LrChange("value", (self._learning_rate,)))

    def _learning_rate_now(self) -> float | None:
        """The learning rate the next train step uses."""
        return self._lr_scheduler() if self._lr_scheduler is not None else self._learning_rate

    def _take_lr_changes(self) -> tuple[LrChange, ...]:
        if not self._lr_changes:
            return ()
        changes = tuple(self._lr_changes)
        self._lr_changes.clear()
        return changes

    def restart(self) -> None:
        """Start a fresh group of ranks (after a failure) and restore the newest state there is.

        After a rank died, that is the state its surviving peers held, if they
        hold all of it (every shard of the parameters and optimizer state, e.g.
        on a data-parallel mesh) at the last step the driver saw complete: then
        nothing is lost but the steps that failed. Otherwise it is the last
        checkpoint this model saved or loaded; with none, the model starts from
        its initial parameters again. Steps in flight are dropped; step numbers
        go on from where they were. An elastic model comes back at the largest
        accepted size the cluster holds now (waiting, up to
        ``placement_timeout_s``, for its minimum).
        """
        salvaged = self._salvaged
        first_step = self._client.window.submitted
        freed = self._client.group.live_bundles()
        self._close()
        self._start(first_step, freed=freed)
        if self._specs.known(self._mode):
            self._enter(self._mode, self._specs.current())
        self._client.after_first_step(self._spares.fill)  # for the next restart
        self._restored_live = salvaged is not None
        if salvaged is not None:
            state, rate, trained = salvaged
            self._put_back(state, rate)
            log.warning("raydist: went on from the state the surviving ranks held after %d train steps "
                        "(no checkpoint read)", trained)  # fmt: skip
        elif self._state.last_checkpoint is not None:
            self.load(self._state.last_checkpoint)

    def _salvage(self, group: RankGroup) -> None:
        """A rank of ``group`` died: keep the state its survivors hold for `restart`, if they
        hold all of it at the last train step the driver saw complete."""
        if group is not self._client.group or "train" not in self._plans:
            return
        found = live_state(group.actors, self._state.names)
        if isinstance(found, str):
            log.warning("raydist: %s: a restart goes back to the last checkpoint", found)
            return
        trained, state = found
        oldest = self._client.window.oldest  # the failing step, if a step failed
        unfinished = [i for i, number, _ in self._sent_train if oldest is not None and number >= oldest]
        if trained != self._trained_here - len(unfinished):
            log.warning("raydist: the surviving ranks are after %d train steps, the driver saw %d complete: a "
                        "restart goes back to the last checkpoint", trained, self._trained_here - len(unfinished))
            return
        rate = self._rate_now() if not unfinished else next(r for i, _, r in self._sent_train if i == trained)
        self._salvaged = (state, rate, trained)

    def _rate_now(self) -> Any:
        """The learning rate the next train step runs with: the schedule's state, or the float."""
        return self._lr_scheduler.state_dict() if self._lr_scheduler is not None else self._learning_rate

    def _put_back(self, state: dict[str, np.ndarray], rate: Any) -> None:
        """Give a new group the state and learning rate of the one before."""
        if "train" not in self._plans and not set(state) <= set(self._state.meta()):
            current = self._mode  # the optimizer's state lives in the train program: build it
            self._switch("train")
            self._switch(current)
        self._state.set_state_dict(state)
        if isinstance(rate, dict):
            self._lr_scheduler.set_state_dict(rate)
        elif rate is not None and rate != self._learning_rate:
            self._set_learning_rate(rate)

    def _can_grow(self) -> int | None:
        """A larger accepted size that the cluster has room for now, if any (elastic models)."""
        if not self._sizes.elastic or self.num_workers >= self._sizes.max:
            return None
        return self._sizes.larger(self.num_workers, placeable_now(self._config.bundle()))

    def _resize(self, size: int) -> None:
        """Move to a group of ``size`` ranks, the state handed over from the live ranks.

        The state travels through Ray's object store (the ranks' pieces, assembled
        at the driver, then put once for every new rank); no checkpoint is written.
        """
        state = self.state_dict("all" if "train" in self._plans else "param")
        rate = self._rate_now()
        first_step = self._client.window.submitted
        freed = self._client.group.live_bundles()
        self._finalizer.detach()
        self._client.close(drain=True)
        try:  # the room seen a moment ago may be gone (taken by another job, a node lost again)
            self._start(first_step, size=size, freed=freed, placement_timeout_s=GROW_PLACEMENT_S)
        except TimeoutError:
            log.warning("raydist: no room for %d ranks after all; going on at the size that fits", size)
            self._start(first_step)
        if self._specs.known(self._mode):
            self._enter(self._mode, self._specs.current())
        self._client.after_first_step(self._spares.fill)
        self._put_back(state, rate)

    # -- modes -----------------------------------------------------------------

    def train(self) -> None:
        """Switch every rank to "train": calls update the parameters and return the loss."""
        if not (self._has_loss and self._has_optimizer):
            raise ValueError("train mode needs both a loss and an optimizer")
        self._switch("train")

    def eval(self) -> None:
        """Switch every rank to "eval": calls return the loss, nothing is updated."""
        if not self._has_loss:
            raise ValueError("eval mode needs a loss")
        self._switch("eval")

    def predict(self) -> None:
        """Switch every rank to "predict": calls return the model's outputs."""
        self._switch("predict")

    @property
    def mode(self) -> str:
        return self._mode

    def _switch(self, mode: str) -> None:
        self._client.drain()
        self._mode = mode
        if self._specs.known(mode):
            self._enter(mode, self._specs.current())

    def _enter(self, mode: str, specs: Specs) -> None:
        """Put the ranks in ``mode`` with ``specs`` (building its program the first time); waits.

        A program the ranks cannot build (e.g. a batch of the wrong dtype for
        the layer) is refused on every rank: `UsageError` with Paddle's
        message; the ranks stay, and ``specs`` are not remembered.
        """
        if not _same(specs, self._rank_specs):
            self._client.call(RankActor.set_specs, specs[0] or [], specs[1] or [])
            self._rank_specs, self._rank_mode = specs, None
        if self._rank_mode != mode:
            new = mode not in self._plans
            self._plans[mode] = ModePlan.merge(self._client.call(RankActor.set_mode, mode))
            self._rank_mode = mode
            self._specs.accept(specs, mode)
            if new:
                self._state.built("train" in self._plans)  # a checkpoint's tensors this program brought

    # -- steps -----------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        """One step on a GLOBAL batch: the loss (train, eval) or the outputs (predict).

        Arguments are numpy arrays or paddle Tensors (or lists of them), inputs
        then labels, as for Paddle's DistModel; or the handles a
        `raydist.shard_dataloader` yields, which the ranks read themselves.
        Predict takes inputs only and returns the outputs as numpy. Train and
        eval return a `raydist.Loss` at once, while the step runs: it acts as
        the float loss of the batch, waiting for it when read.
        """
        mode = self._mode
        message = self._message(list(leaves(args)), mode)
        plan = self._plans[mode]
        rate = self._rate_now() if mode == "train" else None
        step = self._client.step(message, lambda results: _combine(plan, mode, results))
        if mode == "train":
            self._sent_train.append((self._trained_here, step.number, rate))
            self._trained_here += 1
        return step.result() if mode == "predict" else Loss(step)

    def _message(self, values: list, mode: str) -> StepMessage:
        """The step message for a call's arguments, once they are checked and the ranks are in ``mode``."""
        handles = [v for v in values if isinstance(v, Handle)]
        if not handles:
            arrays = [to_array(v) for v in values]
            self._enter(mode, self._specs.for_call(array_specs(arrays), mode))
            return ArraysStep(arrays, self._take_lr_changes())  # every rank takes its own shard (a view)
        first = handles[0]
        if len(handles) != len(values):
            raise TypeError("pass either loader handles or arrays to a DistModel call, not both")
        if any((h.loader, h.epoch, h.step) != (first.loader, first.epoch, first.step) for h in handles):
            raise ValueError("the handles of one call must come from the same batch of one loader")
        loader = first.loader
        loader.bind(self._client, self._data_meshes)
        by_key = loader.specs_by_key()
        specs = self._specs.for_call([by_key[h.key] for h in handles], mode)
        self._enter(mode, specs)
        loader.take(first)
        return LoaderStep(loader._id, first.epoch, first.step, tuple(h.key for h in handles), self._take_lr_changes())

    def evaluate(self, data: Any, steps: int | None = None, callbacks: Any = None) -> dict[str, float]:
        """Loss and metrics over every row of ``data``, as Paddle's ``Engine.evaluate``.

        ``data``: a `raydist.ShardDataloader` (one epoch of it) or an iterable of
        batches (inputs then labels, as for a call). Returns ``{"loss": ...,
        <metric names>: ...}``: the loss is the mean over the rows, each metric
        (``metrics=`` of the model) is updated with every step's values, which the
        ranks holding the outputs compute, and accumulated. The model goes back
        to its mode afterwards. ``callbacks``: ``paddle.callbacks.Callback`` objects,
        told ``on_eval_begin``, ``on_eval_batch_begin/end`` and ``on_eval_end`` (with
        the result).
        """
        if not self._has_loss:
            raise ValueError("evaluate needs a loss")
        loader = data if isinstance(data, ShardDataloader) else None
        batches = loader() if loader is not None else iter(data)
        previous = self._mode
        self._switch("eval")
        for metric in self._metrics:
            metric.reset()
        cbks = _callback_list(callbacks)
        names = [name for metric in self._metrics for name in _as_list(metric.name())]
        cbks.on_begin("eval", {"steps": len(loader) if loader is not None else None, "metrics": ["loss", *names]})
        total, rows = 0.0, 0
        pending: collections.deque = collections.deque()  # (Loss, rows, step), in flight

        def fold(wait: bool) -> None:
            nonlocal total, rows
            while pending and (wait or pending[0][0].done):
                loss, n, step = pending.popleft()
                outcome = loss._step.result()
                total, rows = total + float(outcome) * n, rows + n
                for metric, values in zip(self._metrics, getattr(outcome, "metrics", [])):
                    metric.update(*values)
                cbks.on_batch_end("eval", step, {"loss": float(outcome), "batch_size": n})

        try:
            for step, batch in enumerate(batches):
                if steps is not None and step >= steps:
                    break
                args = list(batch.values()) if isinstance(batch, dict) else list(batch)
                n = loader.rows_at(step) if loader is not None else len(to_array(next(leaves(args))))
                cbks.on_batch_begin("eval", step, {})
                pending.append((self(*args), n, step))
                fold(wait=False)
            fold(wait=True)
        finally:
            if previous != "eval":
                self._switch(previous)
        if not rows:
            raise ValueError("evaluate: the data held no batch")
        result = {"loss": total / rows}
        for metric in self._metrics:
            names, values = _as_list(metric.name()), _as_list(metric.accumulate())
            result.update((name, float(value)) for name, value in zip(names, values))
        cbks.on_end("eval", dict(result))
        return result

    def wait(self) -> None:
        """Complete every step in flight; raises the first failure."""
        self._client.drain()

    # -- programs and state ----------------------------------------------------

    def dist_main_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s distributed main program of ``mode`` (default: current)."""
        return self._program("dist_main", mode, rank)

    def dist_startup_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s distributed startup program of ``mode``."""
        return self._program("dist_startup", mode, rank)

    def serial_main_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s serial (undistributed) main program of ``mode``."""
        return self._program("serial_main", mode, rank)

    def serial_startup_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s serial startup program of ``mode``."""
        return self._program("serial_startup", mode, rank)

    def _program(self, kind: str, mode: str | None, rank: int) -> str:
        mode = mode or self._mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= rank < self._client.size:
            raise ValueError(f"rank must be in [0, {self._client.size}), got {rank}")
        if mode not in self._plans:
            if not self._specs.known(mode):
                raise ValueError(f"the {mode} program is built at the first {mode} step (or pass input_spec)")
            current = self._mode
            self._switch(mode)
            self._switch(current)
        return self._client.call(RankActor.program, kind, mode, ranks=[rank])[0]

    def state_dict(self, mode: str = "all") -> dict[str, np.ndarray]:
        """The FULL (unsharded) state as numpy arrays, keyed like Paddle's ``DistModel.state_dict``.

        ``mode``: "param" (the model's parameters), "opt" (the optimizer's
        state) or "all".
        """
        if mode not in ("all", "opt", "param"):
            raise ValueError(f"mode must be 'all', 'opt' or 'param', got {mode!r}")
        return self._state.state_dict(mode)

    def set_state_dict(self, state: dict[str, Any]) -> None:
        """Set parameters (and optimizer state) from FULL values; every rank keeps its own shard.

        ``state`` maps names as `state_dict` gives them to numpy arrays or
        paddle Tensors; a subset is fine, e.g. a plain single-process
        ``paddle.nn.Layer.state_dict()`` to start from pretrained weights.
        Unknown names and wrong shapes are errors, before anything is sent.
        """
        self._state.set_state_dict(state)

    def save(self, path: str) -> None:
        """Write a distributed checkpoint to ``path`` (a new local directory or a pyarrow.fs URI).

        Every rank writes its own shards, in parallel; see `raydist.checkpoint`.
        """
        import paddle

        from .. import __version__

        if self._lr_scheduler is not None:
            learning_rate = {"scheduler": self._lr_scheduler.state_dict()}
        else:
            learning_rate = {"value": self._learning_rate}
        self._state.save(path, step=self._client.window.submitted, mode=self._mode, learning_rate=learning_rate,
                         raydist=__version__, paddle=paddle.__version__)  # fmt: skip

    def load(self, path: str) -> None:
        """Restore parameters and optimizer state from a checkpoint `save` wrote, on any mesh.

        What the model does not have yet (the optimizer's state before the
        train program is built) is restored when it is built.
        """
        manifest = self._state.load(path, "train" in self._plans)
        saved = manifest.get("learning_rate") or {}
        if self._lr_scheduler is not None and saved.get("scheduler") is not None:
            self._lr_scheduler.set_state_dict(saved["scheduler"])
        elif self._learning_rate is not None and saved.get("value") is not None:
            self._set_learning_rate(saved["value"])

    def fit(
        self,
        loader: ShardDataloader,
        epochs: int = 1,
        steps: int | None = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | None = None,
        max_failures: int = 0,
        progress: bool = True,
        callbacks: Sequence[Any] | None = None,
        eval_loader: Any = None,
        eval_every: int | None = None,
    ) -> list[float]:
        """Train on ``loader`` for ``epochs`` (or ``steps``), surviving up to ``max_failures`` rank failures.

        Shows a progress bar (loss, steps/s); runs Paddle's callbacks
        (``paddle.callbacks.Callback``: ``on_train_batch_end`` gets ``{"loss", "lr"}``);
        steps the learning-rate schedule every step (or every epoch, with
        ``callbacks=[paddle.callbacks.LRScheduler(by_step=False, by_epoch=True)]``);
        evaluates on ``eval_loader`` (a loader of its own) every ``eval_every``
        steps, or at each epoch's end; saves a checkpoint to
        ``checkpoint_dir/step-NNNNNNNN`` every ``checkpoint_every`` steps; on a
        `RankError` restarts the ranks, restores the newest state (see `restart`)
        and resumes the data where it stood. Returns the loss of every step.
        See `raydist.driver.fit`.
        """
        from .fit import fit

        return fit(self, loader, epochs, steps, checkpoint_every, checkpoint_dir, max_failures, progress, callbacks,
                   eval_loader, eval_every)  # fmt: skip

    # -- lifetime --------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        """The number of ranks now (an elastic model's changes with the cluster)."""
        return self._client.size

    def shutdown(self) -> None:
        """Complete the steps in flight, then stop every rank and free their resources. Idempotent."""
        self._finalizer.detach()
        try:
            self._client.close(drain=True)
        finally:
            self._stop_spares.detach()
            self._spares.shutdown()

    def _close(self) -> None:
        """Stop the ranks now, without completing the steps in flight."""
        self._finalizer.detach()
        self._client.close()

    def __enter__(self) -> "DistModel":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.shutdown()  # raises a failure of the last steps
        else:
            self._close()  # the exception on its way out says what went wrong
            self._stop_spares.detach()
            self._spares.shutdown()


def to_static(
    layer: Callable[[], Any],
    loader: Any = None,
    loss: Any = None,
    optimizer: Callable[[Sequence[Any]], Any] | None = None,
    strategy: Any = None,
    input_spec: Sequence[Sequence[Any]] | None = None,
    **kwargs: Any,
) -> DistModel:
    """Build a `DistModel` on a group of Ray ranks, as ``paddle.distributed.to_static`` would.

    See `DistModel` for the arguments; keyword arguments (``metrics``,
    ``num_workers``, ``use_gpu``, ...) go to it.
    """
    metrics = kwargs.pop("metrics", None)
    return DistModel(layer, loader, loss, optimizer, strategy, metrics, input_spec, **kwargs)


# -- argument checks (all before any actor starts) ---------------------------------


def _check_arguments(layer, loader, loss, optimizer, strategy, metrics, max_in_flight, dispatch,
                     steps_per_message) -> None:  # fmt: skip
    import paddle

    if isinstance(layer, paddle.nn.Layer):
        raise TypeError(
            "raydist builds the layer on every rank: pass a function that returns it "
            "(e.g. `lambda: MyNet(mesh)`), not a Layer built on the driver"
        )
    if not callable(layer):
        raise TypeError(f"layer must be a callable that returns a paddle.nn.Layer, got {type(layer).__name__}")
    if loader is not None and not isinstance(loader, ShardDataloader):
        raise TypeError(f"loader must be a raydist.shard_dataloader(...) or None, got {type(loader).__name__}")
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a paddle.nn.Layer or a callable, got {type(loss).__name__}")
    if isinstance(optimizer, paddle.optimizer.Optimizer) or (optimizer is not None and not callable(optimizer)):
        raise TypeError(
            "optimizer must be a callable that makes the optimizer on each rank from the rank's "
            "parameters, e.g. `lambda params: paddle.optimizer.AdamW(1e-3, parameters=params)`; "
            f"got {type(optimizer).__name__}"
        )
    if strategy is not None:
        if not isinstance(strategy, paddle.distributed.Strategy):
            raise TypeError(f"strategy must be a paddle.distributed.Strategy, got {type(strategy).__name__}")
        if not strategy.full_graph:
            raise ValueError("strategy.full_graph=False asks Paddle for a dygraph model; raydist runs the static DistModel")
    if metrics is not None and not isinstance(metrics, (list, tuple)):
        raise TypeError(f"metrics must be a list, got {type(metrics).__name__}")
    for metric in metrics or []:
        if not isinstance(metric, paddle.metric.Metric):
            raise TypeError(f"metrics must be paddle.metric.Metric objects, got {type(metric).__name__}")
    check_window(max_in_flight, steps_per_message)
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch must be one of {DISPATCH}, got {dispatch!r}")


def _num_workers(num_workers: int | tuple[int, int] | None, specs: list, loader: Any) -> Sizes:
    spec_ranks = {i for s in specs if s.layout is not None for i in s.layout.mesh.process_ids}
    if num_workers is None:
        if not spec_ranks:
            raise ValueError("num_workers is required unless input_spec gives the mesh")
        return Sizes((max(spec_ranks) + 1,))
    sizes = sizes_of(num_workers, loader)
    if spec_ranks and max(spec_ranks) >= sizes.max:
        raise ValueError(
            f"input_spec's mesh uses processes up to {max(spec_ranks)}, but num_workers={num_workers}"
        )
    return sizes


def _weakly(method: Callable) -> Callable:
    """``method`` of an object, called only while the object lives (no reference cycle through it)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _on_a_thread(stop: Callable[[], None]) -> Callable[[], None]:
    """``stop`` for a finalizer, run on a thread of its own: a model dropped without shutdown() is
    finalized when the garbage collector runs, which can be inside one of Ray's own calls (seen:
    while ``ray.get`` deserialized a result), and killing actors from there deadlocks in Ray."""

    def start() -> None:
        try:
            threading.Thread(target=stop, name="raydist-stop", daemon=True).start()
        except RuntimeError:  # the interpreter is exiting: no new threads, and no Ray call is under way
            stop()

    return start


def _in_placement_group() -> bool:
    from ray.util.placement_group import get_current_placement_group

    return ray.is_initialized() and get_current_placement_group() is not None


def _data_meshes(meshes: list[Mesh], num_workers: int) -> tuple[Mesh, Mesh]:
    """The meshes inputs and labels are laid on by default.

    Pipeline stages (disjoint meshes, in the order of the layer's
    parameters): inputs on the first, labels on the last, as Paddle's
    ``shard_dataloader`` lays them. Otherwise both on the layer's largest
    mesh, or on all ranks as "dp" if the layer has no dist parameters.
    """
    if not meshes:
        mesh = Mesh.of(list(range(num_workers)), ["dp"])
        return mesh, mesh
    if stages(meshes):
        return meshes[0], meshes[-1]
    mesh = max(meshes, key=lambda m: len(m.process_ids))
    return mesh, mesh


def _callback_list(callbacks: Any):
    """Paddle's CallbackList of ``callbacks`` (a list of Callback objects, or a CallbackList)."""
    from paddle.hapi.callbacks import CallbackList

    return callbacks if isinstance(callbacks, CallbackList) else CallbackList(list(callbacks or []))


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _same(a: Specs | None, b: Specs | None) -> bool:
    """Whether two (inputs, labels) hold the very same spec lists (cheaper than comparing them)."""
    return a is not None and b is not None and a[0] is b[0] and a[1] is b[1]


def _value(layout: Layout, results: Any, i: int) -> Any:
    """Value ``i`` of a step, whole, from the ranks' pieces (`raydist.driver.client.StepAnswers`, or a
    list by rank). A data-parallel loss is reduced over the ranks once for all steps of a message,
    so a step costs the driver the same whatever the number of ranks."""
    op = layout.reduced_whole
    if op is not None and hasattr(results, "reduced"):
        value = results.reduced(i, layout.reader_tuple, op)
        if value is not None:
            return value
    return layout.assemble({r: results[r][i] for r in layout.reader_tuple})


def _combine(plan: ModePlan, mode: str, results: Any) -> Any:
    """A step's result from the ranks': the loss (with eval's metric values), or the outputs (predict)."""
    values = [_value(layout, results, i) for i, layout in enumerate(plan.layouts)]
    if mode == "predict":
        return values[0] if len(values) == 1 else values
    loss = np.asarray(values[0])
    loss = float(loss.reshape(-1)[0] if loss.size == 1 else loss.mean())
    if len(plan.groups) < 2:
        return loss
    groups, start = [], 1
    for size in plan.groups[1:]:
        groups.append(values[start : start + size])
        start += size
    return Evaluated(loss, groups)
