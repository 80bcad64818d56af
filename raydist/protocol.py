"""The rank actors' endpoints: what the driver may call on a rank, and nothing else.

Both sides import this module: the driver to start the actors and to name
their methods (``client.call(RankActor.state_meta, "param")``), the ranks to
run them. Each body delegates, in a line, to the rank's services in
`raydist.worker` (`setup` makes them): the model, its data, the relay tree.
They are imported inside the rank process only, when it joins the process
group (Paddle reads its environment at import).
"""

from __future__ import annotations

import functools
import os
import resource
import socket
import time
import traceback
from typing import TYPE_CHECKING, Any

import ray

from .env import RankPlace
from .errors import RankFailed, RankRefused, UsageError
from .handover import describe, returns
from .messages import (
    INLINE_BYTES,
    BuildReport,
    MirrorPlan,
    Parcel,
    Progress,
    RankAnswers,
    ReadOrder,
    Reattached,
    StepResults,
    pack,
    unpack,
)
from .net import free_port
from .topology import ModePlan

if TYPE_CHECKING:
    from .specs import TensorSpec
    from .worker.data import DataService
    from .worker.model import ModelService
    from .worker.relay import Relay


def reports_rank(method):
    """Raise a failure of ``method`` as `RankFailed` naming this rank; a refusal
    (`UsageError`) as `RankRefused`. Either way, the rank answered (`Member.answered`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except UsageError as e:
            raise RankRefused(self.rank, traceback.format_exc(), str(e)) from None
        except Exception as e:
            raise RankFailed(self.rank, traceback.format_exc(), getattr(e, "raydist_step", None)) from None
        finally:
            self.answered = time.time()

    return wrapper


def here() -> RankPlace:
    """Where this Ray worker runs: its node, IP, and the GPUs Ray gave it."""
    ctx = ray.get_runtime_context()
    return RankPlace(ctx.get_node_id(), ray.util.get_node_ip_address(), tuple(str(g) for g in ray.get_gpu_ids()),
                     ctx.get_actor_id() or "")  # fmt: skip


# Concurrency groups of the actors (besides Ray's default one, where the calls
# of the driver run in order): "aside" answers liveness and status checks
# while a step runs; "data" is a loader's hand-outs, beside the steps;
# "relay" collects a relayed message's results (one thread per message in flight).
ASIDE = "aside"
DATA = "data"
RELAY = "relay"
RELAY_THREADS = 8
SAVE = "save"  # waits for a checkpoint's background write, beside the steps


class Member:
    """What every raydist actor answers: where it runs, ports for the rendezvous, liveness,
    and what it is (`status`, for ``raydist status``)."""

    concurrency_groups = {ASIDE: 1}

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.answered: float | None = None  # when it last answered its driver (time.time())
        self.card: dict[str, Any] = {}  # what its driver says of the group (`describe`)

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
    def ping(self) -> Progress | None:
        """Answers even while a step runs: tells the driver this actor is alive (and, for a
        rank, the step it runs and for how long; None: none)."""
        return None

    @ray.method(concurrency_group=ASIDE)
    def describe(self, card: dict[str, Any]) -> None:
        """What the driver says of the group, for anyone who asks (`status`): its holder, sizes,
        last checkpoint (`raydist.driver.api.status.ModelStatus`)."""
        self.card = card

    @ray.method(concurrency_group=ASIDE)
    def status(self) -> dict[str, Any]:
        """Who and where (node IP and Ray node id) this actor is, its peak resident memory (MiB),
        when it last answered, and its driver's card."""
        return {"rank": self.rank, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "device": "cpu", "kind": "script", "mode": None,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "last_answer": self.answered, "card": self.card}  # fmt: skip


