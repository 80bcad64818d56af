"""A model's options as frozen dataclasses (raydist.PlacementConfig, DispatchConfig, RecoveryConfig):
each checked once when made, the keywords of to_static shorthand for their fields, and a config
given whole reaching the ranks as a keyword would."""

from __future__ import annotations

import dataclasses
import os
import signal

import paddle
import pytest
from helpers import wait_gone
from models import Reference, adamw, assert_close, assert_params_equal, batches, build

import raydist
from raydist import DispatchConfig, PlacementConfig, RecoveryConfig, testing

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("make, message", [
    (lambda: PlacementConfig(placement_strategy="SPRED"), "placement_strategy must be one of"),
    (lambda: PlacementConfig(resources_per_rank={"CPU": "1"}), "resources_per_rank must map"),
    (lambda: PlacementConfig(resources_per_rank=[("CPU", 1)]), "resources_per_rank must map"),
    (lambda: PlacementConfig(placement_timeout_s=0), "placement_timeout_s must be None or a positive"),
    (lambda: PlacementConfig(master_port=70000), "master_port must be None or a port"),
    (lambda: PlacementConfig(spare_ranks=-1), "spare_ranks must be an int >= 0"),
    (lambda: PlacementConfig(spare_ranks=True), "spare_ranks must be an int >= 0"),
    (lambda: PlacementConfig(runtime_env="pip"), "runtime_env must be a dict"),
    (lambda: DispatchConfig(dispatch="rpc"), "dispatch must be one of"),
    (lambda: DispatchConfig(max_in_flight=0), "max_in_flight must be a positive int, got 0"),
    (lambda: DispatchConfig(steps_per_message="many"), "steps_per_message must be a positive int or 'auto'"),
    (lambda: DispatchConfig(step_timeout_s=-1), "step_timeout_s must be None or a positive"),
    (lambda: RecoveryConfig(peer_memory=0), r"peer_memory must be None or an int >= 1 \(train steps between two\)"),
    (lambda: RecoveryConfig(check_replicas=1.5), "check_replicas must be None or an int >= 1"),
    (lambda: RecoveryConfig(replica_mismatch="ignore"), "replica_mismatch must be 'raise' or 'warn'"),
])  # fmt: skip
def test_each_option_is_checked_once_when_its_config_is_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_configs_are_frozen_and_keep_no_reference_to_the_callers_dicts():
    resources, env = {"CPU": 1}, {"env_vars": {"A": "1"}}
    config = PlacementConfig(resources_per_rank=resources, runtime_env=env)
    resources["CPU"], env["pip"] = 4, ["x"]
    assert config.resources_per_rank == {"CPU": 1} and config.runtime_env == {"env_vars": {"A": "1"}}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.placement_strategy = "SPREAD"  # type: ignore[misc]
    assert config.bundle(use_gpu=False) == {"CPU": 1} and PlacementConfig().bundle(use_gpu=True) == {"CPU": 1, "GPU": 1}


def test_a_keyword_is_shorthand_for_its_field_and_a_keyword_that_disagrees_with_the_config_is_refused():
    from raydist.options import merged

    given = PlacementConfig(spare_ranks=2, placement_timeout_s=60)
    # a keyword left at its default leaves the config's field; one that is set takes its place
    assert merged(PlacementConfig, given, "placement_config", spare_ranks=0, placement_strategy="SPREAD") == \
        dataclasses.replace(given, placement_strategy="SPREAD")  # fmt: skip
    assert merged(PlacementConfig, given, "placement_config", spare_ranks=2) == given  # the same: no conflict
    assert merged(PlacementConfig, None, "placement_config", master_port=29500) == PlacementConfig(master_port=29500)
    with pytest.raises(ValueError, match=r"spare_ranks=1 and placement_config.spare_ranks=2 disagree"):
        merged(PlacementConfig, given, "placement_config", spare_ranks=1)
    with pytest.raises(TypeError, match="placement_config must be a raydist.PlacementConfig, got dict"):
        merged(PlacementConfig, {"spare_ranks": 1}, "placement_config")


@pytest.mark.parametrize("kwargs, message", [
    ({"dispatch_config": DispatchConfig(max_in_flight=3), "max_in_flight": 1}, "max_in_flight=1 and dispatch_config"),
    ({"recovery_config": RecoveryConfig(peer_memory=2), "peer_memory": 3}, "peer_memory=3 and recovery_config"),
    ({"recovery_config": DispatchConfig()}, "recovery_config must be a raydist.RecoveryConfig"),
    ({"steps_per_message": 0}, "steps_per_message must be a positive int or 'auto'"),
    ({"placement_strategy": "ANY"}, "placement_strategy must be one of"),
    ({"detached": True, "name": "m", "dispatch_config": DispatchConfig(dispatch="compiled")},
     "dispatch='compiled' cannot be detached"),
])  # fmt: skip
def test_to_static_refuses_bad_options_before_anything_starts(kwargs, message):
    import ray

    started = ray.is_initialized()
    with pytest.raises((ValueError, TypeError), match=message):
        raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2, **kwargs)
    assert ray.is_initialized() == started  # refused before Ray was started


@pytest.mark.usefixtures("ray_session")
def test_configs_given_whole_reach_the_ranks_and_recover_as_the_keywords_do():
    """mp2 with the three configs given whole: the placement, the transport and the window come from
    them, and peer memory brings a killed rank back with the steps since replayed; the run equals one
    process."""
    data, ref = batches(8, seed=5), Reference(adamw())
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2,
                           placement_config=PlacementConfig(placement_strategy="SPREAD", placement_timeout_s=120),
                           dispatch_config=DispatchConfig(dispatch="tree", max_in_flight=1, steps_per_message=1),
                           recovery_config=RecoveryConfig(peer_memory=2)) as dm:  # fmt: skip
        config = testing.lifecycle(dm).config
        assert (config.placement.placement_strategy, config.placement.placement_timeout_s) == ("SPREAD", 120)
        assert config.recovery.peer_memory == 2 and config.dispatch.max_in_flight == 1
        losses = [float(dm(x, y)) for x, y in data[:5]]
        assert dm.dispatch == "tree"
        pids = [r.pid for r in dm.ranks]
        os.kill(pids[1], signal.SIGKILL)
        wait_gone([pids[1]])
        with pytest.raises(raydist.RankError) as info:
            for x, y in data[5:]:
                losses.append(float(dm(x, y)))
        assert info.value.rank == 1 and info.value.died
        dm.restart()
        [restart] = [e for e in dm.events() if e["kind"] == "restart"]
        assert restart["source"] == "peer_memory" and restart["behind"] == 0, restart  # the steps since replayed
        losses += [float(dm(x, y)) for x, y in data[len(losses):]]
        params = dm.state_dict("param")
    assert_close(losses, [ref.train(x, y) for x, y in data])
    assert_params_equal(params, ref.params())
