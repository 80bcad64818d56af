"""Which group of ranks is live: its start, its peer memory and replica checks, and shutdown.

One `Lifecycle` per model owns the live `raydist.driver.cluster.group.RankGroup` (through
its `raydist.driver.dispatch.client.RankClient`), the spare ranks, and the decisions that
replace the group. Every new group builds the model, then the other parts of the model
are told (`Modes.started`, `LearningRate.started`, the state's client, `Recovery.started`).
The class is written in parts, a file each:

- here: starting a group, peer memory and the replica check, events, shutdown;
- `raydist.driver.lifecycle.restart` (`Restarting`): a restart after a failure, from the
  best source of state (`raydist.driver.lifecycle.sources`);
- `raydist.driver.lifecycle.moves` (`Moves`): growing, and moving off a draining node;
- `raydist.driver.lifecycle.adopt` (`Adoption`): a detached model's ranks taken over.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ...errors import RankError, ReplicaMismatchError
from ...messages import MirrorPlan
from ...protocol import Member, RankActor
from ..cluster.config import GroupConfig
from ..cluster.group import RankGroup
from ..cluster.sizes import Sizes, size_now
from ..cluster.spares import SparePool
from ..dispatch.client import LiveGroup, RankClient
from ..watching.events import Events
from ..watching.metrics import RunMetrics
from .adopt import Adoption
from .detached import Hold, Holder, Snapshot
from .moves import Moves, RoomWatch
from .peers import PeerMemory
from .preemption import DrainWatch, Notice
from .recovery import Recovery
from .replicas import ReplicaCheck
from .restart import LifeRebuild, Restarting, Restarts

if TYPE_CHECKING:
    from ..model.changes import Changes
    from ..model.modes import Modes
    from ..model.rates import LearningRate
    from ..model.state import ModelState

log = logging.getLogger("raydist")


class Lifecycle(Restarting, Moves, Adoption):
    """The live group of ranks of one model, and everything that replaces it.

    ``payload``: the pickled builders every new group builds the model from (``metrics``: the
    `paddle.metric.Metric` objects in it, which a detached model's record keeps);
    ``modes``, ``rates``, ``state``: the model's parts that a new group resets and restores;
    ``group``: the cell of the live group's client they share; ``changes``: what they say changed;
    ``hold``: this driver's hold on a detached model (`raydist.driver.lifecycle.detached`), or None.
    """

    def __init__(self, config: GroupConfig, sizes: Sizes, payload: bytes, metrics: list, modes: Modes,
                 rates: LearningRate, state: ModelState, group: LiveGroup, changes: Changes,
                 hold: Hold | None = None):  # fmt: skip
        self.config = config
        self.sizes = sizes
        self.payload, self.paddle_metrics = payload, metrics
        self.modes, self.rates, self.state, self._group = modes, rates, state, group
        self.hold = hold
        changes.listen(_weakly(self._changed))
        self.recovery = Recovery()
        # peer memory (`raydist.driver.lifecycle.peers`): keepers named after the first group
        self.peers: PeerMemory | None = None
        recovery = config.recovery
        self.peer_memory = recovery.peer_memory
        self.replicas = ReplicaCheck(recovery.check_replicas, recovery.replica_mismatch == "warn") \
            if recovery.check_replicas else None  # fmt: skip
        self._mismatched = False  # the last failure was a replica mismatch: copies after the last clean check are not
        self.restarts = Restarts(state.saves, LifeRebuild(self))
        self.spares = SparePool(config, config.placement.spare_ranks)
        self.meshes: list = []  # of the layer's parameters, as the live group built them
        self._room: RoomWatch | None = None
        self._drains: DrainWatch | None = None  # from the first start on
        self.notice: Notice | None = None  # the last preemption notice a fixed-size group could not move off
        self._stop_spares = weakref.finalize(self, _on_a_thread(self.spares.shutdown))
        self._finalizer: weakref.finalize | None = None
        self.driver = Holder.here()  # this driver, as `raydist status` names it
        self.events = Events(config.name or "")  # named after the first group, if the model is not
        self.metrics = RunMetrics(config.name or "")
        self.events.add_sink(self.metrics.on_event)
        self.events.add_sink(_weakly(self._published))

    @property
    def client(self) -> RankClient | None:
        """The live group's client (None before the first group, and once closed)."""
        return self._group.client

    @client.setter
    def client(self, client: RankClient | None) -> None:
        self._group.client = client

    def _changed(self, what: str) -> None:
        """A part of the model changed: publish a new last checkpoint; and a detached model's mode,
        specs and learning rate (`raydist.driver.model.changes`)."""
        if what == "rate":
            if self.hold is not None:
                self.hold.rate(self.rates.position())
        elif what == "checkpoint" or self.hold is not None:
            self.publish()

    def snapshot(self) -> Snapshot:
        """What a detached model's record keeps for a later driver."""
        modes = self.modes
        return Snapshot(self.config, self.sizes, self.payload, self.paddle_metrics, modes.specs, modes.has_loss,
                        modes.has_optimizer, modes.mode, self.state.last_checkpoint, self.meshes)  # fmt: skip

    # -- starting --------------------------------------------------------------------

    def start(self, first_step: int = 0, size: int | None = None, freed: int = 0,
              placement_timeout_s: float | None = None, base: int = 0, mirror: bool = True) -> None:  # fmt: skip
        """A new group of ``size`` ranks (or the largest accepted size the cluster holds now; ``freed``:
        ranks a group just let go of), spare ranks first; the model built on it, the parts told.
        ``base``: the train steps the state it gets is after; ``mirror``: start its peer memory now
        (else the caller does, once the group has its state: `_mirror`)."""
        spares = self.spares.take(size or self.sizes.max)
        if size is None:
            size = size_now(self.sizes, self.config.bundle(), freed, held=len(spares))
        spares, extra = spares[:size], spares[size:]
        self.spares.give_back(extra)
        self.config = dataclasses.replace(self.config, num_workers=size)
        config = self.config
        if placement_timeout_s is not None:
            config = dataclasses.replace(config, placement=dataclasses.replace(config.placement,
                                                                      placement_timeout_s=placement_timeout_s))
        group = RankGroup(config, spares)
        client = self._took(group, first_step, base)
        try:
            report = client.call(RankActor.build, ray.put(self.payload))[0]
        except BaseException:
            client.close()
            raise
        self.meshes = report.meshes
        self.modes.started(report.meshes)
        self.rates.started(report.learning_rate)
        self.modes.resume()
        client.after_first_step(self.spares.fill)  # spares' Paddle import would slow the start
        if mirror:
            self._mirror(base)
        self._watching()

    def _took(self, group: RankGroup, first_step: int, base: int = 0) -> RankClient:
        """``group`` is the live one, its steps numbered from ``first_step``: its client. It stops when
        this model is dropped (if it is detached, this driver lets go of it instead)."""
        if not self.events.model:
            self.events.model = self.metrics.tags["model"] = group.prefix
        group.on_death(_weakly(self._salvage))
        group.on_failure(_weakly(self._failed))
        d = self.config.dispatch
        client = RankClient(group, max_in_flight=d.max_in_flight, dispatch=d.dispatch,
                            step_timeout_s=d.step_timeout_s, first_step=first_step,
                            steps_per_message=d.steps_per_message)  # fmt: skip
        self.client = client
        stop = self.hold.release if self.hold is not None else client.close
        self._finalizer = weakref.finalize(self, _on_a_thread(stop))
        # the steps in flight, and with peer memory the steps since the copy before the last one, or
        # with replica checks since the copy at or before the check three back (`raydist.worker.mirror.kept`)
        checks = 3 * (self.config.recovery.check_replicas or 0) if self.peer_memory else 0
        keep = (d.max_in_flight + 1) * client.window.most + 2 + 2 * (self.peer_memory or 0) + checks
        # the one before stays with a restart that still needs it; the steps kept before ``base`` go on (a
        # copy before a resize or a restart is still served, with the steps since it)
        self.recovery = Recovery(keep, base, carried=self.recovery.before(base))
        return client

    def _mirror(self, base: int, forget: bool = True) -> None:
        """The live group (its state after ``base`` train steps) copies its state into peer memory from
        now on, and now if it holds a train state (a new model's first state the builders make again),
        and checks its replicas. ``forget=False``: the copies before count the same steps (a restart
        from peer memory or the survivors' state, a resize): they stay until the group's own are complete."""
        group, check = self.live().group, self.config.recovery.check_replicas
        if self.peer_memory:
            if self.peers is None:
                self.peers = PeerMemory(self.peer_memory, group.prefix, self.config.detached)
            draining = self._drains.draining if self._drains is not None else {}
            self.peers.attach(group, base, copy_now=self.modes.built("train"), forget=forget, check_every=check,
                              avoid=set(draining), in_flight=self.config.dispatch.max_in_flight)  # fmt: skip
        elif check:
            plan = MirrorPlan(None, 0, base, check_every=check)
            group.call(RankActor.mirror, plan, during="the replica check")
        if self.replicas is not None:
            self.replicas.started(group.actors, base, renumbered=forget)

    def loaded(self) -> None:
        """The user loaded a checkpoint: a timeline of its own begins. Peer memory's copies and the
        replica checks before it are of another: they go, and the loaded state is copied now."""
        if self.client is not None and self.client.alive and (self.peer_memory or self.config.recovery.check_replicas):
            self._mirror(self.trained(), forget=True)

    def verify(self, wait: bool = False) -> None:
        """Before a train step: compare the replica checks that came back (``wait``: once every step
        sent completed, all of them); a `ReplicaMismatchError` if replicas disagree (then the group
        is torn down, as after a failure)."""
        if self.replicas is None or self.client is None or not self.client.alive:
            return
        client, sent = self.client, self.recovery.base + self.recovery.trained
        if wait:
            client.drain()
        elif not self.replicas.due(sent):
            return  # the per-step path: no check due, nothing asked
        late = None if wait else self.replicas.overdue(sent)
        if late is not None:  # a mismatch is raised within two checks' distance of the step it came after
            number = self.recovery.number(late - 1)
            if number is not None:
                client.complete_until(number)
            wait = True
        gather = (lambda refs: client.group.gather(refs, "the replica check", watch=client.watch)) if wait else None
        self.replicas.poll(self.recovery.completed(client.window.completed), gather)
        try:
            self.replicas.raise_found()
        except ReplicaMismatchError as e:
            log.error("raydist: %s", e.cause)
            self.events.emit("replica_mismatch", self.step(), ranks=e.ranks, names=e.names[:50], after=e.step)
            self._mismatched = True
            self.client.drain()  # the steps in flight complete: a restart replays up to the last of them
            self.close()
            raise

    def _watching(self) -> None:
        """The live group is ready: watch for room, drains and (detached) the hold; publish it."""
        self._watch_room()
        if self._drains is None:
            self._drains = DrainWatch()
        self.publish()
        if self.hold is not None:
            self.hold.watch(_weakly(self._lost))

    def publish(self) -> None:
        """After each change: tell the ranks what ``raydist status`` shows of the model (its holder,
        sizes, last checkpoint); keep what a later driver needs of a detached model in its record."""
        if self.client is None or not self.client.alive:
            return
        group = self.client.group
        card = {"kind": "model", "holder": str(self.hold.holder if self.hold is not None else self.driver),
                "sizes": [self.sizes.min, self.sizes.max], "last_checkpoint": self.state.last_checkpoint,
                "events": self.events.last(3)}  # fmt: skip
        group.tell(Member.describe, card)
        if self.hold is not None:
            self.hold.publish(self.snapshot(), group.actors, group.placement_group)

    def _published(self, event: dict) -> None:
        self.publish()

    def sent(self, number: int, train: bool, rate: Any, message: Any = None) -> None:
        """Step ``number`` was sent (a train step runs with the learning rate ``rate``; ``message``: what
        it carried): recovery can replay a train step, and the metrics count every step."""
        if train:
            self.recovery.sent(number, rate, message if self.peer_memory else None)
        self.metrics.tick(self.client, self.sizes)

    def step(self) -> int:
        """The number the next step sent gets (0 before the first group)."""
        return self.client.window.submitted if self.client is not None else 0

    def _failed(self, group: RankGroup, error: RankError) -> None:
        """A failure of the live group, as an event."""
        if self.client is None or group is not self.client.group:
            return
        node = group.places[error.rank].node_ip if 0 <= error.rank < len(group.places) else None
        first = str(error.cause).strip().splitlines()
        self.events.emit("failure", self.client.window.completed, rank=error.rank, node=node, during=error.during,
                         error=(first[-1] if first else "")[:500], died=error.died)  # fmt: skip

    # -- replacing the group -----------------------------------------------------------

    def state_meta(self, mode: str) -> dict:
        """The model state's names, shapes and dtypes (``mode``: "param", "opt" or "all")."""
        return self.state.meta(mode)

    def wait_saved(self) -> None:
        """Wait until the checkpoint being written in the background is complete."""
        self.state.wait_saved()

    def trained(self) -> int:
        """The train steps sent to the model over its life (the state a save now writes is after them)."""
        return self.recovery.base + self.recovery.trained

    # -- stopping --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the ranks now, without completing the steps in flight."""
        self._stop_watching_room()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self.client is not None:
            self.client.close()

    def shutdown(self, drain: bool = True) -> None:
        """Stop every rank (after the steps in flight, if ``drain``) and the spares; a detached model
        ends (unless another driver took it over: then this one only lets go). Idempotent."""
        if self.hold is not None:
            self.hold.end()
        if drain:
            self.state.wait_saved()
        self._stop_watching_room()
        if self._drains is not None:
            self._drains.stop()
        try:
            if self._finalizer is not None:
                self._finalizer.detach()
            if self.client is not None:
                self.client.close(drain=drain)
        finally:
            self._stop_spares.detach()
            self.spares.shutdown()
            if self.peers is not None:
                self.peers.shutdown()


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
