"""The executor's cache key of a program, computed once. All devices.

Paddle 3.3.1 defect (a cost, not a failure): ``Executor.run`` keys its cache of compiled
programs, for a PIR program, by ``str(program)``
(``_get_strong_program_cache_key_for_new_exe`` in ``paddle/base/executor.py``): every
step prints the whole program again, and hashes the text, so the cost of a step grows
with the size of its program. The canary
``tests/test_compat.py::test_executor_defect_every_run_prints_the_whole_program_and_a_frozen_one_is_printed_once``
shows it: plain
Paddle prints a program once per run (5 times for 5 runs), a program raydist froze is
printed once (by `freeze`), and runs give the same outputs.

Fix: a program that will not change any more is `freeze`-d: its key is made from a
digest of its text, taken once. raydist's runner freezes each mode's program once it is
built; a script's own DistModel (`raydist launch`) has each mode's program frozen once
the engine has prepared it (``Engine._prepare_program``). Programs with the same text
still share a key, as with Paddle's; programs not frozen are keyed as Paddle keys them.
"""

from __future__ import annotations

import hashlib

from . import expect_source

_KEY = "_raydist_frozen_key"  # held by the program object itself: it goes when the program goes


def freeze(program) -> None:
    """Key ``program`` by its text as it is now, from now on (it must not change any more)."""
    setattr(program, _KEY, "raydist-frozen:" + hashlib.sha1(str(program).encode()).hexdigest())


def apply() -> None:
    from paddle.base import executor

    if getattr(executor, "_raydist_frozen_keys", False):
        return
    original = executor._get_strong_program_cache_key_for_new_exe
    expect_source(original, "str(program)", "str(scope.raw_address())", "_get_program_cache_key(feed, fetch_list)",
                  fix="executor")  # fmt: skip

    def key(program, scope, feed, fetch_list):
        frozen = getattr(program, _KEY, None)
        if frozen is None:
            return original(program, scope, feed, fetch_list)
        return frozen + str(scope.raw_address()) + executor._get_program_cache_key(feed, fetch_list)

    executor._get_strong_program_cache_key_for_new_exe = key
    executor._raydist_frozen_keys = True
    _freeze_prepared_programs()


def _freeze_prepared_programs() -> None:
    from paddle.distributed.auto_parallel.static import engine

    original = engine.Engine._prepare_program
    expect_source(original, "self._has_prepared[mode] = True", fix="executor")

    def _prepare_program(self, mode, *args, **kwargs):
        result = original(self, mode, *args, **kwargs)
        program = getattr(self, "_pir_dense_main_progs", {}).get(mode)
        if program is not None:
            freeze(program)
        return result

    engine.Engine._prepare_program = _prepare_program
