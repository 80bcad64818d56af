"""Pure units: layouts, the rank environment (GPU included), specs. No Ray, no ranks."""

import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from raydist.env import RankPlace, executor_flags, paddle_env
from raydist.specs import TensorSpec, spec_of
from raydist.topology import Layout, Mesh, data_layout

MESH = Mesh.of([[0, 1], [2, 3]], ["dp", "mp"])


def test_mesh_coordinates():
    assert MESH.coord(0) == (0, 0) and MESH.coord(3) == (1, 1) and MESH.coord(2) == (1, 0)
    with pytest.raises(ValueError):
        Mesh((2, 2), (0, 1, 2), ("a", "b"))


def test_data_layout_splits_along_dp_and_replicates_along_mp():
    layout = data_layout(MESH, "dp", 2)
    x = np.arange(16).reshape(8, 2)
    local = {r: layout.local(x, r) for r in range(4)}
    np.testing.assert_array_equal(local[0], x[:4])
    np.testing.assert_array_equal(local[1], x[:4])  # the mp peer reads the same rows
    np.testing.assert_array_equal(local[2], x[4:])
    assert np.shares_memory(local[0], x)  # a view: nothing copied on the rank
    assert layout.key(0) == layout.key(1) == (0,) and layout.key(2) == layout.key(3) == (1,)
    assert layout.readers() == [0, 2]
    np.testing.assert_array_equal(layout.assemble(local), x)
    assert data_layout(MESH, None, 2).readers() == [0]
    with pytest.raises(ValueError, match="not dims of the mesh"):
        data_layout(MESH, "pp", 2)


def test_assemble_two_dim_sharding_and_partials():
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    layout = Layout(MESH, (0, 1))  # rows on dp, columns on mp
    local = {r: full[2 * c[0]: 2 * c[0] + 2, 3 * c[1]: 3 * c[1] + 3] for r in range(4) for c in [MESH.coord(r)]}
    np.testing.assert_array_equal(layout.assemble(local), full)
    avg = Layout(MESH, (), ((0, "avg"),))  # a loss averaged over dp
    assert avg.readers() == [0, 2]
    assert avg.assemble({0: np.float32(1.0), 2: np.float32(3.0)}) == 2.0
    total = Layout(MESH, (-1,), ((1, "sum"),))
    np.testing.assert_array_equal(total.assemble({0: np.ones(2), 1: np.ones(2) * 2}), [3, 3])


def test_a_relayed_message_reaches_every_rank_once_and_enters_each_node_once():
    from raydist.driver.dispatch.transport import relay_tree

    nodes = ["a"] * 9 + ["b"] * 8 + ["c"] * 3 + ["d"] * 2 + ["e"] * 1 + ["f"] * 1
    tree = relay_tree(nodes, fanout=4)
    reached, edges, depth = [0], [], {0: 0}
    for rank in reached:  # breadth first, from rank 0
        for child in tree[rank]:
            reached.append(child)
            edges.append((rank, child))
            depth[child] = depth[rank] + 1
    assert sorted(reached) == list(range(len(nodes)))  # every rank once: no rank gets a message twice
    crossing = [(a, b) for a, b in edges if nodes[a] != nodes[b]]
    assert sorted(nodes[b] for _, b in crossing) == list("bcdef")  # one crossing into each other node
    assert all(b == nodes.index(nodes[b]) for _, b in crossing)  # to its first rank
    assert all(len([c for c in tree[r] if nodes[c] == nodes[r]]) <= 4 for r in tree)
    assert all(len([c for c in tree[r] if nodes[c] != nodes[r]]) <= 4 for r in tree)
    assert max(depth.values()) == 3  # a: 0 -> 1..4 -> 5..8; b: 0 -> 9 -> 10..13 -> 14..16
    assert relay_tree(["x"] * 64)[0] == [1, 2, 3, 4] and max(len(c) for c in relay_tree(["x"] * 64).values()) == 4
    assert relay_tree(["x"]) == {0: []}


def test_a_relay_trees_answer_stacks_the_ranks_and_reads_like_one_answer_per_rank():
    """What `RankActor.collect` sends up: one object for many ranks. The driver's reading of it (a rank's
    results, a loss reduced over ranks) equals reading each rank's `StepResults`, bit for bit."""
    from raydist.driver.dispatch.client import MessageAnswers
    from raydist.driver.dispatch.transport import TreeAnswers
    from raydist.messages import RankAnswers, StepResults

    rng = np.random.default_rng(0)

    def results(rank):  # 3 steps: a loss, an output whose shape differs by rank, a value rank 3 does not hold
        return StepResults.of([[rng.standard_normal(()).astype("float32"), np.ones((2, rank + 1)),
                                None if rank == 3 else np.full(3, rank)] for _ in range(3)])  # fmt: skip

    by_rank = {r: results(r) for r in (0, 2, 3, 5)}  # ranks 1 and 4: not read
    leaf = {r: RankAnswers.of(r, a) for r, a in by_rank.items()}
    tree = RankAnswers.merge([leaf[0], RankAnswers.merge([leaf[3], leaf[2]]), leaf[5]])
    assert tree.ranks == (0, 3, 2, 5) and RankAnswers.merge([leaf[2]]) is leaf[2]
    loaded = pickle.loads(pickle.dumps(tree))
    assert isinstance(loaded.columns[0], np.ndarray) and loaded.columns[0].shape == (4, 3)  # one array, not 4
    assert isinstance(loaded.columns[1], list) and isinstance(loaded.columns[2], list)
    view = TreeAnswers(loaded, 6)
    assert len(view) == 6 and view[1] is None and view[4] is None
    for r, expected in by_rank.items():
        for step in range(3):
            for got, want in zip(view[r][step], expected[step]):
                assert (got is None and want is None) or np.array_equal(got, want)
    listed = [by_rank.get(r) for r in range(6)]  # what the calls transports hand the driver
    for ranks in [(0, 2, 3, 5), (5, 0)]:
        fast, slow = MessageAnswers(view).reduced(0, ranks, "avg"), MessageAnswers(listed).reduced(0, ranks, "avg")
        assert fast.dtype == slow.dtype == np.float32 and fast.tobytes() == slow.tobytes()
    # a value not stacked over the ranks (rank 3 holds none of it) is stacked by the driver
    np.testing.assert_array_equal(MessageAnswers(view).reduced(2, (0, 2), "sum"), np.full((3, 3), 2))
    assert TreeAnswers(None, 2)[0] is None and TreeAnswers(None, 2).stacked(0, (0,)) is None


def test_a_small_message_and_its_results_cross_ray_pickled_once_and_large_results_do_not():
    """`RankActor.run` given a packed parcel (what the calls transport sends) unpacks it, and packs
    its results unless their arrays are large; a parcel object (compiled graphs, the relay tree)
    gets objects back."""
    from raydist.messages import INLINE_BYTES, ArraysStep, LoaderStep, LrChange, Parcel, StepResults, pack, unpack
    from raydist.protocol import RankActor

    x = np.arange(6.0).reshape(2, 3)
    parcel = Parcel(3, (LoaderStep(0, 1, 3, ("x", "y"), (LrChange("value", (0.5,)),)), ArraysStep([x])))
    packed = pack(parcel)
    assert isinstance(packed, bytes)
    x[:] = -1  # changed after sending: the message keeps what was sent
    got = unpack(packed)
    assert got.first == 3 and got.steps[0] == parcel.steps[0]
    np.testing.assert_array_equal(got.steps[1].arrays[0], np.arange(6.0).reshape(2, 3))
    assert unpack(parcel) is parcel
    unpicklable = lambda: 0  # noqa: E731 - pickle refuses it: it travels as the object, through Ray's serializer
    assert pack(unpicklable) is unpicklable

    class Model:  # a rank's model service: each step's results
        def __init__(self, size):
            self.size, self.got = size, None

        def run(self, parcel, data):
            self.got = parcel
            return StepResults.of([[np.float32(1.5), np.zeros(self.size, np.float32)] for _ in parcel.steps])

    rank = RankActor(0, 2)
    rank._model, rank._data = Model(4), object()  # a joined rank's services
    small = rank.run(packed)
    assert isinstance(small, bytes) and unpack(small).nbytes == 2 * 4 + 2 * 4 * 4
    assert isinstance(rank.model.got, Parcel) and rank.model.got.first == 3
    assert isinstance(rank.run(parcel), StepResults)  # an object in, objects out
    rank._model = Model(INLINE_BYTES)  # its arrays go to the object store as they are, without a copy
    large = rank.run(packed)
    assert isinstance(large, StepResults) and large.nbytes > INLINE_BYTES


