"""The rank actors' endpoints: what the driver may call on a rank, and nothing else.

Both sides import this module: the driver to start the actors and to name
their methods (``client.call(RankActor.state_meta, "param")``), the ranks to
run them. The bodies are one line each and delegate to the rank's services
in `raydist.worker`, which are imported inside the rank process only, when
it joins the process group (Paddle reads its environment at import).
"""

from __future__ import annotations

import functools
import os
import resource
import socket
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import ray

from .env import RankPlace
from .errors import RankFailed, RankRefused, UsageError
from .messages import INLINE_BYTES, BuildReport, LoaderStep, Parcel, RankAnswers, ReadOrder, StepResults
from .topology import ModePlan

if TYPE_CHECKING:
    from .specs import TensorSpec


def reports_rank(method):
    """Raise a failure of ``method`` as `RankFailed` naming this rank; a refusal
    (`UsageError`) as `RankRefused`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except UsageError as e:
            raise RankRefused(self.rank, traceback.format_exc(), str(e)) from None
        except Exception as e:
            raise RankFailed(self.rank, traceback.format_exc(), getattr(e, "raydist_step", None)) from None

    return wrapper


def here() -> RankPlace:
    """Where this Ray worker runs: its node, IP, and the GPUs Ray gave it."""
    ctx = ray.get_runtime_context()
    return RankPlace(ctx.get_node_id(), ray.util.get_node_ip_address(), tuple(str(g) for g in ray.get_gpu_ids()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# Concurrency groups of the actors (besides Ray's default one, where the calls
# of the driver run in order): "aside" answers liveness and status checks
# while a step runs; "data" is a loader's hand-outs, beside the steps;
# "relay" collects a relayed message's results (one thread per message in flight).
ASIDE = "aside"
DATA = "data"
RELAY = "relay"
RELAY_THREADS = 8
# How often a rank collecting a relayed message looks at its own step while it waits for its children's.
RELAY_POLL_S = 0.05


class Member:
    """What every raydist actor answers: where it runs, ports for the rendezvous, liveness."""

    concurrency_groups = {ASIDE: 1}

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    @ray.method(concurrency_group=ASIDE)
    def place(self) -> tuple[RankPlace, int]:
        return here(), os.getpid()

    @ray.method(concurrency_group=ASIDE)
    def free_port(self) -> int:
        return free_port()

    @ray.method(concurrency_group=ASIDE)
    def port_is_free(self, port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True

    @ray.method(concurrency_group=ASIDE)
    def ping(self) -> int | None:
        """Answers even while a step runs: tells the driver this rank is alive (and, for a
        rank, the number of the step it runs; None: none)."""
        return None


class RankActor(Member):
    """One rank of a `raydist.DistModel`: its model service and its data service."""

    concurrency_groups = {ASIDE: 1, DATA: 1, RELAY: RELAY_THREADS}

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self.model = None  # raydist.worker.model.ModelService, once joined
        self.data = None  # raydist.worker.data.DataService, once joined
        self.device = "cpu"
        self.group: str | None = None  # the group's name, once joined
        self.children: list = []  # the ranks this one relays messages to (`relay`)
        self._relayed: dict[int, _Relayed] = {}  # by a message's first step
        self._relaying = threading.Lock()

    def warm_up(self, quiet: bool, modules: tuple[str, ...] = ()) -> None:
        """Import Paddle (and ``modules``) while the group is placed (CPU ranks: nothing it
        does depends on the rank). In the thread of the driver's calls, as `setup` and the
        steps; the rendezvous calls answer from another meanwhile."""
        from .worker.join import warm_up

        warm_up(quiet, modules)

    @reports_rank
    def setup(self, env: dict[str, str], use_gpu: bool, data_timeout: float | None = None,
              group: str | None = None) -> list[str]:  # fmt: skip
        """Join the process group as the rank ``env`` names; returns the Paddle fixes applied.

        ``data_timeout``: how long a step waits for its loader batch (None: no limit);
        ``group``: the group's name (a spare was started under another).
        """
        from .worker.data import DataService
        from .worker.join import join
        from .worker.model import ModelService

        self.rank, self.world_size = int(env["PADDLE_TRAINER_ID"]), int(env["PADDLE_TRAINERS_NUM"])
        self.group = group
        fixes, self.device = join(env, use_gpu)
        self.data = DataService(self.device, data_timeout)
        self.model = ModelService(self.rank, self.world_size, self.device)
        return fixes

    # -- the model ---------------------------------------------------------------

    @reports_rank
    def build(self, payload: bytes) -> BuildReport:
        """Build the layer and the optimizer from the pickled builders: its meshes and learning rate."""
        return self.model.build(payload)

    @reports_rank
    def set_specs(self, inputs: list[TensorSpec], labels: list[TensorSpec]) -> None:
        self.model.set_specs(inputs, labels)

    @reports_rank
    def set_mode(self, mode: str) -> ModePlan:
        """Enter ``mode``, building its program the first time; what a step fetches."""
        return self.model.set_mode(mode)

    @reports_rank
    def run(self, parcel: Parcel) -> StepResults | None:
        """The parcel's steps, in order: this rank's local results of each if the driver reads them, else None.

        A step that fails says which it was (its number), so the driver names it."""
        results = []
        try:
            for number, message in enumerate(parcel.steps, parcel.first):
                self.model.running = number
                try:
                    batch = self.data.take(message) if isinstance(message, LoaderStep) else None
                    results.append(self.model.step(message, batch))
                except Exception as e:
                    e.raydist_step = number
                    raise
        finally:
            self.model.running = None
        return StepResults.of(results) if self.model.collect else None

    # -- relayed messages (`raydist.driver.transport.TreeTransport`) ---------------

    def set_children(self, children: list) -> None:
        """The actors this rank passes each relayed message on to."""
        self.children = list(children)

    def relay(self, first: int, payload: Parcel | list) -> None:
        """Pass the message (its first step: ``first``) on to this rank's children, then run its
        steps (as `run`); `collect` returns the results. ``payload``: the parcel, or ``[ref]`` to it
        in the object store (so that it is passed on as a ref, not copied)."""
        parcel = payload if isinstance(payload, Parcel) else None
        if parcel is not None and self.children and parcel.nbytes > INLINE_BYTES:
            payload = [ray.put(parcel)]  # the ranks below borrow it from this one, not from the driver
        for child in self.children:
            child.relay.remote(first, payload)  # in order, as every caller's calls to one actor
        relayed = self._relayed_for(first)
        try:
            relayed.results = self.run(parcel if parcel is not None else ray.get(payload[0]))
        except BaseException as e:  # noqa: BLE001 - `collect` raises it
            relayed.error = e
        finally:
            relayed.done.set()

    @ray.method(concurrency_group=RELAY)
    def collect(self, first: int) -> RankAnswers | None:
        """The results of the relayed message that begins at step ``first``, of this rank and every
        rank below it that the driver reads, as one answer (None: no such rank). Raises the first
        failure below (a child's at once, even while this rank's own step waits for the failed one)."""
        pending = [child.collect.remote(first) for child in self.children]
        relayed = self._relayed_for(first)
        below: list[RankAnswers] = []
        while pending and relayed.error is None:
            # while this rank's own steps run, look at them now and then: a failure here would
            # leave the children waiting for this rank in a collective
            timeout = None if relayed.done.is_set() else RELAY_POLL_S
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            below += [answers for answers in map(_result_below, ready) if answers is not None]
        relayed.done.wait()
        with self._relaying:
            del self._relayed[first]
        if relayed.error is not None:
            raise relayed.error
        if relayed.results is not None:
            below.insert(0, RankAnswers.of(self.rank, relayed.results))
        return RankAnswers.merge(below) if below else None

    def _relayed_for(self, first: int) -> "_Relayed":
        """The record of a relayed message, made by `relay` or `collect`, whichever comes first."""
        with self._relaying:
            return self._relayed.setdefault(first, _Relayed())

    @reports_rank
    def program(self, kind: str, mode: str | None) -> str:
        return self.model.program(kind, mode)

    @reports_rank
    def state_dict(self, mode: str) -> dict:
        return self.model.state_dict(mode)

    @reports_rank
    def state_meta(self, mode: str = "all") -> dict:
        return self.model.state_meta(mode)

    @reports_rank
    def set_state(self, full: dict) -> None:
        self.model.set_state(full)

    @reports_rank
    def save_pieces(self, directory: str, names: list[str]) -> str:
        """Write this rank's shards of ``names`` into a checkpoint directory; the file's name."""
        return self.model.save_pieces(directory, names)

    @reports_rank
    def load_state(self, directory: str, tensors: dict) -> None:
        """Set ``tensors`` (manifest entries) from a checkpoint; this rank keeps its own shards."""
        self.model.load_state(directory, tensors)

    # -- a loader's data: its own thread, beside the steps ---------------------------

    @ray.method(concurrency_group=DATA)
    def data_open(self, order: ReadOrder, members: list) -> None:
        """Read an epoch for this rank's data-parallel group (``members``: its ranks, None for this one)."""
        self.data.open(order, members)

    @ray.method(concurrency_group=DATA)
    def data_stage(self, loader: int, epoch: int, first_step: int, batches: list) -> None:
        self.data.stage(loader, epoch, first_step, batches)

    @ray.method(concurrency_group=DATA)
    def data_fail(self, loader: int, epoch: int, error: str) -> None:
        self.data.fail(loader, epoch, error)

    @ray.method(concurrency_group=ASIDE)
    def ping(self) -> int | None:
        return self.model.running if self.model is not None else None

    @ray.method(concurrency_group=ASIDE)
    def live_state(self, wait_s: float) -> tuple[int, dict] | None:
        """Beside a step: this rank's state once no step runs (see `ModelService.live_state`)."""
        return self.model.live_state(wait_s) if self.model is not None else None

    # -- observing -------------------------------------------------------------------

    @ray.method(concurrency_group=ASIDE)
    def status(self) -> dict[str, Any]:
        """Who and where (node IP and Ray node id) this rank is, its mode and its peak resident memory (MiB)."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        mode = self.model.mode if self.model is not None else None
        return {"rank": self.rank, "group": self.group, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "device": self.device, "mode": mode,
                "peak_rss_mib": peak}  # fmt: skip

    @ray.method(concurrency_group=ASIDE)
    def take_stats(self) -> dict[str, Any]:
        """When this rank's steps started and how long they waited for data since the last call, and for
        pipeline neighbours in all; the process's CPU seconds so far (for bench/)."""
        from .compat.collectives import p2p_waited_s

        return {"starts": self.model.take_starts(), "wait": self.data.take_wait(), "stage_wait": p2p_waited_s(),
                "cpu": time.process_time()}


class _Relayed:
    """A relayed message on one rank: its parcel, and this rank's results or failure once its steps ran."""

    __slots__ = ("results", "error", "done")

    def __init__(self):
        self.results: list | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


def _result_below(ref: ray.ObjectRef) -> RankAnswers | None:
    """A child's `RankActor.collect` result; its failure raised as the child raised it (a rank's
    `RankFailed` keeps naming that rank; a death stays a death, for the driver to find)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, BaseException):
            raise e.cause from None
        raise
