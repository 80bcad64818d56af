"""A rank that hangs (a stopped process, a collective that never returns) is a RankError naming it
within a step's limit, whatever the size of the message its step travels in."""

import os
import signal
import time

import paddle
import pytest

import raydist
from raydist import testing
from models import Reference, assert_close, batches, build, sgd
from raydist.driver.cluster import hangs as watch_module
from raydist.messages import Progress

STEP_TIMEOUT_S = 3.0
# the step's limit, one slice of the wait, a ping's wait, and room for a loaded 2-core machine
FOUND_WITHIN_S = STEP_TIMEOUT_S + watch_module.REPORT_GRACE_S + watch_module.LOOK_MAX_S + watch_module.PING_S + 5


def _go_on_and_close(dm, pids):
    """Let the stopped processes go on (a test that failed left them stopped) and stop the ranks."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    testing.lifecycle(dm).close()


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(240)
# every dispatch, and both a message of one step and messages grown to many (each takes ~11 s here)
@pytest.mark.parametrize("dispatch,steps_per_message", [("calls", "auto"), ("compiled", 1), ("tree", "auto")])
def test_a_stopped_rank_is_a_rank_error_naming_it_within_the_step_limit(dispatch, steps_per_message):
    x, y = batches(1)[0]
    reference = Reference(sgd())
    dm = raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2, dispatch=dispatch,
                           steps_per_message=steps_per_message, step_timeout_s=STEP_TIMEOUT_S)  # fmt: skip
    pids = [r.pid for r in dm.ranks]
    try:
        losses = [dm(x, y) for _ in range(300)]  # auto: the messages grow to many steps
        assert_close([float(loss) for loss in losses], [reference.train(x, y) for _ in losses])
        window = testing.window(dm)
        if steps_per_message == "auto":
            assert window._k > 8, "the messages should hold many steps by now"
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(raydist.RankError) as info:
            for _ in range(100_000):  # the window fills, the driver waits for a message that cannot finish
                dm(x, y)
            dm.wait()
        took = time.monotonic() - stopped
        print(f"{dispatch}, steps_per_message={steps_per_message}: RankError {took:.1f} s after the stop")
        assert info.value.rank == 1, info.value
        assert "no answer from ranks [1]" in str(info.value)
        assert took < FOUND_WITHIN_S, f"found after {took:.1f} s"
        with pytest.raises(raydist.GroupShutdownError):
            dm(x, y)
    finally:
        _go_on_and_close(dm, pids)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(240)
@pytest.mark.long
def test_a_rank_stopped_between_steps_after_restarts_is_found_within_the_limit_at_the_replica_check():
    """dp2 with check_replicas=2, after two restarts (a rank killed each time): rank 1 stopped once
    its steps completed. ``dm.wait()`` then asks the ranks for their replica checks: the stopped
    rank is a RankError naming it within the step limit (before: Ray's own RPC timeout, minutes)."""
    data, reference = batches(6), Reference(sgd())
    dm = raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2, check_replicas=2,
                           step_timeout_s=STEP_TIMEOUT_S)  # fmt: skip
    pids = []
    try:
        for round_ in range(3):
            for x, y in data[2 * round_:2 * round_ + 2]:
                assert_close(float(dm(x, y)), reference.train(x, y))
            pids = [r.pid for r in dm.ranks]
            if round_ < 2:  # a rank killed, found at the next call, and a restart from the survivor's state
                os.kill(pids[round_], signal.SIGKILL)
                with pytest.raises(raydist.RankError):
                    dm.wait()
                    for _ in range(50):
                        dm(x, y)
                        time.sleep(0.2)
                dm.restart()
                # the step the kill interrupted is not counted: the reference lost it too, as the survivor's state
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(raydist.RankError) as info:
            dm.wait()
        took = time.monotonic() - stopped
        assert info.value.rank == 1 and "no answer from ranks [1]" in str(info.value), info.value
        assert "replica check" in str(info.value), info.value
        assert took < FOUND_WITHIN_S, f"found after {took:.1f} s"
        assert [e["source"] for e in dm.events() if e["kind"] == "restart"] == ["replicas", "replicas"]
    finally:
        _go_on_and_close(dm, pids)