def test_auto_dispatch_on_cpus_relays_through_the_ranks_from_eight_on():
    from raydist.driver.dispatch.client import RankClient

    class Group:  # all a client reads of its group before the first step
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    def chosen(n, dispatch="auto"):
        return RankClient(Group(n), max_in_flight=2, dispatch=dispatch, step_timeout_s=None)._dispatch

    assert (chosen(2), chosen(7), chosen(8), chosen(64)) == ("calls", "calls", "tree", "tree")
    assert (chosen(64, "calls"), chosen(2, "tree"), chosen(2, "compiled")) == ("calls", "tree", "compiled")


def test_cpu_environment():
    places = [RankPlace("n1", "10.0.0.1")] * 2 + [RankPlace("n2", "10.0.0.2")] * 2
    eps = ["10.0.0.1:1", "10.0.0.1:2", "10.0.0.2:1", "10.0.0.2:2"]
    env = paddle_env(3, places, eps, "10.0.0.1:9", use_gpu=False)
    assert env["PADDLE_DISTRI_BACKEND"] == "gloo" and env["PADDLE_MASTER"] == "10.0.0.1:9"
    assert env["PADDLE_TRAINER_ID"] == "3" and env["PADDLE_TRAINERS_NUM"] == "4"
    assert env["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:2" and env["PADDLE_TRAINER_ENDPOINTS"] == ",".join(eps)
    assert env["PADDLE_LOCAL_RANK"] == "1" and env["PADDLE_LOCAL_SIZE"] == "2" and env["PADDLE_NNODES"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in env and "FLAGS_selected_gpus" not in env and "POD_NAME" not in env


def test_cpu_ranks_run_a_programs_ops_on_the_steps_thread_unless_their_environment_says():
    flag = "FLAGS_new_executor_serial_run"
    assert executor_flags(False, {}) == {flag: True}
    assert executor_flags(False, {flag: "0"}) == {}  # a runtime_env's env_vars: Paddle read it at import
    assert executor_flags(True, {}) == {}  # GPUs: Paddle's default


def test_gpu_environment_selects_the_gpu_ray_gave_each_rank():
    # Ray gave rank 0 GPU 3 and rank 1 GPU 1 on node n1; rank 2 GPU 0 on node n2.
    places = [RankPlace("n1", "a", ("3",)), RankPlace("n1", "a", ("1",)), RankPlace("n2", "b", ("0",))]
    eps = ["a:1", "a:2", "b:1"]
    envs = [paddle_env(r, places, eps, "a:9", use_gpu=True) for r in range(3)]
    assert all(e["PADDLE_DISTRI_BACKEND"] == "nccl" for e in envs)
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == envs[1]["CUDA_VISIBLE_DEVICES"] == "1,3"  # the node's, shared
    # each rank uses the GPU Ray accounts to it: rank 0 GPU 3 (index 1 of "1,3"), rank 1 GPU 1 (index 0)
    for env, place in zip(envs, places):
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(env["FLAGS_selected_gpus"])] == place.gpu_ids[0]
    assert [e["FLAGS_selected_gpus"] for e in envs] == ["1", "0", "0"]
    assert envs[2]["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(ValueError, match="no GPU from Ray"):
        paddle_env(0, [RankPlace("n1", "a", ())] * 2, eps[:2], "a:9", use_gpu=True)


def test_gpu_environment_sorts_the_node_gpus_as_ray_train_shares_them():
    """Ray Train's share_cuda_visible_devices sorts the node's ids as strings ("10" < "2"); the
    Ray Train integration leaves CUDA_VISIBLE_DEVICES to it and selects by the same order."""
    from ray.train.v2._internal.callbacks.accelerators import _get_visible_accelerator_ids_per_worker
    from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata

    ids = [("2",), ("10",), ("0",)]
    places = [RankPlace("n1", "a", g) for g in ids]
    metas = [ActorMetadata(hostname="h", node_id="n1", node_ip="a", pid=1, accelerator_ids={"GPU": list(g)})
             for g in ids]  # fmt: skip
    shared = _get_visible_accelerator_ids_per_worker(metas, "GPU")
    envs = [paddle_env(r, places, ["a:1", "a:2", "a:3"], "a:9", use_gpu=True) for r in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == shared
    for env, gpu in zip(envs, ids):
        assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["FLAGS_selected_gpus"])] == gpu[0]


def test_paddle_logs_are_quiet_unless_asked_for():
    places, eps = [RankPlace("n1", "a")], ["a:1"]
    assert paddle_env(0, places, eps, "a:9", use_gpu=False)["GLOG_minloglevel"] == "2"
    assert "GLOG_minloglevel" not in paddle_env(0, places, eps, "a:9", use_gpu=False, paddle_logs=True)


def test_spec_checks():
    spec = TensorSpec("x", (None, 3), "float32")
    spec.check(spec_of(np.zeros((5, 3), np.float32), "a"), "input")
    with pytest.raises(TypeError, match="dtype"):
        spec.check(spec_of(np.zeros((5, 3)), "a"), "input")
    with pytest.raises(ValueError, match=r"\(\?, 3\)"):
        spec.check(spec_of(np.zeros((5, 4), np.float32), "a"), "input")
    assert spec.resolved(spec_of(np.zeros((5, 3), np.float32), "a")).shape == (5, 3)
    laid = spec.resolved(layout=data_layout(MESH, "dp", 2))
    with pytest.raises(ValueError, match="split over the ranks"):
        laid.check(TensorSpec("x", (4, 3), "float32", data_layout(MESH, None, 2)), "input")


def test_importing_raydist_imports_no_paddle_and_no_rank_code():
    code = "import raydist, sys; print(sorted(m for m in sys.modules if m.startswith(('raydist', 'paddle'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "raydist.worker" not in out and "raydist.compat" not in out and "'paddle'" not in out


def test_default_data_meshes_follow_pipeline_stages():
    from raydist.driver.model.modes import data_meshes as _data_meshes
    from raydist.topology import Mesh, stages

    dpmp = Mesh.of([[0, 1], [2, 3]], ["dp", "mp"])
    sub = Mesh.of([0, 1], ["mp"])
    assert _data_meshes([sub, dpmp], 4) == (dpmp, dpmp)  # overlapping: the largest holds both
    first, last = Mesh.of([[0, 1]], ["dp", "mp"]), Mesh.of([[2, 3]], ["dp", "mp"])
    assert stages([first, last]) and not stages([sub, dpmp])
    assert _data_meshes([first, last], 4) == (first, last)  # inputs to the first stage, labels to the last
    assert _data_meshes([], 2)[0] == Mesh.of([0, 1], ["dp"])


@pytest.mark.parametrize("bad, says", [
    ((3, 2), "min 3 > max 2"), (0, "positive int"), ((0, 2), "two positive ints"), ((1, 2, 3), "two positive"),
    ((3, 3.5), "two positive ints"), ((1, 2), "largest size: the loader's mesh has 4 ranks"),
    ((3, 4), None),  # accepted: 4 only
])
def test_bad_num_workers_are_refused_at_the_driver(bad, says):
    """No actor starts: sizes are checked against the loader's mesh at the largest size."""
    from raydist.driver.cluster.sizes import sizes_of

    class Loader:  # what sizes_of reads of a shard_dataloader made on a dp2 x mp2 mesh
        meshes = [Mesh.of([[0, 1], [2, 3]], ["dp", "mp"])]
        dp = 2

    if says is None:
        assert sizes_of(bad, Loader()).accepted == (4,)
        return
    with pytest.raises(ValueError, match=re.escape(says)):
        sizes_of(bad, Loader())


def test_elastic_sizes_split_the_loaders_shards_evenly():
    from raydist.driver.cluster.sizes import sizes_of

    class Loader:  # dp4 x mp2 at the largest size: 8 ranks, 4 shards
        meshes = [Mesh.of(np.arange(8).reshape(4, 2), ["dp", "mp"])]
        dp = 4

    assert sizes_of((2, 8), Loader()).accepted == (2, 4, 8)  # 3 groups would split 4 shards unevenly
    assert sizes_of((2, 8), None).accepted == tuple(range(2, 9))  # driver batches: any size
    assert sizes_of((2, 8), Loader()).fitting(7) == 4 and sizes_of((2, 8), Loader()).fitting(1) == 2
    assert sizes_of((2, 8), Loader()).larger(2, 2) == 4 and sizes_of((2, 8), Loader()).larger(4, 3) is None
    assert sizes_of((3, 8), Loader()).accepted == (4, 8) and not sizes_of((5, 8), Loader()).elastic


class _Value:
    """A piece's source in the object store, faked: counts its fetches."""

    fetched = 0

    def __init__(self, array):
        self.array = np.asarray(array)

    def fetch(self):
        _Value.fetched += 1
        return self.array


def _holding(state: dict, rank: int, steps: int = 3, torn: str | None = None):
    from raydist.driver.lifecycle.recovery import Holding
    from raydist.handover import describe

    return Holding(steps, torn, describe(state, rank), {name: _Value(a) for name, (a, _) in state.items()})


def test_the_survivors_state_is_located_only_when_they_hold_all_of_it_at_one_step():
    from raydist.driver.lifecycle.recovery import locate as locate_state
    from raydist.handover import half_updated

    names = {"w", "b", "w_beta1_pow_acc_0", "b_beta1_pow_acc_0"}

    def locate(answers, names=names):
        return locate_state(answers, names)

    mesh = Mesh.of([[0, 1], [2, 3]], ["dp", "mp"])
    w = np.arange(8.0).reshape(2, 4)
    by_mp = Layout(mesh, (-1, 1))  # columns split over mp, replicated over dp

    def answer(rank, steps=3, value=w, broke_off=False, pows=(0.9, 0.9)):
        state = {"w": (by_mp.local(value, rank), by_mp), "b": (np.ones(2), None)}
        if pows:
            state.update({"w_beta1_pow_acc_0": (np.array([pows[0]]), None),
                          "b_beta1_pow_acc_0": (np.array([pows[1]]), None)})  # fmt: skip
        return _holding(state, rank, steps, half_updated(state) if broke_off else None)

    def full(found, name):
        return found[1][name].cut(None, 0)

    found = locate({2: answer(2), 3: answer(3)})  # one data-parallel group survives
    assert found[0] == 3 and np.array_equal(full(found, "w"), w) and np.array_equal(full(found, "b"), np.ones(2))
    found = locate({0: answer(0), 3: answer(3)})  # a piece from each group
    assert np.array_equal(full(found, "w"), w)
    assert "no surviving rank holds piece (1,) of 'w'" in locate({0: answer(0), 2: answer(2)})
    assert "different steps" in locate({2: answer(2), 3: answer(3, steps=4)})
    assert "replicas of 'w' differ" in locate({0: answer(0), 1: answer(1), 2: answer(2, value=w + 1), 3: answer(3)})
    assert locate({}) == "no surviving rank answered"
    # a step broken off (by a peer's death): Adam's per-parameter counts tell whether it updated half
    assert locate({2: answer(2, broke_off=True), 3: answer(3)})[0] == 3
    assert "some of its parameters were updated" in locate({2: answer(2, broke_off=True, pows=(0.81, 0.9)),
                                                            3: answer(3)})  # fmt: skip
    assert "no per-parameter step count" in locate({2: answer(2, broke_off=True, pows=()), 3: answer(3)},
                                                   {"w", "b"})  # fmt: skip
    # a tensor only a dead pipeline stage held
    assert "no surviving rank holds ['v']" in locate({2: answer(2), 3: answer(3)}, names | {"v"})


@pytest.mark.parametrize("source", [(-1, 1), (0, -1), (0, 1), (1, 0), (-1, -1)])
def test_a_new_rank_cuts_its_shard_from_only_the_pieces_that_overlap_it(source):
    """Handed-over state (`raydist.handover`): a tensor on a dp2 x mp2 mesh taken by the ranks of
    other meshes (one rank, mp4, a 2 x 2 split the other way): each gets exactly its shard, and
    fetches only the pieces its shard overlaps."""
    from raydist.handover import Tensor

    w = np.arange(48, dtype="float32").reshape(8, 6)
    old = Layout(Mesh.of([[0, 1], [2, 3]], ["dp", "mp"]), source)
    pieces = {key: _Value(old.local(w, ranks[0])) for key, ranks in old.holders().items()}
    tensor = Tensor(w.shape, "float32", old, pieces)
    targets = [None, Layout(Mesh.of([0, 1, 2, 3], ["mp"]), (0, -1)),
               Layout(Mesh.of([[0, 1], [2, 3]], ["a", "b"]), (1, 0)), Layout(Mesh.of([0, 1], ["x"]), (-1, 0))]
    for target in targets:
        ranks = target.mesh.process_ids if target is not None else (0,)
        for rank in ranks:
            _Value.fetched = 0
            mine = tensor.cut(target, rank)
            assert np.array_equal(mine, w if target is None else target.local(w, rank)), (source, target, rank)
            overlapping = sum(
                all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(_bounds(target, rank, w), _bounds(old, k, w)))
                for k in ([r[0] for r in old.holders().values()]))
            assert _Value.fetched == overlapping <= len(pieces)


