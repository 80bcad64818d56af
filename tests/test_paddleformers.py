"""PaddleFormers' models through raydist, as a PaddleFormers user writes them, held to one plain process.

A tiny ``LlamaForCausalLM`` (PaddleFormers installed with pip, the ``paddleformers`` extra),
wrapped in a Layer that returns its logits, cross-entropy over the vocabulary, AdamW. Paddle's
dy2static cannot convert PaddleFormers' configs (`raydist.compat.dy2static`): the user's code
has no workaround. Tensor parallel uses PaddleFormers' own plan (``auto_dist_config``).
"""

import hashlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import paddle
import paddle.distributed as dist
import pytest

import raydist
from models import assert_close, assert_params_equal

try:
    import paddleformers
except ImportError:  # the suite's environment: the tests run in one of their own (the last test)
    paddleformers = None

REPO = pathlib.Path(__file__).resolve().parent.parent
PADDLEFORMERS = "paddleformers>=1.2,<1.3"  # what a user adds beside raydist (pyproject's extra names the same)
here = pytest.mark.skipif(paddleformers is None, reason="PaddleFormers is not installed here: run in an "
                          "environment of its own by test_in_an_environment_with_paddleformers_from_pip")  # fmt: skip

VOCAB, SEQ, BATCH = 256, 16, 4


def llama_config():
    from paddleformers.transformers import LlamaConfig

    # fuse_rms_norm: the fused kernel exists on GPUs only
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       use_single_model_implementation=True, tie_word_embeddings=False, fuse_rms_norm=False,
                       use_flash_attention=False, fuse_attention_qkv=False, _attn_implementation="eager")  # fmt: skip


class CausalLM(paddle.nn.Layer):
    """A PaddleFormers causal LM as DistModel takes it: token ids in, logits out."""

    def __init__(self):
        super().__init__()
        from paddleformers.transformers import LlamaForCausalLM

        paddle.seed(7)
        self.lm = LlamaForCausalLM(llama_config())

    def forward(self, ids):
        return self.lm(input_ids=ids, return_dict=False)[0]


def plan(layer: CausalLM) -> dict:
    """PaddleFormers' tensor-parallel plan for ``layer``, with two of its defects (PaddleFormers
    1.2.0; the asserts fail when it changes): its keys name the decoder "llama.", where the model's
    sublayer is "model."; and it marks ``lm_head.weight`` column-parallel, but its LMHead keeps the
    weight as [vocab, hidden] and multiplies with ``transpose_y``, so that split cuts the hidden
    dim and Paddle's matmul rule refuses the program (the head stays replicated here)."""
    keys = layer.lm.auto_dist_config(prefix="lm.")["mp_config"]["parallelize_plan"]
    assert all(key.startswith(("lm.llama.", "lm.lm_head.")) for key in keys), sorted(keys)
    assert tuple(layer.lm.lm_head.weight.shape) == (VOCAB, 64)
    return {key.replace("lm.llama.", "lm.model."): value for key, value in keys.items() if "lm_head" not in key}


def build(dims: tuple[int, int]):
    """The LM on a dp x mp mesh of ``dims``; PaddleFormers' plan along "mp"."""

    def build_layer():
        from paddle.distributed.auto_parallel.intermediate.parallelize import parallelize_model

        dp, mp = dims
        layer = CausalLM()
        if mp == 1:
            mesh, config = dist.ProcessMesh(list(range(dp)), dim_names=["dp"]), {"dp_config": {"sharding_level": 0}}
        elif dp == 1:
            mesh, config = dist.ProcessMesh(list(range(mp)), dim_names=["mp"]), {}
        else:
            mesh = dist.ProcessMesh(np.arange(dp * mp).reshape(dp, mp).tolist(), dim_names=["dp", "mp"])
            config = {"dp_config": {"sharding_level": 0}}
        if mp > 1:
            config["mp_config"] = {"parallelize_plan": plan(layer)}
        return parallelize_model(layer, mesh=mesh, config=config)

    return build_layer


