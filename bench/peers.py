"""Peer memory and the replica check: what they cost per step, and what a lost node costs with them.

    python -m bench peers [--models gpt-mp2,gpt-pp2] [--steps 40] [--every 1,10,100] [--check 10]
                          [--rounds 3] [--idle-copies 0]
                          [--recovery-every 10] [--kill-after 15]

On a ``ray.cluster_utils.Cluster`` of real raylets on this machine: a 1-CPU head and three
worker nodes with one "rank" each, so the two ranks run on two nodes and a copy crosses
from one to the other (the third is room for a replacement).

- *cost*: one model, driver batches; each round runs ``--steps`` steps with peer memory
  off, then at each K of ``--every`` (a whole number of K-step intervals, at least one),
  then with the replica check every ``--check`` steps and no peer memory (switched on the
  live model between runs, so every run has the same ranks), rounds interleaved; the
  time per step and its ratio to "off" in the same round, medians over rounds.
- *recovery*: ``fit`` over a loader, and the node of the last rank removed after
  ``--kill-after`` steps (the loop waits there while it goes): with
  ``peer_memory=--recovery-every`` and no checkpoint directory, then with a checkpoint
  every ``--recovery-every`` steps written in the background (raydist's default) and no
  peer memory. The time from the removal to the first step past those done before it
  (detection, a new group, the state, the steps computed again); of it, the restart's
  time and its state's part (the restart event's ``seconds`` and ``state_s``); the steps
  computed twice; whether the losses equal a run that lost nothing; and the driver's resident
  memory growth from the removal to the end of the run (sampled every 5 ms; its largest over
  the rounds) beside the model's whole state: the state moves rank to rank, not through it.
- *a copy alone* (``--idle-copies N``): after the rounds, N copies each after one step on
  the otherwise idle machine: the machine's CPU they take (all processes: the rank's copy
  and put, the raylets' transfer, the keeper), less a step's with peer memory off, and
  the wall time from the step's end to the copy kept. Medians.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time

import numpy as np

CLUSTER_NODES = 3


def _cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    # object stores of 1 GiB: a node holds its ranks' copies and the other node's (150 MiB by default here)
    nodes = [cluster.add_node(num_cpus=1, resources={"rank": 1}, object_store_memory=2**30) for _ in range(CLUSTER_NODES)]
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, nodes


def _configure(dm, every: int | None, check: int | None) -> None:
    """Peer memory every ``every`` steps and the replica check every ``check`` (None: off) on the live
    model, from its next step on (the bench switches them between runs of one model)."""
    import dataclasses

    from raydist import testing
    from raydist.driver.lifecycle.replicas import ReplicaCheck
    from raydist.messages import MirrorPlan

    dm.wait()
    life = testing.lifecycle(dm)
    life.config = dataclasses.replace(life.config, peer_memory=every, check_replicas=check)
    life.peer_memory = every
    if life.peers is not None:
        life.peers.every = every
    life.replicas = ReplicaCheck(check, warn=False) if check else None
    base = life.recovery.base + life.recovery.trained
    if every or check:
        life._mirror(base)
    else:
        group = testing.group(dm)
        group.gather([a.mirror.remote(MirrorPlan(None, 0, base)) for a in group.actors], "bench")


def _busy_s() -> float:
    """The machine's busy CPU seconds so far, every core (Linux's /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _idle_rate() -> float:
    """The idle machine's busy CPU seconds per second (Ray's own processes), a median of 5 looks."""
    idle = []
    for _ in range(5):
        c, t = _busy_s(), time.perf_counter()
        time.sleep(0.5)
        idle.append((_busy_s() - c) / (time.perf_counter() - t))
    return statistics.median(idle)


def _copy_cpu(dm, batches, repeats: int, rate: float, window_s: float = 1.0) -> float:
    """One copy's cost with the machine otherwise idle: the machine's CPU (ms) over ``window_s``
    from the start of one step whose copy follows, less that over the same window of one step with
    peer memory off (each less the idle machine's CPU); the median over ``repeats`` pairs,
    interleaved. The copy must be kept within the window (nothing polls the keepers in it)."""
    from raydist import testing

    life = testing.lifecycle(dm)
    cpu = []
    for i in range(repeats):
        excess = {}
        for every in (None, 1):
            _configure(dm, every, None)
            _timed(dm, batches[:2])  # a copy made on switching, and the first after it, out of the way
            time.sleep(window_s)  # and their transfers
            index = life.recovery.base + life.recovery.trained + 1
            c, t = _busy_s(), time.perf_counter()
            j = 2 + i % (len(batches) - 2)
            _timed(dm, batches[j : j + 1])
            time.sleep(max(0.0, window_s - (time.perf_counter() - t)))
            excess[every] = _busy_s() - c - rate * (time.perf_counter() - t)
            held = life.peers.copies() if every else {}
            if every and not any(k == index and len(r) == len(dm.ranks) for (_, k), r in held.items()):
                raise RuntimeError(f"the copy after step {index} was not kept within {window_s} s")
        cpu.append(excess[1] - excess[None])
    return statistics.median(cpu) * 1e3


