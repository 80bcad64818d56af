"""Recovery's books, without Ray: the checkpoints of a timeline, and fit's save of a step at most once."""

import json
import os

import pytest

from raydist import checkpoint
from raydist.driver.api import fit as fits
from raydist.driver.api.resume import latest_checkpoint
from raydist.driver.model.saves import Saves

pytestmark = pytest.mark.timeout(60)


def fake_checkpoint(path, steps: int = 0) -> str:
    """A directory that reads as a complete raydist checkpoint (a manifest, no tensors)."""
    os.makedirs(path)
    record = {"fit": {"steps": steps, "position": [0, steps], "history": [0.0] * steps}}
    with open(os.path.join(path, checkpoint.MANIFEST), "w") as f:
        json.dump({"format": checkpoint.FORMAT, "step": steps, "record": record, "tensors": {}}, f)
    return str(path)


def test_a_restart_that_goes_back_moves_the_later_checkpoints_aside_and_never_picks_them(tmp_path):
    told = []
    saves = Saves(lambda: told.append(saves.last))
    for n in (0, 4, 8, 12):
        saves.saved(n, fake_checkpoint(tmp_path / f"step-{n:08d}", n))
    assert saves.newest(at_most=11).trained == 8 and saves.newest(at_most=3).trained == 0
    assert saves.newest(at_most=-1) is None
    gone = saves.went_back(5)  # e.g. the last clean replica check was after 5 steps
    assert [s.trained for s in gone] == [8, 12]
    assert saves.last.trained == 4 and saves.newest(at_most=100).trained == 4
    names = sorted(os.listdir(tmp_path))
    assert names[:2] == ["step-00000000", "step-00000004"]
    assert [n.split(checkpoint.ABANDONED)[0] for n in names[2:]] == ["step-00000008", "step-00000012"]
    # neither a resumed run nor the new timeline's save of the same step meets them
    assert [os.path.basename(p) for p in checkpoint.complete(str(tmp_path))] == names[:2]
    assert latest_checkpoint(str(tmp_path)).steps == 4
    assert not checkpoint.exists(str(tmp_path / "step-00000008"))
    assert told[-1].trained == 4  # the card shows the newest of the timeline


def test_a_load_begins_a_timeline_of_its_own_and_a_removed_checkpoint_is_no_error(tmp_path):
    saves = Saves()
    saves.saved(3, fake_checkpoint(tmp_path / "a"))
    saves.saved(6, str(tmp_path / "removed-by-keep-last"))
    saves.loaded(6, fake_checkpoint(tmp_path / "b"))
    assert saves.newest(at_most=5) is None and saves.last.path.endswith("b")
    saves.saved(9, str(tmp_path / "gone"))
    assert [s.trained for s in saves.went_back(6)] == [9]  # nothing to move: no error


class _Saving:
    """What `_Run.checkpoint` uses of a model and its lifecycle: saves that write a fake checkpoint,
    in the background until `wait_saved`."""

    def __init__(self):
        self.saved, self.waits, self.pending, self.rates = [], 0, [], None

    def save(self, path, position=None, record=None, background=False):
        assert not checkpoint.exists(path), "raydist never overwrites a checkpoint"
        self.saved.append(path)
        (self.pending.append if background else fake_checkpoint)(path)

    def wait_saved(self):
        self.waits += 1
        while self.pending:
            fake_checkpoint(self.pending.pop())


def _run(saving: _Saving, every: int | None, directory: str, bar=None) -> fits._Run:
    """`fit`'s run of one epoch of 10 steps over a stand-in loader, on ``saving`` (model and lifecycle)."""
    loader = type("Loader", (), {"batch_size": 8, "__len__": lambda self: 10})()
    return fits._Run(saving, saving, loader, 1, 10, every, directory, None, None, None, fits.Pace(8), {}, [], bar)


