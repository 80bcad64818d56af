"""raydist launch: unmodified SPMD Paddle scripts, one rank per Ray actor.

The "outside client" is Paddle itself: the usage examples in the docstrings of
the installed Paddle's to_static, shard_dataloader and shard_tensor, extracted
here at test time and run unchanged (followed, where a test says so, by lines that
print what it checks).
"""

import inspect
import pathlib
import time
import io
import re
import subprocess
import sys
import textwrap

import paddle.distributed
import pytest
import ray

from helpers import wait_gone
from raydist.launch import launch

# slow: every test here takes 5 to 16 s on 2 cores (a script launched on its own ranks)
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300), pytest.mark.slow]

SPMD = """
import os, sys
import paddle, paddle.distributed as dist
dist.init_parallel_env()
rank = dist.get_rank()
t = paddle.to_tensor([float(rank + 1)])
dist.all_reduce(t)
print("rank", rank, "of", dist.get_world_size(), "sum", float(t), "args", sys.argv[1:],
      "env", os.environ["PADDLE_TRAINER_ID"], os.environ["PADDLE_TRAINERS_NUM"], os.environ["PADDLE_DISTRI_BACKEND"])
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"pid{rank}"), "w").write(str(os.getpid()))
if "--fail" in sys.argv:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
"""


