"""Which group of ranks is live: its start, restart after a failure, resize, and shutdown.

One `Lifecycle` per model owns the live `raydist.driver.cluster.group.RankGroup` (through
its `raydist.driver.dispatch.client.RankClient`), the spare ranks, and the decisions that
replace the group: a restart after a failure, a move to another size (elastic
models), a shutdown. Every new group builds the model, then the other parts of
the model are told (`Modes.started`, `LearningRate.started`, the state's client,
`Recovery.started`) and given back what the old group held: the survivors'
state after a death (`raydist.driver.lifecycle.recovery`), the live state on a resize, or
the last checkpoint.

An elastic model's room to grow is watched by a thread of its own (`RoomWatch`),
so a step boundary learns of a joined node by reading a flag, without asking
the cluster.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ... import checkpoint
from ...errors import RankError
from ...errors import ReplicaMismatchError
from ...messages import ArraysStep, MirrorPlan
from ...protocol import RankActor
from ..dispatch.client import RankClient
from ..cluster.sizes import Sizes, size_now
from ..cluster.config import GroupConfig
from ..cluster.group import RankGroup
from .detached import Hold, Holder, Snapshot
from ..cluster.state import Outage
from ..watching.events import Events
from ..watching.metrics import RunMetrics
from .preemption import DrainWatch, Notice
from ..cluster.placement import placeable_now
from .peers import PeerMemory
from .recovery import LIVE_STATE_WAIT_S, Recovery, assemble_live
from .replicas import ReplicaCheck
from ..cluster.spares import SparePool

if TYPE_CHECKING:
    from ..model.modes import Modes
    from ..model.rates import LearningRate
    from ..model.state import ModelState

log = logging.getLogger("raydist")

GROW_PLACEMENT_S = 30.0  # how long growing waits for the room it saw before settling for what fits
ROOM_POLL_S = 1.0  # how often an elastic model below its largest size looks for room to grow


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a restart went on from: ``source`` ("replicas", "peer_memory", "checkpoint" or "start");
    ``behind``: the completed train steps the state stands behind the last one that completed (0: on
    from there; a number: peer memory's, whose steps since came from a loader, for the loop to feed
    again) or None (the ``checkpoint``'s state, or the initial one: the loop goes back to it)."""

    source: str
    behind: int | None
    checkpoint: str | None = None


@dataclasses.dataclass
class Failure:
    """What a failure left for its restart, read once: a restart that fails itself (a node lost while
    its ranks are placed, a rank dead in the replay) is tried again from the same. ``recovery``: the
    books of the failed group; ``salvaged``: its survivors' state; ``first_step``, ``done``: the
    numbers of the next step and of the first not completed; ``completed``: the train steps done;
    ``bound``: the newest count whose state a restart trusts (the last clean check after a mismatch);
    ``rate``: the learning rate the first step not completed ran with."""

    recovery: Recovery
    salvaged: tuple[dict, Any, int] | None
    first_step: int
    done: int
    completed: int
    bound: int
    rate: Any


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """How steps travel to a group (see `raydist.DistModel`): messages in flight, steps per message, path."""

    max_in_flight: int
    steps_per_message: int | str
    dispatch: str