def test_fit_saves_a_step_once_and_a_notices_save_waits_for_the_schedules(tmp_path):
    saving = _Saving()
    run = _run(saving, 2, str(tmp_path))
    run.history = [0.1, 0.2]
    run.checkpoint(0, 2)  # the schedule's, in the background
    run.checkpoint(0, 2, background=False)  # a preemption notice at the same step: no second save
    assert saving.saved == [str(tmp_path / "step-00000002")] and saving.waits == 1
    assert checkpoint.exists(saving.saved[0])  # complete before the node goes
    run.checkpoint(0, 2)
    assert len(saving.saved) == 1
    os.rename(saving.saved[0], saving.saved[0] + checkpoint.ABANDONED + "x")  # a restart went back before it
    run.checkpoint(0, 2)
    assert len(saving.saved) == 2  # the new timeline's own


def test_after_a_failure_fit_keeps_every_completed_loss_though_a_callback_calls_the_failed_ranks(tmp_path):
    """A callback that asks the ranks (``dm.ranks``) raises `RankError` once the group failed: the
    losses of the steps that completed still go into the history, and fit goes back by the model's
    count of train steps, not by the history's length."""
    import collections

    from raydist.errors import RankError

    class Done:
        done = True

        def __init__(self, value):
            self.value = value

        def __float__(self):
            return self.value

    class Calls:
        def on_batch_end(self, mode, step, logs):
            raise RankError(1, "process died", died=True, during="status")

    class Bar:
        n = 0

        def update(self, n):
            self.n += n

        def set_postfix(self, **kw):
            pass

        def refresh(self):
            pass

    saving = _Saving()
    saving.metrics = type("Metrics", (), {"read": lambda self, loss, lr: None})()
    run = _run(saving, None, str(tmp_path), Bar())
    run.callbacks, run.history = Calls(), [0.0, 1.0]
    run.pending = collections.deque(fits._Pending(Done(float(i)), 0, i, 0.1) for i in range(2, 7))
    run.keep_completed()
    assert run.history == [float(i) for i in range(7)] and not run.pending
    run.go_back(4)  # peer memory's state after this run's step 4 (fit: the restart's count less the run's base)
    assert run.history == [0.0, 1.0, 2.0, 3.0] and run.position == (0, 4)
    with pytest.raises(RuntimeError, match="a bug"):
        run.go_back(9)


# -- the recovery machine: its sources and the phases of a restart, against fakes --------------------

import numpy as np  # noqa: E402

from raydist.driver.lifecycle.recovery import Holding, Recovery  # noqa: E402
from raydist.errors import RankError  # noqa: E402
from raydist.handover import describe  # noqa: E402
from raydist.driver.lifecycle.restart import Restarts  # noqa: E402
from raydist.driver.lifecycle.sources import (Checkpoints, Failure, Offer, PeerCopies, Start,  # noqa: E402
                                               Survivors, choose)
from raydist.messages import ArraysStep  # noqa: E402

NAMES = {"w"}


def _books(sent: int, base: int = 0, loader_from: int | None = None) -> Recovery:
    """A group's books: ``sent`` train steps numbered 0.., each to run at rate ``i``; the steps from
    ``loader_from`` on came from a loader (no batch the driver could send again)."""
    books = Recovery(keep=100, base=base)
    for i in range(sent):
        message = "loader-step" if loader_from is not None and i >= loader_from else ArraysStep([np.zeros(1)])
        books.sent(i, rate=i, message=message)
    return books


def _failure(books: Recovery, completed: int | None = None, salvaged=None, bound: int | None = None) -> Failure:
    done = books.base + books.trained if completed is None else completed
    return Failure(books, salvaged, first_step=books.trained, done=done - books.base, completed=done,
                   bound=done if bound is None else bound, rate="resume-rate", unsalvaged="a test said so")


def test_a_new_group_keeps_the_books_of_the_steps_before_its_base_and_not_after():
    """A resize or a restart goes on with the steps since the copies made before it (a copy from
    before a move off a draining node still serves); steps after the new base are of a timeline left."""
    old = _books(9)
    new = Recovery(keep=100, base=6, carried=old.before(6))
    for i in range(3):
        new.sent(100 + i, rate=f"again {i}", message=ArraysStep([]))
    assert [r for r, _ in new.since(2, 9)] == [2, 3, 4, 5, "again 0", "again 1", "again 2"]
    assert new.completed(done=101) == 7 and new.number(6) == 100 and new.number(5) == 5