def run(script, args=(), n=2):
    out, err = io.StringIO(), io.StringIO()
    status = launch(str(script), list(args), n, stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


def test_a_script_runs_on_every_rank_with_paddles_environment(tmp_path):
    script = tmp_path / "spmd.py"
    script.write_text(SPMD)
    status, out, err = run(script, ["a", "--b"], n=3)
    assert status == 0, err
    for rank in range(3):
        assert f"[rank {rank}] rank {rank} of 3 sum 6.0 args ['a', '--b'] env {rank} 3 gloo" in out
    assert "Modified FLAGS" not in err  # Paddle's noise is quiet by default


def test_every_rank_sees_the_launching_environment_set_after_the_local_ray_started(monkeypatch):
    """The session's Ray started before these variables were set: the ranks have them from the launch, not
    from the raylet; ``pass_env=False`` gives only ``env``."""
    from pathlib import Path

    from helpers import seen_env

    script = Path(__file__).resolve().parent / "shows_env.py"
    monkeypatch.setenv("FOO", "bar")
    monkeypatch.setenv("VIRTUAL_ENV", "/launching/venv")
    status, out, err = run(script)
    assert status == 0, err
    assert all(s["FOO"] == "bar" and s["VIRTUAL_ENV"] != "/launching/venv" for s in seen_env(out)), out
    out = io.StringIO()
    assert launch(str(script), [], 2, stdout=out, env={"BAZ": "qux"}, pass_env=False) == 0
    assert [(s["FOO"], s["BAZ"]) for s in seen_env(out.getvalue())] == [(None, "qux"), (None, "qux")]


@pytest.mark.long
def test_paddles_glog_lines_are_quiet_unless_asked_for(tmp_path):
    script = tmp_path / "spmd.py"
    script.write_text(SPMD)
    glog = re.compile(r"^\[rank 0\] I\d{4} .*tcp_store", re.M)  # e.g. "I1201 03:57:18.80 ... tcp_store.cc:336]"
    out, err = io.StringIO(), io.StringIO()
    assert launch(str(script), [], 2, paddle_logs=True, stdout=out, stderr=err) == 0
    assert glog.search(err.getvalue()) and "Modified FLAGS" in err.getvalue()
    status, _, err = run(script)
    assert status == 0 and not glog.search(err)


def test_a_failing_rank_fails_the_launch_and_stops_the_others(tmp_path):
    script = tmp_path / "spmd.py"
    script.write_text(SPMD)
    status, out, err = run(script, ["--fail"])
    assert status == 1
    assert "[rank 1] ValueError: rank 1 fails on purpose" in err
    assert "rank 1 exited with status 1" in err
    wait_gone([int((tmp_path / f"pid{r}").read_text()) for r in range(2)])  # rank 0 was blocked in a collective


@pytest.mark.long
def test_the_command_line(tmp_path):
    script = tmp_path / "spmd.py"
    script.write_text(SPMD + "\nif '--exit' in sys.argv: sys.exit(7)\n")
    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "raydist.launch", "-n", "2", "--address", address, str(script)]
    done = subprocess.run(cmd + ["x"], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr
    assert "[rank 1] rank 1 of 2 sum 3.0 args ['x']" in done.stdout
    done = subprocess.run(cmd + ["--exit"], capture_output=True, text=True, timeout=200)
    assert done.returncode == 7, done.stderr
    done = subprocess.run([sys.executable, "-m", "raydist.launch", "-n", "2", str(tmp_path / "none.py")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "no such script" in done.stderr


# -- Paddle's own docstring examples, unchanged ------------------------------------------


def docstring_scripts(function) -> list[str]:
    """The ``.. code-block:: python`` examples of ``function``'s docstring, as scripts.

    Not doctest's parser: it drops lines of shard_dataloader's first example
    (a ">>>" inside a class body), so the prompts are stripped by hand.
    """
    scripts = []
    for block in re.split(r"\.\. code-block:: python", inspect.cleandoc(function.__doc__))[1:]:
        lines = []
        for line in block.splitlines():
            text = line.strip()
            if text.startswith((">>>", "...")):
                lines.append(text[4:] if text[3:4] == " " else text[3:])
            elif not text and lines:
                lines.append("")
        scripts.append(textwrap.dedent("\n".join(lines)).strip() + "\n")
    return scripts


def run_example(tmp_path, function, index, n, then=""):
    """The example, unchanged, as a script (followed by ``then``, lines the test adds) on ``n`` ranks."""
    source = docstring_scripts(function)[index]
    compile(source, function.__name__, "exec")
    script = tmp_path / f"{function.__name__}_{index}.py"
    script.write_text(source + then)
    return source, run(script, n=n)


def test_paddle_example_to_static_trains_and_evaluates_on_cpu(tmp_path):
    """2 ranks: train and eval run; predict then hits Paddle 3.3.1's own KeyError
    (raydist.DistModel fixes it; a launched script runs Paddle's DistModel as is)."""
    source, (status, out, err) = run_example(tmp_path, paddle.distributed.to_static, 0, n=2)
    assert "dist_model.train()" in source and "dist.ProcessMesh([0, 1]" in source
    predict_line = source.splitlines().index("    outs = dist_model(image)") + 1
    assert status == 1
    assert f"line {predict_line}, in <module>" in err and "KeyError: 'predict'" in err, err[-3000:]


# After the example: what each rank reads, held to the rows of the dataset in the same process
# (RandomDataset's inputs are random, so each rank's own), as one process reads them: global
# batch i is rows 2i, 2i+1 (BatchSampler(batch_size=2)).
READ_BACK = """
rank = dist.get_rank()
for i, batch in enumerate(dist_dataloader()):
    inputs = batch["inputs"]
    mine = [t._local_value().numpy() for t in inputs]
    rows = [j for j in range(len(dataset))
            if all(len(m) == 1 and np.array_equal(m[0], dataset[j]["inputs"][k]) for k, m in enumerate(mine))]
    print("batch", i, "global", [list(t.shape) for t in inputs], "local", [list(m.shape) for m in mine],
          "placements", inputs[0].placements, "rows", rows, "label on", batch["label"].process_mesh.process_ids)
print("batches", i + 1)
"""


def test_paddle_example_shard_dataloader_with_dict_batches(tmp_path):
    """Its first example needs 8 ranks and a cross-mesh reshard (send/recv, which
    CPU lacks); the second builds a dp-sharded loader over dict batches: on ranks 0 and 1
    (mesh0's first dp row, its two mp ranks) each dict batch holds both inputs as global
    [2, 4, 8] tensors split along dp, each rank's part the first row of the global batch
    (dp row 1, ranks 2 and 3, would get the second), and the label on mesh1."""
    examples = docstring_scripts(paddle.distributed.shard_dataloader)
    assert len(examples) == 2 and "RUN_STATIC" in examples[0]
    _, (status, out, err) = run_example(tmp_path, paddle.distributed.shard_dataloader, 1, n=2, then=READ_BACK)
    assert status == 0, err
    for rank in range(2):
        for i in range(4):
            line = (f"[rank {rank}] batch {i} global [[2, 4, 8], [2, 4, 8]] local [[1, 4, 8], [1, 4, 8]] "
                    f"placements [Shard(dim=0), Replicate()] rows [{2 * i}] label on [4, 5, 6, 7]")  # fmt: skip
            assert line in out, out
        assert f"[rank {rank}] batches 4" in out, out


@pytest.mark.timeout(400)
@pytest.mark.long
def test_paddle_example_shard_tensor_on_the_six_ranks_of_its_mesh(tmp_path):
    source, (status, out, err) = run_example(tmp_path, paddle.distributed.shard_tensor, 0, n=6)
    assert "dist.ProcessMesh([[2, 4, 5], [0, 1, 3]]" in source
    assert status == 0, err
    for rank in range(6):  # printing a dist tensor gathers it: every rank shows the whole
        mine = "\n".join(line.split("] ", 1)[1] for line in out.splitlines() if line.startswith(f"[rank {rank}] "))
        assert re.search(r"GlobalDenseTensor=\s*\[\[1, 2, 3\],\s*\[5, 6, 7\]\]\)", mine), out


# -- restarts, logs, placement -------------------------------------------------------------

RESUMES = pathlib.Path(__file__).resolve().parent / "paddle_style" / "resumes.py"


def _losses(text: str, rank: int) -> dict[int, str]:
    """{step: loss} that ``rank`` printed (its last run's, where a step ran twice)."""
    return {int(m[1]): m[2] for m in re.finditer(rf"^\[rank {rank}\] LOSS (\d+) (\S+)$", text, re.M)}


@pytest.mark.long
def test_a_rank_killed_after_its_first_checkpoint_restarts_every_rank_and_the_run_ends_as_an_uninterrupted_one(
        tmp_path):  # fmt: skip
    """A plain Paddle loop of a Trainer's shape (it resumes from its latest checkpoint): rank 1 SIGKILLed
    after the checkpoint of step 2; --max-restarts 2 starts both ranks again, they resume from it, and
    every loss and the final weights equal an uninterrupted run's. The logs: workerlog.N with both runs
    and the restart's cause; the terminal shows only the filtered rank."""
    (tmp_path / "calm").mkdir()
    out, err = io.StringIO(), io.StringIO()
    assert launch(str(RESUMES), [str(tmp_path / "calm")], 2, stdout=out, stderr=err) == 0, err.getvalue()
    calm = out.getvalue()
    (tmp_path / "hurt").mkdir()
    out, err = io.StringIO(), io.StringIO()
    status = launch(str(RESUMES), [str(tmp_path / "hurt"), "die"], 2, stdout=out, stderr=err, max_restarts=2,
                    log_dir=str(tmp_path / "logs"), ranks_filter=[0])  # fmt: skip
    assert status == 0, err.getvalue()
    said = err.getvalue()
    assert re.search(r"raydist launch: restart 1 of 2, after rank 1 was ended by SIGKILL \(status -9\)", said), said
    assert "RESUMED 2 restart 1 of 2" in out.getvalue() and "[rank 1]" not in out.getvalue() + err.getvalue()
    assert _losses(out.getvalue(), 0) == _losses(calm, 0) and len(_losses(calm, 0)) == 8
    assert re.findall(r"FINAL (\S+)", out.getvalue()) == re.findall(r"\[rank 0\] FINAL (\S+)", calm)
    logs = {r: (tmp_path / "logs" / f"workerlog.{r}").read_text() for r in range(2)}
    for rank, text in logs.items():
        assert text.count("LOSS 0 ") == 1 and text.count("LOSS 7 ") == 1, text  # the first run, then the resumed
        assert "raydist launch: restart 1 of 2" in text and "RESUMED 2" in text, text
    lines = [f"[rank 1] {line}" for line in logs[1].splitlines()]
    assert _losses("\n".join(lines), 1) == _losses(calm, 1)


def test_raydist_stop_ends_a_launch_with_restarts_left_and_status_counts_its_restarts(tmp_path):
    import threading

    script = tmp_path / "waits.py"
    script.write_text("import os, time\nprint('up', os.environ['PADDLE_RESTART_COUNT'], flush=True)\n"
                      "if os.environ['PADDLE_RESTART_COUNT'] == '0' and os.environ['PADDLE_TRAINER_ID'] == '1':\n"
                      "    raise SystemExit(3)\ntime.sleep(600)\n")  # fmt: skip
    out, err, result = io.StringIO(), io.StringIO(), []
    runner = threading.Thread(target=lambda: result.append(launch(str(script), [], 2, stdout=out, stderr=err,
                                                                  max_restarts=3, name="waits")))  # fmt: skip
    runner.start()
    address = ray.get_runtime_context().gcs_address
    cli = [sys.executable, "-m", "raydist", "status", "--address", address]
    deadline = time.monotonic() + 120
    while out.getvalue().count("up 1") < 2:  # the restart's two ranks are up
        assert time.monotonic() < deadline and runner.is_alive(), out.getvalue() + err.getvalue()
        time.sleep(0.2)
    shown = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert "waits  launched script waits.py" in shown.stdout, shown.stdout
    assert re.search(r"restarted 1 time$", shown.stdout, re.M), shown.stdout
    stopped = subprocess.run([sys.executable, "-m", "raydist", "stop", "waits", "--address", address],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr
    runner.join(timeout=60)
    assert result and result[0] != 0 and "stopped by raydist stop" in err.getvalue(), err.getvalue()
    assert "restart 2 of 3" not in err.getvalue()


@pytest.mark.parametrize("bad, said", [
    (["--ranks-filter", "0,5"], "the ranks are 0..1"),
    (["--ranks-filter", "a"], "takes ranks like 0,2"),
    (["--resources-per-rank", "{CPU: 4}"], "takes a JSON object"),
    (["--resources-per-rank", '{"CPU": "4"}'], "resource names to amounts"),
    (["--max-restarts", "-1"], "0 or more"),
    (["--placement-strategy", "RANDOM"], "invalid choice"),
])  # fmt: skip
def test_bad_launch_options_are_refused_before_anything_starts(bad, said, tmp_path):
    script = tmp_path / "spmd.py"
    script.write_text(SPMD)
    done = subprocess.run([sys.executable, "-m", "raydist.launch", "-n", "2", *bad, str(script)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and said in done.stderr, done.stderr


def test_a_rank_asks_for_the_resources_given(tmp_path):
    """--resources-per-rank reaches the ranks' placement group: a resource no node has cannot be
    placed, and the launch says so at once."""
    script = tmp_path / "spmd.py"
    script.write_text(SPMD)
    with pytest.raises(ValueError, match="nowhere"):
        launch(str(script), [], 2, resources_per_rank={"CPU": 1, "nowhere": 1}, placement_strategy="SPREAD")
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "raydist.launch", "-n", "2", "--address", address,
                           "--resources-per-rank", '{"CPU": 1, "nowhere": 1}', str(script)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "raydist launch:" in done.stderr and "nowhere" in done.stderr, done.stderr
