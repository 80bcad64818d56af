"""The executor's cache key of a program, computed once. All devices.

Paddle 3.3.1 defect (a cost, not a failure): ``Executor.run`` keys its cache of
compiled programs, for a PIR program, by ``str(program)``
(``_get_strong_program_cache_key_for_new_exe`` in ``paddle/base/executor.py``):
every step prints the whole program again, and hashes the text: for the
bench GPT's train program (225,316 characters on a rank of mp2) 5.7 ms of CPU
per step on the 2-core test machine, for the quickstart MLP's (13,052) 0.23 ms
of a 3.7 ms step. With the fix: 0.015 ms.

Fix: a program that will not change any more is `freeze`-d (raydist's runner
freezes each mode's program once it is built): its key is made from a digest
of its text, taken once. Programs with the same text still share a key, as
with Paddle's; programs not frozen are keyed as Paddle keys them.
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