class RankActor(Member):
    """One rank of a `raydist.DistModel`: its model service and its data service."""

    concurrency_groups = {ASIDE: 1, DATA: 1, RELAY: RELAY_THREADS, SAVE: 1}

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self._model: ModelService | None = None  # once joined (`setup`)
        self._data: DataService | None = None
        self.device = "cpu"
        self.group: str | None = None  # the group's name, once joined
        self._relays: Relay | None = None  # once the driver relays messages through the ranks

    @property
    def model(self) -> ModelService:
        """The rank's model (`raydist.worker.model.ModelService`), once it joined its group."""
        if self._model is None:
            raise UsageError(f"rank {self.rank} has not joined a group: the driver calls setup first")
        return self._model

    @property
    def data(self) -> DataService:
        """The rank's loaders (`raydist.worker.data.DataService`), once it joined its group."""
        if self._data is None:
            raise UsageError(f"rank {self.rank} has not joined a group: the driver calls setup first")
        return self._data

    @property
    def relays(self) -> Relay:
        """How this rank passes the driver's messages on (`raydist.worker.relay.Relay`), once asked to."""
        if self._relays is None:
            raise UsageError(f"rank {self.rank} relays no messages: the driver calls set_children first")
        return self._relays

    def warm_up(self, quiet: bool, modules: tuple[str, ...] = ()) -> None:
        """Import Paddle (and ``modules``) while the group is placed (CPU ranks: nothing it
        does depends on the rank). In the thread of the driver's calls, as `setup` and the
        steps; the rendezvous calls answer from another meanwhile."""
        from .worker.join import warm_up

        warm_up(quiet, modules)

    @reports_rank
    def setup(self, env: dict[str, str], use_gpu: bool, step_timeout_s: float | None = None,
              group: str | None = None) -> list[str]:  # fmt: skip
        """Join the process group as the rank ``env`` names; returns the Paddle fixes applied.

        ``step_timeout_s``: how long a step waits for its loader batch (None: no limit), as the model's;
        ``group``: the group's name (a spare was started under another).
        """
        from .worker.data import DataService
        from .worker.join import join
        from .worker.model import ModelService

        self.rank, self.world_size = int(env["PADDLE_TRAINER_ID"]), int(env["PADDLE_TRAINERS_NUM"])
        self.group = group
        fixes, self.device = join(env, use_gpu)
        self.step_timeout_s = step_timeout_s
        self._data = DataService(self.device, step_timeout_s)
        self._model = ModelService(self.rank, self.world_size, self.device)
        from .worker.steplog import RECORD_ENV, Exporter, Unrecorded

        if os.environ.get(RECORD_ENV, "1") == "0":  # for measuring what the record costs (bench paired)
            self.model.log = Unrecorded()
        else:
            Exporter(self.model.log, group or "", self.rank)
        return fixes

    @reports_rank
    def reattach(self) -> Reattached:
        """A new driver holds this rank (its model's detached, the driver before gone): forget the
        old driver's loaders and relays; where the rank stands. In the thread of the driver's
        calls, so it answers once the steps the old driver sent are done."""
        from .worker.data import DataService

        self.data.close()
        self._data = DataService(self.device, self.step_timeout_s)
        self._relays = None
        return self.model.reattached()

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
    def run(self, parcel: Parcel | bytes) -> StepResults | bytes | None:
        """The parcel's steps, in order: this rank's local results of each if the driver reads them, else None.
        A `raydist.messages.pack`ed parcel gets its results packed too, unless they are large (the
        object store takes large arrays without a copy)."""
        if not isinstance(parcel, bytes):
            return self.model.run(parcel, self.data)
        results = self.model.run(unpack(parcel), self.data)
        return pack(results) if results is not None and results.nbytes <= INLINE_BYTES else results

    # -- relayed messages (`raydist.driver.dispatch.transport.TreeTransport`) ---------------

    def set_children(self, children: list) -> None:
        """The actors this rank passes each relayed message on to."""
        from .worker.relay import Relay

        self._relays = Relay(self.rank, self.run, children)

    def relay(self, first: int, payload: Parcel | list) -> None:
        """Pass the message on to this rank's children, then run its steps (see `raydist.worker.relay`)."""
        self.relays.relay(first, payload)

    @ray.method(concurrency_group=RELAY)
    def collect(self, first: int) -> RankAnswers | None:
        """The results of the relayed message from step ``first``, of this rank and the ranks below it."""
        return self.relays.collect(first)

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
    def take_state(self, state: dict) -> None:
        """Set this rank's shards from a `raydist.handover.StateMap`: each piece fetched from where it lies."""
        self.model.take_state(state)

    @reports_rank
    def save_pieces(self, directory: str, names: list[str], background: bool = False) -> str:
        """Write this rank's shards of ``names`` into a checkpoint directory; the file's name.
        ``background``: return once they are copied to host memory, and write them beside the
        next steps (`saved` waits for the write)."""
        return self.model.save_pieces(directory, names, background)

    @reports_rank
    def export_offer(self, names: list[str]) -> dict[str, tuple]:
        """This rank's pieces of the parameters ``names``, in the object store: {name: (Piece, reference)}
        (`raydist.worker.weights.offer`), for the ranks that write an export."""
        return self.model.export_offer(names)

    @reports_rank
    def write_weights(self, directory: str, format: str, files: list, state: Any, prefix: str = "") -> None:
        """Write the export's ``files`` ((name, tensor names)), each tensor whole, from ``state``'s pieces,
        named without ``prefix``."""
        self.model.write_weights(directory, format, files, state, prefix)

    @ray.method(concurrency_group=SAVE)
    def saved(self, directory: str) -> str:
        """Wait for the background write of `save_pieces` into ``directory``; the file's name (or its error)."""
        return self.model.saved(directory)

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
    def ping(self) -> Progress | None:
        return self.model.progress() if self._model is not None else None

    def mirror(self, plan: MirrorPlan, copy_now: int | None = None) -> None:
        """Peer memory and the replica check from now on (`raydist.worker.mirror`,
        `raydist.worker.replicas`); ``copy_now``: a copy of the state as it is, counted as after
        that many train steps (a restart's restored state)."""
        from .worker.mirror import Mirror
        from .worker.replicas import ReplicaHashes

        model = self.model
        if model.mirror is not None:
            model.mirror.close()
        model.mirror = Mirror(self.rank, plan, model.trained) if plan.every else None
        every = plan.check_every
        model.hashes = ReplicaHashes(self.rank, every, plan.base, model.trained) if every else None
        if copy_now is not None and model.mirror is not None:
            model.mirror.copy(copy_now, model._state_copy)

    @ray.method(concurrency_group=ASIDE)
    def mirrored(self) -> dict[int, dict]:
        """What this rank's own peer-memory copies hold, by train-step index (`raydist.handover.Piece`
        by name; after a peer died: the pieces themselves come with `copy_pieces`)."""
        mirror = self.model.mirror if self._model is not None else None
        return {i: describe(copy, self.rank, codes=False) for i, copy in mirror.copies().items()} if mirror else {}

    @ray.method(concurrency_group=ASIDE)
    def copy_pieces(self, index: int, names: list[str]) -> list:
        """The pieces ``names`` of this rank's copy after ``index`` train steps, each its own object
        (called with ``num_returns=len(names)``, so that the caller owns them past this rank's end)."""
        mirror = self.model.mirror
        if mirror is None:
            raise UsageError(f"rank {self.rank} keeps no peer-memory copies")
        copy = mirror.copies()[index]
        return returns([copy[name][0] for name in names])

    @ray.method(concurrency_group=ASIDE)
    def replica_codes(self, index: int) -> dict[str, tuple[tuple, int]] | None:
        """The codes of this rank's shards after ``index`` train steps (`raydist.worker.replicas`)."""
        hashes = self.model.hashes if self._model is not None else None
        return hashes.take(index) if hashes is not None else None

    @ray.method(concurrency_group=ASIDE)
    def hand_over(self, wait_s: float, names: list[str]) -> list:
        """Beside a step: this rank's pieces of the state once no step runs (see `ModelService.hand_over`;
        called with ``num_returns=len(names) + 1``, so that the caller owns them past this rank's end)."""
        if self._model is None:
            return [None] * (len(names) + 1)
        return self.model.hand_over(wait_s, names)

    # -- observing -------------------------------------------------------------------

    @ray.method(concurrency_group=ASIDE)
    def clock(self) -> int:
        """This rank's ``time.monotonic_ns`` now (the driver aligns the ranks' clocks to its own)."""
        return time.monotonic_ns()

    @ray.method(concurrency_group=ASIDE)
    def steps(self, last: int | None = None) -> dict[str, Any] | None:
        """The last ``last`` steps this rank ran (all it keeps: None) and the collectives in them
        (`raydist.worker.steplog.StepLog.recent`); None before it joined."""
        return self.model.log.recent(last) if self._model is not None else None

    @ray.method(concurrency_group=ASIDE)
    def status(self) -> dict[str, Any]:
        """`Member.status`, and the rank's group, device, mode and step (the number after its last)."""
        model = self._model
        status = Member.status(self)  # type: ignore[operator]  # Ray types a ray.method as remote only
        return {**status, "group": self.group, "device": self.device, "kind": "model",
                "mode": model.mode if model is not None else None, "step": model.next_step if model else None}