def _bounds(layout, rank, array):
    """[start, stop) per dim of ``rank``'s piece under ``layout``, from `Layout.local` of an index grid."""
    if layout is None:
        return [(0, n) for n in array.shape]
    grids = np.meshgrid(*[np.arange(n) for n in array.shape], indexing="ij")
    return [(int(layout.local(g, rank).min()), int(layout.local(g, rank).max()) + 1) for g in grids]


def test_pipeline_stages_fill_in_pp_degree_and_refuse_what_paddles_schedules_would_deadlock_on():
    import paddle.distributed as dist

    from raydist.errors import UsageError
    from raydist.strategy import pipeline_stages

    def strategy(**more):
        return dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B", **more}})

    two = strategy()
    pipeline_stages(two, [Mesh.of([0], ["pp"]), Mesh.of([1], ["pp"])], 2)
    assert two.pipeline.pp_degree == 2
    by_dp = strategy()
    pipeline_stages(by_dp, [Mesh.of([0, 1], ["dp"]), Mesh.of([2, 3], ["dp"]), Mesh.of([0, 1], ["dp"])], 4)
    assert by_dp.pipeline.pp_degree == 2  # VPP: a stage's mesh comes back for its next chunk
    one = strategy()
    pipeline_stages(one, [MESH], 4)  # one stage: nothing to check
    assert one.pipeline.pp_degree == 1
    with pytest.raises(UsageError, match=r"stages .*are on ranks \[\(1,\), \(0,\)\]"):
        pipeline_stages(strategy(), [Mesh.of([1], ["pp"]), Mesh.of([0], ["pp"])], 2)  # stage 0 on rank 1
    with pytest.raises(UsageError, match="pp_degree is 3"):
        pipeline_stages(strategy(pp_degree=3), [Mesh.of([0], ["pp"]), Mesh.of([1], ["pp"])], 2)
    with pytest.raises(UsageError, match="group has 4 ranks"):  # ranks 2, 3 in no stage
        pipeline_stages(strategy(), [Mesh.of([0], ["pp"]), Mesh.of([1], ["pp"])], 4)
    pipeline_stages(None, [Mesh.of([1], ["pp"]), Mesh.of([0], ["pp"])], 2)  # no pipeline section: no schedule


