"""FThenB, then 1F1B, on two stage meshes: Paddle's auto-parallel pipeline test style
(pp_degree left at its default; dist.shard_dataloader over a paddle.io.DataLoader)."""

import unittest

import paddle
import paddle.distributed as dist

from pp_net import PPDemoNet, loader, pipeline_strategy, train_and_print


class TestPipelineSchedules(unittest.TestCase):
    def setUp(self):
        self.mesh0 = dist.ProcessMesh([0], dim_names=["pp"])
        self.mesh1 = dist.ProcessMesh([1], dim_names=["pp"])

    def train(self, schedule_mode):
        paddle.seed(2024)
        model = PPDemoNet(self.mesh0, self.mesh1)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        dist_loader = dist.shard_dataloader(loader(), meshes=[self.mesh0, self.mesh1])
        return train_and_print(model, opt, dist_loader, pipeline_strategy(schedule_mode), schedule_mode, [1])

    def test_fthenb_then_1f1b(self):
        self.train("FThenB")
        self.train("1F1B")


if __name__ == "__main__":
    unittest.main()