class FakePeers:
    """Peer memory's copies: {(generation, index): {rank: held}}; reading a held copy named "lost" fails."""

    def __init__(self, copies: dict):
        self._copies = copies

    def copies(self):
        return self._copies

    @staticmethod
    def read(held):
        if held == "lost":
            raise ConnectionError("the keeper's node is gone")
        return held


class _Value:
    """A piece in the object store, faked."""

    def __init__(self, array):
        self.array = array

    def fetch(self):
        return self.array


def _held(value: float, index: int = 0, names: tuple = ("w",)) -> Holding:
    """A copy of ``names`` after ``index`` train steps, every value ``value``."""
    state = {name: (np.full(2, value, "float32"), None) for name in names}
    return Holding(index, None, describe(state, 0, codes=False), {n: _Value(a) for n, (a, _) in state.items()})


def _sources(peers=None, saves=None) -> dict:
    saves = saves if saves is not None else Saves()
    return {"replicas": Survivors(), "peer_memory": PeerCopies(peers, NAMES),
            "checkpoint": Checkpoints(saves), "start": Start(saves)}


def _offers(failure, **sources) -> dict:
    return {name: s.offer(failure) for name, s in _sources(**sources).items()}


def test_the_rule_takes_the_newest_state_after_its_replay_and_the_cheapest_on_a_tie():
    peer = Offer("peer_memory", 10, 3, steps=tuple((i, ArraysStep([])) for i in range(3)), replay=True)
    disk = Offer("checkpoint", 12, 1, path="ck")
    assert peer.reaches == 13 and choose({"peer_memory": peer, "checkpoint": disk, "start": Offer("start", 0, 14)}) is peer
    newer = Offer("checkpoint", 14, 0, path="ck")
    assert choose({"peer_memory": peer, "checkpoint": newer}) is newer
    level = Offer("checkpoint", 13, 0, path="ck")
    assert choose({"checkpoint": level, "peer_memory": peer}) is peer  # memory before disk on a tie
    survivors = Offer("replicas", 13, 0, state={})
    assert choose({"peer_memory": peer, "replicas": survivors, "why": "not this one"}) is survivors
    # steps from a loader are fed again by the loop, not replayed: a copy reaches only as far as the batches
    fed = Offer("peer_memory", 10, 3, steps=((10, ArraysStep([])), (11, "loader-step"), (12, ArraysStep([]))), replay=True)
    assert fed.reaches == 11


def test_every_source_says_what_it_offers_or_why_not(tmp_path):
    books = _books(9)
    failure = _failure(books, salvaged=({"w": 1}, 0.5, 9))
    offers = _offers(failure)
    assert offers["replicas"] == Offer("replicas", 9, 0, state={"w": 1}, rate=0.5)
    assert offers["peer_memory"] == "the model has no peer memory"
    assert offers["checkpoint"] == "no checkpoint on this timeline"
    assert offers["start"].source == "start" and offers["start"].replay and len(offers["start"].steps) == 9
    assert _offers(_failure(books))["replicas"] == "a test said so"
    # copies: the newest complete one at or before the bound, with the steps since it kept
    peers = FakePeers({(0, 8): {0: _held(8.0)}, (0, 6): {0: _held(6.0)}, (0, 4): {0: "lost"}, (0, 2): {0: _held(2.0)}})
    offer = _offers(_failure(books), peers=peers)["peer_memory"]
    assert offer.trained == 8 and offer.replayed == 1 and [r for r, _ in offer.steps] == [8]
    assert float(offer.state["w"].cut(None, 0)[0]) == 8.0
    # after a mismatch whose last clean check was after 5 steps: the copy after 4 is lost, the one after 2 serves
    offer = _offers(_failure(books, bound=5), peers=peers)["peer_memory"]
    assert offer.trained == 2 and len(offer.steps) == 7
    why = _offers(_failure(books, bound=1), peers=peers)["peer_memory"]
    assert why.count("newer than the last state to trust (1)") == 3  # the log names the newest three
    why = _offers(_failure(books), peers=FakePeers({(0, 4): {0: "lost"}}))["peer_memory"]
    assert why == "the copy after 4 train steps could not be read (ConnectionError: the keeper's node is gone)"
    assert _offers(_failure(books), peers=FakePeers({}))["peer_memory"].startswith("no copy is left")
    short = Recovery(keep=3)
    for i in range(9):
        short.sent(i, i, ArraysStep([]))
    assert "no longer keeps the train steps since the copy after 2" in \
        _offers(_failure(short), peers=FakePeers({(0, 2): {0: _held(2.0)}}))["peer_memory"]
    incomplete = _offers(_failure(books), peers=FakePeers({(0, 8): {0: _held(8.0, names=())}}))["peer_memory"]
    assert "the copy after 8 train steps is incomplete" in incomplete
    # checkpoints: the newest of the timeline at or before the bound
    saves = Saves()
    for n in (3, 7):
        saves.saved(n, fake_checkpoint(tmp_path / f"step-{n:08d}", n))
    offer = _offers(_failure(books), saves=saves)["checkpoint"]
    assert (offer.trained, offer.replayed, offer.path) == (7, 2, saves.last.path)
    assert _offers(_failure(books, bound=5), saves=saves)["checkpoint"].trained == 3
    assert "every checkpoint is newer" in _offers(_failure(books, bound=2), saves=saves)["checkpoint"]
    # the start: replayed from the driver's batches only on the model's first timeline
    start = _offers(_failure(books), saves=saves)["start"]
    assert not start.replay and start.replayed == 9
    assert not _offers(_failure(_books(9, base=4)))["start"].replay


