import os

# Local test clusters run without token authentication; the job-submission
# tests start their own head with it on.
os.environ["RAY_AUTH_MODE"] = "disabled"

import pytest  # noqa: E402
import ray  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (8 logical CPUs: four 1-CPU ranks fit twice)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_head():
    """A `ray start --head` with a Ray Client server, as an operator starts one (`clusters.RayHead`),
    for the tests of where users stand: Ray Client, `raydist launch --address`, the terminal."""
    from clusters import RayHead

    with RayHead() as head:
        yield head