# -- the watch's decisions, on scripted answers (no ranks) -------------------------------------------


class _Group:
    """Stands in for a RankGroup: the ranks' scripted ping answers, and the error it would raise."""

    def __init__(self, script):
        self.actors = [0, 1]
        self.script = iter(script)
        self.failed = None

    def timed_out(self, ranks, during, why):
        self.failed = (ranks, why)
        return raydist.RankError(ranks[0], why, during=during)


class Clock:
    """A monotonic clock that moves only when told: the watch's decisions, timed exactly."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def quick(monkeypatch):
    """A watch with a step limit of 0.3 s, looked at every 0.05 s, on a `Clock`."""
    monkeypatch.setattr(watch_module, "REPORT_GRACE_S", 0.0)
    monkeypatch.setattr(watch_module, "LOOK_MIN_S", 0.05)
    monkeypatch.setattr(watch_module, "LOOK_MAX_S", 0.05)
    clock = Clock()

    def make(script):
        group = _Group(script)
        monkeypatch.setattr(watch_module, "ping_all", lambda actors, timeout: next(group.script))
        return group, watch_module.Watch(group, 0.3, clock=clock)

    return make, clock


def _slow_get(clock, after_s):
    """An answer ``after_s`` seconds of ``clock`` from now: each slice waited moves the clock on."""
    began = clock()

    def get(timeout):
        if clock() - began < after_s:
            clock.now += timeout
            raise TimeoutError
        return "answer"

    return get


def test_a_message_longer_than_the_limit_whose_steps_move_on_is_not_hung(quick):
    # steps of 0.1 s each: the message takes 1 s, more than three limits
    steps = ([Progress(n, 0.1), Progress(n, 0.1)] for n in range(10_000))
    make, clock = quick
    group, watch = make(steps)
    assert watch.wait(_slow_get(clock, 1.0), "steps 0-9") == "answer"
    assert group.failed is None and clock() == pytest.approx(1.0)


def test_a_rank_in_one_step_past_the_limit_is_hung(quick):
    make, clock = quick
    group, watch = make([Progress(4, clock.now), None] for _ in range(10_000))  # in step 4 since the start
    with pytest.raises(raydist.RankError) as info:
        watch.wait(_slow_get(clock, 60), "steps 0-63")
    assert group.failed[0] == [0] and "in one step" in group.failed[1]
    assert clock() == pytest.approx(0.35)  # the first look past the limit of 0.3 s
    assert info.value.during == "steps 0-63"


def test_a_silent_rank_is_named_once_silent_for_the_limit(quick):
    answers = ([Progress(4, 0.01), watch_module.NO_ANSWER] for _ in range(10_000))
    make, clock = quick
    group, watch = make(answers)
    with pytest.raises(raydist.RankError):
        watch.wait(_slow_get(clock, 60), "step 4")
    assert group.failed[0] == [1] and "no answer from ranks [1]" in group.failed[1]
    assert clock() == pytest.approx(0.35)  # silent since the start, past the limit at the first look after it


def test_a_silent_rank_is_named_after_step_timeout_s_without_the_grace_a_rank_in_a_step_gets(quick, monkeypatch):
    """A stopped process reports no timeout of its own: the grace that lets a rank's loader timeout be
    the one reported does not apply to it (a hang is found within step_timeout_s + 5 s)."""
    monkeypatch.setattr(watch_module, "REPORT_GRACE_S", 0.5)
    answers = ([Progress(4, 0.01), watch_module.NO_ANSWER] for _ in range(10_000))
    make, clock = quick
    group, watch = make(answers)
    assert watch.limit == pytest.approx(0.8) and watch.silence == pytest.approx(0.3)
    with pytest.raises(raydist.RankError):
        watch.wait(_slow_get(clock, 60), "step 4")
    assert group.failed[0] == [1] and clock() == pytest.approx(0.35)


def test_no_limit_waits_without_looking():
    watch = watch_module.Watch(_Group([]), None)
    assert watch.wait(lambda timeout: timeout, "step 0") is None
