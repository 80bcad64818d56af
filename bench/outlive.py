"""A job killed and run again: how long until it trains, and how many steps it computes twice.

    python -m bench resume [--models gpt-mp2] [--steps 24] [--every 4] [--kill-after 10] [--repeat 3]

On a ``ray start --head`` of its own (stopped by its PID), a driver process trains
with ``fit(..., checkpoint_dir=D, checkpoint_every=EVERY, resume=True)``; round-robin:

- *fresh*: the script on an empty directory;
- *killed, run again*: the script, SIGKILLed once ``--kill-after`` steps have
  completed, then the same script again on the same directory.

Reports, for the run that starts (fresh) or resumes (run again): the time from the
driver process's start to its first completed step, and the steps computed twice
(those the killed driver completed after its newest checkpoint); and whether the
resumed run's losses equal the fresh run's (rtol 1e-5).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from raydist.net import free_port

from .common import ROOT

SCRIPT = """
import json, os, sys, time
import numpy as np, paddle, ray
import raydist
from bench import models

name, steps, every, hang = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
b, kind = models.batch_size(name), models.MODELS[name][0]
ray.init(runtime_env=RANK_ENV, log_to_driver=False)
# not materialized: its blocks would come in the order its tasks end (the loader reads in order)
ds = ray.data.range(steps * b, override_num_blocks=4).map_batches(lambda x: models.rows(kind, x["id"]))
loader = raydist.shard_dataloader(ds, models.mesh(name), input_keys=["x", "y"], shard_dims="dp", batch_size=b)


class Report(paddle.callbacks.Callback):
    seen = 0

    def on_train_batch_end(self, step, logs=None):
        self.seen += 1
        if self.seen == 1:
            print("first-step", time.time(), flush=True)
        if self.seen == hang:
            print("hanging", flush=True)
            time.sleep(3600)


with raydist.to_static(lambda: models.build_layer(name), loader, models.loss(name),
                       lambda p: paddle.optimizer.AdamW(1e-3, parameters=p), num_workers=models.world_size(name)) as dm:
    losses = dm.fit(loader, checkpoint_every=every, checkpoint_dir=os.environ["CKPT_DIR"], resume=True,
                    progress=False, callbacks=[Report()])
print("losses", json.dumps(losses), flush=True)
"""


class _Head:
    """A ``ray start --head --block`` of its own, stopped by its PID (and its process group)."""

    def __enter__(self):
        self.temp = tempfile.mkdtemp(prefix="rdb", dir="/tmp")
        self.address = f"127.0.0.1:{free_port('127.0.0.1')}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={self.address.rsplit(':', 1)[1]}", "--num-cpus=8", "--include-dashboard=false",
             f"--temp-dir={self.temp}", "--disable-usage-stats"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"})  # fmt: skip
        time.sleep(8)  # the GCS comes up; a driver that connects too early retries anyway
        return self

    def __exit__(self, *exc):
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _driver(head: _Head, directory: str, name: str, steps: int, every: int, hang: int) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "RAY_ADDRESS": head.address, "RAY_AUTH_MODE": "disabled", "CKPT_DIR": directory,
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    code = "from bench.common import RANK_ENV\n" + textwrap.dedent(SCRIPT)
    started = time.time()
    process = subprocess.Popen([sys.executable, "-c", code, name, str(steps), str(every), str(hang)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))  # fmt: skip
    return process, started


def _first_step(lines: list[str], started: float) -> float:
    return next(float(line.split()[1]) for line in lines if line.startswith("first-step ")) - started


def _losses(lines: list[str]) -> list[float]:
    return json.loads(next(line[len("losses ") :] for line in lines if line.startswith("losses ")))


def _finish(process: subprocess.Popen) -> list[str]:
    out, _ = process.communicate(timeout=900)
    assert process.returncode == 0, out[-4000:]
    return out.splitlines()


def resume_table(names: list[str], steps: int, every: int, kill_after: int, repeat: int) -> str:
    import numpy as np

    rows = []
    with _Head() as head:
        for name in names:
            fresh, again, same = [], [], True
            for _ in range(repeat):
                process, started = _driver(head, tempfile.mkdtemp() + "/ck", name, steps, every, 0)
                lines = _finish(process)
                fresh.append(_first_step(lines, started))
                calm = _losses(lines)

                directory = tempfile.mkdtemp() + "/ck"
                process, _ = _driver(head, directory, name, steps, every, kill_after)
                for line in process.stdout:
                    if line.startswith("hanging"):
                        break
                process.kill()
                process.wait()
                process, started = _driver(head, directory, name, steps, every, 0)
                lines = _finish(process)
                again.append(_first_step(lines, started))
                same &= bool(np.allclose(_losses(lines), calm, rtol=1e-5))
            rows.append(_row(name, fresh, again, kill_after - kill_after // every * every, same))
    return _table("fresh run: driver start to first step (s) | run again after a SIGKILL: driver start to first "
                  "step (s) | steps computed twice", rows)  # fmt: skip


def _row(name: str, fresh: list[float], other: list[float], steps: int, same: bool) -> str:
    row = (f"| {name} | {statistics.median(fresh):.1f} | {statistics.median(other):.1f} | {steps} "
           f"| {'yes' if same else 'NO'} |")  # fmt: skip
    print(row, flush=True)
    return row


def _table(columns: str, rows: list[str]) -> str:
    header = f"| model | {columns} | losses equal the fresh run's (rtol 1e-5) |"
    return "\n".join([header, "|---|---:|---:|---:|---|", *rows])


ATTACH_SCRIPT = """
import json, sys, time
import paddle, ray
import raydist
from bench import models

