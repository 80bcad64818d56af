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

    return {"env_vars": {WORKER_PROCESS_SETUP_HOOK_ENV_VAR: f"faults.{name}",
                         "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}}  # fmt: skip


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


def pause_a_save_when_flagged():
    """Once the file named by $RAYDIST_TEST_FLAG exists, the next checkpoint write (of
    whichever rank comes first) removes it, then, after writing, waits 5 s, or until the
    file named by $RAYDIST_TEST_RESUME exists: a save that lasts long enough for a test to
    lose or add a node in the middle of it."""
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
        deadline = time.monotonic() + (120 if resume else 5)
        while time.monotonic() < deadline and not (resume and os.path.exists(resume)):
            time.sleep(0.05)
        return name

    checkpoint.write_pieces = write_then_wait


def die_in_step_5_on_rank_1():
    """Rank 1's process is killed as its step 5 (its sixth since the build) begins: its peers
    are then inside step 5, waiting for it in a collective."""
    from raydist.protocol import RankActor

    setup = RankActor.setup

    def setup_then_patch(self, *args):
        fixes = setup(self, *args)  # Paddle is imported only once the rank joined: patch after
        from raydist.worker import model

        step = model.ModelService.step

        def step_or_die(service, message, staged):
            service.steps_begun = getattr(service, "steps_begun", 0) + 1
            if service.rank == 1 and service.steps_begun == 6:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(service, message, staged)

        model.ModelService.step = step_or_die
        return fixes

    RankActor.setup = setup_then_patch
