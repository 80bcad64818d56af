"""Every check of a model's arguments, made at the driver before any rank starts.

A bad argument is a `TypeError` or `ValueError` here, saying what to pass
instead; nothing has been started or sent yet.
"""

from __future__ import annotations

from typing import Any

import ray

from ...data.loader import ShardDataloader
from ...options import DispatchConfig, PlacementConfig
from ...specs import from_input_spec, spec_of
from ...strategy import check as check_strategy
from ...strategy import check_dynamic
from ..cluster.sizes import Sizes, sizes_of
from .inputs import leaves, to_array


def check_arguments(layer: Any, loader: Any, loss: Any, optimizer: Any, strategy: Any, metrics: Any, *,
                    use_gpu: bool, placement: PlacementConfig, dispatch: DispatchConfig, name: Any = None,
                    detached: Any = False, dynamic: Any = False, weights: Any = None) -> None:  # fmt: skip
    """Refuse arguments that cannot make a model (see `raydist.DistModel` for what each takes); the
    options in ``placement`` and ``dispatch`` were checked when they were made."""
    import paddle

    if isinstance(layer, paddle.nn.Layer):
        raise TypeError(
            "raydist builds the layer on every rank: pass a function that returns it "
            "(e.g. `lambda: MyNet(mesh)`), not a Layer built on the driver"
        )
    if not callable(layer):
        raise TypeError(f"layer must be a callable that returns a paddle.nn.Layer, got {type(layer).__name__}")
    if loader is not None and not isinstance(loader, (ShardDataloader, paddle.io.DataLoader)):
        from paddle.distributed.auto_parallel.api import ShardDataloader as PaddleShardDataloader

        if isinstance(loader, PaddleShardDataloader):
            raise TypeError(
                "paddle.distributed.shard_dataloader(...) makes each rank's dist tensors in the process that "
                "iterates it, and this driver is no rank: make it with raydist.shard_dataloader(dataset, meshes, "
                "input_keys, shard_dims, batch_size) instead (the same arguments; dataset: the paddle.io.Dataset "
                "of your DataLoader, or a ray.data.Dataset), and each rank reads its own rows"
            )
        raise TypeError(
            "loader must be a raydist.shard_dataloader(...), a paddle.io.DataLoader or None, "
            f"got {type(loader).__name__}"
        )
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a paddle.nn.Layer or a callable, got {type(loss).__name__}")
    if isinstance(optimizer, paddle.optimizer.Optimizer) or (optimizer is not None and not callable(optimizer)):
        raise TypeError(
            "optimizer must be a callable that makes the optimizer on each rank from the rank's "
            "parameters, e.g. `lambda params: paddle.optimizer.AdamW(1e-3, parameters=params)`; "
            f"got {type(optimizer).__name__}"
        )
    if strategy is not None:
        if not isinstance(strategy, paddle.distributed.Strategy):
            raise TypeError(f"strategy must be a paddle.distributed.Strategy, got {type(strategy).__name__}")
        if not strategy.full_graph:
            raise ValueError("strategy.full_graph=False asks Paddle for a dygraph model: in raydist, build it with "
                             "dynamic=True (the ranks run the layer eagerly)")
    if metrics is not None and not isinstance(metrics, (list, tuple)):
        raise TypeError(f"metrics must be a list, got {type(metrics).__name__}")
    for metric in metrics or []:
        if not isinstance(metric, paddle.metric.Metric):
            raise TypeError(f"metrics must be paddle.metric.Metric objects, got {type(metric).__name__}")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not isinstance(use_gpu, bool):
        raise TypeError(f"use_gpu must be True or False, got {use_gpu!r}")
    if not isinstance(detached, bool):
        raise TypeError(f"detached must be True or False, got {detached!r}")
    if detached:
        _check_detached(name, dispatch.dispatch, placement.spare_ranks)
    check_strategy(strategy, use_gpu)
    if weights is not None:
        from ...weights import Weights

        if not isinstance(weights, Weights):
            Weights(weights)  # a TypeError or ValueError that says what is wrong, or what is there
    if not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be True or False, got {dynamic!r}")
    if dynamic:
        check_dynamic(strategy)


def _check_detached(name: Any, dispatch: str, spare_ranks: int) -> None:
    if name is None:
        raise ValueError("detached=True needs a name= (raydist.attach(name) finds the model by it)")
    if dispatch == "compiled":
        raise ValueError("dispatch='compiled' cannot be detached: a compiled graph's ranks wait on channels that "
                         "end with its driver; use dispatch='calls' or 'tree' ('auto' picks one of them)")  # fmt: skip
    if spare_ranks:
        raise ValueError("spare_ranks cannot be used with detached=True: spare ranks end with their driver")


def input_specs(input_spec: Any, loader: Any) -> tuple[list | None, list | None]:
    """(inputs, labels) specs from ``input_spec``, else from the loader (as Paddle: its last column
    is the label; a ``paddle.io.DataLoader``'s from its first batch, whose arrays are the global
    batch, as its batches are when the driver sends them); None where they are to be inferred
    from the first batch."""
    inputs, labels = from_input_spec(input_spec) if input_spec is not None else (None, None)
    if inputs is None and loader is not None:
        specs = loader.specs() if isinstance(loader, ShardDataloader) else _first_batch_specs(loader)
        inputs, labels = (specs[:-1], specs[-1:]) if len(specs) > 1 else (specs, None)
    return inputs, labels


def _first_batch_specs(loader: Any) -> list:
    """The specs of a ``paddle.io.DataLoader``'s first batch (inputs, then the label last)."""
    batch = next(iter(loader), None)
    if batch is None:
        raise ValueError("the paddle.io.DataLoader yields no batch: its specs cannot be taken from it")
    arrays = [to_array(a) for a in leaves(list(batch.values()) if isinstance(batch, dict) else [batch])]
    names = [f"input{i}" for i in range(len(arrays) - 1)] + ["label0"] if len(arrays) > 1 else ["input0"]
    return [spec_of(a, name) for a, name in zip(arrays, names)]


def group_sizes(num_workers: Any, specs: list, loader: Any, spare_ranks: int) -> Sizes:
    """The group sizes ``num_workers`` allows (an int, ``(min, max)``, or None: the processes of the
    specs' mesh), checked against the specs, the loader and where this driver runs."""
    spec_ranks = {i for s in specs if s.layout is not None for i in s.layout.mesh.process_ids}
    if num_workers is None:
        if not spec_ranks:
            raise ValueError("num_workers is required unless input_spec gives the mesh")
        sizes = Sizes((max(spec_ranks) + 1,))
    else:
        sizes = sizes_of(num_workers, loader if isinstance(loader, ShardDataloader) else None)
        if spec_ranks and max(spec_ranks) >= sizes.max:
            raise ValueError(
                f"input_spec's mesh uses processes up to {max(spec_ranks)}, but num_workers={num_workers}"
            )
    if spare_ranks and _in_placement_group():
        raise ValueError("spare_ranks inside a placement group (a Ray Tune trial, say): spares hold resources "
                         "outside it; leave spare_ranks at 0 there")  # fmt: skip
    if sizes.elastic and _in_placement_group():
        raise ValueError(
            "an elastic num_workers=(min, max) inside a placement group (a Ray Tune trial, say): the group's "
            "bundles fix the size; give num_workers an int"
        )
    return sizes


def _in_placement_group() -> bool:
    from ray.util.placement_group import get_current_placement_group

    return ray.is_initialized() and get_current_placement_group() is not None
