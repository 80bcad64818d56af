"""The asynchronous driver: steps in flight, lazy losses, and both dispatch paths."""

import math
import os
import time

import numpy as np
import paddle
import pytest

import faults
import raydist
from raydist import testing
from helpers import DPMP_MESH, Poisoned, rows
from raydist import Loss
from raydist.driver.dispatch.window import Window
from models import Reference, assert_close, assert_params_equal, batches, build, sgd


class Ranks:
    """A stand-in transport for a `Window`: a message's ticket is its steps' messages, each
    step's results are ``[message]``; ``fail``: raise this for the message holding that step."""

    def __init__(self, fail=None, error=RuntimeError):
        self.sent, self.fail, self.error = [], fail, error

    def send(self, first, messages):
        self.sent.append((first, list(messages)))
        return list(messages)

    def receive(self, ticket, steps):
        if self.fail is not None and self.fail in ticket:
            self.fail = self.fail if self.error is not KeyboardInterrupt else None
            raise self.error(f"steps {steps[0]}-{steps[-1]} failed")
        return [[m] for m in ticket]

    def window(self, size, first=0, most=1):
        return Window(size, first, send=self.send, receive=self.receive, most=most)


def test_window_keeps_at_most_size_messages_and_completes_in_order():
    done = []
    window = Ranks().window(2)
    steps = [window.submit(i, lambda r: done.append(r[0]) or r[0] * 10) for i in range(5)]
    assert done == [0, 1, 2] and len(window) == 2  # submitting the 4th and 5th completed the oldest
    assert steps[4].result() == 40 and done == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="max_in_flight"):
        Ranks().window(0)
    with pytest.raises(ValueError, match="steps_per_message"):
        Ranks().window(2, most=0)


def test_steps_called_while_a_message_is_out_go_together_in_one_message():
    ranks = Ranks()
    window = ranks.window(2, first=10, most=3)
    steps = [window.submit(i, lambda r: r[0] * 10) for i in range(7)]
    # 0 goes alone (the ranks were idle); 1-3 wait beside it and leave once they are 3;
    # 4-6 too, once the oldest (0) is done: 2 messages are out
    assert ranks.sent == [(10, [0]), (11, [1, 2, 3]), (14, [4, 5, 6])] and steps[0].done and not steps[1].done
    assert len(window) == 6 and window.oldest == 11
    steps.append(window.submit(7, lambda r: r[0] * 10))
    assert steps[7].result() == 70  # reading a held step sends it (once there is room)
    assert ranks.sent[3:] == [(17, [7])] and [s.result() for s in steps] == [0, 10, 20, 30, 40, 50, 60, 70]
    assert [s.number for s in steps] == list(range(10, 18)) and window.submitted == 18


def test_a_loop_reading_every_few_steps_sends_two_messages_per_read():
    """The step after a read goes alone to the idle ranks; the others up to the next read go
    together, while the ranks run it."""
    ranks = Ranks()
    window = ranks.window(2, most=64)
    for i in range(30):
        step = window.submit(i, lambda r: r[0])
        if i % 10 == 9:
            assert step.result() == i
    assert [(first, len(m)) for first, m in ranks.sent] == [(0, 1), (1, 9), (10, 1), (11, 9), (20, 1), (21, 9)]
    for i in range(30, 100):  # no read: messages of steps_per_message, the rest at the end
        window.submit(i, lambda r: r[0])
    window.drain()
    assert [(first, len(m)) for first, m in ranks.sent[6:]] == [(30, 1), (31, 64), (95, 5)]


def test_a_loop_reading_the_loss_of_the_step_before_keeps_the_next_one_on_the_ranks():
    """Reading step i-1's loss right after sending step i: step i is held (a message is out),
    and goes to the ranks before the driver waits for i-1, so they never idle between the two."""
    events = []
    ranks = Ranks()
    send, receive = ranks.send, ranks.receive
    ranks.send = lambda first, messages: events.append(f"send {first}") or send(first, messages)
    ranks.receive = lambda ticket, steps: events.append(f"wait {steps[0]}") or receive(ticket, steps)
    window = ranks.window(2, most=64)
    before = None
    for i in range(4):
        step = window.submit(i, lambda r: r[0])
        if before is not None:
            assert before.result() == i - 1
        before = step
    assert events == ["send 0", "send 1", "wait 0", "send 2", "wait 1", "send 3", "wait 2"]