class FakeRebuild:
    """A model's group as a restart uses it: records each phase; ``fail`` names a phase that raises once."""

    def __init__(self, fail: str | None = None, lost: bool = False):
        self.calls, self.fail, self.events, self.lost = [], fail, [], lost

    def _phase(self, name, *args):
        self.calls.append((name, *args))
        if self.fail == name:
            self.fail = None
            if self.lost:  # the state's pieces were on a node that is gone: the new rank says so
                raise RankError(1, "Traceback ...\nraydist.errors.HandoverLost: a piece of the state handed over "
                                   "is gone (ObjectLostError)", during=name)  # fmt: skip
            raise RuntimeError(f"rank 1 died during {name}")

    def close(self):
        self._phase("close")
        return 2

    def start(self, first_step, freed, base):
        self._phase("start", first_step, freed, base)

    def put_back(self, state, rate):
        self._phase("put_back", rate)

    def load(self, path):
        self._phase("load", os.path.basename(path))

    def mirror(self, base, forget):
        self._phase("mirror", base, forget)

    def replay(self, steps, rate):
        self._phase("replay", len(steps), rate)
        return len(steps)

    def emit(self, kind, step, **fields):
        self.events.append((kind, fields))


@pytest.mark.parametrize("phase", [None, "close", "start", "put_back", "mirror", "replay"])
def test_a_restart_that_fails_in_any_phase_is_tried_again_from_the_same_failure(tmp_path, phase):
    """Peer memory's copy after 6 of 9 steps: each phase in turn fails once; the failure is read once,
    the sources are asked again, and the second restart does what an undisturbed one does."""
    saves = Saves()
    for n in (4, 8):
        saves.saved(n, fake_checkpoint(tmp_path / f"step-{n:08d}", n))
    reads, rebuild = [], FakeRebuild(fail=phase)
    restarts = Restarts(saves, rebuild)

    def failed():
        reads.append(1)
        return _failure(_books(9))

    sources = _sources(peers=FakePeers({(0, 6): {0: _held(6.0)}}), saves=saves)
    if phase is not None:
        with pytest.raises(RuntimeError, match=f"during {phase}"):
            restarts.restart(failed, sources)
        assert restarts.pending is not None and not rebuild.events
        rebuild.calls.clear()
    restored = restarts.restart(failed, sources)
    assert reads == [1] and restarts.pending is None
    assert (restored.source, restored.behind, restored.checkpoint) == ("peer_memory", 0, None)
    assert rebuild.calls == [("close",), ("start", 9, 2, 6), ("put_back", None), ("mirror", 6, False),
                             ("replay", 3, "resume-rate")]
    [(kind, event)] = rebuild.events
    assert kind == "restart" and event["source"] == "peer_memory" and event["replayed"] == 3 and event["behind"] == 0
    # the replay reaches step 9: the checkpoint after 8 stays on the timeline
    assert [s.trained for s in saves._saved] == [4, 8]


