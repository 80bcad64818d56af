"""What a rank's failure becomes at the driver: a `RankError` naming the rank, from whatever Ray raised."""

from __future__ import annotations

import re
from collections.abc import Sequence

import ray

from ...errors import RankError, RankFailed, RankRefused


def steps_failed(refs: Sequence, wait_s: float = 0.2) -> list[int]:
    """The steps that the ranks of ``refs`` (a message's) said they failed in, within ``wait_s``."""
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s, fetch_local=False)
    found = []
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - only the step is wanted
            step = getattr(getattr(e, "cause", None), "step", None)
            if step is not None:
                found.append(step)
    return found


def refused(e: BaseException) -> bool:
    return isinstance(getattr(e, "cause", None), RankRefused)


def rank_error(e: BaseException, rank: int, during: str) -> RankError:
    if isinstance(e, ray.exceptions.RayActorError):
        return RankError(rank, str(e).strip() or type(e).__name__, died=True, during=during)
    cause = getattr(e, "cause", None)
    if isinstance(cause, RankFailed):
        return RankError(cause.rank, cause.traceback, during=during if cause.step is None else f"step {cause.step}")
    if isinstance(e, ray.exceptions.RayTaskError):
        return RankError(rank, task_traceback(e), during=during)
    return RankError(rank, f"{type(e).__name__}: {e}", during=during)


def task_traceback(e: ray.exceptions.RayTaskError) -> str:
    """The rank's traceback, as Python prints one (Ray's text, without colour codes)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", getattr(e, "traceback_str", None) or str(e)).strip()
    header, _, frames = text.partition("\n")
    if not header.startswith("ray::"):
        return text
    return f"{frames}" if frames.startswith("Traceback") else f"Traceback (most recent call last):\n{frames}"
