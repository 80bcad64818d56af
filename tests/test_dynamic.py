"""Dynamic mode (``to_static(..., dynamic=True)``): the ranks run the layer eagerly in Paddle's
auto-parallel, no converted program; the same driver API, and the same numbers as one process."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import raydist
from raydist import compat
from helpers import KillOnce
from models import (MLP, Reference, adamw, assert_close, assert_fit_like_one_process, assert_params_equal,
                    batches, build, sgd)

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]


def _sharding(stage: int) -> paddle.distributed.Strategy:
    return paddle.distributed.Strategy({"sharding": {"enable": True, "stage": stage, "degree": 2}})


@pytest.mark.parametrize(
    "kind, workers, optimizer, strategy",
    [("dp", 2, sgd, None), ("mp", 2, adamw, None), ("dpmp", 4, adamw, None),
     ("dp", 2, adamw, 1), pytest.param("dp", 2, adamw, 2, marks=pytest.mark.slow), ("dp", 2, adamw, 3)],
    ids=["dp", "mp", "dpmp", "sharding1", "sharding2", "sharding3"],
)  # fmt: skip
def test_every_mode_equals_one_process(kind, workers, optimizer, strategy):
    data = batches(4)
    ref = Reference(optimizer())
    with raydist.to_static(build(kind), loss=paddle.nn.MSELoss(), optimizer=optimizer(), num_workers=workers,
                           strategy=_sharding(strategy) if strategy else None, dynamic=True) as dm:  # fmt: skip
        for step, (x, y) in enumerate(data[:3]):
            assert_close(dm(x, y), ref.train(x, y), what=f"loss at step {step}")
        x, y = data[3]
        dm.eval()
        assert_close(dm(x, y), ref.eval(x, y), what="eval loss")
        dm.predict()
        assert_close(dm(x), ref.predict(x), what="outputs")
        state = dm.state_dict()
    assert_params_equal(state, ref.params())
    if optimizer is adamw:  # the optimizer's state too, under static's names (the MLP's shapes tell them apart)
        ours = {state[k].shape: state[k] for k in state if k.endswith("_moment1_0") and ".dist" not in k}
        moments = [v.numpy() for k, v in ref.opt.state_dict().items() if "moment1" in k]
        assert len(ours) == len(moments) == 4, sorted(state)
        for moment in moments:
            assert_close(ours[moment.shape], moment, what=f"moment1 of shape {moment.shape}")


def test_a_layer_without_a_mesh_is_data_parallel_on_every_rank():
    """No dist.shard_tensor at all: the parameters are replicated on the ranks, the batch split."""
    data = batches(3)
    ref = Reference(adamw())
    with raydist.to_static(MLP, loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2, dynamic=True) as dm:
        for x, y in data:
            assert_close(dm(x, y), ref.train(x, y))
        assert_params_equal(dm.state_dict("param"), ref.params())


class Unconvertible(MLP):
    """A forward dy2static cannot convert: it reads a tensor's value as a Python number."""

    def forward(self, x):
        scale = [1.0, 0.0][int(x[0, 0].item() > 1e6)]
        return super().forward(x * scale)


def test_a_model_dy2static_cannot_convert_trains_in_dynamic_mode_and_static_says_where_and_what_to_do():
    data = batches(3)
    ref = Reference(sgd())
    with raydist.to_static(Unconvertible, loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2) as dm:
        with pytest.raises(raydist.UsageError) as info:
            dm(*data[0])
    message = str(info.value)
    assert "test_dynamic.py" in message and "int(x[0, 0].item() > 1e6)" in message, message
    assert "dynamic=True" in message, message
    with raydist.to_static(Unconvertible, loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           dynamic=True) as dm:  # fmt: skip
        for x, y in data:
            assert_close(dm(x, y), ref.train(x, y))
        assert_params_equal(dm.state_dict("param"), ref.params())


