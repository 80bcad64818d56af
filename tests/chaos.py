"""A fault soak: one run meets faults one after another, drawn by a seed from a catalogue, and must
end as one plain process.

    python -m bench chaos --minutes 30 --seed 7     (rounds until the time is up; bench/chaos.py)
    tests/test_chaos.py                             (one short seed in the suite)

A round is one case (`CASES`: dp2, mp2, dp2 x mp2, pp2 under 1F1B, sharding stage 3) in one loop
(`LOOPS`: ``fit``, or a plain loop of ``dm(x, y)`` that restarts itself). It runs on a
``ray.cluster_utils.Cluster`` of this machine: a 1-CPU head, and worker nodes of
``{"CPU": 2, "rank": 2}`` (the ranks ask for one "rank" each, so they live on worker nodes only
and a removed node takes its ranks with it), one node more than the ranks need. The driver is a
process of its own (`drive`), so that killing it is a fault too. This process (`soak_round`)
injects the faults, each once the run has gone on past the one before:

- ``kill``: one rank's process SIGKILLed;  ``kill2``: two ranks on different nodes at once;
- ``node``: the node of a rank removed (a new one joins);
- ``node_in_restart``: a rank killed, then, once the driver saw the failure, the node of another
  rank removed while the restart is under way (a new one joins);
- ``hang``: a rank's process SIGSTOPped;
- ``flip``: one bit of a parameter flipped on a rank (the replicas of a data-parallel case only);
- ``preempt``: Ray's preemption notice (``ray drain-node`` with a deadline) for the node of a rank,
  the node removed once the model left it, or once it saved (a new one joins);
- ``driver``: the driver SIGKILLed, and started again (``fit(resume=True)``; the plain loop loads
  its newest checkpoint).

What a user cares about is checked (`Round.problems`): the run ends without error; every
step's loss and the final parameters equal one plain process over the same global batches;
every fault was dealt with; a rank's or a node's loss (``kill``, ``kill2``, ``node``, ``hang``)
was served from the survivors or peer memory, never from disk or the start; a hang was found
within ``step_timeout_s`` + 5 s, a flipped bit within two replica checks; a preemption notice
moved the model off the node (the other nodes have room). `report` tells, by kind: faults
injected and survived, steps computed again, seconds to recover, disk reads.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
RAY = [sys.executable, "-m", "ray.scripts.scripts"]

KINDS = ("kill", "kill2", "node", "node_in_restart", "hang", "flip", "preempt", "driver")
LOOPS = ("fit", "plain")
STEP_TIMEOUT_S = 10.0  # the driver's step_timeout_s: how soon a hang must be found (+ 5 s)
CHECK_REPLICAS = 3  # a flipped bit must be found within two checks of it
PEER_MEMORY = 2
CHECKPOINT_EVERY = 16
DEAL_S = 240.0  # how long a fault may take to be dealt with before the round fails
BATCH = 8
# train steps a round runs per fault: the gap before it, and the steps the run makes while a fault
# is injected and dealt with (a drain or a new driver takes seconds; a step here, tens of ms)
STEPS_PER_FAULT = 40
NO_DISK = {"kill", "kill2", "node", "hang"}  # faults that survivors or peer memory always serve


@dataclasses.dataclass(frozen=True)
class Case:
    """A model on a mesh: ``build`` and ``loader_mesh`` name functions of this module (the ranks
    import it); ``shards``: the loader's data shards; ``replicas``: every parameter has a
    data-parallel replica (a flipped bit can be found)."""

    name: str
    workers: int
    shards: int
    replicas: bool
    pipeline: bool = False


CASES = {
    "dp2": Case("dp2", 2, 2, True),
    "mp2": Case("mp2", 2, 1, False),
    "dp2xmp2": Case("dp2xmp2", 4, 2, True),
    "pp2": Case("pp2", 2, 1, False, pipeline=True),
    "sharding3": Case("sharding3", 2, 2, False),
}


# -- the model of each case (imported by the ranks: module-level, pickled by reference) ---------------


def meshes(case: str):
    """The case's mesh (a pipeline's: its stages' meshes)."""
    import paddle.distributed as dist

    if case == "dp2" or case == "sharding3":
        return dist.ProcessMesh([0, 1], dim_names=["dp"])
    if case == "mp2":
        return dist.ProcessMesh([0, 1], dim_names=["mp"])
    if case == "dp2xmp2":
        return dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    return [dist.ProcessMesh([0], dim_names=["pp"]), dist.ProcessMesh([1], dim_names=["pp"])]


