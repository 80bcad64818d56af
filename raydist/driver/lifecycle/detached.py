"""Detached models: ranks that outlive their driver, and `raydist.attach` from a later one.

``to_static(..., name="run-1", detached=True)`` starts the ranks and their
placement group with Ray's ``lifetime="detached"`` (`raydist.driver.cluster.config.GroupConfig`):
a notebook's kernel restart, a dropped connection or a killed driver leaves them
running. What a new driver needs that only the driver knew (the builders, the
specs, the mode, the sizes, the last checkpoint: a `Snapshot`) lives in one small
detached actor per model, its `ModelRecord` (``raydist-model-<name>``, no CPU),
with the rank actors and the placement group; the ranks themselves tell where they
stand (their step, modes built, learning rate: `raydist.protocol.RankActor.reattach`).

One driver at a time holds a model. The record keeps the holder (`Holder`) and
hands the model over by compare-and-set; a holder counts as alive while its Ray
job does (Ray marks a driver's job dead within a fraction of a second of the
driver's death, so a kernel restart's new driver attaches at once). A driver
through Ray Client is a job of the client server, which outlives the client by
Ray's reconnect grace period (30 s): such a holder also counts as gone once it
has not looked in for `CLIENT_HOLD_S` (it looks every `HOLD_POLL_S`). The record
decides, on the cluster, where the job table can be read. A driver that was
taken over learns it within `HOLD_POLL_S` and says so to the record, which the
new driver waits for (so two drivers never send steps at once): its next call
raises `raydist.GroupShutdownError` naming the new holder, and its ``shutdown`` no
longer stops the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import remove_placement_group

from ..cluster.config import DETACHED_NAMESPACE, GroupConfig, is_member_of
from ..cluster.state import ended_jobs, through_client

if TYPE_CHECKING:
    from ..cluster.sizes import Sizes
    from ..model.inputs import InputSpecs

log = logging.getLogger("raydist")

RECORD_PREFIX = "raydist-model-"  # a detached model's record actor: RECORD_PREFIX + its name
HOLD_POLL_S = 2.0  # how often a holding driver checks that it still holds its model
CLIENT_HOLD_S = 5 * HOLD_POLL_S  # a Ray Client holder silent this long is gone


class ModelHeldError(RuntimeError):
    """`raydist.attach` was refused: another live driver holds the model (``take_over=True`` takes it)."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """The driver that holds a detached model: its Ray job, process and host; ``client``: it
    reaches Ray through Ray Client."""

    job_id: str
    pid: int
    host: str
    since: float
    client: bool = False

    @classmethod
    def here(cls) -> Holder:
        return cls(ray.get_runtime_context().get_job_id(), os.getpid(), socket.gethostname(), time.time(),
                   through_client())  # fmt: skip

    def __str__(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        how = ", through Ray Client" if self.client else ""
        return f"the driver with pid {self.pid} on {self.host} (Ray job {self.job_id}{how}, holding since {since})"


@dataclasses.dataclass
class Snapshot:
    """What only the driver knows of a model and a new driver needs: how it was made, its
    specs and mode, and the last checkpoint (pickled by the driver; the record never opens it)."""

    config: GroupConfig
    sizes: Sizes
    payload: bytes
    metrics: list
    specs: InputSpecs
    has_loss: bool
    has_optimizer: bool
    mode: str
    last_checkpoint: str | None
    meshes: list


class ModelRecord:
    """A detached model's record, as a Ray actor: the driver's `Snapshot` (pickled), the rank
    actors, their placement group, and the holder. Its calls run one at a time, so `claim` is
    atomic. It runs on the cluster, so it tells whether a holder lives (`live_holder`) for drivers
    that cannot read the job table themselves (Ray Client)."""

    def __init__(self, holder: Holder):
        self._snapshot: bytes | None = None
        self._actors: list = []
        self._pg = None
        self._holder: Holder | None = holder
        self._beats: dict[Holder, float] = {holder: time.monotonic()}  # a holder's last look, for Ray Client's
        self._let_go: set[Holder] = set()  # drivers that were taken over and stopped using the ranks
        self._rate: Any = None  # the learning rate's newest position (`LearningRate.position`)

    def publish(self, snapshot: bytes, actors: list, pg: Any) -> None:
        self._snapshot, self._actors, self._pg = snapshot, list(actors), pg

    def set_rate(self, position: Any) -> None:
        self._rate = position

    def read(self) -> tuple[bytes | None, list, Any, Any]:
        return self._snapshot, self._actors, self._pg, self._rate

    def beat(self, holder: Holder) -> Holder | None:
        """``holder`` looks in: who holds the model now."""
        self._beats[holder] = time.monotonic()
        return self._holder

    def live_holder(self) -> Holder | None:
        """The holder, if it is alive; else None."""
        return self._holder if self._holder is not None and self.alive(self._holder) else None

    def alive(self, holder: Holder) -> bool:
        """Whether ``holder``'s Ray job runs (and, through Ray Client, it looked in lately)."""
        if holder.job_id in ended_jobs():
            return False
        return not holder.client or self.silent_for(holder) < CLIENT_HOLD_S

    def silent_for(self, holder: Holder) -> float:
        """Seconds since ``holder`` last looked in."""
        return time.monotonic() - self._beats.get(holder, 0.0)

    def claim(self, holder: Holder, take_over: bool) -> tuple[Holder | None, Holder | None]:
        """Hold the model as ``holder`` unless another live driver does (``take_over``: even then).
        Who holds it now, and the live driver it was taken from (None: none)."""
        live = self.live_holder()
        if live is not None and live != holder and not take_over:
            return live, live
        self._holder = holder
        self._beats[holder] = time.monotonic()
        return holder, None if live == holder else live

    def release(self, holder: Holder) -> None:
        if self._holder == holder:
            self._holder = None

    def let_go(self, holder: Holder) -> None:
        """``holder``, taken over, stopped using the ranks."""
        self._let_go.add(holder)

    def has_let_go(self, holder: Holder) -> bool:
        """Whether ``holder``, taken over, stopped using the ranks (or is gone)."""
        return holder in self._let_go or not self.alive(holder)


