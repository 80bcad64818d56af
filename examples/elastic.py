"""Elastic training: dp x mp2 on 2 to 4 ranks, through node losses and joins.

    python examples/elastic.py                       # a local Ray: 4 ranks
    ray job submit --address http://localhost:8265 --working-dir examples \\
        -- python elastic.py --gpu --checkpoints s3://bucket/run-1

The layer builds its mesh from the world it finds, so the model runs at any even
size from 2 to 4 ranks. The loader is made with the mesh of the largest size; at
every size the global batch holds the same rows, so the numbers do not depend on
the size. A lost node costs the steps since the last checkpoint and training goes
on with the ranks that remain; when a node that fits joins, the model grows back
at the next step boundary, its state moved from the live ranks.
"""

import argparse
import os
import tempfile

import numpy as np
import paddle
import paddle.distributed as dist
import ray

import raydist
from quickstart import IN, OUT, MLP


def build_layer():
    """Runs on every rank: a dp x mp2 mesh over however many ranks there are now."""
    ranks = np.arange(dist.get_world_size()).reshape(-1, 2).tolist()
    return MLP(dist.ProcessMesh(ranks, dim_names=["dp", "mp"]))


def rows(batch: dict) -> dict:
    """A regression task made from row ids (the same rows wherever they are made): y = sin(x @ w)."""
    w = np.random.RandomState(0).randn(IN, OUT).astype("float32") / 6
    x = np.sin(np.outer(batch["id"] + 1, np.arange(1, IN + 1)) * 0.37).astype("float32")
    return {"x": x, "y": np.sin(x @ w)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="one GPU per rank, NCCL")
    parser.add_argument("--checkpoints", default=None, help="a new directory or URI (default: a temporary one)")
    parser.add_argument("--epochs", type=int, default=int(os.environ.get("ELASTIC_EPOCHS", 3)))
    args = parser.parse_args()

    if "RAY_ADDRESS" not in os.environ:  # a local Ray: room for 4 ranks and the loader's Ray Data tasks
        ray.init(num_cpus=max(6, os.cpu_count() or 1))
    dataset = ray.data.range(32 * 64, override_num_blocks=8).map_batches(rows)  # 64 steps of a global batch of 32
    largest = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    loader = raydist.shard_dataloader(dataset, largest, input_keys=["x", "y"], shard_dims="dp", batch_size=32,
                                      shuffle=True, seed=0)  # fmt: skip
    with raydist.to_static(
        build_layer,
        loader,
        paddle.nn.MSELoss(),
        lambda params: paddle.optimizer.AdamW(1e-2, parameters=params),
        num_workers=(2, 4),  # as many as the cluster holds now, 2 at least
        use_gpu=args.gpu,
    ) as dm:
        print(f"training on {dm.num_workers} ranks")
        history = dm.fit(loader, epochs=args.epochs, checkpoint_every=16, max_failures=3,
                         checkpoint_dir=args.checkpoints or tempfile.mkdtemp(prefix="raydist-elastic-"))  # fmt: skip
        print(f"{len(history)} steps, last loss {history[-1]:.4f}, on {dm.num_workers} ranks at the end")


if __name__ == "__main__":
    main()
