"""``DistModel.evaluate``: loss and metrics over every row of a loader or of batches, with Paddle's callbacks.

The steps run ahead of the loop as any calls do; each step's loss and metric
values are folded in as soon as they are known (in order), so evaluation keeps
the ranks as busy as training. The metrics are Paddle's ``Metric`` objects at
the driver: the ranks that hold the outputs compute each step's values
(``Metric.compute`` in the eval program), the driver updates and accumulates them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from ...data.loader import ShardDataloader
from ..model.inputs import leaves, to_array
from ..model.modes import Modes


def evaluate(call: Callable[..., Any], modes: Modes, metrics: Sequence[Any], data: Any, steps: int | None = None,
             callbacks: Any = None) -> dict[str, float]:  # fmt: skip
    """Evaluate with ``call`` (the model's ``__call__``); see `raydist.DistModel.evaluate`."""
    if not modes.has_loss:
        raise ValueError("evaluate needs a loss")
    loader = data if isinstance(data, ShardDataloader) else None
    batches = loader() if loader is not None else iter(data)
    previous = modes.mode
    modes.switch("eval")
    for metric in metrics:
        metric.reset()
    cbks = callback_list(callbacks)
    names = [name for metric in metrics for name in as_list(metric.name())]
    cbks.on_begin("eval", {"steps": len(loader) if loader is not None else None, "metrics": ["loss", *names]})
    total, rows = 0.0, 0
    pending: collections.deque[tuple[Any, int, int]] = collections.deque()  # (Loss, rows, step), in flight

    def fold(wait: bool) -> None:
        nonlocal total, rows
        while pending and (wait or pending[0][0].done):
            loss, n, step = pending.popleft()
            outcome = loss.outcome()
            total, rows = total + float(outcome) * n, rows + n
            for metric, values in zip(metrics, getattr(outcome, "metrics", [])):
                metric.update(*values)
            cbks.on_batch_end("eval", step, {"loss": float(outcome), "batch_size": n})

    try:
        for step, batch in enumerate(batches):
            if steps is not None and step >= steps:
                break
            args = list(batch.values()) if isinstance(batch, dict) else list(batch)
            n = loader.rows_at(step) if loader is not None else len(to_array(next(leaves(args))))
            cbks.on_batch_begin("eval", step, {})
            pending.append((call(*args), n, step))
            fold(wait=False)
        fold(wait=True)
    finally:
        if previous != "eval":
            modes.switch(previous)
    if not rows:
        raise ValueError("evaluate: the data held no batch")
    result = {"loss": total / rows}
    for metric in metrics:
        names, values = as_list(metric.name()), as_list(metric.accumulate())
        result.update((name, float(value)) for name, value in zip(names, values))
    cbks.on_end("eval", dict(result))
    return result


def callback_list(callbacks: Any) -> Any:
    """Paddle's CallbackList of ``callbacks`` (a list of Callback objects, or a CallbackList)."""
    from paddle.hapi.callbacks import CallbackList

    return callbacks if isinstance(callbacks, CallbackList) else CallbackList(list(callbacks or []))


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
