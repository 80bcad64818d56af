"""Errors raydist raises at the driver."""

from __future__ import annotations


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

    def __reduce__(self):
        return (_rebuild_rank_error, (self.rank, self.cause, self.died, self.during))


def _rebuild_rank_error(rank, cause, died, during):
    return RankError(rank, cause, died=died, during=during)


class GroupShutdownError(RuntimeError):
    """The rank group is gone (shut down, or torn down after a failure)."""


class UsageError(ValueError):
    """A bad argument, or one that only the ranks could see (the layer's mesh, a batch
    the layer cannot take): the caller's mistake, and the model goes on.

    Raised inside a rank, it travels as `RankRefused`; when every rank
    refused the call, the driver raises it as itself, not as a `RankError`.
    """


class RankFailed(RuntimeError):
    """Raised inside a rank when a call fails: carries the rank and its traceback to the driver,
    and the step that failed if it was one."""

    def __init__(self, rank: int, traceback: str, step: int | None = None):
        super().__init__(f"rank {rank}: {traceback}")
        self.rank = rank
        self.traceback = traceback
        self.step = step

    def __reduce__(self):
        return (type(self), (self.rank, self.traceback, self.step))


class RankRefused(RankFailed):
    """Raised inside a rank when it refuses a call (a `UsageError` there): the message for the caller."""

    def __init__(self, rank: int, traceback: str, message: str = ""):
        super().__init__(rank, traceback)
        self.message = message

    def __reduce__(self):
        return (RankRefused, (self.rank, self.traceback, self.message))