class RecordClient:
    """The driver's calls to a detached model's `ModelRecord` actor (``actor``)."""

    def __init__(self, actor: Any):
        self.actor = actor

    def read(self) -> tuple[bytes | None, list, Any, Any]:
        """(the pickled `Snapshot`, None before the first; the rank actors; their placement group; the rate)."""
        return ray.get(self.actor.read.remote())

    def claim(self, holder: Holder, take_over: bool) -> tuple[Holder, Holder | None]:
        """(who holds the model now; the live holder taken over from, or None)."""
        return ray.get(self.actor.claim.remote(holder, take_over))

    def live_holder(self) -> Holder | None:
        return ray.get(self.actor.live_holder.remote())

    def silent_for(self, holder: Holder) -> float:
        return float(ray.get(self.actor.silent_for.remote(holder)))

    def has_let_go(self, holder: Holder) -> bool:
        return bool(ray.get(self.actor.has_let_go.remote(holder)))

    def beat(self, holder: Holder, timeout: float) -> Any:
        """``holder`` looks in: who holds the model now ("ended" is not answered: the actor is gone)."""
        return ray.get(self.actor.beat.remote(holder), timeout=timeout)

    def publish(self, blob: bytes, actors: list, pg: Any) -> None:
        self.actor.publish.remote(blob, actors, pg)  # no wait: in order with the holder's next calls

    def set_rate(self, position: Any) -> None:
        self.actor.set_rate.remote(position)

    def let_go(self, holder: Holder) -> None:
        self.actor.let_go.remote(holder)

    def release(self, holder: Holder) -> None:
        self.actor.release.remote(holder)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class Hold:
    """This driver's hold on a detached model: publishes its snapshot, watches that it still
    holds it (``on_lost(why)`` once it does not), lets go or ends the record."""

    def __init__(self, name: str, record: RecordClient, holder: Holder):
        self.name, self.record, self.holder = name, record, holder
        self.lost = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def create(cls, name: str) -> Hold:
        """A new record for a model ``name``; a ValueError if a detached model of that name exists."""
        holder = Holder.here()
        try:
            record = RecordClient(_record_class().options(name=RECORD_PREFIX + name, namespace=DETACHED_NAMESPACE,
                                                          lifetime="detached", num_cpus=0).remote(holder))  # fmt: skip
        except ValueError:  # the name is taken
            raise ValueError(
                f"a detached model named {name!r} exists already ({_held_by(find(name))}): attach to it with "
                f"raydist.attach({name!r}), end it with raydist.attach({name!r}).shutdown(), or choose another name"
            ) from None
        return cls(name, record, holder)

    def publish(self, snapshot: Snapshot, actors: list, pg: Any) -> None:
        from ... import pickling

        if not self.lost:
            self.record.publish(pickling.dumps(snapshot, "the model's record"), actors, pg)

    def rate(self, position: Any) -> None:
        """The learning rate's position after a change: the ranks learn of it with the next step, which
        a driver that dies first never sends."""
        if not self.lost:
            self.record.set_rate(position)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Check every `HOLD_POLL_S` that this driver still holds the model; ``on_lost(why)`` once not."""

        def run() -> None:
            while not self._stopped.wait(HOLD_POLL_S):
                try:
                    now = self.record.beat(self.holder, timeout=30)
                except ray.exceptions.RayActorError:
                    now = "ended"
                except Exception:  # noqa: BLE001 - Ray is busy or shutting down: look again, or stop
                    continue
                if now != self.holder:
                    self.lost = True
                    on_lost(f"the detached model {self.name!r} was ended by another driver" if now == "ended"
                            else f"the detached model {self.name!r} was taken over by {now}")  # fmt: skip
                    if now != "ended":
                        self.record.let_go(self.holder)  # the new holder waits for this
                    return

        if self._thread is None:
            self._thread = threading.Thread(target=run, name="raydist-hold", daemon=True)
            self._thread.start()

    def release(self) -> None:
        """Let go of the model (it stays for another driver to attach to)."""
        self._stopped.set()
        if not self.lost and ray.is_initialized():
            try:
                self.record.release(self.holder)
            except Exception:  # noqa: BLE001 - Ray is shutting down: the job's death frees the hold as well
                pass

    def end(self) -> None:
        """The model ended: its record goes too."""
        self._stopped.set()
        if not self.lost and ray.is_initialized():
            try:
                self.record.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass


def models() -> list[str]:
    """The names of the detached models in the cluster this driver is connected to."""
    if not ray.is_initialized():
        return []
    return sorted(entry["name"][len(RECORD_PREFIX):] for entry in ray.util.list_named_actors(all_namespaces=True)
                  if entry["namespace"] == DETACHED_NAMESPACE and entry["name"].startswith(RECORD_PREFIX))  # fmt: skip


def find(name: str) -> RecordClient:
    """The record of the detached model ``name``; a LookupError listing the models there are."""
    try:
        return RecordClient(ray.get_actor(RECORD_PREFIX + name, namespace=DETACHED_NAMESPACE))
    except ValueError:
        there = models()
        raise LookupError(
            f"no detached model named {name!r} in this Ray cluster; "
            + (f"there are: {', '.join(repr(m) for m in there)}" if there else "there are none")
        ) from None


def _held_by(record: RecordClient) -> str:
    holder = record.live_holder()
    return f"held by {holder}" if holder is not None else "held by no live driver"


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a driver that claimed a detached model goes on from: its hold, the model as the driver
    before left it, and that driver if it was taken over from a live one (None: nobody held it)."""

    hold: Hold
    snapshot: Snapshot
    actors: list
    pg: Any
    rate: Any
    before: Holder | None


