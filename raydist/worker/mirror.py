"""A rank's peer memory: every K train steps a copy of its state, kept by a keeper on another node.

After train step ``index`` (counted over the model's life, ``index % every == 0``)
the rank copies its shards to host memory (`StaticRunner.state_dict`: the one part
on the step's path, as for a checkpoint saved in the background); a thread of its
own puts the copy in its node's object store and hands it to its keeper
(`raydist.driver.lifecycle.peers.Keeper`), which copies it into an object of its own
on its node, while the steps go on. The rank keeps its copy too, so a survivor of
a node's loss still has it when its keeper went with the node.

Which copy is complete everywhere: a rank waits for its copy of ``s`` to be kept
before it starts step ``s + every - 1`` (before that step's collectives); so once
any rank has run that step, every rank has kept ``s``, and with its copy of
``s + every`` a rank lets its keeper drop what is older than ``s`` (`kept`). A keeper
holds two copies per rank: the newest complete everywhere and the one being written;
with replica checks (``check_every``), also the newest at or before each of the last
three checks, since a mismatch goes back to the last check that passed, which a
mismatch raised within two checks of the corruption leaves at most three checks back.
And the newest at or before the start of the oldest message the driver may still have
in flight (``in_flight``): a message's steps complete, for the driver, only with its
answer, so after a death in a message of many steps the driver trusts no copy made
inside it (seen in the fault soak: every copy kept was newer than what it saw complete).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from typing import Any

import ray

from ..messages import MirrorPlan

log = logging.getLogger("raydist")


class Mirror:
    """One rank's copies: made after every ``every``-th train step, kept on its keeper."""

    def __init__(self, rank: int, plan: MirrorPlan, trained: int):
        if not plan.every:
            raise ValueError("a Mirror needs a plan with copies (plan.every)")
        self.rank, self.plan, self.every = rank, plan, plan.every
        self._offset = plan.base - trained  # the rank's train steps (since its build) -> the model's index
        self.local: dict[int, Any] = {}  # index -> this rank's own copy
        # where the last ``in_flight`` messages began (the model's train-step index)
        self._began: collections.deque[int] = collections.deque(maxlen=max(plan.in_flight, 1))
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raydist-mirror")

    def message_began(self, trained: int) -> None:
        """A message of train steps begins, the rank after ``trained`` train steps (since its build)."""
        self._began.append(self._offset + trained)

    def before_step(self, trained: int) -> None:
        """Before the rank's train step ``trained`` (since its build): wait for the last copy to be kept when this
        is the step before the next copy (see the module docstring)."""
        if self._pending is None:
            return
        index, future = self._pending
        every = self.every
        if self._offset + trained >= index - index % every + every - 1:  # the step that ends at the next copy
            self._pending = None
            future.result()

    def after_step(self, trained: int, state: Any) -> None:
        """After the rank's ``trained``-th train step (since its build): a copy of ``state()`` if it is time."""
        index = self._offset + trained
        if index % self.every == 0:
            self.copy(index, state)

    def copy(self, index: int, state: Any) -> None:
        """A copy of ``state()`` (the state after ``index`` train steps), handed to the keeper."""
        if self._pending is not None:  # every == 1: the copy before is kept before this one starts
            self._pending[1].result()
        copy = state()
        # this group's copy before is complete everywhere (every rank ran past its wait); the
        # group's first copy lets nothing go: an earlier group's may be the only complete one
        floor = self._began[0] if self._began else None
        keep = sorted(kept(self.local, self.plan.check_every, floor)) if self.local else None
        self.local = {i: c for i, c in self.local.items() if keep is not None and i in keep}
        self.local[index] = copy
        self._pending = (index, self._thread.submit(self._hand_over, index, copy, keep))

    def _hand_over(self, index: int, copy: Any, keep: list[int] | None) -> None:
        plan = self.plan
        try:
            ray.get(plan.keeper.keep.remote(plan.generation, self.rank, index, keep, [ray.put(copy)]))
        except ray.exceptions.RayError as e:  # its node is gone: the copy stays this rank's own; training goes on
            log.warning("raydist: rank %d: the keeper of its copy after %d train steps is gone (%s); the copy is "
                        "kept here only", self.rank, index, type(e).__name__)  # fmt: skip

    def copies(self) -> dict[int, Any]:
        """This rank's own copies, by index (to a driver after a peer died: the keeper may be gone)."""
        return dict(self.local)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def kept(indices: Any, check_every: int | None, floor: int | None = None) -> set[int]:
    """Of a rank's copies after ``indices`` train steps (the newest complete everywhere), the ones to
    keep: the newest; with replica checks every ``check_every`` steps, the newest at or before
    each of the last three checks (the last clean check, where a mismatch goes back to, is one of
    them: the mismatch is raised within two checks of the corruption); and the newest at or
    before ``floor`` (where the oldest message the driver may not have seen complete began)."""
    newest = max(indices)
    keep = {newest}
    points = [floor] if floor is not None else []
    if check_every:
        last = newest // check_every * check_every
        points += [last, last - check_every, last - 2 * check_every]
    for point in points:
        before = [i for i in indices if i <= point]
        if before:
            keep.add(max(before))
    return keep