@pytest.mark.parametrize("first", ["static", "dynamic"])
@pytest.mark.long
def test_checkpoints_go_between_static_and_dynamic(first, tmp_path):
    """2 steps in one mode, saved; loaded by the other on another mesh, 2 more: equal to 4 steps of one process."""
    data = batches(4)
    ref = Reference(adamw())
    for x, y in data:
        ref.train(x, y)
    kinds = {"static": ("dpmp", 4), "dynamic": ("mp", 2)} if first == "static" else \
        {"dynamic": ("dpmp", 4), "static": ("mp", 2)}  # fmt: skip
    second = "dynamic" if first == "static" else "static"
    for mode, steps in ((first, data[:2]), (second, data[2:])):
        kind, workers = kinds[mode]
        with raydist.to_static(build(kind), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=workers,
                               dynamic=mode == "dynamic") as dm:  # fmt: skip
            if mode == second:
                dm.load(str(tmp_path / "ckpt"))
            for x, y in steps:
                dm(x, y)
            if mode == first:
                dm.save(str(tmp_path / "ckpt"))
            else:
                params = dm.state_dict("param")
    assert_params_equal(params, ref.params())


def test_fit_reads_a_shard_dataloader_and_a_killed_rank_comes_back_from_peer_memory(tmp_path):
    """mp2 (no replica of either rank's shards), AdamW, peer_memory=2: a rank killed mid-fit; fit goes
    on from the keepers' copy, no checkpoint, and its history equals one process, step by step."""
    marker = tmp_path / "killed"
    data = KillOnce(48, row=29, marker=str(marker))
    mesh = paddle.distributed.ProcessMesh([0, 1], dim_names=["mp"])
    loader = raydist.shard_dataloader(data, mesh, shard_dims=None, batch_size=8)
    with raydist.to_static(build("mp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=2, peer_memory=2,
                           dynamic=True) as dm:  # fmt: skip
        history = dm.fit(loader, epochs=1, max_failures=1, progress=False)
        params = dm.state_dict("param")
    assert marker.exists()  # a rank did die
    assert_fit_like_one_process(history, params, data, batch_size=8, shards=1, epochs=1, optimizer=adamw())


def test_what_dynamic_mode_cannot_run_is_refused_at_the_driver_naming_the_way_out():
    pipeline = paddle.distributed.Strategy({"pipeline": {"enable": True, "accumulate_steps": 2}})
    merge = paddle.distributed.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}})
    for strategy, section in ((pipeline, "pipeline"), (merge, "gradient_merge")):
        with pytest.raises(raydist.UsageError, match=f"strategy.{section}.*static mode.*dynamic=False"):
            raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                              strategy=strategy, dynamic=True)  # fmt: skip
    with pytest.raises(raydist.UsageError, match="no programs"):
        with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                               dynamic=True) as dm:  # fmt: skip
            dm(*batches(1)[0])
            dm.dist_main_program()


def test_reshard_defect_eager_sharding_has_no_cpu_reduce_scatter():
    """Without raydist's fix, eager sharding fails at its first step on CPU (compat.reshard)."""
    env = {"env_vars": {compat.DISABLE_ENV: "reshard"}}
    with pytest.raises(raydist.RankError, match="Unimplemented cpu kernel for CReduceScatterOp"):
        with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2,
                               strategy=_sharding(2), dynamic=True, runtime_env=env) as dm:  # fmt: skip
            dm(*batches(1)[0])


# Paddle 3.3.1's message for a forward whose line 9 reads `.item()` (dist.to_static on one rank)
TRANSFORMED = '''In transformed code:

    File "/usr/lib/python3.11/site-packages/paddle/distributed/auto_parallel/static/helper.py", line 94, in _train
	self._output_vars[mode] = self.inner_layer(*inputs)
    File "/home/me/net.py", line 9, in forward
            def forward(s, x):
                scale = [1.0, 1.0][int(x[0, 0].item() > 99)]
                ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~ <--- HERE
                return s.a(x * scale)

    File "/usr/lib/python3.11/site-packages/paddle/pir/math_op_patch.py", line 351, in _item
	if self.is_dist() and not self._is_initialized():

    AttributeError: 'paddle.base.libpaddle.pir.Value' object has no attribute '_is_initialized'
'''


def test_a_failed_conversion_names_the_users_line_the_construct_and_the_way_out():
    from raydist.worker.conversion import explain

    message = explain("train", AttributeError(TRANSFORMED))
    assert message.startswith("the train program cannot be built for these inputs: dy2static stopped at "
                              "/home/me/net.py:9 (in forward): `scale = [1.0, 1.0][int(x[0, 0].item() > 99)]`"), message
    assert "`.item()`" in message and "dynamic=True" in message, message
    assert "Paddle says: AttributeError: 'paddle.base.libpaddle.pir.Value'" in message, message
    assert explain("train", ValueError("shapes do not match")) is None