def claim(name: str, take_over: bool = False) -> Claim:
    """Hold the detached model ``name`` for this driver (see `raydist.attach`): `ModelHeldError` if
    a live driver holds it and not ``take_over``; a silent Ray Client holder is waited for."""
    from ... import pickling
    from ..cluster.connect import connect_to_cluster

    connect_to_cluster(f"attach to the detached model {name!r}")
    record = find(name)
    if record.read()[0] is None:
        raise LookupError(f"the detached model {name!r} is still starting: attach once its to_static returned")
    me = Holder.here()
    now, before = record.claim(me, take_over)
    if now != me and now.client and _wait_silent(record, name, now):  # a notebook's kernel restarted, say
        now, before = record.claim(me, take_over)
    if now != me:
        raise ModelHeldError(f"the detached model {name!r} is held by {now}; attach(..., take_over=True) "
                             "takes it over (that driver's next call then fails)")  # fmt: skip
    if before is not None:
        _wait_let_go(record, before)
        log.warning("raydist: took the detached model %r over from %s", name, before)
    blob, actors, pg, rate = record.read()  # as the driver before left it
    return Claim(Hold(name, record, me), pickling.loads(blob or b""), actors, pg, rate, before)


def _wait_silent(record: RecordClient, name: str, holder: Holder) -> bool:
    """A Ray Client holder that missed a look-in is likely gone (its job outlives it by Ray's reconnect
    grace): wait until it counts as gone, or looks in again. Whether it is gone."""
    silent = record.silent_for(holder)
    if silent < 1.5 * HOLD_POLL_S:
        return False
    log.warning("raydist: the detached model %r is held by %s, which has been silent for %.0f s; waiting up to "
                "%.0f s for it to count as gone", name, holder, silent, CLIENT_HOLD_S - silent)  # fmt: skip
    while record.live_holder() == holder:
        if record.silent_for(holder) < silent:  # it looked in: alive after all
            return False
        time.sleep(0.5)
    return True