def build(case: str):
    """The case's layer, on its mesh (runs on every rank)."""
    from models import MLP, Chain

    return Chain(meshes(case), 2) if CASES[case].pipeline else MLP(meshes(case))


def optimizer(case: str):
    """AdamW (one process's `models.adamw`); sharded over "dp" at stage 3 for sharding3."""
    return functools.partial(_optimizer, case)


def _optimizer(case: str, params):
    import paddle.distributed as dist
    from models import adamw

    opt = adamw()(params)
    return dist.shard_optimizer(opt, dist.ShardingStage3("dp", meshes(case))) if case == "sharding3" else opt


def reference_net(case: str):
    from models import MLP, Chain

    return Chain(None, 2) if CASES[case].pipeline else MLP()


def flip_when_asked():
    """A rank's ``worker_process_setup_hook``: after each message it runs, if the file
    ``$CHAOS_DIR/flip-<rank>`` exists, it is taken (renamed, so one rank takes it once) and one
    low mantissa bit of the rank's first parameter flips in place, as silent corruption would;
    ``flipped-<rank>`` then holds the train steps it came after. (No Paddle import here.)"""
    from raydist.protocol import RankActor

    run = RankActor.run

    def run_then_flip(self, parcel):
        results = run(self, parcel)
        ask = Path(os.environ["CHAOS_DIR"]) / f"flip-{self.rank}"
        try:
            os.rename(ask, f"{ask}.taken")
        except FileNotFoundError:
            return results
        import numpy as np
        import paddle

        model = self.model
        engine = model.runner.model._engine
        program = engine._pir_dist_main_progs[engine._mode]
        tensors = program.state_dict("param", paddle.static.global_scope())
        name = sorted(tensors)[0]
        array = np.array(tensors[name])
        array.reshape(-1).view(np.uint32)[0] ^= 1 << 12
        tensors[name].set(array, paddle.CPUPlace())
        done = Path(os.environ["CHAOS_DIR"]) / f"flipped-{self.rank}"
        index = model.trained + getattr(model.mirror, "_offset", 0)  # the model's count (peer memory's)
        done.write_text(json.dumps({"trained": index, "name": name}))
        return results

    run_then_flip.__dict__.update(run.__dict__)  # its concurrency group
    RankActor.run = run_then_flip


# -- the driver: a process of its own --------------------------------------------------------------


