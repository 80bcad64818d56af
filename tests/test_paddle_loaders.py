"""Paddle's own loaders given to a DistModel, as a user porting a Paddle script would."""

import paddle
import pytest

import raydist
from models import Reference, Rows, assert_close, assert_params_equal, build, sgd


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(180)
def test_a_paddle_dataloader_gives_the_specs_and_its_batches_train_like_one_process():
    rows = Rows(48)
    loader = paddle.io.DataLoader(rows, batch_size=8, shuffle=False, drop_last=True)
    reference = Reference(sgd())
    with raydist.to_static(build("dp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=2) as dm:
        # as Paddle's DistModel: the specs come from the loader, so the train program exists before any step
        assert "matmul" in dm.dist_main_program("train")
        losses = [dm(batch["x"], batch["y"]) for batch in loader]
        expected = [reference.train(rows.x[i:i + 8], rows.y[i:i + 8]) for i in range(0, 48, 8)]
        assert_close([float(loss) for loss in losses], expected)
        assert_params_equal(dm.state_dict("param"), reference.params())


def test_paddles_shard_dataloader_is_refused_saying_what_to_write_instead():
    from paddle.distributed.auto_parallel.api import ShardDataloader

    stand_in = object.__new__(ShardDataloader)  # made on the driver, it would need a process group
    with pytest.raises(TypeError, match=r"raydist.shard_dataloader\(dataset, meshes"):
        raydist.to_static(build("dp"), stand_in, paddle.nn.MSELoss(), sgd(), num_workers=2)


def test_a_paddle_dataloader_without_batches_is_refused_before_any_rank_starts():
    empty = paddle.io.DataLoader(Rows(4), batch_size=8, drop_last=True)
    with pytest.raises(ValueError, match="yields no batch"):
        raydist.to_static(build("dp"), empty, paddle.nn.MSELoss(), sgd(), num_workers=2)
