"""raydist: PaddlePaddle's auto-parallel DistModel, run on Ray.

One Ray actor hosts one rank; the driver holds a `DistModel` proxy that
switches modes, sends batches and gathers results::

    dm = raydist.to_static(build_layer, loss=paddle.nn.MSELoss(),
                           optimizer=lambda p: paddle.optimizer.SGD(0.1, parameters=p),
                           num_workers=4)
    loss = dm(x, y)
"""

from .data import Handle, ShardDataloader, shard_dataloader
from .driver.api.loss import Loss
from .driver.api.model import DistModel, to_static
from .driver.api.resume import CheckpointInfo, latest_checkpoint
from .driver.api.status import ModelStatus, RankStatus, models, status
from .driver.lifecycle.detached import ModelHeldError
from .errors import GroupShutdownError, RankError, ReplicaMismatchError, UsageError
from .options import DispatchConfig, PlacementConfig, RecoveryConfig
from .weights import Weights

__version__ = "0.1.0"


def attach(name: str, loader: ShardDataloader | None = None, take_over: bool = False) -> DistModel:
    """The live `DistModel` of the detached model ``name`` (``to_static(..., name=name, detached=True)``),
    from any later driver: in its mode, at its step, with its learning-rate schedule, specs and size.

    Connects to the running Ray cluster (``RAY_ADDRESS``, or ``ray start``'s) if not connected.
    ``loader``: a `raydist.shard_dataloader` for the model to read (as ``to_static``'s ``loader``).
    A model another live driver holds is refused (`ModelHeldError`, naming it) unless
    ``take_over``: then that driver's next call fails, and its ``shutdown`` no longer ends the model.
    An unknown name is a LookupError listing the detached models there are. ``dm.shutdown()`` ends
    the model; a driver that ends without it lets go of the model, for the next ``attach``.
    """
    from .driver.api.model import attach as _attach

    return _attach(name, loader, take_over)


__all__ = [
    "CheckpointInfo",
    "DispatchConfig",
    "DistModel",
    "GroupShutdownError",
    "Handle",
    "Loss",
    "ModelHeldError",
    "ModelStatus",
    "PlacementConfig",
    "RankError",
    "RecoveryConfig",
    "ReplicaMismatchError",
    "RankStatus",
    "ShardDataloader",
    "UsageError",
    "Weights",
    "attach",
    "latest_checkpoint",
    "models",
    "shard_dataloader",
    "status",
    "to_static",
]