class Lifecycle:
    """The live group of ranks of one model, and everything that replaces it.

    ``payload``: the pickled builders every new group builds the model from;
    ``modes``, ``rates``, ``state``: the model's parts that a new group resets and restores.
    """

    def __init__(self, config: GroupConfig, sizes: Sizes, payload: bytes, dispatch: Dispatch, spare_ranks: int,
                 modes: Modes, rates: LearningRate, state: ModelState):  # fmt: skip
        self.config = config
        self.sizes = sizes
        self.payload = payload
        self.dispatch = dispatch
        self.modes, self.rates, self.state = modes, rates, state
        state.on_change = _weakly(self.publish)  # a new last checkpoint
        self.recovery = Recovery()
        # peer memory (`raydist.driver.lifecycle.peers`): keepers named after the first group
        self.peers: PeerMemory | None = None
        self.peer_memory = config.peer_memory
        self.replicas = ReplicaCheck(config.check_replicas, config.replica_mismatch == "warn") \
            if config.check_replicas else None  # fmt: skip
        self._mismatched = False  # the last failure was a replica mismatch: copies after the last clean check are not
        self._failure: Failure | None = None  # what the last failure left, until a restart succeeds
        self.spares = SparePool(config, spare_ranks)
        self.client: RankClient | None = None
        self.meshes: list = []  # of the layer's parameters, as the live group built them
        self._room: RoomWatch | None = None
        self._drains: DrainWatch | None = None  # from the first start on
        self.notice: Notice | None = None  # the last preemption notice a fixed-size group could not move off
        self._stop_spares = weakref.finalize(self, _on_a_thread(self.spares.shutdown))
        self._finalizer: weakref.finalize | None = None
        self.hold: Hold | None = None  # this driver's hold on a detached model (`raydist.driver.lifecycle.detached`)
        self.driver = Holder.here()  # this driver, as `raydist status` names it
        self.events = Events(config.name or "")  # named after the first group, if the model is not
        self.metrics = RunMetrics(config.name or "")
        self.events.add_sink(self.metrics.on_event)
        self.events.add_sink(_weakly(self._published))
        self.snapshot: Callable[[], Snapshot] | None = None  # what a detached model's record keeps of it

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
            config = dataclasses.replace(config, placement_timeout_s=placement_timeout_s)
        group = RankGroup(config, spares)
        client = self._took(group, first_step, base)
        try:
            report = client.call(RankActor.build, ray.put(self.payload))[0]
        except BaseException:
            client.close()
            raise
        self.meshes = report.meshes
        self.modes.started(client, report.meshes)
        self.rates.started(report.learning_rate)
        self.state.client = client
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
        d = self.dispatch
        client = RankClient(group, max_in_flight=d.max_in_flight, dispatch=d.dispatch,
                            step_timeout=group.config.step_timeout_s, first_step=first_step,
                            steps_per_message=d.steps_per_message)  # fmt: skip
        self.client = client
        stop = self.hold.release if self.hold is not None else client.close
        self._finalizer = weakref.finalize(self, _on_a_thread(stop))
        # the steps in flight, and with peer memory the steps since the copy before the last one
        keep = (d.max_in_flight + 1) * client.window.most + 2 + 2 * (self.peer_memory or 0)
        self.recovery = Recovery(keep, base)  # the one before stays with a restart that still needs it
        return client

    def _mirror(self, base: int, forget: bool = True) -> None:
        """The live group (its state after ``base`` train steps) copies its state into peer memory from
        now on, and now if it holds a train state (a new model's first state the builders make again),
        and checks its replicas. ``forget=False``: the copies before count the same steps (a restart
        from peer memory or the survivors' state, a resize): they stay until the group's own are complete."""
        group, check = self.client.group, self.config.check_replicas
        if self.peer_memory:
            if self.peers is None:
                self.peers = PeerMemory(self.peer_memory, group.prefix, self.config.detached)
            self.peers.attach(group, base, copy_now=self.modes.built("train"), forget=forget, check_every=check)
        elif check:
            plan = MirrorPlan(None, 0, base, check_every=check)
            group.gather([a.mirror.remote(plan) for a in group.actors], "the replica check")
        if self.replicas is not None:
            self.replicas.started(group.actors, base, renumbered=forget)

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

    def adopt(self, actors: list, pg: Any, meshes: list, mode: str, rate: Any = None) -> None:
        """Take over the running ranks of a detached model (its driver gone, or taken over): where
        they stand (their step, modes, learning rate) is asked of them. If a rank is gone, or the
        ranks disagree (their driver died while it sent a step), a new group starts from the last
        checkpoint instead. ``rate``: the learning rate's newest position, as the driver before knew it."""
        self.meshes = meshes
        try:
            group = RankGroup(self.config, adopt=(actors, pg))
            stands = group.gather([a.reattach.remote() for a in group.actors], "attach")
        except RankError as e:
            return self._start_over(f"a rank is gone ({str(e).splitlines()[0]})")
        if len({s.trained for s in stands}) > 1 or any(s.broke_off for s in stands):
            group.shutdown()
            return self._start_over(f"the ranks stand at different train steps {[s.trained for s in stands]}")
        client = self._took(group, max(s.next_step for s in stands), stands[0].trained)
        self.modes.adopt(client, meshes, stands[0].built)
        self.rates.started(stands[0].learning_rate)
        self.rates.catch_up(rate)
        self.state.client = client
        if stands[0].built:
            self.state.built("train" in stands[0].built)
        self.modes.mode = mode
        self.modes.resume()
        self._mirror(stands[0].trained)
        self._watching()

    def _start_over(self, why: str) -> None:
        """A new group for a detached model whose ranks cannot go on, from its last checkpoint."""
        saved = self.state.saves.last
        path = saved.path if saved is not None else None
        log.warning("raydist: the detached model %r cannot go on where it stood: %s; starting its ranks again "
                    "from %s", self.hold.name, why, path or "its initial parameters (no checkpoint)")  # fmt: skip
        self.start(first_step=checkpoint.read_manifest(path).get("step", 0) if path else 0,
                   base=saved.trained if saved is not None else 0)  # fmt: skip
        if path is not None:
            self.state.load(path, self.modes.built("train"), None)
        self.events.emit("restart", self.step(), size=self.client.size, source="checkpoint" if path else "start",
                         checkpoint=path, replayed=None)  # fmt: skip

    def publish(self) -> None:
        """After each change: tell the ranks what ``raydist status`` shows of the model (its holder,
        sizes, last checkpoint); keep what a later driver needs of a detached model in its record."""
        if self.client is None or not self.client.alive:
            return
        group = self.client.group
        card = {"kind": "model", "holder": str(self.hold.holder if self.hold is not None else self.driver),
                "sizes": [self.sizes.min, self.sizes.max], "last_checkpoint": self.state.last_checkpoint,
                "events": self.events.last(3)}  # fmt: skip
        for actor in group.actors:
            actor.describe.remote(card)
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

    def _lost(self, why: str) -> None:
        """Another driver took this detached model over: stop using its ranks, without stopping them."""
        log.warning("raydist: %s", why)
        self._stop_watching_room()
        if self.client is not None:
            self.client.group.let_go(why)
        self.peers = None  # the keepers are the new driver's

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

    def restart(self) -> Restored:
        """A fresh group (after a failure), with the newest state there is: the survivors' (if they
        hold all of it), else peer memory's newest complete copy and the train steps since replayed,
        else the newest checkpoint of the timeline, or the initial parameters. After a replica
        mismatch, nothing newer than the last check that passed. The checkpoints after the state it
        goes on from leave the timeline (`raydist.driver.model.saves`). What it went on from: see
        `Restored`, and `raydist.DistModel.restart`."""
        self.state.wait_saved()  # a background save ends first: committed, or gone with the ranks
        if self._failure is None:
            self._failure = self._failed_at()
        restored = self._restart(self._failure)  # a failure in it: the next restart starts from the same
        self._failure = None
        return restored

    def _failed_at(self) -> Failure:
        """What the failure of the live group left for a restart."""
        recovery, window = self.recovery, self.client.window
        completed = recovery.completed(window.completed)
        failure = Failure(recovery, recovery.take(), window.submitted, window.completed, completed, completed,
                          recovery.resume_rate(window.completed, self.rates.position()))  # fmt: skip
        if self._mismatched:  # the states after the last check that passed may hold the corruption
            failure.salvaged, failure.bound, self._mismatched = None, min(completed, self.replicas.clean), False
        return failure

    def _restart(self, failure: Failure) -> Restored:
        recovery, salvaged, bound = failure.recovery, failure.salvaged, failure.bound
        first_step, done, completed, resume_rate = failure.first_step, failure.done, failure.completed, failure.rate
        copy, began, why = None, time.monotonic(), "the model has no peer memory"
        if salvaged is None and self.peers is not None:
            copy, why = self._newest_copy(recovery, completed, bound)
        state_s = time.monotonic() - began  # the state's time: finding it, and putting it in the new group
        freed = self.client.group.live_bundles()
        self.close()
        saves = self.state.saves
        saved = saves.newest(at_most=bound)
        behind: int | None = 0
        replay_s = 0.0
        if salvaged is not None:
            state, rate, trained = salvaged
            saves.went_back(recovery.base + trained)
            self.start(first_step, freed=freed, base=recovery.base + trained, mirror=False)
            state_s += _timed(self._put_back, state, rate)
            self._mirror(self.recovery.base, forget=False)
            log.warning("raydist: went on from the state the surviving ranks held after %d train steps "
                        "(no checkpoint read)", trained)  # fmt: skip
            source, replayed = "replicas", 0
        elif copy is not None:
            index, state, steps = copy
            saves.went_back(min(bound, index + _replayable(steps)))
            self.start(first_step, freed=freed, base=index, mirror=False)
            if state is not None:
                state_s += _timed(self._put_back, state, None)
            self._mirror(index, forget=False)
            replay_began = time.monotonic()
            replayed = self._replay(steps, resume_rate)
            replay_s = time.monotonic() - replay_began
            behind = len(steps) - replayed
            log.warning("raydist: went on from peer memory's copy after %d train steps (no checkpoint read); "
                        "replayed %d train steps%s", index, replayed,
                        f", {behind} more to feed again" if behind else "")  # fmt: skip
            source, replayed = "peer_memory" if state is not None else "start", len(steps)
        else:
            if self.peers is not None:
                log.warning("raydist: peer memory cannot serve the restart: %s; %s", why,
                            f"back to the checkpoint {saved.path}" if saved else "starting over")  # fmt: skip
            saves.went_back(saved.trained if saved is not None else -1)
            self.start(first_step, freed=freed, base=saved.trained if saved is not None else 0, mirror=False)
            if saved is not None:
                state_s += _timed(self.state.load, saved.path, self.modes.built("train"), None)
                source, replayed = "checkpoint", done - checkpoint.read_manifest(saved.path).get("step", 0)
            else:
                source, replayed = "start", done
            self._mirror(self.recovery.base)
            behind = None
        path = saved.path if source == "checkpoint" else None
        self.events.emit("restart", first_step, size=self.client.size, source=source, checkpoint=path,
                         replayed=max(0, replayed), behind=behind, seconds=round(time.monotonic() - began, 3),
                         state_s=round(state_s, 3), replay_s=round(replay_s, 3))  # fmt: skip
        return Restored(source, behind, path)

    def _newest_copy(self, recovery: Recovery, completed: int,
                     newest: int) -> tuple[tuple[int, dict | None, list] | None, str]:  # fmt: skip
        """The newest state peer memory can give at or before ``newest`` train steps, whole (every
        shard of a copy made after the same step) and with the steps since kept up to ``completed``:
        (its index, the state or None for the initial one, the (rate, message) of each step since),
        or None; and why not the newer copies (for the log)."""
        whys = []
        for (generation, index), holders in sorted(self.peers.copies().items(), key=lambda kv: kv[0][::-1],
                                                   reverse=True):  # fmt: skip
            if index > newest:
                whys.append(f"the copy after {index} train steps is newer than the last state to trust ({newest})")
                continue
            steps = recovery.since(index, completed)
            if steps is None:
                whys.append(f"the driver no longer keeps the train steps since the copy after {index}")
                continue
            try:
                answers = {rank: (index, False, self.peers.read(held)) for rank, held in holders.items()}
            except Exception as e:  # noqa: BLE001 - a keeper lost meanwhile: an older copy may do
                whys.append(f"the copy after {index} train steps could not be read ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})")  # fmt: skip
                continue
            found = assemble_live(answers, self.state.names)
            if not isinstance(found, str):
                return (index, found[1], steps), ""
            whys.append(f"the copy after {index} train steps is incomplete: "
                        f"{found.replace('surviving rank', 'rank kept')}")  # fmt: skip
        if recovery.base == 0 and self.state.last_checkpoint is None:
            steps = recovery.since(0, completed)
            if steps is not None:  # no copy yet: the initial state, which the builders make again
                return (0, None, steps), ""
        return None, "; ".join(whys[:3]) or "no copy is left (none made yet, or the ranks that made them and the " \
            "keepers that held them are all gone)"

    def _replay(self, steps: list[tuple[Any, Any]], resume_rate: Any) -> int:
        """Run again the train steps ``steps`` ((rate, message) each) that came from the driver's
        batches, in order, up to the first that came from a loader; the learning rate then where the
        next step (that one, or the first that did not complete) runs with. How many ran."""
        replayed, mode = 0, self.modes.mode
        for rate, message in steps[:_replayable(steps)]:
            self.rates.go_to(rate)
            self.modes.mode = "train"
            again = self.modes.message(list(message.arrays), self.rates.take_changes)
            step = self.client.step(again, lambda results: None)
            self.sent(step.number, True, rate, again)
            replayed += 1
        self.client.drain()
        if self.modes.mode != mode:
            self.modes.switch(mode)
        self.rates.go_to(steps[replayed][0] if replayed < len(steps) else resume_rate)
        return replayed

    def can_grow(self, look: bool = False) -> int | None:
        """A larger accepted size the cluster had room for when last looked at (every `ROOM_POLL_S`), if any;
        ``look``: look now (a few calls to Ray's GCS), e.g. after the loop stood still for a save."""
        if self._room is None:
            return None
        if look and self._room.size is None:
            self._room.look()
        return self._room.size

    def at_boundary(self, look: bool = False, before: Callable[[], Any] | None = None,
                    grow: bool = True) -> str | None:  # fmt: skip
        """Between two steps: act on a preemption notice for a node of the live group, else grow if
        there is room (``look``: look now, see `can_grow`). What was done: ``"moved"`` (the model left
        the draining node, from its live state, at an accepted size the other nodes hold: a fixed-size
        model's only one), ``"noticed"`` (it could not: `notice` is
        set, for `fit` to checkpoint), ``"grew"``, or None. ``before`` runs before any of these;
        ``grow=False``: act on notices only."""
        if self.client is None or not self.client.alive:
            return None
        notice = self._drains.notice(self.client.group.nodes) if self._drains is not None else None
        size = None if notice is not None or not grow else self.can_grow(look)
        if (notice is not None or size is not None) and before is not None:
            before()
        if notice is not None:
            on = [r for r, node in enumerate(self.client.group.nodes) if node in notice.nodes]
            log.warning("raydist: preemption notice: %s; it holds ranks %s", notice, on)
            size = self._size_off()  # a fixed-size model moves too, when its size fits elsewhere
            self.events.emit("drain", self.step(), nodes=sorted(notice.nodes), deadline=notice.deadline, ranks=on,
                             action="move" if size is not None else "checkpoint")  # fmt: skip
            if size is not None:
                log.warning("raydist: moving off it, from %d to %d ranks on other nodes, with the live state (no "
                            "checkpoint)", self.client.size, size)  # fmt: skip
                self.resize(size, why="drain")
                return "moved"
            self.notice = notice
            return "noticed"
        if size is not None:
            log.warning("raydist: room for %d ranks; growing from %d", size, self.client.size)
            self.resize(size, why="grow")
            return "grew"
        return None

    def _size_off(self) -> int | None:
        """The largest accepted size that fits on nodes that are not draining, if any."""
        room = placeable_now(self.config.bundle()) + self.client.group.live_bundles()
        size = self.sizes.fitting(room)
        return size if size <= room else None

    def resize(self, size: int, why: str = "grow") -> None:
        """Move to a group of ``size`` ranks, the state handed over from the live ranks (through Ray's
        object store: no checkpoint is written); at a step boundary only. ``why``: "grow" or "drain"."""
        self.state.wait_saved()
        state = self.state.state_dict("all" if self.modes.built("train") else "param")
        rate = self.rates.position()
        first_step = self.client.window.submitted
        base = self.recovery.base + self.recovery.trained  # at a boundary: every step sent completed
        freed, before = self.client.group.live_bundles(), self.client.size
        self._stop_watching_room()
        self._finalizer.detach()
        self.client.close(drain=True)
        try:  # the room seen a moment ago may be gone (taken by another job, a node lost again)
            self.start(first_step, size=size, freed=freed, placement_timeout_s=GROW_PLACEMENT_S, base=base,
                       mirror=False)  # fmt: skip
        except TimeoutError:
            log.warning("raydist: no room for %d ranks after all; going on at the size that fits", size)
            self.start(first_step, base=base, mirror=False)
        self._put_back(state, rate)
        self._mirror(base, forget=False)
        self.events.emit("resize", first_step, to=self.client.size, why=why, **{"from": before})

    def _salvage(self, group: RankGroup) -> None:
        """A rank of ``group`` died: keep what its survivors hold, for `restart`."""
        if self.client is None or group is not self.client.group or not self.modes.built("train"):
            return
        self.recovery.salvage(group, self.state.names, self.client.window.oldest, self.rates.position())
        if self.peers is not None:  # the survivors' own copies, before the group is torn down
            self.peers.salvage(group, LIVE_STATE_WAIT_S)

    def _put_back(self, state: dict, rate: Any) -> None:
        """Give the new group the state and learning rate of the one before."""
        if not self.modes.built("train") and not set(state) <= set(self.state.meta()):
            self.modes.build("train")  # the optimizer's state lives in the train program
        self.state.set_state_dict(state)
        self.rates.go_to(rate)

    # -- room to grow --------------------------------------------------------------------

    def _watch_room(self) -> None:
        if self.sizes.elastic and self.client.size < self.sizes.max:
            self._room = RoomWatch(self.sizes, self.client.size, self.config.bundle())

    def _stop_watching_room(self) -> None:
        room, self._room = self._room, None
        if room is not None:
            room.stop()

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


