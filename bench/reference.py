"""The reference every runner is held to: the benchmark model trained in ONE plain process.

    python -m bench.reference NAME STEPS

Builds the model unsharded (the quickstart MLP, which always shards, on a
one-process mesh: its parameters start as on any mesh, since the layers are
made, then sharded), trains it in dygraph with the same optimizer on the same
global batches, and prints the losses as JSON.
"""

import json
import sys


def main(name: str, steps: int) -> None:
    import paddle
    import paddle.distributed as dist

    from bench import models

    if models.MODELS[name][0] == "mlp":  # the quickstart's MLP always shards: on one process
        layer = models.build_layer(name, dist.ProcessMesh([[0]], dim_names=models.MODELS[name][2]))
    elif models.MODELS[name][0] == "wide":
        layer = models.Wide(None)
    else:
        layer = models.GPT(None)
    optimizer = paddle.optimizer.AdamW(1e-3, parameters=layer.parameters())
    loss_fn = models.loss(name)
    losses = []
    for x, y in models.data(name, steps):
        loss = loss_fn(layer(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    print("RESULT " + json.dumps({"losses": losses}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