def test_auto_sizes_messages_from_the_pace_of_the_steps():
    ranks = Ranks()
    window = ranks.window(1, most="auto")
    assert window.most == 64
    for i in range(80):  # done at once: as many steps per message as auto allows
        window.submit(i, lambda r: r[0])
    window.drain()
    assert max(len(m) for _, m in ranks.sent) == 64


def test_a_failure_fails_the_later_steps_too():
    window = Ranks(fail=1).window(3)
    steps = [window.submit(i, lambda r: r[0]) for i in range(3)]
    with pytest.raises(RuntimeError, match="steps 1-1 failed"):
        steps[2].result()
    assert steps[0].result() == 0
    with pytest.raises(RuntimeError, match="steps 1-1 failed"):
        steps[1].result()
    with pytest.raises(RuntimeError, match="steps 1-1 failed"):
        steps[2].result()
    # a step held when its window failed never reached the ranks: it fails, and gives its number back
    ranks = Ranks(fail=1)
    window = ranks.window(1, first=5)
    steps = [window.submit(i, lambda r: r[0]) for i in range(2)]
    with pytest.raises(RuntimeError, match="steps 6-6 failed"):
        window.submit(2, lambda r: r[0])
    assert steps[0].result() == 0 and window.submitted == 7 and ranks.sent == [(5, [0]), (6, [1])]


def test_an_interrupted_wait_leaves_the_step_in_flight():
    window = Ranks(fail=0, error=KeyboardInterrupt).window(3, first=7)
    steps = [window.submit(i, lambda r: r[0]) for i in range(3)]
    with pytest.raises(KeyboardInterrupt, match="while waiting for step 7: steps 7-9 still run"):
        steps[2].result()
    assert len(window) == 3 and not steps[0].done  # nothing dropped, nothing marked failed
    assert [s.result() for s in steps] == [0, 1, 2] and len(window) == 0
    assert window.submitted == 10


def test_loss_acts_as_a_float():
    loss = Loss(Ranks().window(1).submit(None, lambda results: 0.25))
    assert float(loss) == 0.25 and loss == 0.25 and 0.25 == loss and loss != 0.5
    assert loss + 1 == 1.25 and 1 - loss == 0.75 and loss * 2 == 0.5 and loss / 0.5 == 0.5 and 2**loss == 2**0.25
    assert loss < 1 and loss > 0 and loss <= 0.25 and loss >= 0.25 and -loss == -0.25 and abs(-loss) == 0.25
    assert f"{loss:.2f}" == "0.25" and str(loss) == "0.25" and repr(loss) == "0.25" and round(loss, 1) == 0.2
    assert np.asarray(loss).dtype == np.float64 and np.allclose([loss, loss], 0.25)
    assert math.isclose(loss, 0.25) and loss == pytest.approx(0.25) and hash(loss) == hash(0.25)
    assert sum([loss, loss]) == 0.5 and np.mean([loss, loss]) == 0.25 and loss.done and loss.item() == 0.25