class RoomWatch:
    """A thread that looks, every `ROOM_POLL_S`, whether the cluster has room for a larger accepted
    size than ``size``; `size` is that size once it has (None before). `look` looks at once."""

    def __init__(self, sizes: Sizes, size: int, bundle: dict[str, float]):
        self.size: int | None = None
        self._sizes, self._from, self._bundle = sizes, size, bundle
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raydist-room", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        outage = Outage(f"the model does not grow past {self._from} ranks", "the model grows when room shows")
        while not self._stopped.wait(ROOM_POLL_S) and self.size is None:
            try:
                self.look()
                outage.read()
            except Exception as e:  # noqa: BLE001 - said once; looked at again
                if self._stopped.is_set() or not ray.is_initialized():  # Ray shuts down
                    return
                outage.failed(e)

    def look(self) -> None:
        """Look now (from any thread): `size` is set once a larger size fits."""
        larger = self._sizes.larger(self._from, placeable_now(self._bundle))
        if larger is not None:
            self.size = larger

    def stop(self) -> None:
        self._stopped.set()


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


def _replayable(steps: list[tuple[Any, Any]]) -> int:
    """How many of ``steps`` ((rate, message) each) a replay can run: those up to the first that came
    from a loader (the loop feeds that one and the rest again)."""
    return next((i for i, (_, message) in enumerate(steps) if not isinstance(message, ArraysStep)), len(steps))


def _timed(call: Callable[..., Any], *args: Any) -> float:
    """The seconds ``call(*args)`` took."""
    began = time.monotonic()
    call(*args)
    return time.monotonic() - began