phase, name, steps, before = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ray.init(runtime_env=RANK_ENV, log_to_driver=False)
data = models.data(name, steps)
if phase == "attach":
    dm = raydist.attach("bench-attach")
    first = before
else:
    dm = raydist.to_static(lambda: models.build_layer(name), None, models.loss(name),
                           lambda p: paddle.optimizer.AdamW(1e-3, parameters=p), num_workers=models.world_size(name),
                           name="bench-attach" if phase == "detach" else None, detached=phase == "detach")
    first = 0
losses = []
for x, y in data[first:before if phase == "detach" else steps]:
    losses.append(float(dm(x, y)))
    if len(losses) == 1:
        print("first-step", time.time(), flush=True)
print("losses", json.dumps(losses), flush=True)
if phase == "detach":
    print("hanging", flush=True)
    time.sleep(3600)
dm.shutdown()
"""


def _attach_driver(head: _Head, phase: str, name: str, steps: int, before: int) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "RAY_ADDRESS": head.address, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    code = "from bench.common import RANK_ENV\n" + textwrap.dedent(ATTACH_SCRIPT)
    started = time.time()
    process = subprocess.Popen([sys.executable, "-c", code, phase, name, str(steps), str(before)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))  # fmt: skip
    return process, started


def attach_table(names: list[str], steps: int, before: int, repeat: int) -> str:
    """Round-robin: a fresh driver's start to its first step, against a new driver attaching to a detached
    model whose driver was SIGKILLed after ``before`` steps; whether the two drivers' losses are the fresh run's."""
    import numpy as np

    rows = []
    with _Head() as head:
        for name in names:
            fresh, attached, same = [], [], True
            for _ in range(repeat):
                process, started = _attach_driver(head, "fresh", name, steps, before)
                lines = _finish(process)
                fresh.append(_first_step(lines, started))
                calm = _losses(lines)

                process, _ = _attach_driver(head, "detach", name, steps, before)
                lines = []
                for line in process.stdout:
                    lines.append(line)
                    if line.startswith("hanging"):
                        break
                process.kill()
                process.wait()
                first = _losses(lines)
                process, started = _attach_driver(head, "attach", name, steps, before)
                lines = _finish(process)
                attached.append(_first_step(lines, started))
                same &= bool(np.allclose(first + _losses(lines), calm, rtol=1e-5))
            rows.append(_row(name, fresh, attached, 0, same))
    return _table("fresh driver: start to first step (s) | attach after the driver's SIGKILL: new driver's start to "
                  "first step (s) | steps lost", rows)  # fmt: skip
