"""A rank's model service: the layer, its static DistModel (or its eager run), its steps and its state."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
import time

import numpy as np
import paddle
import ray

from .. import handover, pickling
from ..compat import engine as compat_engine
from ..errors import HandoverLost, UsageError
from ..messages import ArraysStep, BuildReport, LoaderStep, Parcel, Progress, Reattached, StepMessage, StepResults
from ..specs import TensorSpec
from ..strategy import pipeline_stages
from ..topology import Mesh, ModePlan, widest
from . import weights as rank_weights
from .conversion import explain
from .eager import EagerRunner, replicate_dense
from .mirror import Mirror
from .replicas import ReplicaHashes
from .runner import StaticRunner
from .schedule import RankSchedule
from .steplog import StepLog


class ModelService:
    """The model of one rank: built from the driver's pickled builders, then driven step by step."""

    def __init__(self, rank: int, world_size: int, device: str):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._runner: StaticRunner | EagerRunner | None = None  # once built
        self._schedule: RankSchedule | None = None
        self.collect = False  # whether the driver reads this rank's step results (set per mode)
        self._thread_device: int | None = None
        self._starts: collections.deque = collections.deque(maxlen=100_000)
        self._running: tuple[int, float] | None = None  # (step, since when) running now or waiting for its data
        self.log = StepLog()  # the last steps, for the timeline and the metrics
        self.trained = 0  # train steps completed since the build (the live state's position)
        self.next_step = 0  # the number after the last step run, whatever its mode (for a driver that attaches)
        self.broke_off = False  # whether the last train step raised (a peer's death, say)
        self._idle = threading.Event()  # no step running: the state is between two steps
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None  # background checkpoint writes
        self._writes: dict[str, concurrent.futures.Future] = {}  # directory -> its write
        self.mirror: Mirror | None = None  # peer memory (`raydist.worker.mirror`), if the model has it
        self.hashes: ReplicaHashes | None = None  # the replica check's codes (`raydist.worker.replicas`)
        self._idle.set()

    @property
    def runner(self) -> StaticRunner | EagerRunner:
        """What runs the built layer's steps (`build` makes it)."""
        if self._runner is None:
            raise UsageError(f"rank {self.rank} has built no model yet: the driver calls build first")
        return self._runner

    @property
    def schedule(self) -> RankSchedule:
        """The optimizer's learning-rate schedule on this rank (`build` makes it)."""
        if self._schedule is None:
            raise UsageError(f"rank {self.rank} has built no model yet: the driver calls build first")
        return self._schedule

    @property
    def mode(self) -> str | None:
        return self._runner.mode if self._runner is not None else None

    def build(self, payload: bytes) -> BuildReport:
        """Build the layer and the optimizer; the meshes of the layer's parameters, in order.
        A dynamic model's layer runs eagerly (`raydist.worker.eager`), else as Paddle's static DistModel."""
        build_layer, loss, optimizer_factory, strategy, metrics, dynamic, weights = pickling.loads(payload)
        layer = build_layer()
        if not isinstance(layer, paddle.nn.Layer):
            raise UsageError(f"build_layer must return a paddle.nn.Layer, it returned {type(layer).__name__}")
        meshes = []
        for p in layer.parameters():
            if p.is_dist():
                mesh = Mesh.of_paddle(p.process_mesh)
                if mesh not in meshes:
                    meshes.append(mesh)
        beyond = sorted({i for m in meshes for i in m.process_ids if i >= self.world_size})
        if beyond:
            raise UsageError(
                f"the model's mesh uses processes {beyond}, but the group has {self.world_size} ranks "
                f"(num_workers={self.world_size}): raise num_workers to {max(beyond) + 1}"
            )
        pipeline_stages(strategy, meshes, self.world_size)
        if weights is not None:  # every new group starts from them: a restart from the start too
            rank_weights.load(layer, weights, self.rank)
        if dynamic:  # before the optimizer is made: it holds the parameters it is given
            replicate_dense(layer, widest(meshes, self.world_size))
        optimizer = optimizer_factory(layer.parameters()) if optimizer_factory is not None else None
        if optimizer is None and optimizer_factory is not None:
            raise UsageError("optimizer: the factory returned None, not a paddle.optimizer.Optimizer (does it "
                             "`return` the optimizer it makes?); pass optimizer=None for a model without one")
        if optimizer is not None and not isinstance(optimizer, paddle.optimizer.Optimizer):
            inner = getattr(optimizer, "_inner_opt", None)  # dist.shard_optimizer's wrapper
            if not isinstance(inner, paddle.optimizer.Optimizer):
                raise UsageError(
                    f"optimizer must return a paddle.optimizer.Optimizer, it returned {type(optimizer).__name__}"
                )
        if optimizer is not None:
            from ..compat.engine import shard_by_strategy

            optimizer = shard_by_strategy(optimizer, strategy, layer.parameters())
        if dynamic:
            self._runner = EagerRunner(layer, loss, optimizer, metrics)
        else:
            self._runner = StaticRunner(layer, loss, optimizer, strategy, metrics)
        self._schedule = schedule = RankSchedule(optimizer, static=not dynamic)
        return BuildReport(meshes, schedule.report())

    def set_specs(self, inputs: list[TensorSpec], labels: list[TensorSpec]) -> None:
        self.runner.set_specs(inputs, labels)

    def set_mode(self, mode: str) -> ModePlan:
        """Enter ``mode``; a program that cannot be built for these specs is refused (`UsageError`).

        Every rank builds from the same specs and code, so a build error (a
        batch of the wrong dtype for the layer, a bug in ``forward``) is the
        same on all ranks; the driver keeps the ranks and the engine builds
        again with the next specs.
        """
        built = mode in self.runner.modes
        try:
            plan = self.runner.set_mode(mode)
        except Exception as e:
            why = explain(mode, e)
            if why is not None:
                raise UsageError(why) from None  # Paddle's own message is in it
            raise UsageError(f"the {mode} program cannot be built for these inputs: {type(e).__name__}: {e}") from e
        if mode == "train" and not built and isinstance(self.runner, StaticRunner):
            self.schedule.built(compat_engine.dense_program(self.runner.engine, "train"))
        self.collect = self.rank in plan.readers()
        return plan

    @property
    def running(self) -> int | None:
        """The number of the step running now (or waiting for its data); None between messages."""
        running = self._running
        return None if running is None else running[0]

    def progress(self) -> Progress | None:
        """The step running now and for how long (read from another thread: one attribute, set whole)."""
        running = self._running
        return None if running is None else Progress(running[0], time.monotonic() - running[1])

    def run(self, parcel: Parcel, data) -> StepResults | None:
        """The parcel's steps, in order (``data``: the rank's `raydist.worker.data.DataService`):
        this rank's local results of each if the driver reads them, else None. A step that
        fails says which it was (its number), so the driver names it."""
        results: list[list] = []
        log, clock, mode = self.log, time.monotonic_ns, self.runner.mode  # a message's steps share a mode
        if mode is None:
            raise UsageError(f"rank {self.rank} is in no mode: the driver sets one before the steps")
        if mode == "train" and self.mirror is not None:
            self.mirror.message_began(self.trained)
        try:
            for number, message in enumerate(parcel.steps, parcel.first):
                asked = clock()
                self._running = (number, asked / 1e9)
                try:
                    batch = data.take(message) if isinstance(message, LoaderStep) else None
                    fed = clock() if batch is not None else asked  # a driver batch is there already
                    out = self.step(message, batch)
                    if out is not None:  # (the driver reads them)
                        results.append(out)
                    log.add(number, mode, asked, fed, clock())
                    self.next_step = number + 1
                except Exception as e:
                    e.raydist_step = number  # type: ignore[attr-defined]  # the driver names the step
                    raise
        finally:
            self._running = None
        return StepResults.of(results) if self.collect else None

    def step(self, message: StepMessage, staged: list | None) -> list | None:
        """One step, on the global arrays of ``message`` or the ``staged`` loader batch."""
        self._starts.append(time.monotonic())
        if self._thread_device != threading.get_ident():
            # Steps may run on a thread of Ray's (compiled graphs): Paddle's device is per thread.
            paddle.set_device(self.device)
            self._thread_device = threading.get_ident()
        training = self.runner.mode == "train"
        if message.lr:
            self.schedule.apply(message.lr)
        if training:
            self.schedule.sync()
            if self.mirror is not None:
                self.mirror.before_step(self.trained)
        if isinstance(message, ArraysStep):
            # copies: the message's arrays may live in a channel's buffer, which
            # Ray reuses only once nothing refers to them
            staged = [np.array(a) for a in self.runner.local(message.arrays, self.rank)]
        self._idle.clear()
        try:
            results = self.runner.step(staged, self.collect)
        except BaseException:
            self.broke_off |= training
            raise
        finally:
            self._idle.set()
        if training:
            self.trained, self.broke_off = self.trained + 1, False
            if self.hashes is not None or self.mirror is not None:
                copy = functools.cache(self._state_copy)  # one copy a step, for the check and the mirror
                if self.hashes is not None:
                    self.hashes.after_step(self.trained, copy)
                if self.mirror is not None:
                    self.mirror.after_step(self.trained, copy)
        return results

    def _state_copy(self) -> dict:
        return self.runner.state_dict("all")  # copies: host memory the next steps leave alone

    def hand_over(self, wait_s: float, names: list[str]) -> list:
        """This rank's pieces of the state, for new ranks to take (`raydist.handover`): first
        (train steps completed, why its state may hold half of a step's updates or None,
        {name: Piece}), then the local array of each of ``names`` (None: not held here), each
        its own object. Read between two steps; all None if a step still runs after ``wait_s``
        (blocked in a collective with a dead peer, say), or before a program exists. A step
        that breaks off fails in a collective; once the program runs its updates last
        (compat.engine, behaviour 8), that is before any of them."""
        if self._runner is None or not self._runner.modes or not self._idle.wait(wait_s):
            return [None] * (len(names) + 1)
        state = self.runner.state_dict("all")  # copies: what the driver's references point at
        torn = self.broke_off and not self.runner.updates_last
        why = handover.half_updated(state) if torn else None
        return [(self.trained, why, handover.describe(state, self.rank))] + \
            [state[n][0] if n in state else None for n in names]  # fmt: skip

    def take_state(self, state: handover.StateMap) -> None:
        """Set this rank's shards from ``state``'s pieces, each fetched from where it lies."""
        def pieces(held):
            mine = {name: layout for name, layout in held.items() if name in state}
            asked = handover.ask_keepers(state, mine, self.rank)
            return ((name, asked[name].cut(layout, self.rank)) for name, layout in mine.items())

        try:
            self.runner.set_pieces(pieces)
        except ray.exceptions.RayError as e:
            raise HandoverLost(f"a piece of the state handed over is gone ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''})") from e  # fmt: skip

    def reattached(self) -> Reattached:
        """Where this rank stands, for a driver that attaches to it (the one before it gone)."""
        runner = self.runner
        built = sorted(runner.modes, key=lambda m: m == runner.mode) if runner is not None else []
        return Reattached(runner.mode if runner is not None else None, built, self.next_step, self.trained,
                          self.broke_off, self.schedule.report() if self.schedule is not None else None)

    def take_starts(self) -> list[float]:
        starts, self._starts = self._starts, collections.deque(maxlen=100_000)
        return list(starts)

    def program(self, kind: str, mode: str | None) -> str:
        return self.runner.program(kind, mode)

    def state_dict(self, mode: str) -> dict:
        return self.runner.state_dict(mode)

    def state_meta(self, mode: str = "all") -> dict:
        return self.runner.state_meta(mode)

    def set_state(self, full: dict) -> None:
        self.runner.set_state(full, self.rank)

    def save_pieces(self, directory: str, names: list[str], background: bool = False) -> str:
        from .. import checkpoint

        state = self.runner.state_dict("all")  # copies: a snapshot that the next steps leave alone
        pieces = {n: state[n][0] for n in names}
        if not background:
            return checkpoint.write_pieces(directory, self.rank, pieces)
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raydist-save")
        self._writes[directory] = self._writer.submit(checkpoint.write_pieces, directory, self.rank, pieces)
        return checkpoint.pieces_file(self.rank)

    def export_offer(self, names: list[str]) -> dict[str, tuple]:
        return rank_weights.offer(self.runner.state_dict("param"), names, self.rank)

    def write_weights(self, directory: str, format: str, files: list, state: handover.StateMap, prefix: str) -> None:
        transposed = rank_weights.linear_weights(self.runner.layer) if format == "safetensors" else set()
        rank_weights.write(directory, format, files, state, self.rank, transposed, prefix)

    def saved(self, directory: str) -> str:
        return self._writes.pop(directory).result()

    def load_state(self, directory: str, tensors: dict) -> None:
        from ..checkpoint import assemble

        # only the tensors this rank holds (not another pipeline stage's) are read
        self.runner.set_state(lambda mine: assemble(directory, {n: t for n, t in tensors.items() if n in mine}),
                              self.rank)  # fmt: skip
