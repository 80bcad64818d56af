"""Each Strategy section and sharding stage, trained through raydist and held to one plain process.

Where Paddle cannot run a section on CPU, raydist must refuse it at the
driver, before any rank starts (the facts are canaries in test_compat.py).
"""

import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from paddle.distributed import Replicate, Shard
from paddle.distributed.fleet.utils import recompute
from ray.util.placement_group import placement_group_table

import raydist
from raydist import strategy as raydist_strategy
from models import MLP, Reference, adamw, assert_close, assert_params_equal, batches, build, sgd

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]


def train_and_compare(dm, ref, data):
    for step, (x, y) in enumerate(data):
        assert_close(dm(x, y), ref.train(x, y), what=f"loss at step {step}")
    params = dm.state_dict("param")
    assert_params_equal(params, ref.params())


def merge(k: int, avg: bool) -> dist.Strategy:
    strategy = dist.Strategy()
    strategy.gradient_merge.enable = True
    strategy.gradient_merge.k_steps = k
    strategy.gradient_merge.avg = avg
    return strategy


@pytest.mark.parametrize("kind, avg", [("dp", True), ("dp", False), ("mp", True)])
def test_gradient_merge_equals_one_process_on_whole_batches(kind, avg):
    """k micro-batches, merged: the step of one process on the whole batch (avg), or k times it (sum)."""
    data = batches(4)
    ref = Reference(sgd(0.05 if avg else 0.1))  # summing 2 micro-batch gradients doubles the step
    with raydist.to_static(build(kind), loss=paddle.nn.MSELoss(), optimizer=sgd(0.05), strategy=merge(2, avg),
                           num_workers=2) as dm:  # fmt: skip
        rows = 6 if kind == "dp" else 3  # 3 rows per rank: no 2 micro-batches
        with pytest.raises(ValueError, match="2 micro-batches"):
            dm(*(a[:rows] for a in data[3]))
        train_and_compare(dm, ref, data[:3])
        dm.eval()  # Paddle 3.3.1 would run train's merge plan here and update the parameters
        x, y = data[3]
        assert_close(dm(x, y), ref.eval(x, y))
        assert_close(dm.state_dict("param")["fc1.weight"], ref.params()["fc1.weight"])
        dm.train()
        assert_close(dm(x, y), ref.train(x, y))


class RecomputedMLP(MLP):
    def forward(self, x):
        return self.fc2(recompute(lambda t: paddle.tanh(self.fc1(t)), x))


def test_recompute_equals_one_process_and_recomputes():
    strategy = dist.Strategy({"recompute": {"enable": True}})
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    with raydist.to_static(lambda: RecomputedMLP(mesh), loss=paddle.nn.MSELoss(), optimizer=adamw(),
                           strategy=strategy, num_workers=2) as dm:  # fmt: skip
        train_and_compare(dm, Reference(adamw()), batches(3))
        # fc1's matmul runs again in the backward: 2 forward matmuls + 1 recomputed
        assert dm.dist_main_program().count('"pd_op.matmul"') == 3


def sharded_adamw(stage: int, kind: str):
    def make(params):
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"]) if kind == "dp" else \
            dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])  # fmt: skip
        stages = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}
        return dist.shard_optimizer(adamw()(params), stages[stage]("dp", mesh))

    return make


@pytest.mark.parametrize("stage, kind, workers",
                         [(1, "dp", 2), (2, "dp", 2), (3, "dp", 2), pytest.param(1, "dpmp", 4, marks=pytest.mark.slow)])
def test_sharding_stages_equal_one_process(stage, kind, workers):
    """On CPU the reduce-scatter runs as raydist's all-reduce-and-slice op (compat.collectives)."""
    with raydist.to_static(build(kind), loss=paddle.nn.MSELoss(), optimizer=sharded_adamw(stage, kind),
                           num_workers=workers) as dm:  # fmt: skip
        train_and_compare(dm, Reference(adamw()), batches(3))
        assert '"pd_op.reduce_scatter"' in dm.dist_main_program()  # the gradients were sharded


@pytest.mark.slow
def test_the_strategys_sharding_section_shards_the_optimizer():
    """Paddle 3.3.1's PIR engine ignores strategy.sharding; raydist applies it with dist.shard_optimizer."""
    strategy = dist.Strategy()
    strategy.sharding.enable, strategy.sharding.stage, strategy.sharding.degree = True, 2, 2
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), strategy=strategy,
                           num_workers=2) as dm:  # fmt: skip
        train_and_compare(dm, Reference(adamw()), batches(3))
        assert '"pd_op.reduce_scatter"' in dm.dist_main_program()
    strategy.sharding.degree = 4
    with pytest.raises(raydist.UsageError, match="degree is 4, but mesh dim 'dp' has 2 ranks"):
        raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), strategy=strategy, num_workers=2)