class _BareRank:
    """Ray alone, the same bytes: a rank's copy (host copy, put) handed to a keeper as raydist's are."""

    def __init__(self, state):
        self.state = state

    def copy(self, keeper) -> None:
        import copy

        import ray

        ray.get(keeper.keep.remote([ray.put(copy.deepcopy(self.state))]))


class _BareKeeper:
    def keep(self, ref: list) -> None:
        import ray

        self.held = ray.get(ref[0])


def _bare_copy_cpu(dm, repeats: int, rate: float, window_s: float = 1.0) -> float:
    """The floor under `_copy_cpu`: the machine's CPU (ms) of the ranks' last copies (the very
    objects, read from the keepers) copied, put and handed to keepers on the same nodes by bare
    Ray actors, with nothing else running, less the idle machine's; the median of ``repeats``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import raydist
    from raydist import testing
    from raydist.driver.lifecycle.peers import PeerMemory, keeper_nodes

    peers = testing.lifecycle(dm).peers
    held = max((k, r) for k, r in peers.copies().items() if len(r) == len(dm.ranks))[1]
    nodes = [s.node_id for s in sorted(raydist.status(), key=lambda s: s.rank)]
    targets = keeper_nodes(nodes, [n["NodeID"] for n in ray.nodes() if n["Alive"]])

    def on(node):
        return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    ranks = [ray.remote(_BareRank).options(**on(n)).remote(PeerMemory.read(held[r])) for r, n in enumerate(nodes)]
    keepers = [ray.remote(_BareKeeper).options(**on(n)).remote() for n in targets]
    try:
        ray.get([r.copy.remote(k) for r, k in zip(ranks, keepers)])  # warm: the actors' first calls
        cpu = []
        for _ in range(repeats):
            time.sleep(window_s)
            c, t = _busy_s(), time.perf_counter()
            ray.get([r.copy.remote(k) for r, k in zip(ranks, keepers)])
            time.sleep(max(0.0, window_s - (time.perf_counter() - t)))
            cpu.append(_busy_s() - c - rate * (time.perf_counter() - t))
        return statistics.median(cpu) * 1e3
    finally:
        for actor in ranks + keepers:
            ray.kill(actor)


def _timed(dm, batches) -> float:
    start = time.perf_counter()
    for x, y in batches:
        dm(x, y)
    dm.wait()
    return (time.perf_counter() - start) / len(batches)


def cost_table(names: list[str], steps: int, everys: list[int], check: int, rounds: int, idle_copies: int = 0) -> str:
    import ray

    from bench import models
    from bench.common import raydist_model

    rows, copies = [], []
    cluster, _ = _cluster()
    try:
        for name in names:
            batches = models.data(name, max([steps, *everys]))
            configs = {"off": (None, None), **{f"peer_memory={k}": (k, None) for k in everys},
                       f"check_replicas={check}": (None, check)}  # fmt: skip
            dm = raydist_model(name, resources_per_rank={"CPU": 1, "rank": 1}, steps_per_message=1)
            try:
                _timed(dm, batches[:10])  # builds
                per: dict[str, list[float]] = {c: [] for c in configs}
                ratios: dict[str, list[float]] = {c: [] for c in configs}
                for _ in range(rounds):
                    round_ = {}
                    for config, (every, chk) in configs.items():
                        _configure(dm, every, chk)
                        _timed(dm, batches[:5])  # the first copy and its keeper out of the timed steps
                        # a whole number of copy intervals: the copies' share of the steps, no more, no less
                        n = steps if every is None else max(steps // every, 1) * every
                        round_[config] = _timed(dm, batches[:n])
                    for config, t in round_.items():
                        per[config].append(t)
                        ratios[config].append(t / round_["off"])
                for config in configs:
                    rows.append(f"| {name} | {config} | {statistics.median(per[config]) * 1e3:.2f} "
                                f"| {statistics.median(ratios[config]):.3f}x |")  # fmt: skip
                    print(rows[-1], flush=True)
                if idle_copies:
                    rate = _idle_rate()
                    cpu = _copy_cpu(dm, batches, idle_copies, rate)
                    bare = _bare_copy_cpu(dm, idle_copies, rate)
                    off = statistics.median(per["off"]) * 1e3
                    # with every core busy with the ranks' steps, a copy's CPU is taken from the steps
                    cores = os.cpu_count() or 1
                    copies.append(f"| {name} | {cpu:.0f} | {cpu / 10 / cores / off * 100:.1f} % | {bare:.0f} "
                                  f"| {bare / 10 / cores / off * 100:.1f} % |")  # fmt: skip
                    print(copies[-1], flush=True)
            finally:
                dm.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    header = "| model | configuration | time per step (ms) | ratio to off, same round |"
    table = [header, "|---|---|---:|---:|", *rows]
    if copies:
        table += ["", ("| model | one copy of every rank's state, the machine otherwise idle: the machine's CPU (ms) "
                       "| that CPU at K=10 shared by the cores, per step: % of a step with peer memory off "
                       "| the same bytes copied, put and kept by bare Ray actors: CPU (ms) | its % at K=10 |"),
                  "|---|---:|---:|---:|---:|", *copies]  # fmt: skip
    return "\n".join(table)


def _recovery_run(name: str, steps: int, every: int, kill_after: int, peer: bool) -> dict:
    import paddle
    import ray

    import raydist
    from bench import models
    from bench.common import RANK_ENV, raydist_model

    cluster, nodes = _cluster()
    try:
        b, kind = models.batch_size(name), models.MODELS[name][0]
        ds = ray.data.range(steps * b, override_num_blocks=4).map_batches(lambda x: models.rows(kind, x["id"]),
                                                                           runtime_env=RANK_ENV)
        loader = raydist.shard_dataloader(ds, models.mesh(name), input_keys=["x", "y"], shard_dims="dp",
                                          batch_size=b)  # fmt: skip
        dm = raydist_model(name, loader, resources_per_rank={"CPU": 1, "rank": 1}, max_in_flight=1,
                           steps_per_message=1, peer_memory=every if peer else None)  # fmt: skip
        where = {s.rank: s.node_id for s in raydist.status()}
        paused, go_on, times = threading.Event(), threading.Event(), {}
        done_before = []

        class Watch(paddle.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                done_before.append(step)
                if len(done_before) == kill_after and not paused.is_set():
                    paused.set()
                    go_on.wait()
                if paused.is_set() and "next" not in times and len(done_before) > kill_after \
                        and step >= kill_after:  # fmt: skip
                    times["next"] = time.monotonic()

        disk = {} if peer else dict(checkpoint_dir=tempfile.mkdtemp(prefix="rdpeer") + "/ck", checkpoint_every=every)
        run = {}
        fit = threading.Thread(target=lambda: run.update(losses=dm.fit(loader, epochs=1, max_failures=1,
                                                                        progress=False, callbacks=[Watch()], **disk)))
        fit.start()
        paused.wait()
        last = max(where)
        peak = _Peak()  # the driver's memory over the recovery: the state does not pass through it
        cluster.remove_node(next(n for n in nodes if n.node_id == where[last]))
        times["kill"] = time.monotonic()
        go_on.set()
        fit.join()
        grew = peak.stop()
        [restart] = [e for e in dm.events() if e["kind"] == "restart"]
        params = dm.state_dict("param")
        state_bytes = sum(a.nbytes for a in dm.state_dict("all").values())
        dm.shutdown()
        return {"recovery": times["next"] - times["kill"], "replayed": restart["replayed"],
                "source": restart["source"], "restart": restart["seconds"], "state": restart["state_s"],
                "losses": run["losses"], "params": params, "driver_peak": grew, "state_bytes": state_bytes}
    finally:
        ray.shutdown()
        cluster.shutdown()


class _Peak:
    """The driver process's resident memory, sampled every 5 ms from now to `stop`: its growth above now."""

    def __init__(self):
        import psutil

        self._process, self._stopped = psutil.Process(), threading.Event()
        self.base = self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stopped.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def stop(self) -> int:
        self._stopped.set()
        self._thread.join()
        return self.peak - self.base


