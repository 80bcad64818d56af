"""Lost and joining nodes: how long training stops, and how many steps it loses.

    python -m bench elastic [--models mlp-dp2xmp2,gpt-dp2xmp2] [--steps 24] [--repeat N]

On a ``ray.cluster_utils.Cluster`` of real raylets on this machine (a 1-CPU head
and two worker nodes of 2 CPUs, with a "rank" resource only worker nodes have), each
model trains with ``fit`` (a checkpoint every 4 steps) and loses a worker node after
step 6 (the other node keeps a whole data-parallel group). Three runs, round-robin:

- *elastic*: ``num_workers=(2, 4)``: it goes on at 2 ranks from the state the
  surviving ranks hold; the node comes back after step 14 and the model grows to 4
  at a step boundary, the state moved from the live ranks;
- *fixed, survivors*: ``num_workers=4``: a replacement node joins right after the
  loss, and the model restarts at 4 ranks from the survivors' state;
- *fixed, checkpoint*: the same, from the last checkpoint (reading the survivors'
  state turned off), as before raydist read it;
- *elastic, notice*: ``num_workers=(2, 4)``, and the node is not lost without
  warning: Ray is told it will go (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
  --deadline-remaining-seconds 60``, what a spot preemption sends) and it is removed once
  no rank is left on it. The model moves off at a step boundary with the live state.

Reports the time from the node loss (or the notice) to the next completed step (at 2
ranks, for the notice), from the node's
join to the first step at 4 ranks, the steps lost per loss (steps run again), and
whether every loss equals that of a run that lost nothing, and how far the final
parameters are from its (AdamW, learning rate 1e-3).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np

LOSE_AFTER, JOIN_AFTER, CHECKPOINT_EVERY = 6, 14, 4


def _drain(address: str, node_id: str, deadline_s: int = 60) -> None:
    """Ray's preemption notice for a node (a hidden subcommand of Ray's CLI; the GCS's DrainNode)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", address, "--node-id",
                    node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "bench",
                    "--deadline-remaining-seconds", str(deadline_s)], check=True, capture_output=True)  # fmt: skip


