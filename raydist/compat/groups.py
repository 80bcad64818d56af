"""Gloo process groups after the global one, each with a rendezvous of its own. CPU builds only.

Paddle 3.3.1 defect (``paddle/fluid/distributed/collective/process_group_gloo.cc``):
``ProcessGroupGloo``'s constructor connects a gloo full mesh through the global
TCP store under bare keys, one per rank in the group ("0", "1", ...); the group
id no longer prefixes them, as it did in Paddle 2.x. So every group made after
the global one (``paddle.distributed.new_group``, and so every hybrid group of
``fleet.init``, which ``DistModel`` calls under ``paddle.distributed.launch`` or
``raydist launch``) may find its peers' keys already written by an earlier
group, or by another group being made at the same moment (pp2 x dp2 makes the
pipe groups {0,2} and {1,3} together), connect to a stale address and fail:
``gloo/transport/tcp/pair.cc: connect [127.0.0.1]:N: Connection refused``.
Seen in 3 of 5 launches of a pp2 x dp2 script on 4 CPU ranks.

Fix: every gloo group but the global one makes its rendezvous in a TCP store of
its own. The group's first member serves it on a free port and says where under
a key named for the group id in the global store (group ids advance alike on
every rank, as ``new_group`` requires of its callers).
"""

from __future__ import annotations

import functools

from . import expect_source
from .store import wait_for_master

_applied = False
# Paddle's default store timeout, in seconds.
TIMEOUT_S = 900


def _own_store(global_store, rank: int, size: int, group_id: int):
    """A new TCP store for the ``size`` members of group ``group_id``, served by its rank 0."""
    from paddle.base import core
    from paddle.distributed.collective import _get_global_env

    from ..net import free_port

    key = f"raydist/gloo-group/{group_id}"
    if rank == 0:
        host = _get_global_env().current_endpoint.rsplit(":", 1)[0]
        port = free_port()
        global_store.set(key, f"{host}:{port}")
        return core.TCPStore(host, port, True, size, TIMEOUT_S)  # returns once every member connected
    where = global_store.get(key).decode()
    wait_for_master(where)  # Paddle's own client retries a refused connect only every 3 s
    host, port = where.rsplit(":", 1)
    return core.TCPStore(host, int(port), False, size, TIMEOUT_S)


def apply() -> None:
    global _applied
    if _applied:
        return
    from paddle.distributed import collective

    expect_source(collective._new_process_group_impl, "core.ProcessGroupGloo.create(store, rank, world_size, group_id)",
                  fix="groups")  # fmt: skip
    original = collective._new_process_group_impl

    @functools.wraps(original)
    def _new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, *args, **kwargs):
        if backend == "gloo" and group_id != 0:
            store = _own_store(store, rank, world_size, group_id)
        return original(backend, store, rank, world_size, group_name, pg_options, group_id, *args, **kwargs)

    # new_group looks the function up in collective's globals; init_parallel_env (the global
    # group, whose keys are still fresh) keeps the reference it imported.
    collective._new_process_group_impl = _new_process_group_impl
    _applied = True
