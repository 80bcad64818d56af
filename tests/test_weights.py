"""Weights that leave raydist and come in: `DistModel.export` to safetensors and ``paddle.save`` files,
``to_static(..., weights=...)`` from those and from Paddle's ``dist.save_state_dict`` checkpoints, on
any mesh; each against one plain process (`raydist.weights`)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

import raydist
from raydist import weights
from models import MLP, Reference, adamw, assert_close, assert_params_equal, batches, build

# -- the formats, in this process ---------------------------------------------------------------

TENSORS = {"a.weight": np.arange(24, dtype="float32").reshape(4, 6), "b.bias": np.ones(6, "float32"),
           "c": np.arange(8, dtype="int64")}  # fmt: skip


@pytest.mark.parametrize("format", weights.FORMATS)
@pytest.mark.parametrize("shard_bytes", [100, 10**9], ids=["shards", "one-file"])
def test_an_export_plan_writes_files_a_reader_reads_back_box_by_box(format, shard_bytes, tmp_path):
    files = weights.plan_files({n: (a.shape, str(a.dtype)) for n, a in TENSORS.items()}, format, shard_bytes)
    for file, names in files:
        weights.write_file(str(tmp_path / file), format, {n: TENSORS[n] for n in names})
    weights.write_index(str(tmp_path), format, files, sum(a.nbytes for a in TENSORS.values()))
    one, _, index = {"safetensors": ("model.safetensors", 0, "model.safetensors.index.json"),
                     "paddle": ("model_state.pdparams", 0, "model_state.pdparams.index.json")}[format]  # fmt: skip
    if shard_bytes == 100:  # 96 bytes of a.weight, then the rest: two shards and an index
        assert [f for f, _ in files] == [one.replace(".", "-00001-of-00002.", 1), one.replace(".", "-00002-of-00002.", 1)]
        mapping = json.loads((tmp_path / index).read_text())
        assert mapping["weight_map"] == {"a.weight": files[0][0], "b.bias": files[1][0], "c": files[1][0]}
        assert mapping["metadata"]["total_size"] == 184
    else:
        assert files == [(one, list(TENSORS))] and not (tmp_path / index).exists()
    assert sorted(os.listdir(tmp_path)) == sorted([f for f, _ in files] + ([index] if shard_bytes == 100 else []))
    for where in [str(tmp_path)] + ([str(tmp_path / one)] if shard_bytes != 100 else [str(tmp_path / index)]):
        reader = weights.open_weights(where)
        assert reader.names() == set(TENSORS)
        assert reader.shape("a.weight") == (4, 6)
        np.testing.assert_array_equal(reader.read("a.weight", [(2, 4), (1, 5)]), TENSORS["a.weight"][2:4, 1:5])
        np.testing.assert_array_equal(reader.read("c", [(0, 8)]), TENSORS["c"])


def test_the_files_are_the_ecosystems_own():
    """safetensors' own loader and paddle.load read what raydist writes, names, dtypes and values."""
    from safetensors.numpy import load_file

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        weights.write_file(os.path.join(d, "model.safetensors"), "safetensors", TENSORS)
        weights.write_file(os.path.join(d, "model_state.pdparams"), "paddle", TENSORS)
        for loaded in (load_file(os.path.join(d, "model.safetensors")),
                       paddle.load(os.path.join(d, "model_state.pdparams"), return_numpy=True)):  # fmt: skip
            assert set(loaded) == set(TENSORS)
            for name, value in TENSORS.items():
                assert np.asarray(loaded[name]).dtype == value.dtype
                np.testing.assert_array_equal(np.asarray(loaded[name]), value)


@pytest.mark.parametrize("size, expected", [(10, 10), ("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1.5kb", 1500)])
def test_max_shard_size_reads_as_save_pretrained_does(size, expected):
    assert weights.parse_size(size) == expected


@pytest.mark.parametrize("size", [0, "five", "5 GiG", True])
def test_a_bad_max_shard_size_is_refused(size):
    with pytest.raises(ValueError, match="max_shard_size"):
        weights.parse_size(size)


