"""A step's result from the ranks' answers: the loss (with eval's metric values) or the outputs.

The ranks send only what they hold of each fetched value (`raydist.topology.ModePlan`
says who holds what); here the pieces become whole values. A data-parallel loss is
reduced over the ranks once for all the steps of a message, so a step costs the
driver the same whatever the number of ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...topology import Layout, ModePlan
from ..dispatch.window import Evaluated


def combine(plan: ModePlan, mode: str, results: Any) -> Any:
    """Step results by rank (`raydist.driver.dispatch.client.StepAnswers`, or a list by rank) -> the step's
    result: the float loss, an `Evaluated` loss with metric values, or the outputs (predict)."""
    values = [_value(layout, results, i) for i, layout in enumerate(plan.layouts)]
    if mode == "predict":
        return values[0] if len(values) == 1 else values
    first = np.asarray(values[0])
    loss = float(first.reshape(-1)[0] if first.size == 1 else first.mean())  # gradient merge: the micro-batches' mean
    if len(plan.groups) < 2:
        return loss
    groups, start = [], 1
    for size in plan.groups[1:]:
        groups.append(values[start : start + size])
        start += size
    return Evaluated(loss, groups)


def _value(layout: Layout | None, results: Any, i: int) -> Any:
    """Value ``i`` of a step, whole, from the ranks' pieces."""
    if layout is None:
        raise RuntimeError(f"no rank holds value {i} of the step")
    op = layout.reduced_whole
    if op is not None and hasattr(results, "reduced"):
        value = results.reduced(i, layout.reader_tuple, op)
        if value is not None:
            return value
    return layout.assemble({r: results[r][i] for r in layout.reader_tuple})
