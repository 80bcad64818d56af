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

The custom ops are compiled once per machine and Paddle version into
``$RAYDIST_CACHE_DIR`` (default ``~/.cache/raydist``), under a file lock so
co-located ranks do not compile at the same time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
from pathlib import Path

import paddle
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
    "pd_op.send_v2", "pd_op.recv_v2", "pd_op.p_send", "pd_op.p_recv", "pd_op.p_send_array",
    "pd_op.p_recv_array", "pd_op.c_softmax_with_cross_entropy", "pd_op.c_allgather",
    "pd_op.c_broadcast", "pd_op.c_broadcast_",
}  # fmt: skip

_NAME = "raydist_collective"
_loaded = False
_applied = False


def cache_dir() -> Path:
    return Path(os.environ.get("RAYDIST_CACHE_DIR", Path.home() / ".cache" / "raydist"))


def load_ops() -> None:
    """Register the custom ops in this process (compiled on first use, then cached)."""
    global _loaded
    if _loaded:
        return
    from paddle.utils.cpp_extension import load
    from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op

    source = _CSRC / "collective.cc"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    build = cache_dir() / f"ops-paddle{paddle.__version__}-{digest}"
    build.mkdir(parents=True, exist_ok=True)
    library = build / _NAME / f"{_NAME}.so"
    with open(build / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            load_op_meta_info_and_register_op(str(library))
        else:
            with contextlib.redirect_stdout(io.StringIO()):  # Paddle prints "Compiling ..."
                load(name=_NAME, sources=[str(source)], extra_include_paths=[str(_CSRC / "gloo_stub")],
                     build_directory=str(build), verbose=False)  # fmt: skip
    _loaded = True


def _blocks(block):
    yield block
    for op in block.ops:
        for sub in op.blocks():
            yield from _blocks(sub)


def rewrite(program) -> int:
    """Replace the collectives of ``program`` in place; returns how many."""
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
                if name not in REPLACEMENTS:
                    continue
                new_name, params = REPLACEMENTS[name]
                attrs = op.attrs()
                args = [attrs[p] if isinstance(p, str) else p for p in params]
                pir.set_insertion_point(op)
                new = paddle._C_ops._run_custom_op(new_name, op.operand_source(0), *args)
                new = new[0] if isinstance(new, (list, tuple)) else new
                new_op = new.get_defining_op()
                new_op.op_role = op.op_role
                new_op.chunk_id = op.chunk_id
                op.result(0).replace_all_uses_with(new)
                op.erase()
                count += 1
            pir.set_insertion_point_to_block_end(block)
    return count


def apply() -> None:
    global _applied
    if _applied:
        return
    from paddle.distributed.auto_parallel.static import engine

    expect_source(engine.Engine._parallel_pir, "remove_unuseful_comm_op_pass(dense_program)", fix="collectives")
    expect_source(engine.Engine._initialize, "remove_unuseful_comm_op_pass(startup_prog)", fix="collectives")
    load_ops()
    original = engine.remove_unuseful_comm_op_pass

    def remove_unuseful_comm_op_pass(program, *args, **kwargs):
        result = original(program, *args, **kwargs)
        rewrite(program)
        return result

    engine.remove_unuseful_comm_op_pass = remove_unuseful_comm_op_pass
    _applied = True
