"""VPP (vpp_degree 2, segments by the Block class) on two stage meshes, AdamW: Paddle's auto-parallel
pipeline test style (pp_degree left at its default; dist.shard_dataloader over a paddle.io.DataLoader).
argv: the blocks' stages, e.g. 0,1,0,1."""

import sys
import unittest

import paddle
import paddle.distributed as dist

from pp_net import VPPDemoNet, loader, pipeline_strategy, train_and_print

PLACE = tuple(int(p) for p in (sys.argv[1] if len(sys.argv) > 1 else "0,1,0,1").split(","))


class TestVPP(unittest.TestCase):
    def test_vpp(self):
        meshes = [dist.ProcessMesh([0], dim_names=["pp"]), dist.ProcessMesh([1], dim_names=["pp"])]
        model = VPPDemoNet(meshes, PLACE)
        opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
        dist_loader = dist.shard_dataloader(loader(), meshes=meshes)
        strategy = pipeline_strategy("VPP", vpp_degree=2, vpp_seg_method="Block")
        train_and_print(model, opt, dist_loader, strategy, "VPP", [1])  # the last chunk is on stage 1


if __name__ == "__main__":
    sys.argv = sys.argv[:1]
    unittest.main()