def test_weights_that_are_not_there_or_a_raydist_checkpoint_are_told_apart(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        weights.detect(str(tmp_path / "nothing"))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match=r"raydist checkpoint: load it with dm.load\(path\)"):
        weights.detect(str(tmp_path / "ck"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    with pytest.raises(ValueError, match=r"no \*.safetensors, \*.pdparams"):
        weights.detect(str(tmp_path / "other"))


# A plain Paddle script that writes Paddle's distributed checkpoint of the MLP's initial weights (seed 5)
# with dist.save_state_dict: in one process, or on two ranks of `raydist launch` with each weight sharded
# (fc1 by columns, fc2 by rows) the way a tensor-parallel run holds them.
SAVES_DISTCP = """
import sys
import paddle, paddle.distributed as dist
sys.path.insert(0, {tests!r})
from models import MLP
if dist.get_world_size() > 1:
    dist.init_parallel_env()
    layer = MLP(dist.ProcessMesh([0, 1], dim_names=["mp"]), seed=5)
else:
    layer = MLP(seed=5)
dist.save_state_dict(layer.state_dict(), sys.argv[1])
"""


def _distcp(tmp_path, ranks: int) -> str:
    script = tmp_path / "saves_distcp.py"
    script.write_text(SAVES_DISTCP.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / f"distcp{ranks}"
    if ranks == 1:
        done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    else:  # on the session's Ray
        from raydist.launch import launch

        printed = io.StringIO()
        assert launch(str(script), [str(out)], ranks, stdout=printed, stderr=printed) == 0, printed.getvalue()
    return str(out)


def test_a_distributed_checkpoint_of_one_process_reads_as_its_weights(tmp_path):
    reader = weights.open_weights(_distcp(tmp_path, 1))
    expected = MLP(seed=5).state_dict()
    assert reader.names() == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(reader.read(name, [(0, n) for n in value.shape]), value.numpy())
    np.testing.assert_array_equal(reader.read("fc1.weight", [(3, 7), (10, 20)]), expected["fc1.weight"].numpy()[3:7, 10:20])


LINEAR = {"fc1.weight", "fc2.weight"}  # the MLP's paddle.nn.Linear weights


# -- through the ranks -------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_model_trained_on_dp_x_mp_exports_its_full_weights_and_another_mesh_starts_from_them(dynamic, tmp_path):
    """dp2 x mp2, 3 AdamW steps, then export: the safetensors shards (a 90-byte limit: a file per tensor, and an index)
    and the paddle file hold exactly `state_dict("param")`, read by safetensors' and Paddle's own
    loaders; the model trains on after them as one process does. A model on mp2 (another mesh) and one
    on a single rank start from each export (the weights, a fresh optimizer) and train on as one
    process given the same weights does, step for step."""
    from safetensors.numpy import load_file

    data = batches(6)
    dm = raydist.to_static(build("dpmp"), None, paddle.nn.MSELoss(), adamw(), num_workers=4, dynamic=dynamic)
    try:
        for x, y in data[:3]:
            dm(x, y)
        params = dm.state_dict("param")
        files = dm.export(str(tmp_path / "st"), max_shard_size=90)
        assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
        index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(params) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        read = {}
        for file in files:
            read.update(load_file(str(tmp_path / "st" / file)))
        assert dm.export(str(tmp_path / "pd"), format="paddle") == ["model_state.pdparams"]
        pd = paddle.load(str(tmp_path / "pd" / "model_state.pdparams"), return_numpy=True)
        for name, value in params.items():  # Linear weights: [out, in] in safetensors, as Hugging Face's
            np.testing.assert_array_equal(read[name], value.T if name in LINEAR else value)
            np.testing.assert_array_equal(pd[name], value)
        with pytest.raises(ValueError, match="exists: raydist never overwrites"):
            dm.export(str(tmp_path / "pd"), format="paddle")
        later = [dm(x, y) for x, y in data[3:]]
        later = [float(loss) for loss in later]
    finally:
        dm.shutdown()
    whole = Reference(adamw())  # the exports leave the model training on as one process does
    assert_close(later, [whole.train(x, y) for x, y in data][3:], rtol=1e-5)
    reference = Reference(adamw())  # the weights, a fresh optimizer
    reference.net.set_state_dict({n: paddle.to_tensor(v) for n, v in params.items()})
    expected = [reference.train(x, y) for x, y in data[3:]]
    for source, kind, workers in ((tmp_path / "st", "mp", 2), (tmp_path / "pd" / "model_state.pdparams", "one", 1)):
        started = raydist.to_static(build(kind), None, paddle.nn.MSELoss(), adamw(), num_workers=workers,
                                    dynamic=dynamic, weights=str(source))  # fmt: skip
        try:
            assert_params_equal(started.state_dict("param"), params, rtol=0, atol=0)
            losses = [float(started(x, y)) for x, y in data[3:]]
            assert_close(losses, expected, rtol=1e-5)
            assert_params_equal(started.state_dict("param"), reference.params(), atol=1e-5)
        finally:
            started.shutdown()


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_paddles_distributed_checkpoints_of_one_process_and_of_two_sharded_ranks_start_a_model_on_any_mesh(tmp_path):
    """``dist.save_state_dict`` of the MLP's weights, written by one process and by two ranks holding them
    sharded (fc1 by columns, fc2 by rows), starts models on dp2 x mp2 and on mp2: their parameters are
    the written ones, and their steps are one process's from them."""
    written = MLP(seed=5).state_dict()
    data = batches(3)
    reference = Reference(adamw(), seed=5)
    expected = [reference.train(x, y) for x, y in data]
    for path in (_distcp(tmp_path, 1), _distcp(tmp_path, 2)):
        for kind, workers in (("dpmp", 4), ("mp", 2)):
            dm = raydist.to_static(build(kind), None, paddle.nn.MSELoss(), adamw(), num_workers=workers, weights=path)
            try:
                assert_params_equal(dm.state_dict("param"), {n: v.numpy() for n, v in written.items()}, rtol=0, atol=0)
                assert_close([float(dm(x, y)) for x, y in data], expected, rtol=1e-5)
            finally:
                dm.shutdown()


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_weights_of_another_layer_are_refused_naming_what_differs(tmp_path):
    from safetensors.numpy import save_file

    values = {n: v.numpy().T if n in LINEAR else v.numpy() for n, v in MLP().state_dict().items()}
    save_file({n: v for n, v in values.items() if n != "fc2.bias"}, str(tmp_path / "lacks.safetensors"))
    save_file({**values, "fc2.bias": np.zeros(7, "float32")}, str(tmp_path / "shape.safetensors"))
    for file, said in (("lacks", r"they lack \['fc2.bias'\]"), ("shape", r"'fc2.bias' is \(7,\) there, \(6,\) in the layer")):
        with pytest.raises(raydist.UsageError, match=said):
            raydist.to_static(build("mp"), None, paddle.nn.MSELoss(), adamw(), num_workers=2,
                              weights=str(tmp_path / f"{file}.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="no such file"):  # at the driver, before any rank starts
        raydist.to_static(build("mp"), None, paddle.nn.MSELoss(), adamw(), num_workers=2, weights=str(tmp_path / "x"))
    with pytest.raises(TypeError, match="weights must be a path or raydist.Weights"):
        raydist.to_static(build("mp"), None, paddle.nn.MSELoss(), adamw(), num_workers=2, weights=3)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_a_bad_export_is_refused_at_the_driver(tmp_path):
    dm = raydist.to_static(build("mp"), None, paddle.nn.MSELoss(), adamw(), num_workers=2)
    try:
        with pytest.raises(ValueError, match="format must be one of"):
            dm.export(str(tmp_path / "x"), format="onnx")
        with pytest.raises(ValueError, match="max_shard_size"):
            dm.export(str(tmp_path / "x"), max_shard_size="big")
        assert not (tmp_path / "x").exists()
        # before any step: the builder's initial weights
        dm.export(str(tmp_path / "first"))
        from safetensors.numpy import load_file

        first = load_file(str(tmp_path / "first" / "model.safetensors"))
        assert_params_equal({n: v.T if n in LINEAR else v for n, v in first.items()}, Reference().params(),
                            rtol=0, atol=0)  # fmt: skip
    finally:
        dm.shutdown()
