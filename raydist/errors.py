"""Errors raydist raises at the driver."""

from __future__ import annotations

from typing import Any


class RankError(RuntimeError):
    """A rank failed: it raised, or its process died.

    Attributes:
        rank: the failing rank (0-based, Paddle's trainer id).
        cause: the rank's traceback as text, or what Ray knows of the death.
        died: True when the rank's process is gone (killed, crashed, OOM),
            False when it raised an exception and was then torn down.
    """

    def __init__(self, rank: int, cause: str, *, died: bool = False, during: str = ""):
        self.rank = rank
        self.cause = cause
        self.died = died
        self.during = during
        what = "process died" if died else "raised"
        where = f" during {during}" if during else ""
        super().__init__(f"rank {rank} {what}{where}:\n{cause}")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild_rank_error, (self.rank, self.cause, self.died, self.during))


def _rebuild_rank_error(rank: int, cause: str, died: bool, during: str) -> RankError:
    return RankError(rank, cause, died=died, during=during)


class ReplicaMismatchError(RankError):
    """Data-parallel replicas of a shard disagree (silent data corruption, or a rank that went its
    own way), found by the replica check (``to_static(..., check_replicas=N)``).

    Attributes:
        step: the model's train steps when the codes were taken (after that many).
        ranks: the ranks whose copy differs from the majority's, or, with no majority
            (two replicas), every rank of the pieces that disagree.
        names: the state's tensors (parameters, optimizer state) that disagree.
        rank: the first of ``ranks``.
    """

    def __init__(self, step: int, ranks: list[int], names: list[str]):
        self.step, self.ranks, self.names = step, list(ranks), list(names)
        shown = ", ".join(self.names[:8]) + (f" and {len(self.names) - 8} more" if len(self.names) > 8 else "")
        super().__init__(self.ranks[0], f"the replicas of {shown} differ on ranks {self.ranks} after "
                         f"{step} train steps", during="the replica check")  # fmt: skip

    @property
    def parameters(self) -> list[str]:
        """``names``: the tensors that disagree (parameters, or their optimizer state)."""
        return self.names

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (ReplicaMismatchError, (self.step, self.ranks, self.names))


class GroupShutdownError(RuntimeError):
    """The rank group is gone (shut down, or torn down after a failure)."""


class UsageError(ValueError):
    """A bad argument, or one that only the ranks could see (the layer's mesh, a batch
    the layer cannot take): the caller's mistake, and the model goes on.

    Raised inside a rank, it travels as `RankRefused`; when every rank
    refused the call, the driver raises it as itself, not as a `RankError`.
    """


class HandoverLost(RuntimeError):
    """Raised inside a rank that takes handed-over state (`raydist.handover`) when a piece of it is
    gone (the node that held it died): the restart marks that state spent and takes another."""

    @staticmethod
    def caused(error: BaseException) -> bool:
        """Whether ``error`` (a `RankError` at the driver) is a rank's `HandoverLost`."""
        return f"{HandoverLost.__module__}.HandoverLost" in str(getattr(error, "cause", ""))


class RankFailed(RuntimeError):
    """Raised inside a rank when a call fails: carries the rank and its traceback to the driver,
    and the step that failed if it was one."""

    def __init__(self, rank: int, traceback: str, step: int | None = None):
        super().__init__(f"rank {rank}: {traceback}")
        self.rank = rank
        self.traceback = traceback
        self.step = step

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), (self.rank, self.traceback, self.step))


class RankRefused(RankFailed):
    """Raised inside a rank when it refuses a call (a `UsageError` there): the message for the caller."""

    def __init__(self, rank: int, traceback: str, message: str = ""):
        super().__init__(rank, traceback)
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (RankRefused, (self.rank, self.traceback, self.message))