def test_a_pipelines_micro_batch_size_holds_batches_to_it():
    """Paddle's static engine ignores pipeline.micro_batch_size; raydist refuses batches that
    would run micro-batches of another size, before anything is sent."""
    from raydist.driver.model.inputs import InputSpecs

    stages = Mesh.of([0, 1], ["dp"]), Mesh.of([2, 3], ["dp"])
    specs = InputSpecs(None, None, "dp", {"train": 2, "eval": 2, "predict": 2}, micro_batch_size=2)
    specs.place(*stages)
    x, y = np.zeros((8, 3), np.float32), np.zeros((8, 1), np.float32)  # 4 rows per rank: 2 micro-batches of 2
    inputs, labels = specs.for_call([spec_of(x, "x"), spec_of(y, "y")], "train")
    assert inputs[0].layout.mesh == stages[0] and labels[0].layout.mesh == stages[1]
    with pytest.raises(ValueError, match="micro_batch_size=2 rows: set accumulate_steps to 4 or send batches of 8"):
        specs.for_call([spec_of(np.zeros((16, 3), np.float32), "x"), spec_of(np.zeros((16, 1), np.float32), "y")],
                       "train")  # fmt: skip


def _loss(value: float):
    """A `Loss` whose step is done with ``value`` (no window, no ranks)."""
    from raydist import Loss
    from raydist.driver.dispatch.window import Step

    step = Step(7, None, lambda r: r, window=None)
    step._value, step.done = value, True
    return Loss(step)


