"""A driver of a detached model, run by tests/test_jobs.py: started and SIGKILLed, attached by a new
process, refused while held, taken over, ended.

argv[1], the phase:
- start: 5 train steps (a step-decay schedule stepped after each), then prints the ranks' PIDs and waits
  to be killed;
- attach: attaches, prints where the model stands, 5 more steps (losses and parameters to OUT), then
  holds it until a line on stdin, when it tries one more step (refused once taken over) and shuts down;
- probe: tries to attach (held) and attaches an unknown name; prints both errors;
- take: attaches with take_over=True; on a line on stdin, one step, then shutdown (ends the model).
Environment: NAME (the model's name), OUT.
"""

import json
import os
import sys

import numpy as np
import paddle

import raydist
from helpers import scheduled_sgd
from models import batches, build

NAME, PHASE = os.environ["NAME"], sys.argv[1]
DATA = batches(11)


def steps(dm, which) -> list[float]:
    losses = []
    for x, y in (DATA[i] for i in which):
        losses.append(float(dm(x, y)))
        dm.lr_scheduler.step()
    return losses


def say(*parts) -> None:
    print(*parts, flush=True)


if PHASE == "start":
    dm = raydist.to_static(build("dp"), None, paddle.nn.MSELoss(), scheduled_sgd("step"), num_workers=2, name=NAME,
                           detached=True)  # fmt: skip
    say("losses", json.dumps(steps(dm, range(5))))
    say("ranks", json.dumps(sorted(s.pid for s in raydist.status() if s.group == NAME)))
    sys.stdin.readline()  # killed meanwhile
elif PHASE == "attach":
    dm = raydist.attach(NAME)
    say("stands", json.dumps({"mode": dm.mode, "workers": dm.num_workers, "step": dm.step,
                              "lr": dm.lr_scheduler.last_lr,
                              "ranks": sorted(s.pid for s in raydist.status() if s.group == NAME),
                              "events": [e["kind"] for e in dm.events()]}))  # fmt: skip
    losses = steps(dm, range(5, 10))
    np.savez(os.environ["OUT"], losses=np.array(losses), **dm.state_dict("param"))
    say("holding")
    sys.stdin.readline()
    try:
        dm(*DATA[10])
        say("stepped")
    except raydist.GroupShutdownError as e:
        say("refused", e)
    dm.shutdown()
    say("let go")
elif PHASE == "probe":
    try:
        raydist.attach(NAME)
    except raydist.ModelHeldError as e:
        say("held", e)
    try:
        raydist.attach(NAME + "-unknown")
    except LookupError as e:
        say("lookup", e)
elif PHASE == "take":
    dm = raydist.attach(NAME, take_over=True)
    say("took", dm.step)
    say("events", json.dumps(dm.events()))
    sys.stdin.readline()
    dm(*DATA[10])
    dm.shutdown()
    say("ended", json.dumps([s.pid for s in raydist.status() if s.group == NAME]))
