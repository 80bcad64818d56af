"""Watching a run: the timeline of every rank's steps, the run's events, and Ray metrics."""

import json
import os
import re
import statistics
import time

import paddle
import paddle.distributed as dist
import pytest
import ray

import faults
import raydist
from raydist import testing
from clusters import start_driver
from helpers import said, tell
from models import Reference, Rows, adamw, assert_close, assert_fit_like_one_process, batches, build, sgd

# slow: 5 to 30 s each on 2 cores (they train on 2-4 ranks)
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300), pytest.mark.slow]


def check_trace_format(trace: dict) -> None:
    """What Chrome's trace-event format asks of the events raydist writes (complete events "X" and
    metadata "M"), as Perfetto and chrome://tracing read them."""
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] in ("ms", "ns")
    named = set()
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["name"], str) and isinstance(e.get("args", {}), dict), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name"), e
            named.add((e["name"], e["pid"], e["tid"]))
        else:
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert ("process_name", e["pid"], 0) in named and ("thread_name", e["pid"], e["tid"]) in named, e


def test_a_slow_rank_shows_in_the_timeline_with_its_peers_waiting_for_it(tmp_path):
    """dp2 x mp2, rank 1 sleeping 30 ms at the start of each step: in the timeline, its steps' own
    time (step less its collectives) is the longest by about that, and its three peers wait for it in
    their collectives. The trace is valid trace-event JSON, the ranks' clocks agree with the driver's
    to within a millisecond (one machine: one clock), and the numbers still equal one process."""
    with raydist.to_static(build("dpmp"), None, paddle.nn.MSELoss(), sgd(), num_workers=4,
                           runtime_env=faults.hook("slow_steps_on_rank_1")) as dm:  # fmt: skip
        ref = Reference(sgd())
        losses = [dm(x, y) for x, y in batches(12)]
        assert_close([float(v) for v in losses], [ref.train(x, y) for x, y in batches(12)])
        path = tmp_path / "trace.json"
        trace = dm.timeline(str(path), steps=10)
    assert json.loads(path.read_text()) == trace
    check_trace_format(trace)
    assert all(abs(o) < 1_000_000 for o in trace["otherData"]["clock_offsets_ns"]), trace["otherData"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "driver", 1: "rank 0", 2: "rank 1", 3: "rank 2", 4: "rank 3"}
    own, waits = {}, {}
    for pid in range(1, 5):
        steps = [e for e in spans if e["pid"] == pid and e["name"].startswith("step ")]
        assert [e["args"]["step"] for e in steps] == list(range(2, 12)), steps  # the last 10
        comms = [e for e in spans if e["pid"] == pid and e["tid"] == 2]
        per_step = []
        for s in steps:
            inside = sum(c["dur"] for c in comms if s["ts"] <= c["ts"] and c["ts"] + c["dur"] <= s["ts"] + s["dur"])
            per_step.append((s["dur"] - inside, inside))
        own[pid - 1] = statistics.median(o for o, _ in per_step) / 1000  # ms
        waits[pid - 1] = statistics.median(w for _, w in per_step) / 1000
    print("own ms", own, "in collectives ms", waits)
    assert own[1] > 25 and all(own[1] - own[r] > 20 for r in (0, 2, 3)), own
    assert all(waits[r] - waits[1] > 15 for r in (0, 2, 3)), waits
    driver = [e for e in spans if e["pid"] == 0]
    assert {e["args"].get("first") for e in driver if e["tid"] == 1} and all(e["tid"] in (1, 2) for e in driver)


def test_timeline_refuses_a_bad_steps_before_asking_the_ranks(tmp_path):
    with raydist.to_static(build("one"), None, paddle.nn.MSELoss(), sgd(), num_workers=1) as dm:
        for bad in (0, -1, 1.5, True, "10"):
            with pytest.raises(ValueError, match="steps must be a positive int or None"):
                dm.timeline(str(tmp_path / "t.json"), steps=bad)
        dm(*batches(1)[0])
        trace = dm.timeline(str(tmp_path / "t.json"))
        assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1] == ["step 0"]