def recovery_table(names: list[str], steps: int, every: int, kill_after: int, rounds: int) -> str:
    from bench.reference import one_process

    rows = []
    for name in names:
        expected, _ = one_process(name, steps)
        runs = {True: [], False: []}
        for _ in range(rounds):
            for peer in (True, False):
                runs[peer].append(_recovery_run(name, steps, every, kill_after, peer))
        base = statistics.median(r["recovery"] for r in runs[False])
        for peer, label in ((True, f"peer memory every {every}"), (False, f"checkpoint every {every}, background")):
            done = runs[peer]
            same = all(np.allclose(r["losses"], expected, rtol=1e-5, atol=1e-6) for r in done)
            t = statistics.median(r["recovery"] for r in done)
            rows.append(f"| {name} | {label} | {done[0]['source']} | {t:.1f} | {base / t:.2f}x "
                        f"| {statistics.median(r['restart'] for r in done):.1f} "
                        f"| {statistics.median(r['state'] for r in done) * 1e3:.0f} "
                        f"| {statistics.median(r['replayed'] for r in done):.0f} | {'yes' if same else 'NO'} "
                        f"| {max(r['driver_peak'] for r in done) / 2**20:.1f} | {done[0]['state_bytes'] / 2**20:.1f} |")
            print(rows[-1], flush=True)
    header = ("| model | recovery from | restart's source | node removed to the next new step (s) | faster than "
              "the checkpoint | restart() (s) | of it, the state found and put in (ms) | steps computed twice "
              "| losses of one process | the driver's memory growth over the recovery, largest (MiB) "
              "| the model's state (MiB) |")
    return "\n".join([header, "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|", *rows])
