"""1F1B on two stage meshes of two data-parallel ranks each (pp2 x dp2, 4 ranks): Paddle's
auto-parallel pipeline test style."""

import unittest

import paddle
import paddle.distributed as dist

from pp_net import PPDemoNet, loader, pipeline_strategy, train_and_print


class TestPipelineDP(unittest.TestCase):
    def test_1f1b_pp2_dp2(self):
        mesh0 = dist.ProcessMesh([0, 1], dim_names=["dp"])
        mesh1 = dist.ProcessMesh([2, 3], dim_names=["dp"])
        model = PPDemoNet(mesh0, mesh1)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        dist_loader = dist.shard_dataloader(loader(), meshes=[mesh0, mesh1], shard_dims="dp")
        train_and_print(model, opt, dist_loader, pipeline_strategy("1F1B"), "pp2xdp2", mesh1.process_ids)


if __name__ == "__main__":
    unittest.main()
