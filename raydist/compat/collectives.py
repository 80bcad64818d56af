"""Collectives that pick their gloo ring by id. CPU builds only.

Paddle 3.3.1 defect: the CPU kernels of ``all_reduce``, ``all_gather``,
``broadcast``... use the communicator of the device context, every CPU op
shares one ``CPUContext``, and the PIR executor binds it to the ring of the
FIRST collective it builds (``SetDeviceCommContext`` in
``new_executor/interpreter/interpreter_util.cc`` sets it only while unset).
With several rings per rank (dp x mp on 4 ranks: rank 0 is in {0,1} and
{0,2}) every collective then runs on that first ring: the dp gradient
all-reduce summed mp peers instead, and the dp replicas drifted apart after
one step. NCCL gives every ring a device context of its own and is not
affected.

Fix: after Paddle's last pass over a program (``remove_unuseful_comm_op_pass``,
which the engine runs on every dense main and startup program), replace each
collective with a custom op (``csrc/collective.cc``) that looks its ring up in
CommContextManager by id. gloo in Paddle has no reduce-scatter; the custom op
all-reduces and keeps the local rows.

Second defect: the CPU kernels of ``send_v2``/``recv_v2`` (which carry
activations and gradients between pipeline stages, one ring per ordered pair
of ranks) only throw "Do not support send/recv for cpu kernel now". Fix:
``raydist_send_``/``raydist_recv_`` (``csrc/p2p.cc``) over the same gloo rings;
a send is queued and sent by a thread of its ring, because 1F1B and VPP have
both neighbours send before either receives, and a gloo send waits for its
receiver. `flush` ends each step: every send went out, or its error is raised.
Paddle's pipeline passes route send_v2/recv_v2 into their jobs by name and tie
jobs with events recorded by them, so with ``strategy.pipeline`` the rewrite
waits until the pass has split the program, then rewrites every job and drops
the waits for events the replaced ops would have recorded (on CPU the jobs run
one after the other).

The custom ops are compiled once per machine and Paddle version into
``$RAYDIST_CACHE_DIR`` (default ``~/.cache/raydist``), under a file lock so
co-located ranks do not compile at the same time.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from pathlib import Path
from typing import Any

import paddle
from filelock import FileLock
from paddle import pir

from . import expect_source

_CSRC = Path(__file__).parent / "csrc"

# Paddle op -> (raydist op, attributes passed on, in order).
REPLACEMENTS = {
    "pd_op.all_reduce": ("raydist_all_reduce", ("ring_id", "reduce_type")),
    "pd_op.all_reduce_": ("raydist_all_reduce_", ("ring_id", "reduce_type")),
    "pd_op.c_allreduce_sum": ("raydist_all_reduce", ("ring_id", 0)),
    "pd_op.c_allreduce_sum_": ("raydist_all_reduce_", ("ring_id", 0)),
    "pd_op.mp_allreduce_sum": ("raydist_all_reduce", ("ring_id", 0)),
    "pd_op.mp_allreduce_sum_": ("raydist_all_reduce_", ("ring_id", 0)),
    "pd_op.all_gather": ("raydist_all_gather", ("ring_id", "nranks")),
    "pd_op.broadcast": ("raydist_broadcast", ("ring_id", "root")),
    "pd_op.broadcast_": ("raydist_broadcast_", ("ring_id", "root")),
    "pd_op.reduce_scatter": ("raydist_reduce_scatter", ("ring_id", "nranks")),
}

# Ops that communicate but have no replacement: on CPU they would run on the
# wrong ring, or have no kernel at all.
UNSUPPORTED = {
    "pd_op.all_to_all", "pd_op.c_concat", "pd_op.c_scatter", "pd_op.reduce", "pd_op.c_reduce_sum",
    "pd_op.p_send", "pd_op.p_recv", "pd_op.p_send_array",
    "pd_op.p_recv_array", "pd_op.c_softmax_with_cross_entropy", "pd_op.c_allgather",
    "pd_op.c_broadcast", "pd_op.c_broadcast_",
}  # fmt: skip

_NAME = "raydist_collective"
_loaded = False
_native: Any = None  # the custom ops' library (a ctypes.CDLL), for its C functions
_applied = False
_p2p = 0  # point-to-point ops rewritten in this process (then steps flush their sends)
_deferring_p2p = False  # inside a pipeline's _parallel_pir: send/recv are rewritten in its jobs


def cache_dir() -> Path:
    return Path(os.environ.get("RAYDIST_CACHE_DIR", Path.home() / ".cache" / "raydist"))


def load_ops() -> None:
    """Register the custom ops in this process (compiled on first use, then cached)."""
    global _loaded
    if _loaded:
        return
    from paddle.utils.cpp_extension import load
    from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op

    sources = [_CSRC / "collective.cc", _CSRC / "p2p.cc"]
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, _CSRC / "ring.h"])).hexdigest()[:12]
    build = cache_dir() / f"ops-paddle{paddle.__version__}-{digest}"
    build.mkdir(parents=True, exist_ok=True)
    library = build / _NAME / f"{_NAME}.so"
    with FileLock(build / ".lock"):  # co-located ranks: one compiles, the others wait and load
        if library.exists():
            load_op_meta_info_and_register_op(str(library))
        else:  # compile
            with contextlib.redirect_stdout(io.StringIO()):  # Paddle prints "Compiling ..."
                load(name=_NAME, sources=[str(s) for s in sources], extra_include_paths=[str(_CSRC / "gloo_stub")],
                     build_directory=str(build), verbose=False)  # fmt: skip
    global _native
    import ctypes

    _native = ctypes.CDLL(str(library))  # the same library Paddle loaded: raydist_p2p_flush and _waited_ns
    _native.raydist_p2p_waited_ns.restype = ctypes.c_int64
    _native.raydist_comm_records.restype = ctypes.c_int64
    _native.raydist_comm_records.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.POINTER(ctypes.c_int64)]  # fmt: skip
    _loaded = True


def _blocks(block):
    yield block
    for op in block.ops:
        for sub in op.blocks():
            yield from _blocks(sub)


def rewrite(program, p2p: bool = True) -> int:
    """Replace the collectives of ``program`` in place (and its send/recv if ``p2p``);
    returns how many."""
    global _p2p
    load_ops()
    count = 0
    with paddle.static.program_guard(program):
        for block in list(_blocks(program.global_block())):
            for op in list(block.ops):
                name = op.name()
                if name in UNSUPPORTED:
                    raise NotImplementedError(
                        f"raydist cannot run Paddle's {name} on CPU: gloo has no correct kernel for it "
                        "here. The parallel strategy that needs it is not supported on CPU."
                    )
                if name in _P2P:
                    if p2p:
                        _P2P[name](op)
                        _p2p += 1
                        count += 1
                    continue
                if name not in REPLACEMENTS:
                    continue
                new_name, params = REPLACEMENTS[name]
                attrs = op.attrs()
                args = [attrs[p] if isinstance(p, str) else p for p in params]
                pir.set_insertion_point(op)
                new = paddle._C_ops._run_custom_op(new_name, op.operand_source(0), *args)
                _replace(op, new)
                count += 1
            pir.set_insertion_point_to_block_end(block)
    return count


def _replace(op, new) -> None:
    new = new[0] if isinstance(new, (list, tuple)) else new
    new_op = new.get_defining_op()
    new_op.op_role = op.op_role
    new_op.chunk_id = op.chunk_id
    if op.num_results():
        op.result(0).replace_all_uses_with(new)
    op.erase()


def _send(op) -> None:
    attrs = op.attrs()
    pir.set_insertion_point(op)
    _replace(op, paddle._C_ops._run_custom_op("raydist_send_", op.operand_source(0), attrs["ring_id"], attrs["peer"]))


def _recv(op) -> None:
    attrs = op.attrs()
    pir.set_insertion_point(op)
    buffer = paddle.empty(attrs["out_shape"], attrs["dtype"])  # filled by the receive
    buffer.get_defining_op().op_role = op.op_role
    _replace(op, paddle._C_ops._run_custom_op("raydist_recv_", buffer, attrs["ring_id"], attrs["peer"]))


_P2P = {"pd_op.send_v2": _send, "pd_op.recv_v2": _recv}


def _forget_events(program, gone: set[str]) -> None:
    """Drop the waits for events of replaced send/recv ops. Pipeline passes make an op of
    one job wait for an event the send/recv of another records (streams, on GPU); a
    custom op records none, and on CPU the jobs run one after the other anyway."""
    for op in program.global_block().ops:
        if op.has_attr("events_to_wait"):
            waits = list(op.attrs()["events_to_wait"])
            if set(waits) & gone:
                op.set_str_array_attr("events_to_wait", [e for e in waits if e not in gone])


def p2p_waited_s() -> float:
    """Seconds this rank waited for its pipeline neighbours so far (in receives and flushes)."""
    return _native.raydist_p2p_waited_ns() / 1e9 if _p2p else 0.0


# What `comm_records` calls each kind (csrc/ring.h, CommKind).
COMM_KINDS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "recv", "flush")
COMM_LOG = 1 << 14  # records the native log keeps (kCommLog)


def comm_records(since: int = 0):
    """This rank's collectives and pipeline receives from record number ``since`` on, as far as
    the log still holds them: an int64 array of rows (number, start ns, end ns, kind, ring, 0)
    on ``time.monotonic_ns``'s clock, and the number the next record will get. Empty before
    raydist's ops are loaded (GPU ranks run Paddle's own NCCL collectives, which the host
    cannot time without waiting for the device)."""
    import ctypes

    import numpy as np

    if _native is None:
        return np.zeros((0, 6), np.int64), since
    out = np.empty((COMM_LOG, 6), np.int64)
    after = ctypes.c_int64(0)
    n = _native.raydist_comm_records(since, out.ctypes.data, COMM_LOG, ctypes.byref(after))
    return out[:n], after.value


def flush() -> None:
    """Wait until this rank's pipeline sends went out; raise the first that failed."""
    if not _p2p:
        return
    import ctypes

    error = ctypes.create_string_buffer(2048)
    if _native.raydist_p2p_flush(error, len(error)) != 0:
        raise RuntimeError(f"a pipeline send failed: {error.value.decode(errors='replace')}")


