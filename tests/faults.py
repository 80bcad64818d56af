"""Faults injected into rank processes through Ray's ``worker_process_setup_hook`` (a module path per actor).

Use as ``runtime_env=faults.hook("die_after_writing_on_rank_1")``.
"""

import os
import signal


def hook(name: str) -> dict:
    """A runtime_env that runs ``faults.<name>`` in every new worker process.

    Ray takes ``worker_process_setup_hook`` from a job's runtime_env only; an
    actor's workers read it from this environment variable, which is how Ray
    passes the job's on.
    """
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    path = [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
    return {"env_vars": {WORKER_PROCESS_SETUP_HOOK_ENV_VAR: f"faults.{name}",
                         "PYTHONPATH": os.pathsep.join(p for p in path if p)}}  # fmt: skip


def die_after_writing_on_rank_1():
    """On rank 1, a checkpoint write kills the process once its file is written."""
    from raydist import checkpoint

    write = checkpoint.write_pieces

    def write_then_die(directory, rank, pieces):
        name = write(directory, rank, pieces)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return name

    checkpoint.write_pieces = write_then_die


def die_after_a_background_write_on_rank_1():
    """On rank 1, the process is killed once its background checkpoint write is done, when the driver
    asks for it (`RankActor.saved`): after `save_pieces` has returned, so the kill never overtakes
    its answer, as one in the write's own thread can on a loaded machine. (Nothing that imports
    Paddle may be imported here: Paddle's dygraph mode is per importing thread.)"""
    from raydist.protocol import RankActor

    saved = RankActor.saved

    def saved_then_die(self, directory):
        name = saved(self, directory)
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return name

    saved_then_die.__dict__.update(saved.__dict__)  # its concurrency group
    RankActor.saved = saved_then_die


def pause_a_save_when_flagged():
    """Once the file named by $RAYDIST_TEST_FLAG exists, the next checkpoint write (of
    whichever rank comes first) removes it, then, after writing, waits 5 s, or until the
    file named by $RAYDIST_TEST_RESUME exists (then no timer: the test's timeout bounds the
    wait): a save that lasts long enough for a test to lose or add a node in the middle of it."""
    from raydist import checkpoint

    write = checkpoint.write_pieces

    def write_then_wait(directory, rank, pieces):
        name = write(directory, rank, pieces)
        try:
            os.remove(os.environ["RAYDIST_TEST_FLAG"])
        except (FileNotFoundError, KeyError):
            return name
        import time

        resume = os.environ.get("RAYDIST_TEST_RESUME")
        deadline = time.monotonic() + (float("inf") if resume else 5)
        while time.monotonic() < deadline and not (resume and os.path.exists(resume)):
            time.sleep(0.05)
        return name

    checkpoint.write_pieces = write_then_wait


def _before_each_step(before):
    """Patch the rank's model service so that ``before(service)`` runs as each of its steps
    begins (``service.steps_begun`` counts them from 1, since the build; ``service.rank``)."""
    from raydist.protocol import RankActor

    setup = RankActor.setup

    def setup_then_patch(self, *args, **kwargs):
        fixes = setup(self, *args, **kwargs)  # Paddle is imported only once the rank joined: patch after
        from raydist.worker import model

        step = model.ModelService.step

        def step_after(service, message, staged):
            service.steps_begun = getattr(service, "steps_begun", 0) + 1
            before(service)
            return step(service, message, staged)

        model.ModelService.step = step_after
        return fixes

    RankActor.setup = setup_then_patch


def die_in_step_5_on_rank_1():
    """Rank 1's process is killed as its step 5 (its sixth since the build) begins: its peers
    are then inside step 5, waiting for it in a collective."""

    def die(service):
        if service.rank == 1 and service.steps_begun == 6:
            os.kill(os.getpid(), signal.SIGKILL)

    _before_each_step(die)


def slow_steps():
    """Every step of every rank takes $RAYDIST_TEST_STEP_S seconds more (a sleep as it begins)."""
    import time

    seconds = float(os.environ["RAYDIST_TEST_STEP_S"])
    _before_each_step(lambda service: time.sleep(seconds))


def hold_step_1_until_rank_1_is_gone():
    """For a test that kills rank 1 inside its step 1 (its second since the build): as rank 1
    begins that step, it writes its pid to the file $RAYDIST_TEST_FLAG and goes on into the
    step (where it waits for rank 0); rank 0 begins it only once that pid is gone (at most
    60 s), so the kill lands while rank 1 is inside the step, and rank 0 then runs its part
    against a dead peer."""
    import time

    flag = os.environ["RAYDIST_TEST_FLAG"]

    def hold(service):
        if service.steps_begun != 2:
            return
        if service.rank == 1:
            with open(flag + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(flag + ".tmp", flag)
        elif service.rank == 0:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (os.path.exists(flag) and _gone(int(open(flag).read()))):
                time.sleep(0.02)

    _before_each_step(hold)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def slow_steps_on_rank_1():
    """On rank 1, every step sleeps $RAYDIST_TEST_SLOW_S (default 0.03 s) before it runs: a slow rank,
    whose peers wait for it in their collectives. Its model's step is wrapped once it is set up (no
    Paddle import here)."""
    import time

    from raydist.protocol import RankActor

    setup = RankActor.setup

    def setup_then_slow(self, *args, **kwargs):
        fixes = setup(self, *args, **kwargs)
        if self.rank == 1:
            step = self.model.step

            def slow_step(message, staged):
                time.sleep(float(os.environ.get("RAYDIST_TEST_SLOW_S", "0.03")))
                return step(message, staged)

            self.model.step = slow_step
        return fixes

    setup_then_slow.__dict__.update(setup.__dict__)
    RankActor.setup = setup_then_slow


def flip_a_bit_on_rank_2_after_step_5():
    """On rank 2, after its 5th train step, one bit of its first parameter (by variable name) flips in
    place, as silent data corruption would flip it; the parameter's name goes to $RAYDIST_TEST_FLAG.
    (A message's steps run together: a message holding step 5 flips after its last step.)"""
    from raydist.protocol import RankActor

    run = RankActor.run

    def run_then_flip(self, parcel):
        results = run(self, parcel)
        model = self.model
        if self.rank == 2 and model.trained >= 5 and not os.path.exists(os.environ["RAYDIST_TEST_FLAG"]):
            import numpy as np

            state = model.runner.state_dict("param")  # static or dynamic: the rank's own pieces, copied
            name = sorted(state)[0]
            array = np.array(state[name][0])
            array.reshape(-1).view(np.uint32)[0] ^= 1 << 12  # a low bit of the mantissa: a small change
            model.runner.set_pieces(lambda held: [(name, array)])
            with open(os.environ["RAYDIST_TEST_FLAG"], "w") as f:
                f.write(name)
        return results

    run_then_flip.__dict__.update(run.__dict__)  # its concurrency group
    RankActor.run = run_then_flip