def _wait_let_go(record: RecordClient, holder: Holder) -> None:
    """Wait until the driver taken over stops using the ranks (it looks every `HOLD_POLL_S`), or is gone."""
    deadline = time.monotonic() + 3 * HOLD_POLL_S + 5
    while not record.has_let_go(holder):
        if time.monotonic() > deadline:
            log.warning("raydist: %s did not let go of the model within %.0f s; going on", holder,
                        3 * HOLD_POLL_S + 5)  # fmt: skip
            return
        time.sleep(0.1)


@functools.cache
def _record_class():
    return ray.remote(ModelRecord)


def stop(name: str, force: bool = False) -> None:
    """End the detached model ``name`` from anywhere (``raydist stop``): its ranks, spares,
    placement group and record. A model a live driver holds is refused (`ModelHeldError`) unless
    ``force``: that driver's next call then fails. A LookupError for an unknown name."""
    record = find(name)
    holder = record.live_holder()
    if holder is not None and not force:
        raise ModelHeldError(f"the detached model {name!r} is held by {holder}; --force ends it anyway (that "
                             "driver's next call then fails)")  # fmt: skip
    _, actors, pg, _ = record.read()
    record.kill()  # first: a holder learns the model ended, and lets go of the ranks
    kill_named(name, DETACHED_NAMESPACE, actors)
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - removed already
            pass


def kill_named(group: str, namespace: str | None, actors: Sequence[Any] = ()) -> int:
    """Kill ``actors`` and every actor named as a rank, spare or peer-memory keeper of ``group`` (in
    ``namespace``; None: any); how many."""
    actors = list(actors)
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if is_member_of(entry["name"], group) and namespace in (None, entry["namespace"]):
            try:
                actors.append(ray.get_actor(entry["name"], namespace=entry["namespace"]))
            except ValueError:  # gone meanwhile
                pass
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
    return len(actors)