def test_each_source_is_put_in_its_own_way(tmp_path):
    saves = Saves()
    saves.saved(4, fake_checkpoint(tmp_path / "step-00000004", 4))
    saves.saved(8, fake_checkpoint(tmp_path / "step-00000008", 8))
    # the survivors: their state and rate, no replay, the copies kept
    rebuild = FakeRebuild()
    restored = Restarts(saves, rebuild).restart(lambda: _failure(_books(9), salvaged=({"w": 1}, 0.5, 9)),
                                                _sources(saves=saves))  # fmt: skip
    assert restored.source == "replicas" and restored.behind == 0
    assert rebuild.calls[1:] == [("start", 9, 2, 9), ("put_back", 0.5), ("mirror", 9, False)]
    # a mismatch whose last clean check was after 5: the checkpoint after 4 loads, the one after 8 leaves
    rebuild = FakeRebuild()
    restored = Restarts(saves, rebuild).restart(lambda: _failure(_books(9), bound=5), _sources(saves=saves))
    assert (restored.source, restored.behind, os.path.basename(restored.checkpoint)) == ("checkpoint", None,
                                                                                         "step-00000004")
    assert rebuild.calls[1:] == [("start", 9, 2, 4), ("load", "step-00000004"), ("mirror", 4, True)]
    assert [s.trained for s in saves._saved] == [4] and rebuild.events[0][1]["replayed"] == 5
    assert any(checkpoint.ABANDONED in n for n in os.listdir(tmp_path))
    # nothing else, and no batches kept (no peer memory): the start, the loop feeds every step again
    rebuild, books = FakeRebuild(), Recovery(keep=100)
    for i in range(9):
        books.sent(i, i, None)
    restored = Restarts(Saves(), rebuild).restart(lambda: _failure(books), _sources())
    assert (restored.source, restored.behind) == ("start", None)
    assert rebuild.calls[1:] == [("start", 9, 2, 0), ("mirror", 0, True)]


def test_a_copy_whose_steps_came_from_a_loader_goes_back_and_the_loop_feeds_them_again():
    """Steps 6-8 from a loader: the copy after 6 reaches only 6, behind 3 (fit feeds them again)."""
    rebuild = FakeRebuild()

    def replay(steps, rate):
        rebuild.calls.append(("replay", len(steps), rate))
        return 0

    rebuild.replay = replay
    books = _books(9, loader_from=6)
    restored = Restarts(Saves(), rebuild).restart(lambda: _failure(books),
                                                  _sources(peers=FakePeers({(0, 6): {0: _held(6.0)}})))  # fmt: skip
    assert (restored.source, restored.behind) == ("peer_memory", 3)


@pytest.mark.parametrize("source", ["replicas", "peer_memory"])
def test_a_state_whose_pieces_are_lost_in_the_hand_over_is_not_offered_again(source):
    """The survivors' pieces, or a copy's, lie on their nodes (`raydist.handover`): a node lost while
    the new ranks fetch them leaves the state incomplete; the retry takes the next best source, while a
    rank dying for another reason in the same phase leaves the state on offer."""
    peers = FakePeers({(0, 6): {0: _held(6.0, 6)}, (0, 4): {0: _held(4.0, 4)}})
    salvaged = ({"w": "pieces"}, 0.5, 9) if source == "replicas" else None
    for lost, second in ((True, "peer_memory" if source == "replicas" else 4), (False, source)):
        rebuild = FakeRebuild(fail="put_back", lost=lost)
        restarts = Restarts(Saves(), rebuild)
        failure = _failure(_books(9), salvaged=salvaged)
        with pytest.raises(RuntimeError):
            restarts.restart(lambda: failure, _sources(peers=peers))
        restored = restarts.restart(lambda: failure, _sources(peers=peers))
        if second == "peer_memory":
            assert restored.source == "peer_memory" and restored.trained == 9
        elif isinstance(second, int):
            assert restored.source == "peer_memory" and rebuild.calls[-2] == ("mirror", second, False)
        else:
            assert restored.source == source
