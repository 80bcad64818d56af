"""A rank's learning rate: the optimizer's ``LRScheduler`` (or float), changed as the driver says.

Paddle's static programs read the learning rate from a variable in the scope
(PIR: the parameter ``learning_rate_N`` its startup program fills once with
the value at build time). Stepping the rank's scheduler object changes that
variable only if something copies the new value in: Paddle's own ``Engine``
does it in ``fit`` (its ``LRSchedulerAuto`` callback and the executor's feed
of ``program.lr_scheduler``), which ``DistModel.__call__`` never reaches, so
a schedule nobody copies stays at its first value. `RankSchedule.sync`
copies it before each train step after a change.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle.optimizer.lr import LRScheduler

from ..compat import engine as compat_engine
from ..errors import UsageError
from ..messages import LrChange


class RankSchedule:
    """The learning rate of one rank's optimizer (None: no optimizer)."""

    def __init__(self, optimizer, static: bool = True):
        self._optimizer = getattr(optimizer, "_inner_opt", optimizer)  # dist.shard_optimizer's wrapper
        self._static = static  # else the optimizer runs eagerly and reads its rate itself
        self._var: str | None = None  # the scope variable train programs read, once built
        self._changed = True

    @property
    def scheduler(self) -> LRScheduler | None:
        lr = self._optimizer._learning_rate if self._optimizer is not None else None
        return lr if isinstance(lr, LRScheduler) else None

    def report(self) -> float | bytes | None:
        """For the driver: the float learning rate, or the scheduler pickled (its replica)."""
        if self._optimizer is None:
            return None
        if self.scheduler is not None:
            from ray import cloudpickle

            return cloudpickle.dumps(self.scheduler)
        return float(self._optimizer._learning_rate)

    def _schedule(self) -> LRScheduler:
        scheduler = self.scheduler
        if scheduler is None:
            raise UsageError("the driver steps a learning-rate schedule, and the optimizer has none")
        return scheduler

    def apply(self, changes: tuple[LrChange, ...]) -> None:
        for change in changes:
            if change.kind == "step":
                self._schedule().step(*change.args, **change.kwargs)
            elif change.kind == "state":
                self._schedule().set_state_dict(change.args[0])
            elif change.kind == "value" and self._static:
                self._optimizer._learning_rate = float(change.args[0])
            elif change.kind == "value":  # eager: the rate's tensor is made once, set_lr updates it
                self._optimizer.set_lr(float(change.args[0]))
            else:
                raise ValueError(f"unknown learning-rate change {change.kind!r}")
        self._changed = True

    def built(self, program) -> None:
        """The train program was built: find the variable it reads the learning rate from
        (a scheduler's ``_var_name``; a float's ``learning_rate_N``)."""
        names = []
        for op in program.global_block().ops:
            if op.name() == "builtin.parameter":
                names.append(op.str_attr("parameter_name"))
            elif op.name() == "pd_op.data":
                names.append(op.str_attr("name"))
        own = getattr(self.scheduler, "_var_name", None)
        self._var = own if own in names else next((n for n in names if n.startswith("learning_rate")), None)
        self._changed = True

    def sync(self) -> None:
        """Before a train step: copy a changed learning rate into the scope."""
        if not self._changed or self._var is None:
            return
        scheduler = self.scheduler
        value = scheduler() if scheduler is not None else self._optimizer._learning_rate
        tensor = paddle.static.global_scope().var(self._var).get_tensor()
        tensor.set(np.array(value, dtype=np.float32), compat_engine.expected_place())
        self._changed = False
