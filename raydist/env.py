"""The environment one rank needs, as ``paddle.distributed.launch`` would set it.

A pure function of the group's layout, so the GPU path (NCCL, device
selection) is unit-tested on machines without GPUs: CPU and GPU differ only in
the backend and the device variables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where a rank runs, as its actor reports it."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...] = ()  # what Ray assigned this actor


def paddle_env(
    rank: int,
    places: Sequence[RankPlace],
    endpoints: Sequence[str],
    master: str,
    *,
    use_gpu: bool,
) -> dict[str, str]:
    """Environment variables for ``rank`` (Paddle reads them in ``init_parallel_env``).

    ``places`` and ``endpoints`` are indexed by rank. On GPU every rank sees all
    GPUs Ray gave the ranks on its node (so NCCL can use peer links, as Ray
    Train does) and selects one by ``FLAGS_selected_gpus``: the co-located ranks
    take the node's GPUs in increasing id order, so ranks are ordered by node,
    then GPU id.
    """
    me = places[rank]
    local = [r for r, p in enumerate(places) if p.node_id == me.node_id]
    env = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(places)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_MASTER": master,
        "PADDLE_GLOBAL_RANK": str(rank),
        "PADDLE_GLOBAL_SIZE": str(len(places)),
        "PADDLE_LOCAL_RANK": str(local.index(rank)),
        "PADDLE_LOCAL_SIZE": str(len(local)),
        "PADDLE_RANK_IN_NODE": str(local.index(rank)),
        "PADDLE_NNODES": str(len({p.node_id for p in places})),
        "PADDLE_DISTRI_BACKEND": "nccl" if use_gpu else "gloo",
    }
    if use_gpu:
        node_gpus = sorted({g for r in local for g in places[r].gpu_ids}, key=_gpu_order)
        if len(node_gpus) < len(local):
            raise ValueError(
                f"node {me.node_ip} runs {len(local)} ranks but Ray gave them only {len(node_gpus)} GPUs"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
        env["FLAGS_selected_gpus"] = str(local.index(rank))
    return env


def _gpu_order(gpu_id: str):
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)