STEP_S = 0.5  # what `faults.slow_steps` adds to every step of the test below


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dispatch", ["compiled", "calls", "tree"])
@pytest.mark.long
def test_steps_run_ahead_and_match_single_process(dispatch):
    """Every step takes STEP_S more on the ranks (`faults.slow_steps`): each call returns before
    its step is done, at once while fewer than max_in_flight steps run; the losses, outputs and
    parameters are those of one process."""
    data = batches(6)
    ref = Reference(sgd())
    env = faults.hook("slow_steps")
    env["env_vars"]["RAYDIST_TEST_STEP_S"] = str(STEP_S)
    with raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=4,
                           max_in_flight=3, dispatch=dispatch, runtime_env=env) as dm:  # fmt: skip
        losses, took = [], []
        for x, y in data:
            start = time.monotonic()
            losses.append(dm(x, y))
            took.append(time.monotonic() - start)
            assert not losses[-1].done, f"step {len(losses) - 1} was done when its call returned"
        # steps 1 and 2 found room among the 3 in flight: sent, not waited for (3-5 wait for the oldest)
        assert max(took[1:3]) < STEP_S / 2, took
        assert testing.transport(dm) == dispatch
        for step, (loss, (x, y)) in enumerate(zip(losses, data)):
            assert_close(loss, ref.train(x, y), what=f"step {step}")
        dm.predict()
        assert_close(dm(data[0][0]), ref.predict(data[0][0]))
        params = dm.state_dict("param")
    assert_params_equal(params, ref.params())


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dispatch", ["compiled", "calls", "tree"])
@pytest.mark.long
def test_a_rank_failing_in_a_step_names_the_step_and_rank(dispatch):
    loader = raydist.shard_dataloader(Poisoned(40), DPMP_MESH, shard_dims="dp", batch_size=8, prefetch=1)
    with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=4, dispatch=dispatch,
                           steps_per_message=3) as dm:  # fmt: skip
        start = time.monotonic()
        with pytest.raises(raydist.RankError, match="row 30 is poisoned") as info:
            for batch in loader():
                dm(*batch)
            dm.wait()
        assert info.value.rank in (2, 3) and info.value.during == "step 3"  # rows 28-31: dp group 1, step 3
        assert time.monotonic() - start < 60
        assert testing.window(dm).messages == 3  # steps 0, 1, then 2-4 together: 3 fails inside a message


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(240)
@pytest.mark.long
def test_steps_sent_together_equal_one_process_and_a_death_among_them_names_its_step():
    data = batches(10)
    ref = Reference(sgd())
    expected = [ref.train(x, y) for x, y in data]
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           steps_per_message=4) as dm:  # fmt: skip
        losses = [dm(x, y) for x, y in data]  # 0 alone (the ranks idle); 1-4 and 5-8 together; 9 at the read
        assert_close(losses, expected)
        assert testing.window(dm).messages == 4
        params = dm.state_dict("param")
    assert_params_equal(params, ref.params())
    # 0, 1-3 and 4-6: the death is inside a message
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           steps_per_message=3, runtime_env=faults.hook("die_in_step_5_on_rank_1")) as dm:  # fmt: skip
        losses = [dm(x, y) for x, y in data[:7]]
        start = time.monotonic()
        with pytest.raises(raydist.RankError) as info:
            dm.wait()
        assert (info.value.rank, info.value.died, info.value.during) == (1, True, "step 5")
        assert time.monotonic() - start < 20
        assert_close(losses[:4], expected[:4])
        with pytest.raises(raydist.RankError, match="step 5"):
            float(losses[6])  # 4 and 6 went with 5, in the message that failed
    # 0, 1-4 and 5-8: the death is in a message's first step. The dying rank's answer to 1-4 can
    # go with it (often, beside a busy core): the driver meets the death waiting for 1-4, and the
    # survivor, which broke off in 5, says where it was
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           steps_per_message=4, runtime_env=faults.hook("die_in_step_5_on_rank_1")) as dm:  # fmt: skip
        losses = [dm(x, y) for x, y in data[:9]]
        with pytest.raises(raydist.RankError) as info:
            dm.wait()
        assert (info.value.rank, info.value.died, info.value.during) == (1, True, "step 5")


@pytest.mark.slow
def test_auto_dispatch_uses_calls_on_cpu_and_compiled_is_asked_for():
    x, y = batches(1)[0]
    for dispatch, expected in [("auto", "calls"), ("compiled", "compiled")]:
        with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                               dispatch=dispatch) as dm:  # fmt: skip
            assert testing.transport(dm) is None  # opened by the first step
            float(dm(x, y))
            assert testing.transport(dm) == expected
    with pytest.raises(ValueError, match="dispatch"):
        raydist.to_static(build("dp"), num_workers=2, dispatch="fast")
    for bad in (0, "many", True):  # refused at the driver, before any rank starts
        with pytest.raises(ValueError, match="steps_per_message must be a positive int or 'auto'"):
            raydist.to_static(build("dp"), num_workers=2, steps_per_message=bad)
    with pytest.raises(ValueError, match="max_in_flight"):
        raydist.to_static(build("dp"), num_workers=2, max_in_flight=0)


