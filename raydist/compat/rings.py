"""Auto-parallel process groups ("rings") on CPU over gloo. CPU builds only.

Paddle 3.3.1 defects answered here (``paddle/distributed/auto_parallel/static/
process_group.py`` and ``helper.py``):

1. ``ProcessGroup.instantiate`` knows only NCCL/BKCL/XCCL and raises
   ``AssertionError: No CUDA device found`` on CPU. Fix: create a gloo
   communicator for the ring in Paddle's CommContextManager.
2. The legacy ``barrier`` op it and the engine call has no CPU kernel
   ("NCCLCommContext is nullptr"). Fix: ``paddle.distributed.barrier()``.
3. ``new_process_group`` numbers rings with a per-process counter, so the same
   id names different rank sets on different ranks (the mp ring {0,1} on ranks
   0-1 and {2,3} on ranks 2-3) and gloo's rendezvous keys, which are the ring
   ids, collide. NCCL hashes the members' endpoints into its key and is not
   affected. Fix: derive the id from the rank list itself.
"""

from __future__ import annotations

import paddle
from paddle.distributed.auto_parallel.static import process_group as _pg
from paddle.distributed.auto_parallel.static.utils import dygraph_guard

from . import expect_source

_applied = False


def ring_id(ranks, nth: int = 0) -> int:
    """A ring id that every member derives alike from the ordered rank list.

    Above the small ids Paddle's own counters hand out, below 2**31 (the op
    attribute is an int32).
    """
    import hashlib

    key = "_".join(map(str, ranks)) + (f"#{nth}" if nth else "")
    return 1_000_000 + int(hashlib.md5(key.encode()).hexdigest()[:7], 16)


# Runs with process_group.py's globals: it replaces new_process_group's code
# object in place, so every module that imported the function by name gets it.
def _new_process_group(ranks, group_id=None, force_new_group=False, group_type=None):
    global _g_process_group_map
    key = "_".join(map(str, ranks))
    same = [pg for pid, pg in _g_process_group_map.items() if pid != 0 and "_".join(map(str, pg.ranks)) == key]
    if same and not force_new_group:
        return same[0]
    if group_id is None:
        import raydist.compat.rings as _rings

        group_id = _rings.ring_id(ranks, len(same))
        if group_id in _g_process_group_map:
            raise RuntimeError(f"raydist: ring id {group_id} of ranks {ranks} collides with another ring")
    new_pg = ProcessGroup(group_id, ranks, group_type)  # noqa: F821 - process_group.py's global
    _g_process_group_map[group_id] = new_pg
    return new_pg


@dygraph_guard
def _instantiate(self):
    if self._is_instantiate:
        return
    genv = _pg._get_global_env()
    if self.nranks >= 2 and genv.rank in self.ranks and self.id != 0:
        # Ring 0 (all ranks) exists after init_parallel_env(); making it again
        # raises AlreadyExists.
        _pg.core.CommContextManager.create_gloo_comm_context(
            _pg.core.create_or_get_global_tcp_store(),
            str(self.id),
            self.local_rank(genv.rank),
            self.nranks,
        )
    if self.nranks > 1:
        paddle.distributed.barrier()
    self._is_instantiate = True


def _barrier(x, out, *attrs):
    paddle.distributed.barrier()
    return out


def apply() -> None:
    global _applied
    if _applied:
        return
    expect_source(_pg.ProcessGroup.instantiate, "No CUDA device found", "_legacy_C_ops.barrier", fix="rings")
    expect_source(_pg.new_process_group, "_new_ring_id() + num_groups + 1", fix="rings")
    from paddle.distributed.auto_parallel.static import helper

    expect_source(helper.ProgramHelper.init_pir, "paddle._legacy_C_ops.barrier(", fix="rings")

    _pg.ProcessGroup.instantiate = _instantiate
    _pg.new_process_group.__code__ = _new_process_group.__code__
    paddle._legacy_C_ops.barrier = _barrier
    _applied = True
