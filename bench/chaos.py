"""The fault soak: rounds of faults in sequence until the time is up (tests/chaos.py).

    python -m bench chaos [--minutes 30] [--seed 7] [--cases dp2,mp2,dp2xmp2,pp2,sharding3] [--loops fit,plain]
                          [--faults 8] [--epochs N]

Each round takes the next (case, loop) pair in turn, on a ``ray.cluster_utils.Cluster`` of its own,
with ``--faults`` faults drawn by the seed (``--seed`` + the round's number); rounds go on until
``--minutes`` have passed (at least one round). The table counts, by kind of fault, what was
injected and survived, the steps computed again, the seconds to recover and the disk reads; each
round's line says whether it ended equal to one plain process. Exits 1 if any round did not.
"""

from __future__ import annotations

import itertools
import sys
import time

from bench.common import ROOT

sys.path.insert(0, str(ROOT / "tests"))  # the soak and its models live with the tests

import chaos  # noqa: E402


def chaos_table(minutes: float, seed: int, cases: list[str], loops: list[str], faults: int,
                epochs: int | None) -> tuple[str, bool]:  # fmt: skip
    """The soak's report, and whether every round ended as one process with every fault survived."""
    deadline = time.monotonic() + minutes * 60
    rounds = []
    for number, (case, loop) in enumerate(itertools.cycle(itertools.product(cases, loops))):
        done = chaos.soak_round(case, loop, seed + number, faults, epochs=epochs)
        rounds.append(done)
        print(chaos.report([done]).splitlines()[-1] + "\n" + chaos.faults_list(done), flush=True)
        if done.error:
            print(done.error, file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            break
    return chaos.report(rounds), all(not r.problems for r in rounds)