@pytest.mark.long
def test_the_runs_events_of_a_growth_failures_a_restart_and_checkpoints_in_order_and_in_events_jsonl(tmp_path):
    """dp x mp2 on (2, 4) ranks, 2 epochs of 8 steps, a checkpoint every 4 steps, max_failures=1: it
    starts at 2 (a placement group holds the other CPUs), grows to 4 once it goes, loses rank 1
    (SIGKILL) after step 10 and goes on from the surviving replicas, loses it again two steps after
    that and gives up. ``dm.events()`` and ``events.jsonl`` hold each event, in order. Restarted, fit with
    ``resume=True`` goes on from the last checkpoint and appends to the same file; its losses and parameters
    equal one plain process."""
    from ray.util.placement_group import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": int(ray.available_resources().get("CPU", 0)) - 2}])  # holds all but 2 CPUs
    ray.get(blocker.ready())
    rows = Rows(64)
    loader = raydist.shard_dataloader(rows, dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]),
                                      shard_dims="dp", batch_size=8, shuffle=True, seed=3)  # fmt: skip
    ck = str(tmp_path / "run")
    with raydist.to_static(build("elastic"), loader, paddle.nn.MSELoss(), adamw(), num_workers=(2, 4),
                           name="watched-events") as dm:  # fmt: skip
        assert dm.num_workers == 2
        sizes, kills = [], []

        def kill_rank_1(why: str) -> None:
            kills.append(why)
            os.kill(next(s.pid for s in raydist.status() if s.group == "watched-events" and s.rank == 1), 9)

        class Story(paddle.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                sizes.append(dm.num_workers)
                if len(sizes) == 2:
                    remove_placement_group(blocker)
                    while testing.lifecycle(dm).can_grow(look=True) is None:  # raydist's own look sees the room
                        time.sleep(0.1)
                if len(sizes) == 10 and not kills:
                    kill_rank_1("after step 10")

            def on_train_batch_begin(self, step, logs=None):
                if len(kills) == 1 and "restart" in [e["kind"] for e in dm.events()]:
                    kills.append("a step after the restart")
                elif len(kills) == 2:
                    kill_rank_1("two steps after the restart")  # before the step is sent

        with pytest.raises(raydist.RankError):
            dm.fit(loader, epochs=2, checkpoint_every=4, checkpoint_dir=ck, max_failures=1, progress=False,
                   callbacks=[Story()])  # fmt: skip
        events = dm.events()
        kinds = [e["kind"] for e in events]
        print(sizes, [(e["kind"], e["step"]) for e in events])
        assert kinds[0] == "checkpoint" and events[0]["path"].endswith("step-00000000")  # fit's first, for max_failures
        grew = kinds.index("resize")
        assert events[grew]["from"] == 2 and events[grew]["to"] == 4 and events[grew]["why"] == "grow"
        failed = kinds.index("failure")
        assert grew < failed and kinds[failed + 1] == "restart" and kinds[-1] == "failure", kinds
        failure, restart = events[failed], events[failed + 1]
        assert failure["rank"] == 1 and failure["died"] and failure["node"] and failure["step"] >= 10, failure
        assert restart["source"] == "replicas" and restart["replayed"] == 0 and restart["size"] == 4, restart
        saves = [int(e["path"][-8:]) for e in events if e["kind"] == "checkpoint"]
        assert saves[:3] == [0, 4, 8] and set(saves) <= {0, 4, 8, 12}, saves  # 12: unless the kill came before it
        assert all(e["model"] == "watched-events" and e["stall_s"] >= 0 for e in events if e["kind"] == "checkpoint")
        assert [e["time"] for e in events] == sorted(e["time"] for e in events)
        written = [json.loads(line) for line in open(os.path.join(ck, "events.jsonl"))]
        assert written == json.loads(json.dumps(events, default=str))

        dm.restart()
        losses = dm.fit(loader, epochs=2, checkpoint_every=4, checkpoint_dir=ck, resume=True, progress=False)
        again = [json.loads(line) for line in open(os.path.join(ck, "events.jsonl"))]
        assert again[: len(written)] == written and len(again) > len(written)
        assert [int(e["path"][-8:]) for e in again[len(written):]] == [n for n in (12, 16) if n > saves[-1]]
        assert_fit_like_one_process(losses, dm.state_dict("param"), rows, 8, 2, 2, adamw(), shuffle=True, seed=3)


def test_fit_reports_samples_per_second_and_mfu_from_the_flops_it_is_given(tmp_path):
    rows = Rows(32)
    loader = raydist.shard_dataloader(rows, dist.ProcessMesh([0, 1], dim_names=["dp"]), shard_dims="dp",
                                      batch_size=8)  # fmt: skip
    seen = []

    class Logs(paddle.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            seen.append(dict(logs))

    with raydist.to_static(build("dp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=2) as dm:
        with pytest.raises(ValueError, match="peak_flops .* needs flops_per_sample"):
            dm.fit(loader, peak_flops=1e12)
        with pytest.raises(ValueError, match="flops_per_sample must be a positive number"):
            dm.fit(loader, flops_per_sample=0)
        dm.fit(loader, epochs=2, progress=False, callbacks=[Logs()], flops_per_sample=1e6, peak_flops=1e12)
    assert "samples_per_s" not in seen[0] and all(s["samples_per_s"] > 0 for s in seen[1:]), seen[:3]
    last = seen[-1]
    assert last["flops_per_s"] == pytest.approx(last["samples_per_s"] * 1e6)
    assert last["mfu"] == pytest.approx(last["flops_per_s"] / 1e12)


# A driver through Ray Client that trains until told to stop, so its ranks and its relay export metrics.
METERED = """
    import sys
    import paddle, raydist
    from raydist.driver.cluster.connect import init
    from models import Rows, build, sgd
    import paddle.distributed as dist

    init(ADDRESS, log_to_driver=False)
    rows = Rows(64)
    loader = raydist.shard_dataloader(rows, dist.ProcessMesh([0, 1], dim_names=["dp"]), shard_dims="dp", batch_size=8)
    dm = raydist.to_static(build("dp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=2, name="metered")
    dm.fit(loader, epochs=7, progress=False)  # 56 steps
    print("trained", flush=True)
    stop = []
    import threading
    threading.Thread(target=lambda: stop.append(sys.stdin.readline()), daemon=True).start()
    while not stop:
        dm.fit(loader, epochs=1, progress=False)
    dm.shutdown()
"""


@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.long
def test_ray_metrics_reach_the_clusters_prometheus_endpoint_tagged_with_the_model(ray_head):
    """A driver through Ray Client trains 56 steps, then goes on; the head's metrics endpoint (``ray start
    --metrics-export-port``) holds each rank's step counter, rising, and step times of the right order,
    and the driver's pace, size and bounds, all tagged ``model="metered"``."""
    driver = start_driver(METERED.replace("ADDRESS", repr(ray_head.client)))
    try:
        said(driver, "trained")

        def series(text: str, name: str, **tags: str) -> dict[str, float]:
            out = {}
            for line in text.splitlines():
                if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in tags.items()):
                    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                    out[labels.get("rank", "") + labels.get("part", "")] = float(line.rsplit(" ", 1)[1])
            return out

        def wait_for(name: str, need: int, **tags: str) -> tuple[str, dict]:
            while True:  # bounded by the test's timeout; Ray exports every few seconds
                text = ray_head.metrics()
                found = series(text, name, model="metered", **tags)
                if len(found) >= need:
                    return text, found
                time.sleep(1)

        _, first = wait_for("ray_raydist_rank_steps_total", 2)
        assert all(v > 0 for v in first.values()), first
        text, times = wait_for("ray_raydist_rank_step_time_seconds", 6)
        assert all(1e-5 < times[f"{r}step"] < 1.0 for r in "01"), times
        assert all(0 <= times[f"{r}{p}"] < 1.0 for r in "01" for p in ("data_wait", "collectives")), times
        while True:
            text, later = wait_for("ray_raydist_rank_steps_total", 2)
            if all(later[r] > first[r] for r in first):
                break
            time.sleep(1)
        _, pace = wait_for("ray_raydist_steps_per_second", 1)
        assert list(pace.values())[0] > 0, pace
        _, ranks = wait_for("ray_raydist_ranks", 1)
        assert list(ranks.values()) == [2.0], ranks
        _, bounds = wait_for("ray_raydist_size_max", 1)
        assert list(bounds.values()) == [2.0], bounds
        tell(driver)
        assert driver.wait(timeout=120) == 0
    finally:
        if driver.poll() is None:
            driver.kill()