class TokenLoss(paddle.nn.Layer):
    def forward(self, logits, labels):
        return paddle.nn.functional.cross_entropy(logits.reshape([-1, VOCAB]).astype("float32"),
                                                  labels.reshape([-1, 1]))  # fmt: skip


def adamw(params):
    return paddle.optimizer.AdamW(1e-3, parameters=params)


def tokens(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype("int64") for _ in range(steps)]
    return [(i[:, :-1], i[:, 1:]) for i in ids]


def one_process(data):
    layer = CausalLM()
    opt, loss_fn = adamw(layer.parameters()), TokenLoss()
    losses = []
    for ids, labels in data:
        loss = loss_fn(layer(paddle.to_tensor(ids)), paddle.to_tensor(labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    with paddle.no_grad():
        logits = layer(paddle.to_tensor(data[0][0])).numpy()
    return losses, {k: v.numpy() for k, v in layer.state_dict().items()}, logits


@pytest.fixture(scope="module")
def expected():
    return one_process(tokens(4))


@here
@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dims, dynamic", [((2, 1), False), ((1, 2), False), ((2, 2), False), ((2, 1), True),
                                           ((1, 2), True)])  # fmt: skip
def test_paddleformers_llama_trains_as_one_process(dims, dynamic, expected):
    """Static (dy2static converts it, with raydist's compat) and dynamic (the ranks run it eagerly)."""
    losses, params, logits = expected
    data = tokens(4)
    with raydist.to_static(build(dims), loss=TokenLoss(), optimizer=adamw, num_workers=dims[0] * dims[1],
                           dynamic=dynamic) as dm:  # fmt: skip
        for step, (ids, labels) in enumerate(data):
            assert_close(dm(ids, labels), losses[step], rtol=1e-5, what=f"loss at step {step}")
        state = dm.state_dict("param")
        # AdamW divides each update by its gradient's own scale: float32 rounding in a gradient near
        # zero moves a parameter by up to lr x 1e-2 (seen: 9.5e-6 on one of 8192 elements, mp2)
        assert_params_equal(state, params, rtol=1e-5, atol=2e-5)
        dm.predict()
        assert_close(dm(data[0][0]), logits, rtol=1e-5, atol=5e-5, what="logits")  # through those parameters
        if dims[1] > 1:  # PaddleFormers' plan shards the projections along mp
            layout = dm._state.meta()["lm.model.layers.0.mlp.up_proj.weight"][2]
            assert layout.dims_mapping[1] == layout.mesh.dim("mp")  # [hidden, intermediate]: columns over mp


@here
@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(600)
def test_weights_leave_for_from_pretrained_and_come_back_from_save_pretrained(expected, tmp_path):
    """Trained on dp2 x mp2 and exported (``prefix="lm."``: the LlamaForCausalLM inside the wrapper) as
    safetensors shards with PaddleFormers' config beside: ``LlamaForCausalLM.from_pretrained`` of it gives
    the logits ``dm.predict`` gives. And back: PaddleFormers' own ``save_pretrained`` of one process's
    trained model starts a raydist model on mp2 with those parameters, which predicts its logits."""
    from paddleformers.transformers import LlamaForCausalLM

    losses, params, logits = expected
    data = tokens(4)
    with raydist.to_static(build((2, 2)), loss=TokenLoss(), optimizer=adamw, num_workers=4) as dm:
        for ids, labels in data:
            dm(ids, labels)
        files = dm.export(str(tmp_path / "out"), max_shard_size="100KB", prefix="lm.")
        dm.predict()
        predicted = dm(data[0][0])
    assert len(files) > 2 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    llama_config().save_pretrained(str(tmp_path / "out"))
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))
    loaded.eval()
    with paddle.no_grad():
        theirs = loaded(input_ids=paddle.to_tensor(data[0][0]), return_dict=False)[0].numpy()
    assert_close(theirs, predicted, rtol=1e-5, atol=5e-5, what="from_pretrained's logits")
    assert_params_equal({f"lm.{k}": v.numpy() for k, v in loaded.state_dict().items()}, params, rtol=1e-5, atol=2e-5)

    loaded.save_pretrained(str(tmp_path / "theirs"))  # PaddleFormers' own files: its names, its layout
    weights = raydist.Weights(str(tmp_path / "theirs"), prefix="lm.")
    with raydist.to_static(build((1, 2)), loss=TokenLoss(), optimizer=adamw, num_workers=2, weights=weights) as dm:
        assert_params_equal(dm.state_dict("param"), {f"lm.{k}": v.numpy() for k, v in loaded.state_dict().items()},
                            rtol=0, atol=0)  # fmt: skip
        dm.predict()
        assert_close(dm(data[0][0]), theirs, rtol=1e-5, atol=5e-5, what="logits from save_pretrained's weights")


