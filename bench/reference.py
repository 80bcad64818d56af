"""The reference every runner is held to: the benchmark model trained in ONE plain process.

    python -m bench.reference NAME STEPS

Builds the model unsharded (`bench.models.plain_layer`), trains it in dygraph with the same
optimizer on the same global batches, and prints the losses as JSON.
"""

from __future__ import annotations

import json
import sys


def adamw(params):
    """The optimizer of every benchmark run."""
    import paddle

    return paddle.optimizer.AdamW(1e-3, parameters=params)


def one_process(name: str, steps: int, optimizer=adamw) -> tuple[list[float], dict]:
    """``steps`` steps of ``name`` in this process: the losses and the final parameters (numpy)."""
    import paddle

    from bench import models

    layer = models.plain_layer(name)
    opt, loss_fn, losses = optimizer(layer.parameters()), models.loss(name), []
    for x, y in models.data(name, steps):
        loss = loss_fn(layer(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {k: v.numpy() for k, v in layer.state_dict().items()}


def main(name: str, steps: int) -> None:
    print("RESULT " + json.dumps({"losses": one_process(name, steps)[0]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