def drive(spec: dict) -> None:
    """Train the case ``spec["case"]`` in ``spec["loop"]`` for ``spec["epochs"]`` epochs on the
    cluster at ``spec["address"]``, resuming from ``spec["dir"]``'s checkpoints; every event goes to
    ``events.jsonl`` (with the train steps at its time), the run's progress to ``progress.json``
    after every step, the losses and parameters to ``result.json`` and ``params.npz`` at the end."""
    import logging

    import numpy as np
    import paddle
    import ray

    import raydist
    from models import Rows, global_batches
    from raydist import checkpoint, testing

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(message)s")
    case, where = CASES[spec["case"]], Path(spec["dir"])
    ray.init(address=spec["address"], log_to_driver=False, logging_level="ERROR")
    rows = Rows(BATCH * spec["steps_per_epoch"], seed=spec["seed"])
    loader = raydist.shard_dataloader(rows, meshes(case.name), input_keys=["x", "y"],
                                      shard_dims="dp" if case.shards > 1 else None, batch_size=BATCH,
                                      shuffle=True, seed=3)  # fmt: skip
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    env = {"env_vars": {WORKER_PROCESS_SETUP_HOOK_ENV_VAR: "chaos.flip_when_asked", "CHAOS_DIR": str(where),
                        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}}  # fmt: skip
    dm = raydist.to_static(functools.partial(build, case.name), loader, paddle.nn.MSELoss(), optimizer(case.name),
                           strategy=_strategy(case), num_workers=case.workers,
                           resources_per_rank={"CPU": 1, "rank": 1}, placement_strategy="SPREAD",
                           peer_memory=PEER_MEMORY, check_replicas=CHECK_REPLICAS if case.replicas else None,
                           step_timeout_s=STEP_TIMEOUT_S, runtime_env=env)  # fmt: skip
    life = testing.lifecycle(dm)
    ticks, ranks, seen = [0], [[]], [None]

    def on_event(event: dict) -> None:
        with open(where / "events.jsonl", "a") as f:
            f.write(json.dumps({**event, "trained": life.trained(), "driver": os.getpid()}, default=str) + "\n")

    life.events.add_sink(on_event)

    def tick(trained: int, resumed: int | None = None) -> None:
        ticks[0] += 1
        events = dm.events()
        last = (len(events), events[-1]["time"] if events else None)
        if last != seen[0]:  # a new group, or its first step: where its ranks are
            try:
                ranks[0] = [[r.pid, r.node_id] for r in dm.ranks]
                seen[0] = last
            except raydist.RankError:  # the group failed since (a hung rank found by this very call): the
                pass                   # loop's next step raises it too, and restarts
        checkpoint.write_json(str(where / "progress.json"), {"driver": os.getpid(), "ticks": ticks[0], "trained": trained,
                                              "ranks": ranks[0], "time": time.time(), "resumed": resumed})

    ck = str(where / "ck")
    if spec["loop"] == "fit":
        found = raydist.latest_checkpoint(ck)
        resumed = found.steps if found is not None else 0

        class Progress(paddle.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                tick(life.trained(), resumed)

        losses = dm.fit(loader, epochs=spec["epochs"], checkpoint_every=CHECKPOINT_EVERY, checkpoint_dir=ck,
                        max_failures=1000, resume=True, progress=False, callbacks=[Progress()])  # fmt: skip
    else:
        batches = [b for epoch in range(spec["epochs"])
                   for b in zip(*global_batches(rows, BATCH, case.shards, epoch, True, 3))]  # fmt: skip
        losses = _plain_loop(dm, batches, ck, tick)
    checkpoint.write_json(str(where / "result.json"), {"losses": losses})
    np.savez(where / "params.npz", **dm.state_dict("param"))
    dm.shutdown()
    ray.shutdown()


def _strategy(case: Case):
    if not case.pipeline:
        return None
    import paddle.distributed as dist

    return dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 2}})


def _plain_loop(dm, batches: list, ck: str, tick) -> list[float]:
    """A user's own loop: a step at a time, a checkpoint every `CHECKPOINT_EVERY` steps (its losses in
    ``history-N.json`` beside), on a `RankError` ``restart()`` and on from where the state stands:
    the failed step (survivors, peer memory: their replay brought the state there), the
    checkpoint's step, or the start. A driver started again loads its newest checkpoint."""
    import raydist
    from raydist import checkpoint

    os.makedirs(ck, exist_ok=True)
    saved = checkpoint.complete(ck)
    i, losses, resumed = 0, [], 0
    if saved:
        dm.load(saved[-1])
        i = resumed = int(saved[-1].rsplit("-", 1)[1])
        losses = json.loads(Path(ck, f"history-{i}.json").read_text())
    def restarted() -> int:
        """After a failure: the step the state stands at (the model counts train steps from this
        driver's start), once ``restart()`` brought it back."""
        while True:
            try:
                dm.restart()
                break
            except raydist.RankError:  # a node lost while the ranks are placed: try again, from the same
                continue
        restart = [e for e in dm.events() if e["kind"] == "restart"][-1]
        if restart["source"] == "start" and restart["behind"] is None:  # the builders' state, no step replayed
            return 0
        return resumed + restart["trained"]  # (from the start, too, when its steps were replayed)

    while i < len(batches):
        try:
            loss = float(dm(*batches[i]))
        except raydist.RankError:
            i = restarted()
            del losses[i:]
            continue
        losses.append(loss)
        i += 1
        path = f"{ck}/step-{i:08d}"
        if i % CHECKPOINT_EVERY == 0 and i < len(batches) and not os.path.exists(path):  # (not again, after
            try:                                                                             # going back)
                dm.save(path)
                Path(ck, f"history-{i}.json").write_text(json.dumps(losses))
            except raydist.RankError:
                i = restarted()
                del losses[i:]
                continue
        tick(i, resumed)
    return losses


