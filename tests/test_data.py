"""raydist.shard_dataloader: every row once, mp peers alike, same numbers as one process."""

import time

import numpy as np
import paddle
import paddle.distributed as dist
import pytest

import raydist
from raydist import testing
from helpers import DPMP_MESH as MESH
from helpers import N, Pairs, Poisoned, dataset, rows
from models import Reference, assert_close, assert_params_equal, build, sgd

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]


class Tagger(paddle.nn.Layer):
    """Predicts its input ("tag" = id + [0, .25, .5, .75]) with columns sharded over mp.

    Each mp rank computes the output columns of the rows IT read, so the
    assembled output shows whether the mp peers of a dp group read the same rows.
    """

    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(4, 4)
        self.fc.weight.set_value(np.eye(4, dtype="float32"))
        self.fc.bias.set_value(np.zeros(4, "float32"))
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        self.fc.weight = dist.shard_tensor(self.fc.weight, mesh, [dist.Replicate(), dist.Shard(1)])

    def forward(self, tag):
        return self.fc(tag)


@pytest.fixture(scope="module")
def tagger():
    with raydist.to_static(Tagger, num_workers=4) as dm:
        yield dm


def epoch_ids(dm, loader, stop=None):
    """The row ids of each global batch of one epoch, as the ranks read them."""
    out = []
    for step, batch in enumerate(loader()):
        if step == stop:
            break
        tags = dm(batch["tag"])
        assert_close(tags - tags[:, :1], np.tile(np.arange(4) / 4, (len(tags), 1)), what="mp peers disagree")
        out.append(tags[:, 0].round().astype(int).tolist())
    return out


@pytest.mark.slow
@pytest.mark.long
def test_every_row_once_and_mp_peers_alike(tagger):
    loader = raydist.shard_dataloader(dataset(), MESH, input_keys=["tag"], shard_dims="dp", batch_size=8)
    assert len(loader) == 8 and loader.local_batch_size == 4
    batches = epoch_ids(tagger, loader)
    assert len(batches) == 8 and all(len(b) == 8 for b in batches)
    seen = [i for b in batches for i in b]
    assert len(set(seen)) == len(seen) == 64  # no row twice
    assert set(seen) <= set(range(N))
    groups = [{i for b in batches for i in b[:4]}, {i for b in batches for i in b[4:]}]
    assert not groups[0] & groups[1]  # each dp group has its own split
    assert epoch_ids(tagger, loader) == batches  # no shuffle: the next epoch, the same batches


@pytest.mark.slow
@pytest.mark.long
def test_break_then_new_epoch_and_shuffle_with_seed(tagger):
    loader = raydist.shard_dataloader(dataset(), MESH, input_keys=["tag"], shard_dims="dp", batch_size=8,
                                      shuffle=True, seed=5)  # fmt: skip
    first = epoch_ids(tagger, loader, stop=3)  # an early break
    second = epoch_ids(tagger, loader)
    third = epoch_ids(tagger, loader)
    assert len(first) == 3 and len(second) == len(third) == 8
    assert second != third  # reshuffled every epoch
    for epoch in (second, third):
        seen = [i for b in epoch for i in b]
        assert len(set(seen)) == len(seen) == 64
    again = raydist.shard_dataloader(dataset(), MESH, input_keys=["tag"], shard_dims="dp", batch_size=8,
                                     shuffle=True, seed=5)  # fmt: skip
    assert epoch_ids(tagger, again)[:3] == first  # reproducible, epoch by epoch
    assert epoch_ids(tagger, again) == second and epoch_ids(tagger, again) == third


@pytest.mark.slow
@pytest.mark.long
def test_training_through_the_loader_matches_single_process(tagger):
    loader = raydist.shard_dataloader(dataset(), MESH, input_keys=["x", "y"], shard_dims="dp", batch_size=8)
    probe = raydist.shard_dataloader(dataset(), MESH, input_keys=["tag"], shard_dims="dp", batch_size=8)
    order = epoch_ids(tagger, probe)  # the global batches, in order (the split is deterministic)
    x, y = rows()
    ref = Reference(sgd())
    with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=4) as dm:
        assert loader._prepared[0] == 0  # the first epoch was split while the ranks started
        for epoch in range(2):
            for step, batch in enumerate(loader()):
                ids = order[step]  # every row once, in the probe's order: the prepared split too
                assert loader._prepared is None or step == 0
                assert_close(dm(batch["x"], batch["y"]), ref.train(x[ids], y[ids]), what=f"epoch {epoch} step {step}")
        dm.eval()
        batch = next(iter(loader()))
        assert_close(dm(batch["x"], batch["y"]), ref.eval(x[order[0]], y[order[0]]))
        params = dm.state_dict("param")
    assert_params_equal(params, ref.params())


@pytest.mark.long
def test_a_loop_that_reads_nothing_sends_the_next_epoch_while_the_ranks_still_run_this_one(tagger):
    """The next epoch's first step opens its reading while the ranks still have several steps of
    this epoch to run (4 steps a message, the reader 1 step ahead): they still get their batches;
    the losses of 3 epochs, read at the end, and the parameters are one process's."""
    # no shuffle: its tasks would need a CPU, and this model and the tagger hold all 8
    loader = raydist.shard_dataloader(dataset(), MESH, input_keys=["x", "y"], shard_dims="dp", batch_size=8,
                                      prefetch=1)  # fmt: skip
    probe = raydist.shard_dataloader(dataset(), MESH, input_keys=["tag"], shard_dims="dp", batch_size=8)
    order = epoch_ids(tagger, probe)
    x, y = rows()
    ref = Reference(sgd())
    expected = [ref.train(x[ids], y[ids]) for _ in range(3) for ids in order]
    with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=4, steps_per_message=4,
                           step_timeout_s=60) as dm:  # fmt: skip
        losses = [dm(batch["x"], batch["y"]) for _ in range(3) for batch in loader()]
        assert testing.window(dm).messages < len(losses)  # the driver ran ahead
        assert_close(losses, expected)
        params = dm.state_dict("param")
    assert_params_equal(params, ref.params())


