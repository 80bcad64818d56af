"""One rank of the *native* runner: plain multi-process Paddle, as `paddle.distributed.launch` runs it.

Started by bench/run.py once per rank with launch's environment. Builds Paddle's
own DistModel (raydist.compat applied, since plain Paddle cannot run it on
CPU: the comparison measures what the orchestration costs), feeds each step's
local batch as a dist tensor (as ``shard_dataloader`` does) and prints rank
0's step times as JSON.
"""

import json
import os
import sys
import time


def main(name: str, warmup: int, steps: int) -> None:
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.auto_parallel.static.dist_input_spec import DistributedInputSpec

    from raydist import compat

    from bench import models

    compat.apply(use_gpu=False)
    dist.init_parallel_env()
    rank = dist.get_rank()
    layer = models.build_layer(name)
    mesh = layer.fc1.weight.process_mesh
    place = [dist.Shard(0), dist.Replicate()]
    batches = models.data(name, warmup + steps)
    x0, y0 = batches[0]
    spec = [[DistributedInputSpec(list(x0.shape), "float32", "x", mesh=mesh, placements=place)],
            [DistributedInputSpec(list(y0.shape), "float32", "y", mesh=mesh, placements=place)]]  # fmt: skip
    dm = dist.to_static(layer, None, paddle.nn.MSELoss(),
                        paddle.optimizer.AdamW(1e-2, parameters=layer.parameters()), input_spec=spec)  # fmt: skip
    dm.train()
    dp = mesh.shape[0]
    coord = mesh.process_ids.index(rank) // mesh.shape[1]
    times, first = [], None
    for i, (x, y) in enumerate(batches):
        t = time.perf_counter()
        rows = slice(coord * len(x) // dp, (coord + 1) * len(x) // dp)
        xs = dist.auto_parallel.api.dtensor_from_local(paddle.to_tensor(x[rows]), mesh, place)
        ys = dist.auto_parallel.api.dtensor_from_local(paddle.to_tensor(y[rows]), mesh, place)
        loss = float(dm(xs, ys))
        done = time.perf_counter()
        first = first or time.time()  # wall clock: the launcher subtracts its start time
        if i >= warmup:
            times.append(done - t)
    if rank == 0:
        print("RESULT " + json.dumps({"times": times, "first_step_at": first, "loss": loss}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