def apply() -> None:
    global _applied
    if _applied:
        return
    from paddle.distributed.auto_parallel.static import engine

    expect_source(engine.Engine._parallel_pir, "remove_unuseful_comm_op_pass(dense_program)", fix="collectives")
    expect_source(engine.Engine._initialize, "remove_unuseful_comm_op_pass(startup_prog)", fix="collectives")
    expect_source(engine.Engine._parallel_pir, "self._job_plan = pipeline_pass(", fix="collectives")
    from paddle.distributed.passes.pipeline_scheduler_pass import pipeline_1f1b, pipeline_pass_base

    expect_source(pipeline_1f1b.Pipeline1F1BPass._partial_pir_programs, 'op.name() == "pd_op.send_v2"',
                  fix="collectives")  # fmt: skip
    expect_source(pipeline_pass_base.PipelinePassBase._add_dependency, '"event_to_record"', '"events_to_wait"',
                  fix="collectives")  # fmt: skip
    load_ops()
    original = engine.remove_unuseful_comm_op_pass
    original_pipeline_pass = engine.pipeline_pass
    original_parallel = engine.Engine._parallel_pir

    def remove_unuseful_comm_op_pass(program, *args, **kwargs):
        result = original(program, *args, **kwargs)
        rewrite(program, p2p=not _deferring_p2p)
        return result

    # Paddle's pipeline passes route send_v2/recv_v2 into their jobs by name: the
    # dense program keeps them, and every job program is rewritten after the pass.
    def pipeline_pass(*args, **kwargs):
        plan = original_pipeline_pass(*args, **kwargs)
        programs = [plan.ir_program(job_type) for job_type in plan.job_types()]
        gone = {op.attrs()["event_to_record"] for p in programs for op in p.global_block().ops
                if op.name() in _P2P and op.has_attr("event_to_record")}  # fmt: skip
        for program in programs:
            rewrite(program)
            _forget_events(program, gone)
        return plan

    def _parallel_pir(self, *args, **kwargs):
        global _deferring_p2p
        _deferring_p2p = bool(self._strategy.pipeline.enable)
        try:
            return original_parallel(self, *args, **kwargs)
        finally:
            _deferring_p2p = False

    # A script's own DistModel steps through Engine.run (raydist's ranks run the executor
    # themselves and flush after each step): its sends are flushed there too.
    original_run = engine.Engine.run

    def run(self, *args, **kwargs):
        result = original_run(self, *args, **kwargs)
        flush()
        return result

    engine.remove_unuseful_comm_op_pass = remove_unuseful_comm_op_pass
    engine.pipeline_pass = pipeline_pass
    engine.Engine._parallel_pir = _parallel_pir
    engine.Engine.run = run
    _applied = True
