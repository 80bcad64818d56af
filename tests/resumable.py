"""A training script that resumes its run: started, killed and started again by tests/test_jobs.py.

Environment: CKPT_DIR (the run's directory), OUT (where to write the losses and parameters),
HANG_AFTER (steps after which it prints its ranks' PIDs and waits to be killed).
"""

import json
import os
import time

import numpy as np
import paddle

import raydist
from helpers import Pairs, scheduled_sgd
from models import build


class HangAfter(paddle.callbacks.Callback):
    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, step, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            print("ranks", json.dumps([s.pid for s in raydist.status()]), flush=True)
            time.sleep(3600)


mesh = paddle.distributed.ProcessMesh([0, 1], dim_names=["dp"])
loader = raydist.shard_dataloader(Pairs(48), mesh, shard_dims="dp", batch_size=8, shuffle=True, seed=3)
with raydist.to_static(build("dp"), loader, paddle.nn.MSELoss(), scheduled_sgd("step"), num_workers=2) as dm:
    history = dm.fit(loader, epochs=2, checkpoint_every=2, checkpoint_dir=os.environ["CKPT_DIR"], resume=True,
                     progress=False, callbacks=[HangAfter(int(os.environ.get("HANG_AFTER", "0")))])  # fmt: skip
    np.savez(os.environ["OUT"], history=np.array(history), **dm.state_dict("param"))
print("done after", len(history), "steps", flush=True)
