"""Ray Train for Paddle: `PaddleConfig`, a backend for Ray Train's ``DataParallelTrainer``.

    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # Ray Train V2 (the default)
    from raydist.train import PaddleConfig

    def train_loop_per_worker(config):
        import paddle.distributed as dist          # the process group is up
        shard = ray.train.get_dataset_shard("train")
        ...
        ray.train.report(metrics, checkpoint=...)

    DataParallelTrainer(train_loop_per_worker, backend_config=PaddleConfig(),
                        scaling_config=ray.train.ScalingConfig(num_workers=4),
                        datasets={"train": dataset}).fit()

Each worker gets the environment ``paddle.distributed.launch`` sets (the same
as `raydist launch`, from `raydist.env`), raydist's CPU fixes on CPU, and
joins the Paddle process group (gloo on CPU, NCCL on GPU) before the loop
starts. Failures, restarts and checkpoints are Ray Train's own.
"""

from __future__ import annotations

import dataclasses

import ray
from ray.train.backend import Backend, BackendConfig

from ..env import RankPlace, paddle_env


@dataclasses.dataclass
class PaddleConfig(BackendConfig):
    """How Ray Train's workers join Paddle's process group.

    Attributes:
        paddle_logs: keep Paddle's INFO logs (C++ glog) in the workers; quiet by default.
    """

    paddle_logs: bool = False

    @property
    def backend_cls(self):
        return _PaddleBackend

    def to_dict(self) -> dict:
        return {"paddle_logs": self.paddle_logs}


class _PaddleBackend(Backend):
    # Every worker sees the GPUs of its node's workers and selects its own by
    # FLAGS_selected_gpus, as raydist's ranks do (NCCL can use peer links).
    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config: PaddleConfig) -> None:  # type: ignore[override]  # ours
        use_gpu = bool(worker_group.get_resources_per_worker().get("GPU", 0))
        reports = worker_group.execute(_where)  # in world-rank order
        places = [place for place, _, _ in reports]
        endpoints = [f"{place.node_ip}:{port}" for place, port, _ in reports]
        master = f"{places[0].node_ip}:{reports[0][2]}"
        envs = [paddle_env(rank, places, endpoints, master, use_gpu=use_gpu, paddle_logs=backend_config.paddle_logs)
                for rank in range(len(worker_group))]  # fmt: skip
        for env in envs:
            # Ray Train has shared the node's GPUs already (share_cuda_visible_devices),
            # in the order paddle_env selects the device from: leave it to Ray Train.
            env.pop("CUDA_VISIBLE_DEVICES", None)
        joins = [worker_group.execute_single_async(rank, _join, env, use_gpu) for rank, env in enumerate(envs)]
        ray.get(joins)  # all at once: Paddle's TCP store waits for every rank


def _where() -> tuple[RankPlace, int, int]:
    """This worker's place, and two free ports (its endpoint; the master's, if rank 0)."""
    from ..protocol import free_port, here

    return here(), free_port(), free_port()


def _join(env: dict[str, str], use_gpu: bool) -> None:
    from ..worker.join import join

    join(env, use_gpu)
