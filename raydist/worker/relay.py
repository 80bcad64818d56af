"""Messages relayed from rank to rank (`raydist.driver.dispatch.transport.TreeTransport`).

The driver sends each message to rank 0 only. Every rank passes it on to its
children in the tree (`raydist.driver.dispatch.transport.relay_tree`), runs its steps,
and `Relay.collect` sends the results of its subtree back up as one
`raydist.messages.RankAnswers`, so the driver's work per message does not grow
with the ranks. A failure below is passed up at once, even while this rank's
own step waits for the failed one in a collective.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import ray

from ..messages import INLINE_BYTES, Parcel, RankAnswers, StepResults

# How often a rank collecting a relayed message looks at its own steps while it waits for its children's.
POLL_S = 0.05


class Relay:
    """One rank's part of the relay tree: its children, and the messages it has relayed and not
    yet answered. ``run`` runs a message's steps on this rank (the actor's ``run`` endpoint)."""

    def __init__(self, rank: int, run: Callable[[Parcel], StepResults | None], children: list):
        self.rank = rank
        self.run = run
        self.children = list(children)
        self._relayed: dict[int, _Relayed] = {}  # by a message's first step
        self._lock = threading.Lock()

    def relay(self, first: int, payload: Parcel | list) -> None:
        """Pass the message on to the children, then run its steps. ``payload``: the parcel, or
        ``[ref]`` to it in the object store (passed on as a ref, not copied)."""
        parcel = payload if isinstance(payload, Parcel) else None
        refs = payload if isinstance(payload, list) else []
        if parcel is not None and self.children and parcel.nbytes > INLINE_BYTES:
            payload = refs = [ray.put(parcel)]  # the ranks below borrow it from this one, not from the driver
        for child in self.children:
            child.relay.remote(first, payload)  # in order, as every caller's calls to one actor
        relayed = self._record(first)
        try:
            relayed.results = self.run(parcel if parcel is not None else ray.get(refs[0]))
        except BaseException as e:  # noqa: BLE001 - `collect` raises it
            relayed.error = e
        finally:
            relayed.done.set()

    def collect(self, first: int) -> RankAnswers | None:
        """The results of the message that begins at step ``first``, of this rank and every rank
        below it that the driver reads, as one answer (None: no such rank). Raises the first
        failure below (a child's at once, even while this rank's own step waits for the failed one)."""
        pending = [child.collect.remote(first) for child in self.children]
        relayed = self._record(first)
        below: list[RankAnswers] = []
        while pending and relayed.error is None:
            # while this rank's own steps run, look at them now and then: a failure here would
            # leave the children waiting for this rank in a collective
            timeout = None if relayed.done.is_set() else POLL_S
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            below += [answers for answers in map(_result_below, ready) if answers is not None]
        relayed.done.wait()
        with self._lock:
            del self._relayed[first]
        if relayed.error is not None:
            raise relayed.error
        if relayed.results is not None:
            below.insert(0, RankAnswers.of(self.rank, relayed.results))
        return RankAnswers.merge(below) if below else None

    def _record(self, first: int) -> _Relayed:
        """The record of a relayed message, made by `relay` or `collect`, whichever comes first."""
        with self._lock:
            return self._relayed.setdefault(first, _Relayed())


class _Relayed:
    """A relayed message on one rank: this rank's results or failure once its steps ran."""

    __slots__ = ("results", "error", "done")

    def __init__(self):
        self.results: StepResults | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


def _result_below(ref: ray.ObjectRef) -> RankAnswers | None:
    """A child's ``collect`` result; its failure raised as the child raised it (a rank's
    `RankFailed` keeps naming that rank; a death stays a death, for the driver to find)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, BaseException):
            raise e.cause from None
        raise