@pytest.mark.slow
@pytest.mark.long
def test_paddle_dataset_reads_like_paddles_distributed_sampler():
    data = Pairs(40)
    loader = raydist.shard_dataloader(data, MESH, shard_dims="dp", batch_size=8)
    assert len(loader) == 5
    sampler = [paddle.io.DistributedBatchSampler(data, 4, num_replicas=2, rank=g) for g in range(2)]
    ref = Reference(sgd())
    with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=4) as dm:
        for step, (batch, i0, i1) in enumerate(zip(loader(), *sampler)):
            assert isinstance(batch, list) and len(batch) == 2
            ids = list(i0) + list(i1)
            assert_close(dm(*batch), ref.train(data.x[ids], data.y[ids]), what=f"step {step}")


def test_driver_batches_and_loader_batches_mix(tagger):
    """A model built from driver batches takes loader handles of the same layout, and back."""
    loader = raydist.shard_dataloader(dataset(), MESH, input_keys=["tag"], shard_dims="dp", batch_size=8)
    tags = np.arange(32, dtype="float32").reshape(8, 4)
    assert_close(tagger(tags), tags)
    assert len(epoch_ids(tagger, loader)) == 8
    assert_close(tagger(tags * 2), tags * 2)


def test_bad_loaders_fail_at_the_driver():
    ds = dataset()
    with pytest.raises(ValueError, match=r"input_keys \['z'\]"):
        raydist.shard_dataloader(ds, MESH, input_keys=["x", "z"], shard_dims="dp", batch_size=8)
    with pytest.raises(ValueError, match="does not divide by the 2 data-parallel groups"):
        raydist.shard_dataloader(ds, MESH, input_keys=["x"], shard_dims="dp", batch_size=7)
    with pytest.raises(ValueError, match="not a dim of the mesh"):
        raydist.shard_dataloader(ds, MESH, input_keys=["x"], shard_dims="pp", batch_size=8)
    named = ds.map(lambda r: {**r, "name": f"row{r['id']}"})
    with pytest.raises(TypeError, match="'name' has dtype object"):
        raydist.shard_dataloader(named, MESH, input_keys=["x", "name"], shard_dims="dp", batch_size=8)
    small = raydist.shard_dataloader(dataset(6), MESH, input_keys=["x"], shard_dims="dp", batch_size=8)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        iter(small())
    with pytest.raises(TypeError, match="ray.data.Dataset or a paddle.io.Dataset"):
        raydist.shard_dataloader([1, 2, 3], MESH, batch_size=2)


def test_handles_from_another_epoch_are_refused(tagger):
    loader = raydist.shard_dataloader(dataset(), MESH, input_keys=["tag"], shard_dims="dp", batch_size=8)
    old = next(iter(loader()))
    tagger(old["tag"])
    epoch = loader()
    next(epoch)
    start = time.monotonic()
    with pytest.raises(ValueError, match="finished epoch"):
        tagger(old["tag"])
    assert time.monotonic() - start < 5


@pytest.mark.slow
@pytest.mark.long
def test_a_failing_reader_surfaces_as_rank_error_not_a_hang():
    loader = raydist.shard_dataloader(Poisoned(40), MESH, shard_dims="dp", batch_size=8, prefetch=1)
    samplers = [paddle.io.DistributedBatchSampler(Pairs(40), 4, num_replicas=2, rank=g) for g in range(2)]
    poisoned_step = next(k for k, (a, b) in enumerate(zip(*samplers)) if 30 in list(a) + list(b))
    with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=4) as dm:
        start = time.monotonic()
        with pytest.raises(raydist.RankError, match="row 30 is poisoned on purpose") as info:
            for batch in loader():
                dm(*batch)
            dm.wait()  # the steps run ahead of the loop: the failure shows at the latest here
        assert "reader" in str(info.value) and f"during step {poisoned_step}" in str(info.value)
        assert time.monotonic() - start < 60


@pytest.mark.parametrize("shuffle", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_one_group_reading_every_shard_reads_the_global_batches_of_all_groups(tagger, shuffle):
    """An elastic model on fewer data-parallel groups reads the loader's shards joined
    (raydist.data.sources.JoinedSplit): the rows and order of the full-size run's global batches."""
    from raydist.data.sources import JoinedSplit

    loader = raydist.shard_dataloader(dataset(), MESH, input_keys=["tag"], shard_dims="dp", batch_size=8,
                                      shuffle=shuffle, seed=2)  # fmt: skip
    full = epoch_ids(tagger, loader)  # epoch 0, read by two groups
    joined = JoinedSplit(tuple(loader._source.splits(2, 0, shuffle, 2)))
    ids = [b["id"].tolist() for chunk in joined.chunks(8, True, ["id"], 3) for b in chunk]
    assert ids[: len(full)] == full and len(ids) == len(full) + 0  # 8 steps of 8 rows, each group's split equal