@pytest.mark.parametrize("value", [2.75, -2.75, 0.5])
def test_a_loss_is_a_real_number_every_operation_of_numbers_real_acts_as_on_its_float(value):
    import cmath
    import math
    import numbers
    import operator

    from raydist import Loss

    loss = _loss(value)
    assert isinstance(loss, numbers.Real)
    abstract = set(numbers.Real.__abstractmethods__) | set(numbers.Complex.__abstractmethods__)
    concrete = {"__divmod__", "__rdivmod__", "__complex__", "real", "imag", "conjugate", "__sub__", "__rsub__", "__ne__"}
    assert all(name in vars(Loss) for name in abstract | concrete), sorted(n for n in abstract | concrete if n not in vars(Loss))

    def same(a, b):
        assert type(a) is type(b) and (a == b or (cmath.isnan(a) and cmath.isnan(b))), (a, b)

    binary = [operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
              divmod, operator.pow, operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne]
    for op in binary:
        for other in (3, 1.5, -0.25, _loss(1.25)):
            plain = float(other)
            same(op(loss, other), op(value, plain))
            same(op(other, loss), op(plain, value))
    for op in (abs, operator.neg, operator.pos, math.trunc, math.floor, math.ceil, complex, float, int, bool, round):
        same(op(loss), op(value))
    same(round(loss, 1), round(value, 1))
    same(loss.real, value.real)
    same(loss.imag, value.imag)
    same(loss.conjugate(), value.conjugate())
    same(loss // 1, value // 1)  # the one that raised TypeError
    same(hash(loss), hash(value))
    assert math.isclose(loss, value) and np.asarray(loss) == value


def test_the_rank_scheduler_refuses_an_attribute_set_that_would_reach_the_driver_only():
    import types

    import paddle

    from raydist.driver.model.schedule import RankScheduler

    sent = []
    sched = RankScheduler(paddle.optimizer.lr.StepDecay(0.1, step_size=2, gamma=0.5), sent.append)
    for name, value in (("last_epoch", 5), ("last_lr", 1.0), ("base_lr", 2.0), ("anything", 0)):
        with pytest.raises(AttributeError, match=r"step\(.*set_state_dict\("):
            setattr(sched, name, value)
    with pytest.raises(AttributeError):
        del sched.last_lr
    assert sched.last_epoch == 0 and sched.last_lr == 0.1 and sched() == 0.1 and not sent  # nothing changed
    sched.state_keys()  # Paddle's LRScheduler.state_keys sets `keys`: on the replica
    # Paddle's LRScheduler callback steps `model._optimizer._learning_rate`: it goes to the ranks
    callback = paddle.callbacks.LRScheduler(by_step=True)
    callback.set_model(types.SimpleNamespace(_optimizer=types.SimpleNamespace(_learning_rate=sched)))
    callback.on_train_batch_end(0)
    callback.on_train_batch_end(1)
    assert sched.last_epoch == 2 and sched.last_lr == 0.05 and [c.kind for c in sent] == ["step", "step"]
    sched.set_state_dict({"last_epoch": 0, "last_lr": 0.1})
    assert sched.last_lr == 0.1 and [c.kind for c in sent] == ["step", "step", "state"]


def test_each_seed_and_epoch_shuffle_their_own_way_and_the_same_on_every_run():
    """``seed + epoch`` shuffled seed 5's epoch 1 as seed 6's epoch 0; both sources now seed each pair apart."""
    import paddle

    import raydist
    from raydist.data.sources import PaddleSource, RaySource, shuffle_seed

    assert shuffle_seed(5, 1) == 3796490668 and shuffle_seed(6, 0) == 3060664978  # the same on every run and rank
    seeds = {shuffle_seed(s, e) for s in range(20) for e in range(20)}
    assert len(seeds) == 400 and all(0 <= x < 2**32 for x in seeds)

    class Shuffled(Exception):
        pass

    class Recording:  # a ray.data.Dataset's random_shuffle, recorded
        def random_shuffle(self, seed):
            raise Shuffled(seed)

    def ray_seed(seed, epoch):
        with pytest.raises(Shuffled) as info:
            RaySource(Recording()).splits(2, epoch, True, seed)
        return info.value.args[0]

    assert ray_seed(5, 1) == shuffle_seed(5, 1) != ray_seed(6, 0) == shuffle_seed(6, 0)
    assert ray_seed(None, 1) is None  # no seed: Ray Data's own random order

    class Rows(paddle.io.Dataset):
        def __getitem__(self, i):
            return np.float32(i)

        def __len__(self):
            return 64

    def paddle_order(seed, epoch, group=0):
        source = PaddleSource.__new__(PaddleSource)
        source.ref = "put"  # as if put in Ray's object store already
        split = source.splits(2, epoch, True, seed)[group]
        sampler = paddle.io.DistributedBatchSampler(Rows(), batch_size=4, num_replicas=2, rank=group, shuffle=True)
        sampler.set_epoch(split.epoch)  # as `PaddleSplit._batches` reads
        return [i for batch in sampler for i in batch]

    assert paddle_order(5, 1) == paddle_order(5, 1) and paddle_order(5, 1, 1) == paddle_order(5, 1, 1)
    assert paddle_order(5, 1) != paddle_order(6, 0) and paddle_order(5, 1, 1) != paddle_order(6, 0, 1)
    assert paddle_order(5, 1) != paddle_order(5, 2)
    assert sorted(paddle_order(5, 1) + paddle_order(5, 1, 1)) == list(range(64))
    assert paddle_order(None, 1) == paddle_order(None, 1)  # no seed: the sampler's epoch order, as Paddle's
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="seed must be"):
            raydist.shard_dataloader(Rows(), paddle.distributed.ProcessMesh([0, 1], dim_names=["dp"]), shard_dims="dp", batch_size=4,
                                     seed=bad)  # fmt: skip


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (one that died but was not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launched_scripts_process_dies_with_its_multithreaded_parent_without_preexec_fn(tmp_path):
    import inspect
    import time

    from raydist.integrations import launch

    assert "preexec_fn=" not in inspect.getsource(launch) and "libc.so.6" not in inspect.getsource(launch)
    # a parent with threads (as a Ray actor has) starts a child that would sleep for a minute, then is killed
    parent = subprocess.Popen([sys.executable, "-c", """if True:
        import subprocess, sys, threading, time
        from raydist.integrations.launch import dying_with_this_process
        for _ in range(4):
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        child = subprocess.Popen(dying_with_this_process([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]), stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "up\\n"  # the command ran, after the trampoline
        print(child.pid, flush=True)
        time.sleep(60)
        """], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        child = int(parent.stdout.readline())
        assert _running(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the child outlived its parent"
    finally:
        parent.kill()
    # a trampoline whose parent is not the one it expects (it died before prctl) runs nothing
    command = launch.dying_with_this_process([sys.executable, "-c", "print('ran')"])
    command[command.index(str(__import__("os").getpid()))] = "1"
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "ran" not in done.stdout


def test_the_users_own_modules_travel_by_value_and_installed_or_standard_ones_by_reference(tmp_path, monkeypatch):
    import importlib
    import json
    import os

    import numpy

    from raydist import pickling

    # a folder of the user's whose name merely ends like an installed one's (a path suffix said "installed")
    mine = tmp_path / "my-site-packages"
    mine.mkdir()
    (mine / "raydist_units_helpers.py").write_text("def helper():\n    return 3\n")
    monkeypatch.syspath_prepend(str(mine))
    helpers = importlib.import_module("raydist_units_helpers")
    try:
        assert pickling._is_local(helpers)
        assert pickling._is_local(sys.modules[__name__])  # this test module: not installed
        for module in (json, os, numpy, pytest, subprocess):  # standard library, installed
            assert not pickling._is_local(module), module
        import _json

        assert not pickling._is_local(_json)  # the standard library's extension modules too
        payload = pickling.dumps(helpers.helper, "a helper")  # by value: the module is not importable elsewhere
        sys.modules.pop("raydist_units_helpers")
        sys.path.remove(str(mine))  # as on another node: the module cannot be imported (monkeypatch restores the path)
        import ray.cloudpickle

        assert "raydist_units_helpers" in ray.cloudpickle.list_registry_pickle_by_value()
        assert ray.cloudpickle.loads(payload)() == 3
    finally:
        sys.modules.pop("raydist_units_helpers", None)
        import ray.cloudpickle

        if "raydist_units_helpers" in ray.cloudpickle.list_registry_pickle_by_value():
            ray.cloudpickle.unregister_pickle_by_value(helpers)


def test_checkpoint_member_names_are_percent_encoded_old_ones_still_read_and_saves_are_stamped_in_utc(tmp_path):
    import io
    import zipfile
    from datetime import datetime, timedelta

    from raydist import checkpoint

    names = ["linear_0.w_0", "blocks/0/w", "a%2Fb", "back\\x2fslash", "grad@GRAD", "100%", "é/ü", ""]
    pieces = {n: np.full((2,), i, np.float32) for i, n in enumerate(names)}
    file = checkpoint.write_pieces(str(tmp_path), 3, pieces)
    members = zipfile.ZipFile(tmp_path / file).namelist()
    assert len(members) == len(names) and not any("/" in m or "\\" in m for m in members)
    back = checkpoint.read_pieces(str(tmp_path), file)
    assert sorted(back) == sorted(names)
    for n in names:
        np.testing.assert_array_equal(back[n], pieces[n])
    # a checkpoint written before: "/" as the literal "\x2f"
    buffer = io.BytesIO()
    np.savez(buffer, **{"blocks\\x2f0\\x2fw": np.ones(2), "linear_0.w_0": np.zeros(2)})
    (tmp_path / "rank-00000.npz").write_bytes(buffer.getvalue())
    assert sorted(checkpoint.read_pieces(str(tmp_path), "rank-00000.npz")) == ["blocks/0/w", "linear_0.w_0"]
    saved_at = datetime.fromisoformat(checkpoint.manifest({}, {}, step=1)["saved_at"])
    assert saved_at.utcoffset() == timedelta(0)


def test_co_located_ranks_take_turns_at_the_custom_ops_build_under_filelocks_lock(tmp_path, monkeypatch):
    import ctypes
    import hashlib
    import inspect
    import threading
    import types

    import filelock
    import paddle
    from paddle.utils.cpp_extension import extension_utils

    from raydist.compat import collectives

    assert "fcntl" not in inspect.getsource(collectives)
    monkeypatch.setenv("RAYDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(collectives, "_loaded", False)
    monkeypatch.setattr(collectives, "_native", None)
    loaded = threading.Event()
    monkeypatch.setattr(extension_utils, "load_op_meta_info_and_register_op", lambda path: loaded.set())
    monkeypatch.setattr(ctypes, "CDLL", lambda path: types.SimpleNamespace(raydist_p2p_waited_ns=types.SimpleNamespace(),
                                                                           raydist_comm_records=types.SimpleNamespace()))
    csrc = collectives._CSRC
    digest = hashlib.sha256(b"".join((csrc / f).read_bytes() for f in ("collective.cc", "p2p.cc", "ring.h"))).hexdigest()
    build = tmp_path / f"ops-paddle{paddle.__version__}-{digest[:12]}"
    (build / collectives._NAME).mkdir(parents=True)
    (build / collectives._NAME / f"{collectives._NAME}.so").touch()  # compiled already: only loaded
    with filelock.FileLock(build / ".lock"):  # another rank on this machine holds the build
        worker = threading.Thread(target=collectives.load_ops)
        worker.start()
        assert not loaded.wait(0.5)  # it waits
    worker.join(10)
    assert loaded.is_set() and collectives._loaded


# every command form README.md and BENCHMARKS.md show, and what it parses to
BENCH_FORMS = {
    "": dict(what="models", models="mlp-mp2,mlp-dp2xmp2,gpt-mp2,gpt-dp2xmp2", runners="native,loader,batches",
             steps=60, warmup=10, repeat=1, dispatch="auto", write=False),
    "--repeat 3 --runners native,loader,batches,compiled": dict(what="models", repeat=3,
                                                                runners="native,loader,batches,compiled"),
    "--models gpt-mp2,gpt-dp2xmp2 --runners native,loader,batches --repeat 5 --steps 40": dict(
        what="models", models="gpt-mp2,gpt-dp2xmp2", repeat=5, steps=40),
    "models --dispatch compiled --write": dict(what="models", dispatch="compiled", write=True),
    "dispatch": dict(what="dispatch", ranks=[2, 4, 8, 16, 32, 64], steps=300, warmup=10, repeat=3,
                     paths="ray-calls,calls,tree,ray-compiled,compiled"),
    "dispatch --ranks 2,64 --paths calls,tree,tree-read --repeat 3 --steps 300": dict(
        what="dispatch", ranks=[2, 64], paths="calls,tree,tree-read", repeat=3, steps=300),
    "dispatch --ranks 2,32 --steps 300 --repeat 1": dict(what="dispatch", ranks=[2, 32], repeat=1),
    "restart --repeat 3": dict(what="restart", models="mlp-dp2xmp2", repeat=3, dispatch="auto"),
    "elastic --steps 24": dict(what="elastic", models="mlp-dp2xmp2,gpt-dp2xmp2", steps=24, repeat=1),
    "pipeline --steps 40 --repeat 3": dict(what="pipeline", steps=40, warmup=10, repeat=3, dispatch="auto"),
    "startup --models gpt-mp2,mlp-mp2 --repeat 2": dict(what="startup", models="gpt-mp2,mlp-mp2", repeat=2),
    "elastic --models mlp-dp2xmp2": dict(what="elastic", models="mlp-dp2xmp2", steps=24, repeat=1),
    "resume": dict(what="resume", models="gpt-mp2", steps=24, every=4, kill_after=10, repeat=3),
    "saves --repeat 3": dict(what="saves", models="gpt-mp2", steps=40, every=8, repeat=3),
    "attach": dict(what="attach", models="gpt-mp2", steps=12, before=6, repeat=3),
    "small --repeat 3": dict(what="small", models="mlp-mp2,wide-mp2", steps=300, warmup=20, repeat=3,
                             reads="never,every 10,every step", compiled=False),
    "small --models mlp-mp2 --reads never --compiled": dict(what="small", models="mlp-mp2", reads="never", compiled=True),
    "profile --models mlp-mp2 --seconds 15": dict(what="profile", models="mlp-mp2", seconds=15, every=0),
    "paired --models mlp-mp2 --rounds 20": dict(what="paired", models="mlp-mp2", rounds=20, seconds=1.0, warmup=20,
                                                reads="never,every 10,every step"),
    "paired --models wide-mp2 --rounds 30 --reads never": dict(what="paired", models="wide-mp2", rounds=30,
                                                               reads="never"),
    "paired --models mlp-mp2,block-mp2,gptblock-mp2,llama-dp2xmp2 --rounds 10": dict(
        what="paired", models="mlp-mp2,block-mp2,gptblock-mp2,llama-dp2xmp2", rounds=10),
    "paired --models wide-mp2 --rounds 10 --reads never": dict(what="paired", models="wide-mp2", rounds=10,
                                                               reads="never"),
    "peers --models gpt-mp2,gpt-pp2 --steps 40 --rounds 3 --idle-copies 8": dict(
        what="peers", models="gpt-mp2,gpt-pp2", steps=40, rounds=3, idle_copies=8, every="1,10,100", check=10),
    "recovery --models gpt-mp2,gpt-pp2 --rounds 2": dict(what="recovery", models="gpt-mp2,gpt-pp2", rounds=2,
                                                         every=10, kill_after=15, steps=30),
}


@pytest.mark.parametrize("form", list(BENCH_FORMS))
def test_the_benchs_documented_command_forms_parse_to_their_subcommands_options(form):
    from bench.run import parse

    args = vars(parse(form.split()))
    assert {k: args.get(k) for k in BENCH_FORMS[form]} == BENCH_FORMS[form]


def test_the_command_lines_help_and_refusals():
    from bench.run import parse

    for bad in ("--runners native,nope", "dispatch --ranks 2,x", "restart --steps 3", "nope"):
        with pytest.raises(SystemExit) as info:
            parse(bad.split())
        assert info.value.code == 2, bad
    for command in ([sys.executable, "-m", "bench"], [sys.executable, "-m", "raydist"]):
        done = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "COMMAND" in done.stdout, done.stderr
    assert all(f"\n    {c} " in done.stdout for c in ("launch", "status", "stop")), done.stdout  # raydist's commands
    for sub, option in (("status", "--json"), ("stop", "--force")):
        done = subprocess.run([sys.executable, "-m", "raydist", sub, "--help"], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0 and option in done.stdout and "ray://" in done.stdout, done.stderr
    for sub in ("models", "dispatch", "restart", "elastic", "pipeline", "startup", "small", "profile", "timeline"):
        done = subprocess.run([sys.executable, "-m", "bench", sub, "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and f"python -m bench {sub}" in done.stdout and "--write" in done.stdout
    for command in (["-m", "raydist", "launch"], ["-m", "raydist.launch"]):
        done = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and all(o in done.stdout for o in ("--nproc", "--paddle-logs", "--env", "--no-env")), \
            done.stderr
    done = subprocess.run([sys.executable, "-m", "raydist", "lunch"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "invalid choice: 'lunch'" in done.stderr


def test_raydist_launch_passes_the_scripts_own_arguments_and_the_env_options_through(monkeypatch, tmp_path):
    from raydist import cli
    from raydist.integrations import launch

    script = tmp_path / "train.py"
    script.touch()
    calls = []
    DEFAULTS = dict(max_restarts=0, log_dir=None, ranks_filter=None, resources_per_rank=None,
                    placement_strategy="PACK")  # fmt: skip
    monkeypatch.setattr(launch, "launch", lambda *a, **k: calls.append((a, k)) or 0)
    assert cli.main(["launch", "-n", "3", "--gpus", "--name", "job", "--env", "A=1", "--env", "B=x=y", str(script),
                     "-n", "5", "--gpus", "--env", "C=2", "x"]) == 0  # fmt: skip
    assert calls[-1] == ((str(script), ["-n", "5", "--gpus", "--env", "C=2", "x"], 3),
                         dict(use_gpu=True, paddle_logs=False, name="job", env={"A": "1", "B": "x=y"},
                              pass_env=True, **DEFAULTS))  # fmt: skip
    assert launch.main(["-n", "2", "--paddle-logs", "--no-env", str(script)]) == 0
    assert calls[-1] == ((str(script), [], 2), dict(use_gpu=False, paddle_logs=True, name=None, env={},
                                                    pass_env=False, **DEFAULTS))  # fmt: skip
    for bad in ("A", "=1"):
        with pytest.raises(SystemExit) as info:
            cli.main(["launch", "-n", "2", "--env", bad, str(script)])
        assert info.value.code == 2


def test_the_launching_environment_keeps_the_runs_variables_and_leaves_the_machines_out():
    from raydist.env import launching_env

    shell = {"FOO": "bar", "dp": "2", "FLAGS_cudnn_deterministic": "1", "OMP_NUM_THREADS": "3", "LANG": "C.UTF-8",
             "PADDLE_XCCL_BACKEND": "x", "PATH": "/usr/bin", "PYTHONPATH": "/home/me/src", "HOME": "/home/me",
             "USER": "me", "SHELL": "/bin/zsh", "PWD": "/home/me", "VIRTUAL_ENV": "/home/me/venv",
             "CONDA_PREFIX": "/opt/conda", "CUDA_VISIBLE_DEVICES": "0,1", "RAY_ADDRESS": "ray://head:10001",
             "RAY_JOB_ID": "02000000", "SSH_CONNECTION": "1.2.3.4", "XDG_RUNTIME_DIR": "/run/user/1000",
             "TERM": "xterm", "JPY_PARENT_PID": "7"}  # fmt: skip
    assert launching_env(shell) == {"FOO": "bar", "dp": "2", "FLAGS_cudnn_deterministic": "1", "OMP_NUM_THREADS": "3",
                                    "LANG": "C.UTF-8", "PADDLE_XCCL_BACKEND": "x"}  # fmt: skip


def test_ports_are_found_in_one_place():
    import socket
    from pathlib import Path

    from raydist import protocol
    from raydist.net import free_port, port_is_free

    root = Path(__file__).resolve().parent.parent
    defined = [str(p.relative_to(root)) for d in ("raydist", "tests", "bench") for p in (root / d).rglob("*.py")
               if re.search(r"^\s*def _?free_port\(", p.read_text(), re.MULTILINE)]  # fmt: skip
    assert sorted(defined) == ["raydist/net.py", "raydist/protocol.py"]  # protocol's: the rank's endpoint, a call
    assert protocol.free_port is free_port
    for host in ("", "127.0.0.1"):
        port = free_port(host)
        assert 1024 <= port < 65536 and port_is_free(port, host)
        with socket.socket() as s:
            s.bind((host, port))
            s.listen()
            assert not port_is_free(port, host) and not port_is_free(port)


def test_rays_private_apis_are_each_called_from_one_function_that_says_which_public_api_is_missing():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "raydist"
    private = re.compile(r"ray\._private|ray\._common|_internal_kv|\._meta_count|ray\.experimental")
    allowed = {
        "driver/cluster/state.py": {"recorded_address", "_draining_nodes", "_available_per_node", "_ended_jobs",
                                    "_max_resources_from_cluster_config", "autoscaler_node_types"},
    }
    for path in sorted(root.rglob("*.py")):  # every module: a new private call must be listed here
        name = str(path.relative_to(root))
        source = path.read_text()
        tree = ast.parse(source)
        owners = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for line in range(node.lineno, node.end_lineno + 1):
                    owners.setdefault(line, node)  # the outermost function: walk meets it first
        used = {}
        for number, line in enumerate(source.splitlines(), 1):
            code = line.split("#")[0]
            if private.search(code) and not code.strip().startswith(("\"", "'")):
                owner = owners.get(number)
                used.setdefault(owner.name if owner else "<module>", owner)
        assert set(used) <= allowed.get(name, set()), (name, sorted(used))
        for function in used.values():
            assert "Private Ray: " in ast.get_docstring(function) and "public API" in ast.get_docstring(function)


def test_a_ranks_staged_batches_of_an_epoch_stay_until_a_step_of_the_next_is_taken():
    """The driver runs ahead of the steps: the next epoch's batches may reach a rank before it took
    the last ones of this epoch (seen after a resize mid-epoch). They are dropped only once a step
    of the next epoch is taken (an epoch left early)."""
    import paddle

    from raydist.worker.data import Staging

    staging = Staging(paddle.CPUPlace())
    batch = {"x": np.zeros((2, 3), "float32")}
    staging.put(7, 0, 0, [batch] * 8)
    staging.put(7, 1, 0, [batch] * 8)
    for step in range(5, 8):  # steps 0-4 were "taken" before
        assert staging.take((7, 0, step), timeout=1)[0]["x"].shape() == [2, 3]
    staging.put(7, 2, 0, [batch] * 8)  # epoch 1 left early after its step 0
    staging.take((7, 1, 0), timeout=1)
    staging.take((7, 2, 0), timeout=1)
    assert not [k for k in staging._batches if k[1] < 2]
    with pytest.raises(TimeoutError):
        staging.take((7, 1, 1), timeout=0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(detached=True), r"detached=True needs a name="),
    (dict(detached=True, name="m", dispatch="compiled"), r"dispatch='compiled' cannot be detached"),
    (dict(detached=True, name="m", spare_ranks=1), r"spare_ranks cannot be used with detached=True"),
    (dict(name=""), r"name must be a non-empty str"),
])  # fmt: skip
def test_a_detached_model_without_what_it_needs_is_refused_before_anything_starts(kwargs, message, monkeypatch):
    """Refused by the argument checks, which run before Ray is even connected to."""
    import paddle

    import raydist
    from models import build, sgd

    def no_ray(*args):
        raise AssertionError("Ray was connected to before the arguments were checked")

    monkeypatch.setattr("raydist.driver.api.model.init_ray", no_ray)
    with pytest.raises(ValueError, match=message):
        raydist.to_static(build("dp"), None, paddle.nn.MSELoss(), sgd(), num_workers=2, **kwargs)


def test_a_detached_models_record_hands_it_over_by_compare_and_set_and_counts_let_go_drivers(monkeypatch):
    from raydist.driver.lifecycle import detached
    from raydist.driver.lifecycle.detached import CLIENT_HOLD_S, Holder, ModelRecord

    ended, now = set(), [1000.0]  # the cluster's ended jobs; the record's clock
    monkeypatch.setattr(detached, "ended_jobs", lambda: ended)
    monkeypatch.setattr(detached.time, "monotonic", lambda: now[0])
    a, b, c = (Holder(f"0{i}000000", 100 + i, "host", 0.0) for i in range(3))
    record = ModelRecord(a)
    assert record.claim(b, take_over=False) == (a, a)  # a lives: refused
    assert record.claim(b, take_over=True) == (b, a)  # taken over from a
    record.release(a)  # a holds it no more: nothing changes
    assert record.live_holder() == b and not record.has_let_go(a)
    record.let_go(a)
    assert record.has_let_go(a)
    ended.add(b.job_id)  # b's driver died: the next claim needs no take_over
    assert record.live_holder() is None and record.claim(c, take_over=False) == (c, None)
    record.release(c)
    assert record.live_holder() is None and record.claim(a, take_over=False) == (a, None)
    assert "pid 102 on host (Ray job 02000000, holding since" in str(c)

    # a driver through Ray Client: its job outlives it for Ray's reconnect grace, so it must look in
    remote = Holder("05000000", 105, "laptop", 0.0, client=True)
    assert record.claim(remote, take_over=True) == (remote, a) and "through Ray Client" in str(remote)
    now[0] += CLIENT_HOLD_S - 1
    assert record.beat(remote) == remote and record.live_holder() == remote
    now[0] += CLIENT_HOLD_S - 1
    assert record.live_holder() == remote and not record.has_let_go(remote)
    now[0] += 2  # silent for CLIENT_HOLD_S: gone, though its job is not over
    assert record.live_holder() is None and record.has_let_go(remote)
    assert record.claim(b, take_over=False) == (b, None)


@pytest.mark.parametrize("width, expected", [(8, 64), (4096, 32), (1 << 18, 8)])
def test_auto_prefetch_fills_a_chunk_of_four_mib_with_eight_to_sixty_four_local_batches(width, expected):
    """Rows of ``width`` float32 in local batches of 8: 256 B, 128 KiB and 8 MiB a batch."""
    import paddle

    import raydist

    class Rows(paddle.io.Dataset):
        def __getitem__(self, i):
            return np.zeros(width, np.float32)

        def __len__(self):
            return 64

    mesh = paddle.distributed.ProcessMesh([0, 1], dim_names=["dp"])
    loader = raydist.shard_dataloader(Rows(), mesh, shard_dims="dp", batch_size=16)
    assert loader.prefetch == expected
    assert loader.chunk() == max(1, min(expected, (4 << 20) // (width * 4 * 8)))
    assert raydist.shard_dataloader(Rows(), mesh, shard_dims="dp", batch_size=16, prefetch=3).prefetch == 3
    for bad in (0, -1, 1.5, True, "fast"):
        with pytest.raises(ValueError, match="prefetch must be a positive int or 'auto'"):
            raydist.shard_dataloader(Rows(), mesh, shard_dims="dp", batch_size=16, prefetch=bad)


def test_a_local_ray_gets_the_ranks_cpus_and_two_more_for_ray_data_or_the_machines(monkeypatch):
    """No more: Ray Data starts a worker process per free logical CPU, and idle ones keep polling."""
    from raydist.driver.cluster.connect import local_num_cpus

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert local_num_cpus(2, 1) == 4 and local_num_cpus(8, 1) == 10 and local_num_cpus(3, 0.5) == 4
    assert local_num_cpus(4, 0) == 2  # GPU ranks ask for no CPU
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert local_num_cpus(2, 1) == 16


def test_bench_small_rounds_rotate_their_runners():
    from bench.small import rotated

    order = ["native", "never", "every step"]
    assert [rotated(order, r) for r in range(4)] == [order, ["never", "every step", "native"],
                                                     ["every step", "native", "never"], order]


def test_bench_machine_cpu_counts_every_process_and_steps_divide_it():
    from bench.common import machine_cpu, per_step

    before = machine_cpu()
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass"])  # fmt: skip
    assert spin.wait(timeout=60) == 0
    after = machine_cpu()
    assert after[0] - before[0] >= 0.45 and after[1] >= before[1] >= 0  # another process's CPU is counted
    assert per_step((1.0, 2.0), (3.0, 2.5), 4) == {"machine_cpu_s": 0.5, "steal_s": 0.125}


def test_bench_paired_chunks_hold_whole_read_intervals_and_ratios_pair_rounds():
    from bench.paired import _process_cpu, chunk_steps, table_rows

    assert chunk_steps(1.0, 0.0024, [0, 10, 1]) == 420  # about a second, whole tens
    assert chunk_steps(1.0, 0.25, [0, 10, 1]) == 10  # never fewer than one read interval of 10
    assert chunk_steps(1.0, 0.001, [25]) == 1000
    # the ratio is taken round by round: a slow round slows both runners in it and cancels
    chunks = {"native, ideal": [{"step": 1.0, "rank_cpu": 1.0, "steal": 0.0},
                                {"step": 2.0, "rank_cpu": 2.0, "steal": 0.0},
                                {"step": 1.0, "rank_cpu": 1.0, "steal": 0.0}],
              "native, DataLoader": [{"step": 1.0, "rank_cpu": 1.0, "steal": 0.0}] * 3,
              "raydist": [{"step": 1.2, "rank_cpu": 1.1, "steal": 0.0},
                          {"step": 2.4, "rank_cpu": 2.2, "steal": 0.0},
                          {"step": 1.3, "rank_cpu": 1.1, "steal": 0.0}]}  # fmt: skip
    row = table_rows("m", chunks)[2].split(" | ")
    assert row[1:6] == ["raydist", "1300.00", "1.20", "1.20-1.30", "1.30"]
    assert row[6:8] == ["1100.00", "1.10"]
    spin = subprocess.Popen([sys.executable, "-c", "import sys, time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.3: pass\nprint('spun', flush=True)\n"
                             "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert spin.stdout.readline() == "spun\n"
        assert 0.3 <= _process_cpu([spin.pid]) < 0.6  # the process's user + system time, its start's too
    finally:
        spin.communicate(timeout=60)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_bench_rays_floor_held_for_a_step_takes_that_step_in_each_call():
    from bench.paired import RayFloor

    held, idle = RayFloor(0.05), RayFloor()
    try:
        assert held.chunk(4)["step"] >= 0.05  # every call of the 2 actors sleeps its step
        assert idle.chunk(4)["step"] < held.chunk(4)["step"]
    finally:
        held.close()
        idle.close()


def test_a_drain_watch_that_cannot_read_the_cluster_says_so_once_and_once_that_it_can_again(
        ray_session, monkeypatch, caplog):  # fmt: skip
    """As under Ray Client before raydist read the draining nodes on the cluster: the reads failed,
    the watch swallowed it, and preemption notices were ignored with nothing said."""
    import threading

    from raydist.driver.lifecycle import preemption as drains

    monkeypatch.setattr(drains, "DRAIN_POLL_S", 0.01)
    answers = iter([RuntimeError("Ray has not been started yet")] * 5 + [{"n1": 0}] * 5 +
                   [RuntimeError("GCS unavailable")] * 5)  # fmt: skip
    done, after = threading.Event(), []

    def read():
        answer = next(answers, None)
        if answer is None:  # the second read past the script: the first one's answer is told
            after.append(1)
            if len(after) == 2:
                done.set()
            return {"n1": 0}
        if isinstance(answer, Exception):
            raise answer
        return answer

    with caplog.at_level("WARNING", logger="raydist"):
        watch = drains.DrainWatch(read)
        assert done.wait(10)
        watch.stop()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said
    assert said[0].startswith("raydist: cannot read the cluster's state (RuntimeError: Ray has not been started yet)")
    assert "preemption notices (Ray draining a node) are not acted on until it can" in said[0]
    assert said[1] == "raydist: the cluster's state reads again: preemption notices are acted on"
    assert "GCS unavailable" in said[2] and said[3] == said[1]
    assert watch.notice(["n1"]) == drains.Notice(frozenset({"n1"}), None)


def test_a_ranks_metrics_go_on_when_a_part_of_its_steps_took_no_time(ray_session, monkeypatch):
    """Driver batches never wait for data: a 0-second part is not counted (Ray's Counter refuses
    0), and the exporting thread goes on to the next interval."""
    import time

    from raydist.worker import steplog

    monkeypatch.setattr(steplog, "EXPORT_S", 0.02)
    log = steplog.StepLog()
    exporter = steplog.Exporter(log, "units", 0)
    try:
        for number in range(3):
            log.add(number, "train", 100, 100, 200)  # asked and fed at once
            deadline = time.monotonic() + 10
            while exporter.exported <= number and time.monotonic() < deadline:
                time.sleep(0.01)
            assert exporter.exported == number + 1, "the export of an interval with no data wait failed"
    finally:
        exporter.stop()


def _import_graph(package: str) -> dict[str, set[str]]:
    """``package``'s modules and the package modules each imports: every import, lazy ones
    inside functions and those for types only (under ``if TYPE_CHECKING:``) too."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
             for f in (root / package).rglob("*.py")}  # fmt: skip
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        graph[name] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module  # fmt: skip
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            # a module importing the package it is in runs that package's __init__: not an edge back
            graph[name] |= {t for t in targets if t in files and t != name and not name.startswith(t + ".")}
    return graph


@pytest.mark.parametrize("package", ["raydist", "bench"])
def test_no_import_circles(package):
    """Imports flow one way: no module reaches itself through others (lazy imports count, and those
    for types only: a module's types are read with it)."""
    graph = _import_graph(package)
    circles = []

    def visit(module, path, seen):
        for nxt in graph[module]:
            if nxt == path[0]:
                circles.append(path + [nxt])
            elif nxt not in seen and nxt > path[0]:  # each circle found once, from its smallest module
                seen.add(nxt)
                visit(nxt, path + [nxt], seen)

    for start in sorted(graph):
        visit(start, [start], {start})
    assert not circles, "\n".join(" -> ".join(c) for c in circles[:10])


# Paddle's private members and internals: raydist reads them in raydist/compat only, each through a
# guarded function (raydist.compat.engine's, compat.callbacks, compat.executor...)
PADDLE_PRIVATE = re.compile(r"\bengine\._\w+|\._engine\b|_pir_\w*progs|_current_expected_place|_dygraph_guard|"
                            r"_C_ops|config_callbacks|_executor_cache|_pir_feed_data|_raydist_plans")


def test_paddles_private_members_are_read_in_compat_only():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "raydist"
    found = []
    for path in sorted(root.rglob("*.py")):  # every module of the package
        if path.relative_to(root).parts[0] == "compat":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PADDLE_PRIVATE.search(line.split("#")[0]):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_bench_writes_a_table_only_when_asked_and_replaces_that_command_lines_last(tmp_path, monkeypatch):
    from bench import run

    monkeypatch.setattr(run, "RESULTS", tmp_path)
    monkeypatch.setattr(run, "machine", lambda: "a machine")
    argv = ["paired", "--models", "mlp-mp2", "--rounds", "2"]
    run._write(run.parse(argv), argv, "| first |")
    assert list(tmp_path.iterdir()) == []  # not asked
    for table in ("| first |", "| second |"):
        run._write(run.parse([*argv, "--write"]), [*argv, "--write"], table)
    [written] = list(tmp_path.iterdir())
    text = written.read_text()
    assert text.startswith("# `python -m bench paired --models mlp-mp2 --rounds 2`")
    assert "| second |" in text and "| first |" not in text and "a machine" in text and "code " in text
