"""cluster.yaml is a valid Ray cluster-launcher config for an autoscaling raydist cluster."""

from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raydist.driver.cluster.config import GroupConfig

CONFIG = Path(__file__).resolve().parent.parent / "cluster.yaml"


def test_cluster_yaml_passes_rays_own_validation():
    config = prepare_config(yaml.safe_load(CONFIG.read_text()))
    validate_config(config)
    types = config["available_node_types"]
    head, gpu = types[config["head_node_type"]], types["gpu_worker"]
    assert head["resources"].get("GPU", 0) == 0 and gpu["min_workers"] == 0 and gpu["max_workers"] >= 1
    bundle = GroupConfig(num_workers=4, use_gpu=True).bundle()  # one rank's placement bundle
    assert all(gpu["resources"].get(k, 0) >= v for k, v in bundle.items())
    setup = "\n".join(config["setup_commands"])
    assert "paddlepaddle-gpu==3.3.1 -i https://www.paddlepaddle.org.cn/" in setup
    assert "--no-deps ~/raydist" in setup
    for commands in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "GLOO_SOCKET_IFNAME" in "\n".join(config[commands])
