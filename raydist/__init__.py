"""raydist: PaddlePaddle's auto-parallel DistModel, run on Ray.

One Ray actor hosts one rank; the driver holds a `DistModel` proxy that
switches modes, sends batches and gathers results::

    dm = raydist.to_static(build_layer, loss=paddle.nn.MSELoss(),
                           optimizer=lambda p: paddle.optimizer.SGD(0.1, parameters=p),
                           num_workers=4)
    loss = dm(x, y)
"""

from .data import Handle, ShardDataloader, shard_dataloader
from .driver.model import DistModel, to_static
from .driver.runs import CheckpointInfo, latest_checkpoint
from .driver.status import RankStatus, status
from .driver.steps import Loss
from .errors import GroupShutdownError, RankError, UsageError

__version__ = "0.1.0"

__all__ = [
    "CheckpointInfo",
    "DistModel",
    "GroupShutdownError",
    "Handle",
    "Loss",
    "RankError",
    "RankStatus",
    "ShardDataloader",
    "UsageError",
    "latest_checkpoint",
    "shard_dataloader",
    "status",
    "to_static",
]
