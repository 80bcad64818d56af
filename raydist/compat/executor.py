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

Even keyed once, ``Executor.run`` still builds the key's string, looks the cache up, checks
the fetch list and reads a flag at every step: about a tenth of a small step's time on a
rank. raydist's ranks run a built mode through `Prepared`, which takes the cached
executor once and does per step only what ``Executor._run_pir_impl`` does that can
change between steps (the feeds, the learning-rate scheduler's value, the run).
"""

from __future__ import annotations

import hashlib

from . import expect_source

_KEY = "_raydist_frozen_key"  # held by the program object itself: it goes when the program goes


def freeze(program) -> None:
    """Key ``program`` by its text as it is now, from now on (it must not change any more)."""
    setattr(program, _KEY, "raydist-frozen:" + hashlib.sha1(str(program).encode()).hexdigest())


class Prepared:
    """A frozen program's steps with ``feed_names`` and ``fetch_list``, as ``Executor.run``
    runs them once its cache holds the program (``Executor._run_pir_impl``), minus the cache
    lookup and the checks whose answers do not change between steps."""

    def __init__(self, executor, program, feed_names: list[str], fetch_list: list):
        import paddle
        from paddle.base import executor as _executor

        expect_source(executor._run_pir_impl, "self._executor_cache.get_pir_program_and_executor(",
                      "self._pir_feed_data(program, feed, scope, data_op_infos)", "if hasattr(program, 'lr_scheduler')",
                      "ret = new_exe.run(", fix="executor")  # fmt: skip
        expect_source(_executor._StandaloneExecutor.run, "self._new_exe.run(", "as_numpy(tensors, copy=True)",
                      "_merge_tensors(tensors, self._plan.micro_batch_num())", fix="executor")  # fmt: skip
        self.source = program
        self._executor = executor
        self._scope = paddle.static.global_scope()
        self._feed_names = list(feed_names)
        self._fetch_list = list(fetch_list)
        self._program, new_exe, self._infos = executor._executor_cache.get_pir_program_and_executor(
            program, dict.fromkeys(self._feed_names), self._fetch_list, "feed", "fetch", executor.place,
            self._scope, executor.plan,
        )  # fmt: skip
        self._run = new_exe._new_exe.run
        self._plan = new_exe._plan
        self._merge = not paddle.get_flags("FLAGS_enable_pir_in_executor")["FLAGS_enable_pir_in_executor"]
        self._profile = executor.enable_job_schedule_profiler
        self._scheduled = hasattr(self._program, "lr_scheduler")
        self._as_numpy, self._merge_tensors = _executor.as_numpy, _executor._merge_tensors

    def __call__(self, feed: dict) -> list:
        """Run one step on ``feed`` ({name: array or DenseTensor}, the names given); the fetched values (numpy)."""
        if self._scheduled:  # Paddle copies the scheduler's value in at each run: the general path does it
            return self._executor.run(self._program, feed=feed, fetch_list=self._fetch_list, return_numpy=True)
        # drops the names this program has no input for (a later pipeline stage's), as Paddle's run does
        self._executor._pir_feed_data(self._program, feed, self._scope, self._infos)
        tensors = self._run(list(feed), self._profile)._move_to_list()
        if not self._fetch_list:
            return []
        tensors = self._as_numpy(tensors, copy=True)
        return self._merge_tensors(tensors, self._plan.micro_batch_num()) if self._merge else tensors


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
