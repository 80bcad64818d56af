"""The rank group: its placement, one actor per rank, the rendezvous, its failure, its teardown.

Ranks are ordered by node (the driver's node first), then by bundle. A rank
that raises or dies ends the whole group: every actor is killed (peers
blocked in a collective included) and the driver gets a `RankError` naming
the rank; after a death, the survivors are first asked what they hold
(`RankGroup.on_death`). `RankGroup.gather` is the one place where what ranks return, or
fail with, becomes a result or an error at the driver.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ...env import RankPlace, paddle_env
from ...errors import GroupShutdownError, RankError, RankFailed, UsageError
from ...messages import Progress
from ...protocol import Member, RankActor
from .config import Endpoint, GroupConfig, call_each_on, call_on, ping_all, start_actor
from .failures import rank_error, refused, steps_failed
from .hangs import Watch
from .placement import alive_nodes, wait_placed
from .state import draining_nodes

log = logging.getLogger("raydist")

# How long a failure waits for Ray to report a rank's death, which may be its cause.
DEATH_GRACE_S = 2.0
# After one rank refuses a call (UsageError), how long the others have to refuse it too.
REFUSAL_GRACE_S = 10.0


class RankGroup:
    """``num_workers`` actors that form one Paddle process group.

    ``spares``: started rank actors (`raydist.driver.cluster.spares.SparePool`) to use
    before starting new ones; the group owns them from here on. ``adopt``: the
    actors and placement group of a group that runs already (a detached model's,
    which a new driver attaches to): they are neither placed nor joined again.
    """

    def __init__(self, config: GroupConfig, spares: Sequence = (), adopt: tuple[list, object] | None = None):
        self.config = config
        self._spares = list(spares)
        self.actors: list = list(spares)  # killed with the group, should its start fail
        self.envs: list[dict[str, str]] = []  # each rank's Paddle environment
        self.places: list[RankPlace] = []
        self.pids: list[int] = []
        self.fixes: list[str] = []  # the Paddle fixes the ranks applied
        self._pg: PlacementGroup | None = None
        self._owns_pg = False
        self._bundles: list[int] = []
        self.nodes: list[str] = []  # each rank's Ray node id
        self.adopted: list[int] = []  # the ranks that were spares
        self.prefix = ""  # of the actors' names
        self._alive = False
        self._why = "the rank group is shut down (after shutdown() or a rank failure)"
        self._let_go = False
        self._on_shutdown: list = []
        self._on_death: list = []
        self._on_failure: list = []
        self._default_watch: Watch | None = None
        self._started = False  # placed, joined and set up
        if adopt is None:
            self._start()
        else:
            self._adopt(*adopt)

    # -- start -----------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        port = cfg.placement.master_port
        for attempt in range(3):
            try:
                self._place()
                self._spawn()
                self._rendezvous(port)
                self._started = True
                return
            except RankError as e:
                # A master port taken between our check and Paddle's bind
                # aborts rank 0 (a libuv assertion): start over on a new port.
                if not (e.rank == 0 and e.died and e.during == "setup" and attempt < 2):
                    raise
                log.warning("rank 0 died while opening the master port; retrying on another port")
                port = None
            except BaseException:
                self.shutdown()
                raise

    def _adopt(self, actors: list, pg) -> None:
        self.actors, self._pg, self._owns_pg = list(actors), pg, True
        self._bundles = list(range(len(actors)))
        self.prefix = self.config.name or ""
        self._alive = self._started = True
        placed = self.call(Member.place, during="attach")
        self.places = [p for p, _ in placed]
        self.pids = [pid for _, pid in placed]
        self.nodes = [p.node_id for p in self.places]

    def _place(self) -> None:
        """The placement group and bundles of the ranks: a new group of our own, or, when
        this runs inside a placement group (a Ray Tune trial, say), that group's last bundles."""
        cfg = self.config
        current = get_current_placement_group()
        if current is None or self._spares or cfg.detached:  # a detached group outlives any caller's
            missing = cfg.num_workers - len(self._spares)
            self._owns_pg, self._bundles = True, list(range(missing))
            if missing:
                pg = self._pg = placement_group([cfg.bundle()] * missing, strategy=cfg.placement.placement_strategy,
                                                lifetime="detached" if cfg.detached else None)  # fmt: skip
                wait_placed(pg, cfg.bundle(), missing, cfg.placement.placement_timeout_s)
            return
        self._pg, self._owns_pg = current, False
        bundles = placement_group_table(current)["bundles"]
        mine = sorted(bundles)[-cfg.num_workers:] if len(bundles) > cfg.num_workers else []
        short = [b for b in mine if any(bundles[b].get(k, 0.0) < v for k, v in cfg.bundle().items())]
        if not mine or short:
            raise ValueError(
                f"this runs inside a placement group of {len(bundles)} bundles ({list(bundles.values())}); "
                f"raydist puts its {cfg.num_workers} ranks in the last {cfg.num_workers}, each holding "
                f"{cfg.bundle()}, after the caller's own: e.g. tune.PlacementGroupFactory([{{'CPU': 1}}] + "
                f"[{cfg.bundle()}] * {cfg.num_workers})"
            )
        self._bundles = mine

    def _spawn(self) -> None:
        """Start one actor per rank (or adopt a spare), ranks ordered by node (the driver's
        first), then spares before bundles."""
        cfg = self.config
        self._alive = True
        nodes, placed = {}, {}  # ("spare", index) or ("bundle", index) -> node, and -> (place, pid)
        if self._spares:
            placed = dict(zip((("spare", i) for i in range(len(self._spares))),
                              self.gather(call_on(self._spares, Member.place), "placement")))  # fmt: skip
            nodes.update({k: p.node_id for k, (p, _) in placed.items()})
        if self._bundles:
            bundle_nodes = placement_group_table(self._pg)["bundles_to_node_id"]
            nodes.update({("bundle", b): bundle_nodes[b] for b in self._bundles})
        here = ray.get_runtime_context().get_node_id()
        order = sorted(nodes, key=lambda k: (nodes[k] != here, nodes[k], k))
        self.nodes = [nodes[k] for k in order]
        self.prefix = cfg.name or f"raydist-{uuid.uuid4().hex[:6]}"
        spares, self.actors = self.actors, []
        for rank, (kind, i) in enumerate(order):
            self.actors.append(spares[i] if kind == "spare" else start_actor(
                cfg, f"{self.prefix}-rank-{rank}", rank, cfg.num_workers,
                PlacementGroupSchedulingStrategy(self._bundles_of(), placement_group_bundle_index=i)))  # fmt: skip
        self.adopted = [rank for rank, (kind, _) in enumerate(order) if kind == "spare"]
        new = [(rank, k) for rank, k in enumerate(order) if k not in placed]
        placed.update(zip((k for _, k in new), self.call(Member.place, ranks=[r for r, _ in new],
                                                         during="placement")))  # fmt: skip
        self.places = [placed[k][0] for k in order]
        self.pids = [placed[k][1] for k in order]

    def _rendezvous(self, port: int | None) -> None:
        if port is not None and not self.call(Member.port_is_free, port, ranks=[0], during="rendezvous")[0]:
            log.warning("master port %s is taken on rank 0's node; using a free one", port)
            port = None
        if port is None:
            port = self.call(Member.free_port, ranks=[0], during="rendezvous")[0]
        own_ports = self.call(Member.free_port, during="rendezvous")
        endpoints = [f"{p.node_ip}:{q}" for p, q in zip(self.places, own_ports)]
        master = f"{self.places[0].node_ip}:{port}"
        cfg = self.config
        self.envs = [paddle_env(r, self.places, endpoints, master, use_gpu=cfg.use_gpu, paddle_logs=cfg.paddle_logs)
                     for r in range(len(self))]  # fmt: skip
        if issubclass(cfg.actor_class, RankActor):
            timeout = cfg.dispatch.step_timeout_s
            setups = {r: (env, cfg.use_gpu, timeout, self.prefix) for r, env in enumerate(self.envs)}
            self.fixes = self.call_each(RankActor.setup, setups, during="setup")[0]

    # -- results and failures ------------------------------------------------------

    def __len__(self) -> int:
        return self.config.num_workers

    @property
    def alive(self) -> bool:
        return self._alive

    def check_alive(self) -> None:
        if not self._alive:
            raise GroupShutdownError(self._why)

    def call(self, method: Endpoint, *args: Any, ranks: Sequence[int] | None = None, during: str | None = None,
             watch: Watch | None = None, num_returns: int | None = None) -> list:
        """``method`` (a `RankActor` or `Member` function, e.g. ``RankActor.state_meta``) on every
        rank, or ``ranks``, with ``args``: each rank's result, in order, waited for as `gather` waits
        (``during``: what the ranks were doing, for the error; default the method's name)."""
        ranks = list(range(len(self.actors))) if ranks is None else list(ranks)
        refs = call_on([self.actors[r] for r in ranks], method, *args, num_returns=num_returns)
        return self.gather(refs, during or method.__name__, ranks, watch=watch)

    def call_each(self, method: Endpoint, args: dict[int, tuple], during: str | None = None,
                  watch: Watch | None = None) -> list:  # fmt: skip
        """``method`` on the ranks of ``args``, each with its own arguments: their results, as `call`."""
        refs = call_each_on([self.actors[r] for r in args], method, list(args.values()))
        return self.gather(refs, during or method.__name__, list(args), watch=watch)

    def tell(self, method: Endpoint, *args: Any, ranks: Sequence[int] | None = None) -> None:
        """``method`` on every rank, or ``ranks``, without waiting: its failures reach the calls after."""
        call_on([self.actors[r] for r in (range(len(self.actors)) if ranks is None else ranks)], method, *args)

    def gather(self, refs: Sequence, during: str, ranks: Sequence[int] | None = None,
               watch: Watch | None = None, steps: range | None = None, later: Sequence[Sequence] = ()) -> list:
        """Results of ``refs`` (one per rank in ``ranks``, default all, in order; ``steps``:
        the steps they run, if they are a message's; ``later``: the refs of the messages sent
        after it, whose failed steps also say where a rank died).

        - A call every rank refused (`UsageError`: the caller's mistake, nothing
          changed on the ranks) raises that `UsageError`; the group stays.
        - Any other failure, of any kind (a rank's exception, its death, a
          lost object, Ray's own errors), tears the group down and raises
          `RankError` naming the rank, the original error as its cause.
          ``ray.get`` of several refs raises as soon as one failed, so this
          never waits on a rank blocked because a peer failed.
        - A rank hung for longer than ``watch`` allows (`raydist.driver.cluster.hangs`):
          `RankError` naming it; torn down.
        """
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        watch = watch or self._watch()
        try:
            if watch is None:
                return ray.get(list(refs))
            return watch.wait(lambda timeout: ray.get(list(refs), timeout=timeout), during)
        except RankError:
            raise
        except Exception as e:
            if refused(e):
                refusal = self._refusal(refs)
                if refusal is not None:
                    raise refusal from None
            sent = [*refs, *(r for out in later for r in out)] if steps is not None else []
            raise self.fail(e, during, ranks[0] if len(ranks) == 1 else -1, steps, sent) from e

    def _watch(self) -> Watch | None:
        """The limit on any call to the ranks (``step_timeout_s``; None: none), for the calls made
        without a client's: a rank that stops answering is found as in a step, whatever it was asked."""
        if not self._started:  # a rank that starts (its process, Paddle's import) answers no ping yet
            return None
        if self._default_watch is None and self.config.dispatch.step_timeout_s is not None:

            self._default_watch = Watch(self, self.config.dispatch.step_timeout_s)
        return self._default_watch

    def _refusal(self, refs: Sequence) -> UsageError | None:
        """The `UsageError` every rank refused a call with; None if some did not refuse in time."""
        ready, busy = ray.wait(list(refs), num_returns=len(refs), timeout=REFUSAL_GRACE_S)
        if busy:
            return None
        refusals = []
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - sorted just below
                if refused(e):
                    refusals.append(e.cause)  # type: ignore[attr-defined]  # refused(e): it has one
                    continue
            return None  # this rank succeeded, or failed otherwise: the ranks disagree
        return UsageError(refusals[0].message)

    def timed_out(self, stuck: list[int], during: str, why: str) -> RankError:
        """Tear the group down after ranks ``stuck`` hung (``why``: how)."""
        self.shutdown()
        return self._failed(RankError(stuck[0] if stuck else -1, why, during=during))

    def fail(self, e: BaseException, during: str, rank: int = -1, steps: range | None = None,
             sent: Sequence = ()) -> RankError:  # fmt: skip
        """Tear the group down after ``e``; the error to raise, naming the root cause.

        A rank's death makes its peers' collectives fail too, sometimes before
        Ray reports the death: a dead rank, if any, is the one to name. When it
        died in a message's ``steps`` or a later one's, the step is the earliest
        one a survivor is in or broke off in (``sent``: the refs of those
        messages, whose failures say the step): the dead rank's peers wait for
        it there.
        """
        dead = self._dead_rank() if self._alive else None
        if dead is not None:
            failed = getattr(getattr(e, "cause", None), "step", None)  # a peer's step that broke off
            rank, e, running = dead
            # survivors that broke off are idle, and their answers in: a wait only when none runs
            running += [failed] if failed is not None else []
            running += steps_failed(sent, wait_s=0 if running else 0.2) if sent else []
            if steps is not None and running:
                during = f"step {min(running)}"
            for callback in self._on_death:
                try:
                    callback(self)
                except Exception:  # noqa: BLE001 - the failure is what gets reported
                    log.exception("raydist: reading the surviving ranks failed")
        elif self.rank_of(e) >= 0:
            rank = self.rank_of(e)
        self.shutdown()
        return self._failed(rank_error(e, rank, during))

    def _failed(self, error: RankError) -> RankError:
        for callback in self._on_failure:
            try:
                callback(self, error)
            except Exception:  # noqa: BLE001 - the failure is what gets reported
                log.exception("raydist: telling of a failure failed")
        return error

    def _dead_rank(self, timeout: float = DEATH_GRACE_S) -> tuple[int, Exception, list[int]] | None:
        """A dead rank, its death, and the numbers of the steps the live ranks run; None if none died."""
        answers = ping_all(self.actors, timeout)
        dead = next(((r, a) for r, a in enumerate(answers) if isinstance(a, ray.exceptions.RayActorError)), None)
        running = [a.step for a in answers if isinstance(a, Progress)]
        return None if dead is None else (*dead, running)

    def rank_of(self, e: BaseException) -> int:
        """Which rank a failure came from: `RankFailed` says; a death names its actor."""
        cause = getattr(e, "cause", None)
        if isinstance(cause, RankFailed):
            return cause.rank
        actor_id = getattr(e, "actor_id", None)
        if actor_id is not None:
            return next((r for r, place in enumerate(self.places) if place.actor_id == actor_id), -1)
        return -1

    def live_bundles(self) -> int:
        """How many of this group's own bundles are on nodes still alive and not draining (room it
        frees when it goes, for a group to come)."""
        if not self._owns_pg:
            return 0
        usable = alive_nodes() - set(draining_nodes())
        return sum(node in usable for node in self.nodes)

    # -- teardown --------------------------------------------------------------

    def on_death(self, callback) -> None:
        """Call ``callback(group)`` when a rank died, before the survivors are killed
        (to read what they hold)."""
        self._on_death.append(callback)

    def on_failure(self, callback) -> None:
        """Call ``callback(group, error)`` with the `RankError` each failure of the group becomes."""
        self._on_failure.append(callback)

    def on_shutdown(self, callback) -> None:
        """Call ``callback()`` once the ranks are killed (e.g. to close a compiled graph)."""
        self._on_shutdown.append(callback)

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The placement group the ranks are in (None for spares only)."""
        return self._pg

    def _bundles_of(self) -> PlacementGroup:
        """The placement group of the ranks that are no spares (placed before they start)."""
        if self._pg is None:
            raise RuntimeError("raydist: ranks to start and no placement group for them")
        return self._pg

    def let_go(self, why: str) -> None:
        """Stop using the ranks without stopping them (a detached model another driver took over);
        ``why``: what the calls that follow are told."""
        self._why = why
        self._alive = False
        self._on_shutdown = []
        self._let_go = True

    def shutdown(self) -> None:
        """Kill every rank and free the placement group (unless this driver let go of them). Idempotent."""
        self._alive = False
        if not ray.is_initialized() or self._let_go:
            return
        callbacks, self._on_shutdown = self._on_shutdown, []
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        if self._pg is not None and self._owns_pg:
            try:
                remove_placement_group(self._pg)
            except Exception:  # already removed
                pass
            self._pg = None
        for callback in callbacks:
            callback()
