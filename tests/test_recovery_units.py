"""Recovery's books, without Ray: the checkpoints of a timeline, and fit's save of a step at most once."""

import json
import os

import pytest

from raydist import checkpoint
from raydist.driver.api import fit as fits
from raydist.driver.api.resume import latest_checkpoint
from raydist.driver.model.saves import Saves

pytestmark = pytest.mark.timeout(60)


def fake_checkpoint(path, steps: int = 0) -> str:
    """A directory that reads as a complete raydist checkpoint (a manifest, no tensors)."""
    os.makedirs(path)
    record = {"fit": {"steps": steps, "position": [0, steps], "history": [0.0] * steps}}
    with open(os.path.join(path, checkpoint.MANIFEST), "w") as f:
        json.dump({"format": checkpoint.FORMAT, "step": steps, "record": record, "tensors": {}}, f)
    return str(path)


def test_a_restart_that_goes_back_moves_the_later_checkpoints_aside_and_never_picks_them(tmp_path):
    told = []
    saves = Saves(lambda: told.append(saves.last))
    for n in (0, 4, 8, 12):
        saves.saved(n, fake_checkpoint(tmp_path / f"step-{n:08d}", n))
    assert saves.newest(at_most=11).trained == 8 and saves.newest(at_most=3).trained == 0
    assert saves.newest(at_most=-1) is None
    gone = saves.went_back(5)  # e.g. the last clean replica check was after 5 steps
    assert [s.trained for s in gone] == [8, 12]
    assert saves.last.trained == 4 and saves.newest(at_most=100).trained == 4
    names = sorted(os.listdir(tmp_path))
    assert names[:2] == ["step-00000000", "step-00000004"]
    assert [n.split(checkpoint.ABANDONED)[0] for n in names[2:]] == ["step-00000008", "step-00000012"]
    # neither a resumed run nor the new timeline's save of the same step meets them
    assert [os.path.basename(p) for p in checkpoint.complete(str(tmp_path))] == names[:2]
    assert latest_checkpoint(str(tmp_path)).steps == 4
    assert not checkpoint.exists(str(tmp_path / "step-00000008"))
    assert told[-1].trained == 4  # the card shows the newest of the timeline


def test_a_load_begins_a_timeline_of_its_own_and_a_removed_checkpoint_is_no_error(tmp_path):
    saves = Saves()
    saves.saved(3, fake_checkpoint(tmp_path / "a"))
    saves.saved(6, str(tmp_path / "removed-by-keep-last"))
    saves.loaded(6, fake_checkpoint(tmp_path / "b"))
    assert saves.newest(at_most=5) is None and saves.last.path.endswith("b")
    saves.saved(9, str(tmp_path / "gone"))
    assert [s.trained for s in saves.went_back(6)] == [9]  # nothing to move: no error


class _Saving:
    """What `_Run.checkpoint` uses of a model and its lifecycle: saves that write a fake checkpoint,
    in the background until `wait_saved`."""

    def __init__(self):
        self.saved, self.waits, self.pending, self.rates = [], 0, [], None

    def save(self, path, position=None, record=None, background=False):
        assert not checkpoint.exists(path), "raydist never overwrites a checkpoint"
        self.saved.append(path)
        (self.pending.append if background else fake_checkpoint)(path)

    def wait_saved(self):
        self.waits += 1
        while self.pending:
            fake_checkpoint(self.pending.pop())


def test_fit_saves_a_step_once_and_a_notices_save_waits_for_the_schedules(tmp_path):
    saving = _Saving()
    loader = type("Loader", (), {"batch_size": 8, "__len__": lambda self: 10})()
    run = fits._Run(saving, saving, loader, 1, 10, 2, str(tmp_path), None, None)
    run.history = [0.1, 0.2]
    run.checkpoint(0, 2)  # the schedule's, in the background
    run.checkpoint(0, 2, background=False)  # a preemption notice at the same step: no second save
    assert saving.saved == [str(tmp_path / "step-00000002")] and saving.waits == 1
    assert checkpoint.exists(saving.saved[0])  # complete before the node goes
    run.checkpoint(0, 2)
    assert len(saving.saved) == 1
    os.rename(saving.saved[0], saving.saved[0] + checkpoint.ABANDONED + "x")  # a restart went back before it
    run.checkpoint(0, 2)
    assert len(saving.saved) == 2  # the new timeline's own