B, S, H = 4, 6, 8


class SequenceParallel(paddle.nn.Layer):
    """Column- then row-parallel MLP; its output reduce-scattered along the sequence for a LayerNorm."""

    def __init__(self, mesh=None):
        super().__init__()
        paddle.seed(5)
        self.fc1, self.fc2, self.norm = paddle.nn.Linear(H, 16), paddle.nn.Linear(16, H), paddle.nn.LayerNorm(H)
        self.mesh = mesh
        if mesh is not None:
            self.fc1.weight = dist.shard_tensor(self.fc1.weight, mesh, [Shard(1)])
            self.fc1.bias = dist.shard_tensor(self.fc1.bias, mesh, [Shard(0)])
            self.fc2.weight = dist.shard_tensor(self.fc2.weight, mesh, [Shard(0)])

    def forward(self, x):
        h = self.fc2(paddle.tanh(self.fc1(x)))  # partial sums on mp
        if self.mesh is not None:
            h = dist.reshard(h, self.mesh, [Shard(1)])  # sequence parallel: each rank normalises its tokens
        h = self.norm(h + 1.0)
        if self.mesh is not None:
            h = dist.reshard(h, self.mesh, [Replicate()])
        return h


def test_sequence_parallel_equals_one_process():
    rng = np.random.RandomState(0)
    data = [(rng.randn(B, S, H).astype("float32"), rng.randn(B, S, H).astype("float32")) for _ in range(3)]
    net = SequenceParallel()
    opt = sgd(0.1)(net.parameters())
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    with raydist.to_static(lambda: SequenceParallel(mesh), loss=paddle.nn.MSELoss(), optimizer=sgd(0.1),
                           num_workers=2) as dm:  # fmt: skip
        for x, y in data:
            loss = paddle.nn.functional.mse_loss(net(paddle.to_tensor(x)), paddle.to_tensor(y))
            loss.backward()
            opt.step()
            opt.clear_grad()
            assert_close(dm(x, y), float(loss))
        params = dm.state_dict("param")
    for name, value in net.state_dict().items():
        assert_close(params[name], value.numpy(), what=name)


def _strategy(**sections) -> dist.Strategy:
    return dist.Strategy(sections)


@pytest.mark.parametrize(
    "strategy, match",
    [
        (_strategy(amp={"enable": True, "dtype": "float16", "level": "o1"}), "amp"),
        (_strategy(amp={"enable": True, "dtype": "bfloat16", "level": "o2", "use_master_grad": True}), "amp"),
        (_strategy(mp_optimization={"replace_with_c_embedding": True}), "replace_with_c_embedding"),
        (_strategy(mp_optimization={"replace_with_parallel_cross_entropy": True}), "parallel_cross_entropy"),
    ],
)
def test_what_cpu_cannot_run_is_refused_before_any_rank_starts(strategy, match):
    before = len(placement_group_table())
    with pytest.raises(raydist.UsageError, match=f"{match}.* not supported on CPU"):
        raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), strategy=strategy, num_workers=2)
    assert len(placement_group_table()) == before


def test_sections_paddle_ignores_are_named():
    with pytest.warns(UserWarning, match="bogus"):
        raydist_strategy.check(_strategy(bogus={"enable": True}), use_gpu=False)
    with pytest.warns(UserWarning, match="dp_optimization"):
        raydist_strategy.check(_strategy(dp_optimization={"enable": True}), use_gpu=False)


@pytest.mark.slow
def test_fused_passes_change_nothing_on_cpu():
    """Paddle runs the fused_passes over the dense program; on CPU none of these fuses anything.

    The same program as without them, and the numbers of one process. When this
    fails, a pass started to fuse on CPU: check its numbers, then the README.
    """
    programs = {}
    for enable in (False, True):
        strategy = dist.Strategy()
        strategy.fused_passes.enable = enable
        strategy.fused_passes.fused_passes_list = ["fused_gemm_epilogue_pass", "fused_linear_param_grad_add_pass",
                                                   "fused_dropout_add_pass", "eliminate_transpose"]  # fmt: skip
        with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), strategy=strategy,
                               num_workers=2) as dm:  # fmt: skip
            train_and_compare(dm, Reference(sgd()), batches(3))
            programs[enable] = dm.dist_main_program()
    assert programs[True] == programs[False]
