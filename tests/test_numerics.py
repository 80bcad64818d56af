"""Distributed training through raydist equals one plain process, step by step."""

import numpy as np
import paddle
import pytest

import raydist
from models import Reference, adamw, assert_close, assert_params_equal, batches, build, sgd

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]


@pytest.mark.parametrize(
    "kind, workers, optimizer",
    [("dp", 2, sgd), ("mp", 2, adamw), pytest.param("dpmp", 4, sgd, marks=pytest.mark.slow), ("dpmp", 4, adamw)],
)
def test_training_matches_single_process(kind, workers, optimizer):
    data = batches(6)
    ref = Reference(optimizer())
    with raydist.to_static(build(kind), loss=paddle.nn.MSELoss(), optimizer=optimizer(), num_workers=workers) as dm:
        assert dm.mode == "train"
        for step, (x, y) in enumerate(data):
            assert_close(dm(x, y), ref.train(x, y), what=f"loss at step {step}")
        params = dm.state_dict("param")
    assert set(params) == set(ref.params())
    assert_params_equal(params, ref.params())


@pytest.mark.slow
def test_modes_switch_and_training_resumes():
    """train -> eval -> predict -> train -> predict -> eval, each against the reference."""
    data = batches(5, seed=3)
    ref = Reference(sgd())
    with raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=4) as dm:
        for x, y in data[:2]:
            assert_close(dm(x, y), ref.train(x, y))
        x, y = data[2]
        dm.eval()
        assert_close(dm(x, y), ref.eval(x, y))
        assert_close(dm(paddle.to_tensor(x), paddle.to_tensor(y)), ref.eval(x, y))  # paddle tensors too
        dm.predict()
        out = dm(x)
        assert isinstance(out, np.ndarray) and out.shape == (8, 6)
        assert_close(out, ref.predict(x))
        dm.train()
        for x, y in data[3:]:
            assert_close(dm(x, y), ref.train(x, y))
        dm.predict()
        assert_close(dm(data[0][0]), ref.predict(data[0][0]))
        dm.eval()
        assert_close(dm(*data[1]), ref.eval(*data[1]))
        params = dm.state_dict("param")
    assert_params_equal(params, ref.params())


@pytest.mark.slow
def test_eval_and_predict_without_optimizer():
    """Paddle 3.3.1 cannot run a DistModel without an optimizer; raydist can."""
    x, y = batches(1)[0]
    ref = Reference()
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), num_workers=2) as dm:
        assert dm.mode == "eval"
        dm.predict()  # predict first: its program initialises the parameters
        assert_close(dm(x), ref.predict(x))
        dm.eval()
        assert_close(dm(x, y), ref.eval(x, y))
        with pytest.raises(ValueError, match="optimizer"):
            dm.train()
    with raydist.to_static(build("dp"), num_workers=2) as dm:
        assert dm.mode == "predict"
        assert_close(dm(x), ref.predict(x))
        with pytest.raises(ValueError, match="loss"):
            dm.eval()


def test_input_spec_builds_at_construction():
    from paddle.static import InputSpec

    data = batches(3)
    ref = Reference(sgd())
    spec = [[InputSpec([8, 12], "float32", "x")], [InputSpec([8, 6], "float32", "y")]]
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), input_spec=spec,
                           num_workers=2) as dm:  # fmt: skip
        assert "pd_op" in dm.dist_main_program()  # built before the first step
        for x, y in data:
            assert_close(dm(x, y), ref.train(x, y))


class Classifier(paddle.nn.Layer):
    """No dist parameters at all: raydist lays the batch on all ranks as "dp"."""

    def __init__(self):
        super().__init__()
        paddle.seed(7)
        self.fc = paddle.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x)


def test_plain_layer_int64_labels_cross_entropy():
    rng = np.random.RandomState(0)
    data = [(rng.randn(8, 6).astype("float32"), rng.randint(0, 3, (8, 1)).astype("int64")) for _ in range(4)]
    net, loss_fn = Classifier(), paddle.nn.CrossEntropyLoss()
    opt = paddle.optimizer.SGD(0.1, parameters=net.parameters())
    with raydist.to_static(Classifier, loss=paddle.nn.CrossEntropyLoss(), optimizer=sgd(0.1), num_workers=2) as dm:
        for x, y in data:
            loss = loss_fn(net(paddle.to_tensor(x)), paddle.to_tensor(y))
            loss.backward()
            opt.step()
            opt.clear_grad()
            assert_close(dm(x, y), float(loss))
        assert_close(dm.state_dict("param")["fc.weight"], net.fc.weight.numpy())


class TwoHeads(paddle.nn.Layer):
    """Two outputs, column-sharded: predict assembles them from the mp shards."""

    def __init__(self):
        super().__init__()
        paddle.seed(3)
        self.fc = paddle.nn.Linear(6, 4)
        mesh = paddle.distributed.ProcessMesh([0, 1], dim_names=["mp"])
        self.fc.weight = paddle.distributed.shard_tensor(self.fc.weight, mesh, [paddle.distributed.Shard(1)])

    def forward(self, x):
        h = self.fc(x)
        return h, paddle.tanh(h)


def test_predict_several_sharded_outputs():
    x = np.random.RandomState(1).randn(8, 6).astype("float32")
    paddle.seed(3)
    h = paddle.nn.Linear(6, 4)(paddle.to_tensor(x)).numpy()
    with raydist.to_static(TwoHeads, num_workers=2) as dm:
        out = dm(x)
    assert isinstance(out, list) and len(out) == 2
    assert_close(out[0], h)
    assert_close(out[1], np.tanh(h))


@pytest.mark.parametrize("first", ["predict", "eval"])
def test_training_after_another_mode_was_built_first(first):
    """The train program built second still starts from the model's parameters and makes AdamW's state."""
    data = batches(4, seed=2)
    ref = Reference(adamw())
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2) as dm:
        x, y = data[0]
        if first == "predict":
            dm.predict()
            assert_close(dm(x), ref.predict(x))
        else:
            dm.eval()
            assert_close(dm(x, y), ref.eval(x, y))
        dm.train()
        for step, (x, y) in enumerate(data):
            assert_close(dm(x, y), ref.train(x, y), what=f"step {step}")
        assert any("moment1" in k for k in dm.state_dict("opt"))
        assert_params_equal(dm.state_dict("param"), ref.params())