@pytest.mark.skipif(paddleformers is not None, reason="PaddleFormers is installed here: the tests above ran")
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.long
def test_in_an_environment_with_paddleformers_from_pip():
    """A user's place: ``pip install raydist paddleformers`` in a virtual environment over this one
    (PaddleFormers pins numpy 1.26, which the suite's own environment does not have: raydist's own
    ranges must let the resolver pick what imports), and this file's tests run there, the driver in
    its own process. The environment is kept between runs under raydist's cache directory, one per
    version of raydist's dependencies."""
    cache = pathlib.Path(os.environ.get("RAYDIST_CACHE_DIR", pathlib.Path.home() / ".cache" / "raydist"))
    venv = cache / f"pfenv-{hashlib.sha1((REPO / 'pyproject.toml').read_bytes()).hexdigest()[:10]}"
    python = venv / "bin" / "python"
    if not (venv / "installed").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        install = subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", str(REPO), PADDLEFORMERS],
                                 capture_output=True, text=True, timeout=1200)  # fmt: skip
        assert install.returncode == 0, install.stderr[-3000:]
        (venv / "installed").touch()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tempfile.mkdtemp(prefix="rdpf", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    # -m "": this test (long) is collected there too, and skips itself where PaddleFormers is installed
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", __file__],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert run.returncode == 0 and "7 passed, 1 skipped" in run.stdout, run.stdout[-5000:] + run.stderr[-2000:]


@here
@pytest.mark.timeout(900)
def test_the_example_trains_is_interrupted_resumes_and_ends_as_an_uninterrupted_dynamic_run(tmp_path):
    """examples/paddleformers_llama.py as a user runs it (its own process and local Ray), mp2, 30 steps:
    interrupted (Ctrl-C) once its checkpoint after step 10 is complete, then run again with --resume;
    it ends with the losses of an uninterrupted run in dynamic mode (--dynamic), and the loss fell."""
    def run(out, *flags, interrupt_after=None):
        cmd = [sys.executable, str(REPO / "examples" / "paddleformers_llama.py"), "--out", str(out), "--steps", "30"]
        env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="rdex", dir="/tmp")}
        env.pop("RAY_ADDRESS", None)
        with open(tmp_path / "log", "w+") as log:
            process = subprocess.Popen([*cmd, *flags], env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            if interrupt_after is not None:
                while not any(p.endswith(interrupt_after) for p in raydist.checkpoint.complete(str(out))):
                    assert process.poll() is None, "the run ended before its checkpoint"
                    time.sleep(0.2)
                process.send_signal(signal.SIGINT)
            code = process.wait(timeout=600)
            log.seek(0)
            return code, log.read()

    code, printed = run(tmp_path / "a", interrupt_after="step-00000010")
    assert code != 0 and "KeyboardInterrupt" in printed, printed[-3000:]
    code, resumed = run(tmp_path / "a", "--resume")
    assert code == 0, resumed[-3000:]
    code, dynamic = run(tmp_path / "b", "--dynamic")
    assert code == 0, dynamic[-3000:]
    pattern = r"loss ([\d.]+) -> ([\d.]+) over 30 steps"
    (first, last), (first_d, last_d) = (map(float, re.search(pattern, out).groups()) for out in (resumed, dynamic))
    assert last < first - 1.0, resumed[-2000:]
    assert abs(first - first_d) < 1e-4 and abs(last - last_d) < 1e-3 * abs(last), (resumed[-1000:], dynamic[-1000:])