# -- the soak: this process injects the faults -------------------------------------------------------


@dataclasses.dataclass
class Fault:
    """One injected fault and what became of it."""

    kind: str
    at: float  # time.time() when injected
    trained: int  # the run's train steps then
    target: str = ""
    dealt: bool = False
    recovered_s: float | None = None  # from the fault to the run's next step after it was dealt with
    sources: list = dataclasses.field(default_factory=list)  # of the restarts it caused
    redone: int = 0  # steps computed again
    disk_reads: int = 0
    found_s: float | None = None  # a hang: from the stop to the failure naming the rank
    found_after: int | None = None  # a flip: train steps from the flip to the mismatch raised
    action: str | None = None  # a preemption notice: "move" or "checkpoint"
    note: str = ""


@dataclasses.dataclass
class Round:
    case: str
    loop: str
    seed: int
    faults: list[Fault]
    error: str = ""
    seconds: float = 0.0
    steps: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)


class Soak:
    """One round's cluster, driver and injections."""

    def __init__(self, case: Case, loop: str, seed: int, epochs: int, steps_per_epoch: int):
        from ray.cluster_utils import Cluster

        self.case, self.loop, self.seed = case, loop, seed
        self.rng = random.Random(f"{seed}/{case.name}/{loop}")
        self.dir = Path(tempfile.mkdtemp(prefix=f"chaos-{case.name}-{loop}-"))
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        # a Ray temp dir of its own (short: Ray's socket paths), so no other Ray on the machine meets it
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rdk", dir="/tmp")
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        self.nodes = {}
        for _ in range(case.workers // 2 + 1):
            self.add_node()
        self.driver: subprocess.Popen | None = None
        self.drivers = 0

    def add_node(self) -> None:
        node = self.cluster.add_node(num_cpus=2, resources={"rank": 2})
        self.nodes[node.node_id] = node

    def remove_node(self, node_id: str) -> None:
        self.cluster.remove_node(self.nodes.pop(node_id))

    def start_driver(self) -> None:
        spec = {"case": self.case.name, "loop": self.loop, "dir": str(self.dir), "address": self.cluster.address,
                "epochs": self.epochs, "steps_per_epoch": self.steps_per_epoch, "seed": self.seed}  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), "RAY_AUTH_MODE": "disabled",
               "GLOG_minloglevel": "2"}  # fmt: skip
        env.pop("RAY_ADDRESS", None)
        self.drivers += 1
        log = open(self.dir / f"driver-{self.drivers}.log", "w")
        self.driver = subprocess.Popen([sys.executable, "-c", f"import chaos; chaos.drive({spec!r})"], env=env,
                                       stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip

    def stop(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            self.driver.kill()
            self.driver.wait()
        self.cluster.shutdown()

    # what the driver wrote
    def progress(self) -> dict:
        try:
            return json.loads((self.dir / "progress.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"ticks": 0, "trained": 0, "ranks": [], "driver": None, "time": 0}

    def events(self, since: float = 0.0) -> list[dict]:
        try:
            lines = (self.dir / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        events = [json.loads(line) for line in lines if line.strip()]
        return [e for e in events if e["time"] >= since]

    def log_tail(self, lines: int = 60) -> str:
        text = "".join(p.read_text() for p in sorted(self.dir.glob("driver-*.log")))
        return "\n".join(text.splitlines()[-lines:])

    def wait(self, what, timeout: float, why: str):
        """Until ``what()`` is true (its value); the driver's end or the timeout is an AssertionError."""
        deadline = time.monotonic() + timeout
        while True:
            value = what()
            if value:
                return value
            if self.driver.poll() is not None and self.driver.returncode != 0:
                raise AssertionError(f"the driver ended ({self.driver.returncode}) while waiting until {why}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not in {timeout:.0f} s: {why}")
            time.sleep(0.05)

    def live_ranks(self) -> list[tuple[int, int, str]]:
        """(rank, pid, node id) of the driver's last group, as it last reported it, every pid alive."""
        import psutil

        ranks = [(r, pid, node) for r, (pid, node) in enumerate(self.progress()["ranks"])]
        return ranks if ranks and all(psutil.pid_exists(pid) for _, pid, _ in ranks) else []

    def went_on(self, mark: dict, more: int = 2) -> float | None:
        """The time of the live driver's step ``more`` steps past its progress ``mark`` (a driver
        started since: its step ``more``); None: not yet."""
        p = self.progress()
        if p["driver"] != self.driver.pid:
            return None
        return p["time"] if p["ticks"] >= (mark["ticks"] if mark["driver"] == p["driver"] else 0) + more else None

    # -- the faults ------------------------------------------------------------------------------

    def inject(self, kind: str) -> Fault:
        ranks = self.live_ranks()
        fault = Fault(kind, time.time(), self.progress()["trained"])
        rank, pid, node = self.rng.choice(ranks)
        if kind in ("kill", "hang"):
            fault.target = f"rank {rank}"
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        elif kind == "kill2":
            other = self.rng.choice([r for r in ranks if r[2] != node] or [r for r in ranks if r[0] != rank])
            fault.target = f"ranks {rank} and {other[0]}"
            os.kill(pid, signal.SIGKILL)
            os.kill(other[1], signal.SIGKILL)
        elif kind == "node":
            fault.target = f"the node of rank {rank}"
            self.remove_node(node)
            self.add_node()
        elif kind == "node_in_restart":
            os.kill(pid, signal.SIGKILL)
            self.wait(lambda: [e for e in self.events(fault.at) if e["kind"] == "failure"], DEAL_S,
                      "the driver sees the killed rank")  # fmt: skip
            time.sleep(self.rng.uniform(0.0, 1.5))  # into the restart's placement, its build or its state
            others = sorted({n for _, _, n in ranks if n != node} & set(self.nodes)) or sorted(set(self.nodes))
            lost = self.rng.choice(others)
            fault.target = f"rank {rank}, then a node of the group during the restart"
            self.remove_node(lost)
            self.add_node()
        elif kind == "flip":
            replica = self.rng.randrange(len(ranks))
            fault.target = f"a bit of rank {replica}'s first parameter"
            (self.dir / f"flip-{replica}").write_text("")
        elif kind == "preempt":
            fault.target = f"the node of rank {rank}"
            subprocess.run([*RAY, "drain-node", "--address", self.cluster.address, "--node-id", node, "--reason",
                            "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "chaos", "--deadline-remaining-seconds",
                            "60"], check=True, capture_output=True, timeout=60)  # fmt: skip
            fault.note = node
        elif kind == "driver":
            fault.target = f"the driver (pid {self.driver.pid})"
            self.driver.kill()
            self.driver.wait()
            self.start_driver()
        return fault

    def deal(self, fault: Fault) -> None:
        """Until the run is past ``fault``: its restart (or move, or resumed driver) done and two steps
        run since; what it cost is noted on ``fault``."""
        kind, since = fault.kind, fault.at
        if kind == "preempt":
            drain = self.wait(lambda: [e for e in self.events(since) if e["kind"] == "drain"], DEAL_S,
                              "the model sees the preemption notice")[0]  # fmt: skip
            fault.action = drain.get("action")
            if fault.action == "move":
                self.wait(lambda: [e for e in self.events(since) if e["kind"] == "resize"], DEAL_S,
                          "the model moves off the draining node")  # fmt: skip
            elif self.loop == "fit":  # fit saves at a notice it cannot move off; a plain loop does not
                self.wait(lambda: [e for e in self.events(since) if e["kind"] == "checkpoint"], DEAL_S,
                          "the model saves at the notice")  # fmt: skip
            self.remove_node(fault.note)  # what the cloud does at the deadline
            self.add_node()
            if fault.action != "move":
                self.wait(lambda: [e for e in self.events(since) if e["kind"] == "restart"], DEAL_S,
                          "the model restarts after the node went")  # fmt: skip
        elif kind == "driver":
            self.wait(lambda: self.progress()["driver"] == self.driver.pid, DEAL_S, "the driver started again runs")
            fault.redone = max(0, fault.trained - (self.progress().get("resumed") or 0))
            fault.disk_reads = 1
        else:
            restarts = lambda: [e for e in self.events(since) if e["kind"] == "restart"]  # noqa: E731
            if kind == "flip":
                found = self.wait(lambda: [e for e in self.events(since) if e["kind"] == "replica_mismatch"], DEAL_S,
                                  "the replica check finds the flipped bit")[0]  # fmt: skip
                flipped = [json.loads(p.read_text()) for p in self.dir.glob("flipped-*")]
                if flipped:
                    fault.found_after = found["trained"] - flipped[0]["trained"]
                for p in self.dir.glob("flipped-*"):
                    p.unlink()
            self.wait(restarts, DEAL_S, f"the model restarts after the {kind}")
            if kind == "hang":
                failure = next(e for e in self.events(since) if e["kind"] == "failure")
                fault.found_s = failure["time"] - fault.at
        mark = self.progress()
        done = self.wait(lambda: self.went_on(mark) or self.driver.poll() == 0, DEAL_S,
                         f"the run goes on after the {kind}")  # fmt: skip
        fault.recovered_s = (done if done is not True else time.time()) - fault.at
        for e in self.events(since):
            if e["kind"] == "restart":
                fault.sources.append(e["source"])
                fault.redone += e.get("replayed") or 0
                fault.disk_reads += e["source"] == "checkpoint"
        fault.dealt = True


def soak_round(case_name: str, loop: str, seed: int, faults: int, epochs: int | None = None,
               steps_per_epoch: int = 24, gap: tuple[int, int] = (5, 12)) -> Round:  # fmt: skip
    """One round: ``faults`` faults of the kinds that apply, in a seeded order (each kind once
    before any twice), one every ``gap`` train steps, into ``loop`` training ``case_name`` for
    ``epochs`` (None: enough for the faults, `STEPS_PER_FAULT` each)."""
    case = CASES[case_name]
    epochs = epochs or -(-faults * STEPS_PER_FAULT // steps_per_epoch)
    kinds = [k for k in KINDS if k != "flip" or case.replicas]
    soak = Soak(case, loop, seed, epochs, steps_per_epoch)
    schedule: list[str] = []
    while len(schedule) < faults:
        cycle = kinds[:]
        soak.rng.shuffle(cycle)
        schedule += cycle
    total = epochs * steps_per_epoch
    result = Round(case_name, loop, seed, [])
    began = time.monotonic()
    try:
        soak.start_driver()
        for kind in schedule[:faults]:
            at = soak.progress()["trained"] + soak.rng.randint(*gap)
            if at >= total - (2 * CHECK_REPLICAS + 4):
                break  # too near the end for the fault to be found and dealt with
            soak.wait(lambda: soak.progress()["trained"] >= at and soak.live_ranks() or soak.driver.poll() == 0,
                      DEAL_S, f"step {at} before the {kind}")  # fmt: skip
            if soak.driver.poll() == 0:
                break
            fault = soak.inject(kind)
            result.faults.append(fault)
            soak.deal(fault)
        soak.driver.wait(timeout=DEAL_S * 2)
        if soak.driver.returncode != 0:
            raise AssertionError(f"the driver ended with {soak.driver.returncode}")
        result.steps = total
    except Exception as e:  # noqa: BLE001 - the round failed: said in its report, with the driver's log
        result.error = f"{type(e).__name__}: {e}\n{soak.log_tail()}"
    finally:
        result.seconds = time.monotonic() - began
        soak.stop()
    if not result.error:
        result.error = _compare(case, soak.dir, seed, epochs, steps_per_epoch)
    result.problems = problems(result)
    return result


def _compare(case: Case, where: Path, seed: int, epochs: int, steps_per_epoch: int) -> str:
    """Why the run's losses or parameters differ from one plain process ("" if they do not)."""
    import numpy as np

    from models import Reference, Rows, adamw, global_batches

    rows, ref = Rows(BATCH * steps_per_epoch, seed=seed), Reference(adamw(), net=reference_net(case.name))
    expected = [ref.train(x, y) for epoch in range(epochs)
                for x, y in zip(*global_batches(rows, BATCH, case.shards, epoch, True, 3))]  # fmt: skip
    losses = json.loads((where / "result.json").read_text())["losses"]
    if len(losses) != len(expected):
        return f"{len(losses)} losses, one process has {len(expected)}"
    bad = [i for i, (a, b) in enumerate(zip(losses, expected)) if not np.isclose(a, b, rtol=1e-5, atol=1e-6)]
    if bad:
        return f"the losses of steps {bad[:10]} differ from one process (first: {losses[bad[0]]} != {expected[bad[0]]})"
    params = np.load(where / "params.npz")
    for name, value in ref.params().items():
        if not np.allclose(params[name], value, rtol=1e-5, atol=1e-6):
            return f"parameter {name} differs from one process by {np.abs(params[name] - value).max():.3g}"
    return ""


def problems(result: Round) -> list[str]:
    """What went wrong for a user in ``result``: the run's error, and each fault not dealt with as promised."""
    found = [result.error.splitlines()[0]] if result.error else []
    for f in result.faults:
        what = f"{f.kind} ({f.target})"
        if not f.dealt:
            found.append(f"{what}: not dealt with")
            continue
        if f.kind in NO_DISK and any(s in ("checkpoint", "start") for s in f.sources):
            found.append(f"{what}: restarted from {f.sources} while survivors or peer memory held the state")
        elif "start" in f.sources and f.trained > CHECKPOINT_EVERY:
            found.append(f"{what}: restarted from the start after {f.trained} train steps (a checkpoint and copies existed)")
        if f.kind == "hang" and (f.found_s is None or f.found_s > STEP_TIMEOUT_S + 5):
            found.append(f"{what}: found after {f.found_s} s (step_timeout_s={STEP_TIMEOUT_S:g})")
        if f.kind == "flip" and (f.found_after is None or f.found_after > 2 * CHECK_REPLICAS):
            found.append(f"{what}: found {f.found_after} train steps after the flip (check_replicas={CHECK_REPLICAS})")
        if f.kind == "preempt" and f.action != "move":
            found.append(f"{what}: the model did not move off (action {f.action}) though the others had room")
    return found


def report(rounds: list[Round]) -> str:
    """A markdown table by kind of fault over ``rounds``, then each round's verdict."""
    faults = [f for r in rounds for f in r.faults]
    lines = ["| fault | injected | survived | steps computed again (median / max) | seconds to recover "
             "(median / max) | disk reads | state from |", "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for kind in KINDS:
        mine = [f for f in faults if f.kind == kind]
        if not mine:
            continue
        ok = [f for f in mine if f.dealt]
        redone = [f.redone for f in ok] or [0]
        secs = [f.recovered_s for f in ok if f.recovered_s is not None] or [0.0]
        sources = sorted({s for f in ok for s in f.sources} | ({"moved"} if any(f.action == "move" for f in ok)
                                                              else set()))  # fmt: skip
        lines.append(f"| {kind} | {len(mine)} | {len(ok)} | {statistics.median(redone):g} / {max(redone)} | "
                     f"{statistics.median(secs):.1f} / {max(secs):.1f} | {sum(f.disk_reads for f in ok)} | "
                     f"{', '.join(sources) or '-'} |")  # fmt: skip
    lines.append("")
    for r in rounds:
        verdict = "equal to one process, every fault survived" if not r.problems else "; ".join(r.problems)
        lines.append(f"- {r.case} in {r.loop}, seed {r.seed}: {len(r.faults)} faults over {r.steps} steps in "
                     f"{r.seconds:.0f} s: {verdict}")  # fmt: skip
    return "\n".join(lines)


def faults_list(result: Round) -> str:
    """Each fault of ``result``, one line each: what it was, when, and what became of it."""
    lines = []
    for f in result.faults:
        found = f", found in {f.found_s:.1f} s" if f.found_s is not None else \
            f", found {f.found_after} train steps after" if f.found_after is not None else ""  # fmt: skip
        lines.append(f"  {f.kind} at train step {f.trained} ({f.target}): {'dealt with' if f.dealt else 'NOT dealt with'}"
                     f", state from {f.sources or [f.action]}, {f.redone} steps again, "
                     f"{f.recovered_s or 0:.1f} s to the next steps{found}")  # fmt: skip
    return "\n".join(lines)
