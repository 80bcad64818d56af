"""Peer memory and the replica check: what they cost per step, and what a lost node costs with them.

    python -m bench peers [--models gpt-mp2,gpt-pp2] [--steps 40] [--every 1,10,100] [--check 10]
                          [--rounds 3] [--recovery-every 10] [--kill-after 15]

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
  computed twice; and whether the losses equal a run that lost nothing.
"""

from __future__ import annotations

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


def _timed(dm, batches) -> float:
    start = time.perf_counter()
    for x, y in batches:
        dm(x, y)
    dm.wait()
    return (time.perf_counter() - start) / len(batches)


def cost_table(names: list[str], steps: int, everys: list[int], check: int, rounds: int) -> str:
    import ray

    from bench import models
    from bench.common import raydist_model

    rows = []
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
            finally:
                dm.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    header = "| model | configuration | time per step (ms) | ratio to off, same round |"
    return "\n".join([header, "|---|---|---:|---:|", *rows])


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
        cluster.remove_node(next(n for n in nodes if n.node_id == where[last]))
        times["kill"] = time.monotonic()
        go_on.set()
        fit.join()
        [restart] = [e for e in dm.events() if e["kind"] == "restart"]
        params = dm.state_dict("param")
        dm.shutdown()
        return {"recovery": times["next"] - times["kill"], "replayed": restart["replayed"],
                "source": restart["source"], "restart": restart["seconds"], "state": restart["state_s"],
                "losses": run["losses"], "params": params}
    finally:
        ray.shutdown()
        cluster.shutdown()


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
                        f"| {statistics.median(r['replayed'] for r in done):.0f} | {'yes' if same else 'NO'} |")
            print(rows[-1], flush=True)
    header = ("| model | recovery from | restart's source | node removed to the next new step (s) | faster than "
              "the checkpoint | restart() (s) | of it, the state found and put in (ms) | steps computed twice "
              "| losses of one process |")
    return "\n".join([header, "|---|---|---|---:|---:|---:|---:|---:|---|", *rows])