class Slow(paddle.io.Dataset):
    """Tuple rows; reading row ``row`` takes ``seconds``: the step that needs it waits."""

    def __init__(self, n, row, seconds):
        self.x, self.y = rows(n)
        self.row, self.seconds = row, seconds

    def __getitem__(self, i):
        if i == self.row:
            time.sleep(self.seconds)
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


def loader_reference(data, steps, optimizer):
    """The loader's global batches (as Paddle's DistributedBatchSampler splits them) trained in one process."""
    samplers = [paddle.io.DistributedBatchSampler(data, 4, num_replicas=2, rank=g) for g in range(2)]
    ref = Reference(optimizer)
    out = []
    for _, (a, b) in zip(range(steps), zip(*samplers)):
        ids = list(a) + list(b)
        out.append(ref.train(data.x[ids], data.y[ids]))
    return out, ref


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dispatch", ["calls", "compiled"])
def test_ctrl_c_while_waiting_leaves_the_steps_running_and_the_model_usable(dispatch):
    import signal
    import threading

    import paddle.distributed as dist

    data = Slow(40, row=21, seconds=6)  # row 21: the third step (2) waits for it
    expected, ref = loader_reference(data, 5, sgd())
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    loader = raydist.shard_dataloader(data, mesh, shard_dims="dp", batch_size=8, prefetch=1)
    with raydist.to_static(build("dp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=2, max_in_flight=8,
                           dispatch=dispatch) as dm:  # fmt: skip
        pids = [r.pid for r in dm.ranks]
        losses = [dm(*batch) for batch in loader()]  # five steps, all sent at once
        # a shell's background job ignores SIGINT, and Python then never raises KeyboardInterrupt
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        start = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt, match="waiting for step 2: steps 2-4 still run on the ranks"):
                float(losses[-1])
        finally:
            signal.signal(signal.SIGINT, previous)
        assert time.monotonic() - start < 3.5  # at once (1.5 s), not when the slow step is done (~6 s)
        timer.join()
        for step, (loss, value) in enumerate(zip(losses, expected)):
            assert_close(loss, value, what=f"step {step}")  # nothing was dropped, or run twice
        x, y = data.x[[0, 1, 2, 3, 4, 5, 6, 7]], data.y[[0, 1, 2, 3, 4, 5, 6, 7]]
        assert_close(dm(*next(iter(loader()))), ref.train(x, y))  # the model goes on: a new epoch's first step
        assert [r.pid for r in dm.ranks] == pids


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dispatch", ["calls", "compiled"])
def test_losses_read_from_another_thread_while_steps_are_sent(dispatch):
    import threading

    data = batches(12)
    ref = Reference(sgd())
    expected = [ref.train(x, y) for x, y in data]
    sent, read, errors = [], {}, []

    def reader():
        try:
            while len(read) < len(data):
                for i, loss in list(enumerate(sent)):
                    if i not in read:
                        read[i] = float(loss)  # waits, from this thread, while the main one sends
                time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2, max_in_flight=3,
                           dispatch=dispatch) as dm:  # fmt: skip
        thread = threading.Thread(target=reader)
        thread.start()
        for x, y in data:
            sent.append(dm(x, y))
        thread.join(timeout=120)
    assert not errors and not thread.is_alive()
    assert_close([read[i] for i in range(len(data))], expected)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(180)
def test_a_control_call_waits_for_the_steps_in_flight():
    """The client drains before any call to the ranks: no caller has to remember to."""
    from raydist.protocol import RankActor

    data = batches(3)
    ref = Reference(sgd())
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           max_in_flight=4) as dm:  # fmt: skip
        losses = [dm(x, y) for x, y in data]
        pieces = testing.call(dm, RankActor.state_dict, "param")
        assert all(loss.done for loss in losses)
        for x, y in data:
            ref.train(x, y)
        full = pieces[0]["fc1.bias"][1].assemble({r: p["fc1.bias"][0] for r, p in enumerate(pieces)})
        assert_close(full, ref.params()["fc1.bias"])
