"""A plain Paddle training loop that resumes from its own latest checkpoint, as a Trainer script does:
dp2 in eager auto-parallel, AdamW, 8 steps, a checkpoint every 2 steps in argv[1] (each rank its own
files). When it is not a restart, after its first checkpoint: with argv[2] == "die", rank 1 kills itself;
with "hold", every rank says HOLDING and waits (for its node to be taken away)."""

import os
import signal
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist

dist.init_parallel_env()
rank, out = dist.get_rank(), sys.argv[1]
mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
paddle.seed(3)
layer = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 2))
for sub in (layer[0], layer[2]):
    sub.weight = dist.shard_tensor(sub.weight, mesh, [dist.Replicate()])
    sub.bias = dist.shard_tensor(sub.bias, mesh, [dist.Replicate()])
opt = paddle.optimizer.AdamW(1e-2, parameters=layer.parameters())
data = np.random.RandomState(0).randn(8, 8, 10).astype("float32")
start = 0
saved = sorted(int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("step-") and
               all(os.path.exists(os.path.join(out, d, f"done.{r}")) for r in range(2)))
if saved:
    start = saved[-1]
    state = paddle.load(os.path.join(out, f"step-{start}", f"rank{rank}.pdparams"))
    layer.set_state_dict(state["layer"])
    opt.set_state_dict(state["opt"])
    print(f"RESUMED {start} restart {os.environ['PADDLE_RESTART_COUNT']} of {os.environ['PADDLE_MAX_RESTART']}")
for step in range(start, 8):
    batch = paddle.to_tensor(data[step][rank * 4 : (rank + 1) * 4])
    x = dist.auto_parallel.api.dtensor_from_local(batch[:, :8], mesh, [dist.Shard(0)])
    y = dist.auto_parallel.api.dtensor_from_local(batch[:, 8:], mesh, [dist.Shard(0)])
    loss = paddle.nn.functional.mse_loss(layer(x), y)
    loss.backward()
    opt.step()
    opt.clear_grad()
    print(f"LOSS {step} {float(loss._local_value()):.8f}", flush=True)
    if (step + 1) % 2 == 0:
        where = os.path.join(out, f"step-{step + 1}")
        os.makedirs(where, exist_ok=True)
        paddle.save({"layer": layer.state_dict(), "opt": opt.state_dict()}, os.path.join(where, f"rank{rank}.pdparams"))
        open(os.path.join(where, f"done.{rank}"), "w").close()
        dist.barrier()
        first = os.environ["PADDLE_RESTART_COUNT"] == "0"
        if sys.argv[2:] == ["die"] and rank == 1 and first:
            os.kill(os.getpid(), signal.SIGKILL)
        if sys.argv[2:] == ["hold"] and first:
            print("HOLDING", flush=True)
            time.sleep(600)
print("FINAL", float(layer[0].weight._local_value().sum()))