def _run(name: str, steps: int, elastic: bool, chaos: bool, survivors: bool = True, notice: bool = False) -> dict:
    import paddle
    import paddle.distributed as dist
    import ray
    from ray.cluster_utils import Cluster

    import raydist
    from bench import models
    from bench.common import RANK_ENV

    from raydist.driver.lifecycle.lifecycle import Lifecycle

    salvage = Lifecycle._salvage
    if not survivors:
        Lifecycle._salvage = lambda self, group: None  # as before: every restart from the checkpoint
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=2, resources={"rank": 2}) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        b, kind = models.batch_size(name), models.MODELS[name][0]
        # not materialized: its blocks would come in the order its tasks end (the loader reads in order)
        ds = ray.data.range(steps * b, override_num_blocks=4).map_batches(lambda x: models.rows(kind, x["id"]),
                                                                           runtime_env=RANK_ENV)
        loader = raydist.shard_dataloader(ds, models.mesh(name), input_keys=["x", "y"],
                                          shard_dims="dp", batch_size=b)  # fmt: skip

        def build():
            ranks = np.arange(dist.get_world_size()).reshape(-1, 2).tolist()
            return models.build_layer(name, on=dist.ProcessMesh(ranks, dim_names=["dp", "mp"]))

        dm = raydist.to_static(build, loader, models.loss(name), lambda p: paddle.optimizer.AdamW(1e-3, parameters=p),
                               num_workers=(2, 4) if elastic else 4, runtime_env=RANK_ENV,
                               resources_per_rank={"CPU": 1, "rank": 1})  # fmt: skip
        ends: list[tuple[float, int]] = []  # (time, size) of every completed step, replays included
        events: dict[str, float] = {}

        class Chaos(paddle.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                ends.append((time.monotonic(), dm.num_workers))
                if not chaos:
                    return
                if notice and "lost" in events and "removed" not in events and dm.num_workers == 2:
                    cluster.remove_node(nodes[1])  # no rank is left on it: what the cloud does at the deadline
                    events["removed"] = time.monotonic()
                if len(ends) == LOSE_AFTER and "lost" not in events and notice:
                    events["lost"] = time.monotonic()
                    _drain(cluster.address, nodes[1].node_id)
                elif len(ends) == LOSE_AFTER and "lost" not in events:
                    cluster.remove_node(nodes[1])
                    events["lost"] = time.monotonic()
                    if not elastic:  # a replacement comes at once: the fixed-size run needs it
                        cluster.add_node(num_cpus=2, resources={"rank": 2})
                        events["joined"] = time.monotonic()
                if elastic and len(ends) == JOIN_AFTER and "joined" not in events:
                    cluster.add_node(num_cpus=2, resources={"rank": 2})
                    events["joined"] = time.monotonic()

        losses = dm.fit(loader, epochs=1, checkpoint_every=CHECKPOINT_EVERY, checkpoint_dir=tempfile.mkdtemp() + "/c",
                        max_failures=1, progress=False, callbacks=[Chaos()])  # fmt: skip
        params = dm.state_dict("param")
        dm.shutdown()
        out = {"params": params, "losses": losses, "lost_steps": len(ends) - len(losses)}
        if chaos:
            after = [t for t, n in ends if t > events["lost"] and (n == 2 or not notice)]
            out["loss_to_step"] = after[0] - events["lost"]
            out["join_to_larger"] = next(t for t, n in ends if t > events["joined"] and n == 4) - events["joined"]
        return out
    finally:
        Lifecycle._salvage = salvage
        ray.shutdown()
        cluster.shutdown()


KINDS = {  # label: (elastic, from the survivors' state, a preemption notice first)
    "elastic (2, 4): shrink, then grow": (True, True, False),
    "elastic (2, 4): preemption notice, move off, then grow": (True, True, True),
    "fixed 4: restart on a new node, survivors' state": (False, True, False),
    "fixed 4: restart on a new node, last checkpoint": (False, False, False),
}


def elastic_table(names: list[str], steps: int, repeat: int) -> str:
    rows = []
    for name in names:
        undisturbed = _run(name, steps, elastic=True, chaos=False)
        runs: dict[str, list[dict]] = {label: [] for label in KINDS}
        for _ in range(repeat):
            for label, (elastic, survivors, notice) in KINDS.items():
                runs[label].append(_run(name, steps, elastic=elastic, chaos=True, survivors=survivors, notice=notice))
        for label, done in runs.items():
            same = all(np.allclose(r["losses"], undisturbed["losses"], rtol=1e-5) for r in done)
            # AdamW moves every parameter by about its learning rate whatever the gradient's size, so
            # float rounding (gloo's reduction order differs between clusters) shows in the parameters
            # whose gradients are near zero: reported as the largest difference, absolute
            drift = max(float(np.max(np.abs(r["params"][k] - v)))
                        for r in done for k, v in undisturbed["params"].items())  # fmt: skip
            join = statistics.median(r["join_to_larger"] for r in done)
            rows.append(f"| {name} | {label} | {statistics.median(r['loss_to_step'] for r in done):.1f} "
                        f"| {join:.1f} | {statistics.median(r['lost_steps'] for r in done):.0f} "
                        f"| {'yes' if same else 'NO'} | {drift:.1e} |")  # fmt: skip
            print(rows[-1], flush=True)
    header = ("| model | run | node loss (or notice) to next step (s) | node join to a step at 4 ranks (s) "
              "| steps lost per loss | every loss equals an undisturbed run's (rtol 1e-5) "
              "| parameters: largest difference to it |")
    return "\n".join([header, "|---|---|---:|---:|---:|---|---:|", *rows])
