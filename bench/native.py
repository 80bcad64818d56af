"""One rank of the *native* runner: plain multi-process Paddle, as `paddle.distributed.launch` runs it.

Started by bench/common.py once per rank with launch's environment. Builds Paddle's
own DistModel over Paddle's own ``shard_dataloader`` (a ``paddle.io.DataLoader``
of the benchmark rows), with raydist.compat applied since plain Paddle cannot
run on CPU: the comparison measures what the orchestration costs. Prints the
rank's step times, data waits, CPU time of the timed steps, losses, first-step time and peak memory as JSON.
"""

import json
import os
import resource
import sys
import time


HELD = 32  # batches the "batches" feed holds


def main(name: str, warmup: int, steps: int, feed: str = "loader", chunked: bool = False, eager: bool = False) -> None:
    """``feed``: "loader" (Paddle's shard_dataloader over a paddle.io.DataLoader, what a native
    user runs), "ideal" (the first batch, fed again at every step: no data cost at all) or
    "batches" (`HELD` of the loader's batches, read beforehand and fed in turn: no loader at
    step time, but each step's batch is another one, as in any real loop, and not in the cache).
    ``chunked``: after the warm-up, N steps at each line "N" on stdin (bench/paired.py); the
    loader's data is then ``warmup + steps`` batches, epoch after epoch. ``eager``: no DistModel, the
    layer run eagerly on the loader's dist tensors (``loss.backward()``, ``optimizer.step()``)."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from bench import models
    from bench.common import machine_cpu
    from raydist import compat
    from raydist.compat import executor as compat_executor

    compat.apply(use_gpu=False)
    dist.init_parallel_env()
    b = models.batch_size(name)
    data = models.rows(models.MODELS[name][0], np.arange((warmup + steps) * b))
    dataset = paddle.io.TensorDataset([paddle.to_tensor(data["x"]), paddle.to_tensor(data["y"])])
    loader = dist.shard_dataloader(paddle.io.DataLoader(dataset, batch_size=b, drop_last=True),
                                   meshes=models.mesh(name), shard_dims="dp")  # fmt: skip
    layer = models.build_layer(name)
    optimizer = paddle.optimizer.AdamW(1e-3, parameters=layer.parameters())
    if eager:
        loss_fn = models.loss(name)

        def dm(x, y):
            loss = loss_fn(layer(x), y)
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            return loss._local_value()  # the rank's own value, read as static's fetch is
    else:
        dm = dist.to_static(layer, loader, models.loss(name), optimizer)
        dm.train()
    times, waits, losses, first = [], [], [], None
    progress = os.environ.get("RAYDIST_BENCH_PROGRESS") == "1"
    it = (batch for _ in iter(int, 1) for batch in loader())  # epoch after epoch: chunks run on and on
    first_batch = next(it)
    held = [next(it) for _ in range(HELD)] if feed == "batches" else []

    def step(i: int) -> tuple[float, float]:
        """Step ``i``: its wait for data and its whole time."""
        t = time.perf_counter()
        if feed == "ideal" or i == 0:
            x, y = first_batch
        else:
            x, y = held[i % HELD] if held else next(it)
        got = time.perf_counter()
        losses.append(float(dm(x, y)))
        if i == 0 and not eager:  # built: raydist.compat.executor keys it once, as raydist's ranks do
            for program in dm._engine._pir_dense_main_progs.values():
                compat_executor.freeze(program)
        return got - t, time.perf_counter() - t

    if chunked:  # bench/paired.py: after the warm-up, a line "N" on stdin runs N steps, until stdin closes
        for i in range(warmup):
            step(i)
        print("READY", flush=True)
        i = warmup
        for line in sys.stdin:
            for _ in range(int(line)):
                step(i)
                i += 1
            print("CHUNK", flush=True)
        return
    cpu, machine = time.process_time(), machine_cpu()
    for i in range(warmup + steps):
        wait, took = step(i)
        first = first or time.time()  # wall clock: the launcher subtracts its start time
        if i == warmup - 1:
            cpu, machine = time.process_time(), machine_cpu()
        if i >= warmup:
            times.append(took)
            waits.append(wait)
        if progress and i % 100 == 0:  # for bench/profile.py
            print(f"STEP {i} {time.time()}", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"times": times, "waits": waits, "first_step_at": first, "losses": losses, "peak_mib": peak,
              "cpu_s": time.process_time() - cpu, "machine": [machine, machine_cpu()]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5], chunked="--chunked" in sys.argv,
         eager="--eager" in sys.argv)
