"""State on the driver and distributed checkpoints: exact round trips, across meshes."""

import numpy as np
import paddle
import pytest

import faults
import raydist
from helpers import wait_gone
from models import Reference, adamw, assert_close, batches, build

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def dm_of(kind, workers, optimizer=adamw, **kwargs):
    return raydist.to_static(build(kind), loss=paddle.nn.MSELoss(), optimizer=optimizer(), num_workers=workers,
                             **kwargs)  # fmt: skip


@pytest.mark.slow
def test_state_round_trip_and_pretrained_weights():
    data = batches(3)
    ref = Reference(adamw(), seed=5)  # other weights than the model starts with
    with dm_of("dpmp", 4) as dm:
        before = dm.state_dict("param")
        dm.set_state_dict(ref.net.state_dict())  # a plain single-process Layer's state
        for name, value in ref.params().items():
            assert_close(dm.state_dict("param")[name], value, rtol=0, atol=0)
        for x, y in data:
            assert_close(dm(x, y), ref.train(x, y))
        state = dm.state_dict("all")
        assert any("moment" in k for k in dm.state_dict("opt")) and set(before) < set(state)
        changed = {k: v + 1 if v.dtype.kind == "f" else v for k, v in state.items()}
        dm.set_state_dict(changed)
        after = dm.state_dict("all")
        for k, v in changed.items():
            np.testing.assert_array_equal(after[k], v, err_msg=k)
        dm.set_state_dict(state)  # and back: training goes on as if nothing happened
        x, y = batches(1, seed=9)[0]
        assert_close(dm(x, y), ref.train(x, y))


def test_set_state_dict_misuse_is_refused_and_the_model_goes_on():
    data = batches(2)
    ref = Reference(adamw())
    with dm_of("mp", 2) as dm:
        assert_close(dm(*data[0]), ref.train(*data[0]))
        with pytest.raises(ValueError, match=r"no \['fc3.weight'\]"):
            dm.set_state_dict({"fc3.weight": np.zeros((2, 2), "float32")})
        with pytest.raises(ValueError, match="shape"):
            dm.set_state_dict({"fc1.weight": np.zeros((2, 2), "float32")})
        with pytest.raises(TypeError, match="dtype"):
            dm.set_state_dict({"fc1.weight": np.zeros((12, 24), "int32")})
        assert_close(dm(*data[1]), ref.train(*data[1]))


@pytest.mark.slow
@pytest.mark.long
def test_save_and_load_on_the_same_and_other_meshes(tmp_path):
    data = batches(4)
    ref = Reference(adamw())
    with dm_of("dpmp", 4) as dm:
        for x, y in data[:3]:
            assert_close(dm(x, y), ref.train(x, y))
        dm.save(str(tmp_path / "ckpt"))
        with pytest.raises(ValueError, match="never overwrites"):
            dm.save(str(tmp_path / "ckpt"))
    x, y = data[3]
    expected_out = ref.predict(x)  # what the checkpoint predicts
    expected_loss = ref.train(x, y)  # one more step: needs the optimizer state too
    for kind, workers in [("mp", 2), ("one", 1)]:  # the same mesh: test_fit's restarts
        with dm_of(kind, workers) as other:
            other.load("file://" + str(tmp_path / "ckpt") if kind == "mp" else str(tmp_path / "ckpt"))
            other.predict()
            assert_close(other(x), expected_out, what=f"{kind}: predict after loading")
            other.train()
            assert_close(other(x, y), expected_loss, what=f"{kind}: a step after loading")
            other.predict()
            assert_close(other(data[0][0]), ref.predict(data[0][0]), what=f"{kind}: predict after the step")
            with pytest.raises(ValueError, match="not a complete raydist checkpoint"):
                other.load(str(tmp_path))


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    class Wide(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1 = paddle.nn.Linear(12, 8)

        def forward(self, x):
            return self.fc1(x)

    with raydist.to_static(Wide, num_workers=1) as dm:
        dm.save(str(tmp_path / "wide"))
    x, y = batches(1)[0]
    with dm_of("mp", 2) as dm:
        with pytest.raises(ValueError, match="checkpoint of another model"):
            dm.load(str(tmp_path / "wide"))
        float(dm(x, y))  # still usable


@pytest.mark.slow
@pytest.mark.long
def test_a_save_killed_halfway_leaves_the_old_checkpoint_intact(tmp_path):
    """Rank 1 dies after writing its shard file, before the rename and the manifest."""
    x, y = batches(1)[0]
    ref = Reference(adamw())
    ref.train(x, y)
    with dm_of("mp", 2) as dm:
        float(dm(x, y))
        dm.save(str(tmp_path / "old"))
    dm = dm_of("mp", 2, runtime_env=faults.hook("die_after_writing_on_rank_1"))  # mp: each rank writes a shard
    float(dm(x, y))
    pids = [r.pid for r in dm.ranks]
    with pytest.raises(raydist.RankError) as info:
        dm.save(str(tmp_path / "new"))
    assert info.value.rank == 1 and info.value.died and info.value.during == "save_pieces"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # nothing half-written, nothing that looks complete
    wait_gone(pids)
    with dm_of("mp", 2) as fresh:
        fresh.load(str(tmp_path / "old"))
        fresh.predict()
        assert_close(fresh(x), ref.predict(x))


@pytest.mark.slow
@pytest.mark.long
def test_a_background_save_whose_rank_dies_while_writing_leaves_the_old_checkpoint_and_nothing_complete(tmp_path):
    """save(background=True) returns once the ranks hold their snapshots; rank 1 dies after writing
    its file in the background: the calls after it raise RankError naming it, the staging directory
    is removed, and the old checkpoint loads (the numbers of one process after one step)."""
    x, y = batches(1)[0]
    ref = Reference(adamw())
    ref.train(x, y)
    with dm_of("mp", 2) as dm:
        float(dm(x, y))
        dm.save(str(tmp_path / "old"), background=True)  # shutdown waits for it
    dm = dm_of("mp", 2, runtime_env=faults.hook("die_after_a_background_write_on_rank_1"))
    float(dm(x, y))
    dm.save(str(tmp_path / "new"), background=True)
    with pytest.raises(raydist.RankError) as info:
        for _ in range(200):  # the steps go on beside the write, until rank 1 is gone
            float(dm(x, y))
    assert info.value.rank == 1 and info.value.died, info.value
    dm.restart()  # waits for the save's end: removed, with the ranks that wrote it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # nothing half-written, nothing that looks complete
    dm.shutdown()
    with dm_of("mp", 2) as fresh:
        fresh.load(str(tmp_path / "old"))
        fresh.predict()
        assert_close(fresh(x), ref.predict(x))
