"""The asynchronous driver: steps in flight, lazy losses, and both dispatch paths."""

import math
import time

import numpy as np
import paddle
import pytest

import raydist
from raydist.steps import Loss, Window
from models import Reference, assert_close, batches, build, sgd


def test_window_keeps_at_most_size_steps_and_completes_in_order():
    done = []
    window = Window(2)
    steps = [window.submit(lambda i=i: [i], lambda refs, what: done.append(refs[0]) or refs[0] * 10) for i in range(5)]
    assert done == [0, 1, 2] and len(window) == 2  # submitting the 4th and 5th completed the oldest
    assert steps[4].result() == 40 and done == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="max_in_flight"):
        Window(0)


def test_a_failure_fails_the_later_steps_too():
    window = Window(3)

    def finish(refs, what):
        if refs[0] == 1:
            raise RuntimeError(f"{what} failed")
        return refs[0]

    steps = [window.submit(lambda i=i: [i], finish) for i in range(3)]
    with pytest.raises(RuntimeError, match="step 1 failed"):
        steps[2].result()
    assert steps[0].result() == 0
    with pytest.raises(RuntimeError, match="step 1 failed"):
        steps[1].result()
    with pytest.raises(RuntimeError, match="step 1 failed"):
        steps[2].result()


def test_loss_acts_as_a_float():
    window = Window(1)
    loss = Loss(window.submit(lambda: [None], lambda refs, what: 0.25))
    assert float(loss) == 0.25 and loss == 0.25 and 0.25 == loss and loss != 0.5
    assert loss + 1 == 1.25 and 1 - loss == 0.75 and loss * 2 == 0.5 and loss / 0.5 == 0.5 and 2**loss == 2**0.25
    assert loss < 1 and loss > 0 and loss <= 0.25 and loss >= 0.25 and -loss == -0.25 and abs(-loss) == 0.25
    assert f"{loss:.2f}" == "0.25" and str(loss) == "0.25" and repr(loss) == "0.25" and round(loss, 1) == 0.2
    assert np.asarray(loss).dtype == np.float64 and np.allclose([loss, loss], 0.25)
    assert math.isclose(loss, 0.25) and loss == pytest.approx(0.25) and hash(loss) == hash(0.25)
    assert sum([loss, loss]) == 0.5 and np.mean([loss, loss]) == 0.25 and loss.done and loss.item() == 0.25


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dispatch", ["compiled", "calls"])
def test_steps_run_ahead_and_match_single_process(dispatch):
    data = batches(6)
    ref = Reference(sgd())
    with raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=4,
                           max_in_flight=3, dispatch=dispatch) as dm:  # fmt: skip
        assert dm._group.steps(3, dispatch == "compiled").name == dispatch
        losses = [dm(x, y) for x, y in data]  # returns before the steps are done
        for step, (loss, (x, y)) in enumerate(zip(losses, data)):
            assert_close(loss, ref.train(x, y), what=f"step {step}")
        dm.predict()
        assert_close(dm(data[0][0]), ref.predict(data[0][0]))
        params = dm.state_dict("param")
    for name, value in ref.params().items():
        assert_close(params[name], value, what=name)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dispatch", ["compiled", "calls"])
def test_a_rank_failing_in_a_step_names_the_step_and_rank(dispatch):
    from test_data import MESH, Poisoned

    loader = raydist.shard_dataloader(Poisoned(40), MESH, shard_dims="dp", batch_size=8, prefetch=1)
    with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=4,
                           dispatch=dispatch) as dm:  # fmt: skip
        start = time.monotonic()
        with pytest.raises(raydist.RankError, match="row 30 is poisoned") as info:
            for batch in loader():
                dm(*batch)
            dm.wait()
        assert info.value.rank in (2, 3) and info.value.during == "step 3"  # rows 28-31: dp group 1, step 3
        assert time.monotonic() - start < 60
