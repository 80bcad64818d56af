"""A rank's part in exporting and importing weights (`raydist.weights`): it hands over its pieces,
writes the files it is given whole, and reads its shards of imported weights into the layer."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import ray

from .. import handover, weights
from ..errors import UsageError
from .runner import holds_piece, layout_of_tensor

log = logging.getLogger("raydist")


def offer(state: dict[str, tuple[np.ndarray, Any]], names: list[str], rank: int) -> dict[str, tuple]:
    """{name: (`raydist.handover.Piece`, reference)}: this rank's pieces of ``names``, put in the object
    store for the ranks that write them (`write`)."""
    pieces = handover.describe({n: state[n] for n in names}, rank, codes=False)
    return {name: (pieces[name], ray.put(state[name][0])) for name in names}


def linear_weights(layer) -> set[str]:
    """The names of the layer's ``paddle.nn.Linear`` weights: Paddle holds them [in, out], safetensors
    files hold them [out, in] (Hugging Face's layout, which PaddleFormers' ``save_pretrained`` writes and
    its ``from_pretrained`` reads: its ``^T`` rules), so they are transposed on the way out and in."""
    import paddle

    return {f"{name}.weight" if name else "weight" for name, sub in layer.named_sublayers(include_self=True)
            if isinstance(sub, paddle.nn.Linear) and len(sub.weight.shape) == 2}  # fmt: skip


def write(directory: str, format: str, files: list[tuple[str, list[str]]], state: handover.StateMap, rank: int,
          transposed: set[str], prefix: str = "") -> None:  # fmt: skip
    """Write ``files`` ((file name, tensor names)) into ``directory``, each tensor whole, cut from the
    pieces of ``state`` wherever they lie (``transposed``: those written transposed), named without
    ``prefix``; one file's tensors in memory at a time."""
    for file, names in files:
        arrays = {n: state[n].cut(None, rank) for n in names}
        weights.write_file(os.path.join(directory, file), format,
                           {n[len(prefix):]: a.T if n in transposed else a for n, a in arrays.items()})  # fmt: skip


def load(layer, given: weights.Weights, rank: int) -> None:
    """Set the layer's parameters and buffers (under ``given.prefix``) from the weights: this rank reads
    its shard of each (the box its layout gives it), and only the tensors it holds (not another pipeline
    stage's). A tensor the layer has and the weights lack, or of another shape, is a `UsageError` naming it."""
    path, prefix = given.path, given.prefix
    reader = weights.open_weights(path)
    have = reader.names()
    state = {n[len(prefix):]: t for n, t in layer.state_dict().items() if n.startswith(prefix)}
    transposed = {n[len(prefix):] for n in linear_weights(layer) if n.startswith(prefix)} \
        if weights.detect(path) == "safetensors" else set()  # fmt: skip
    missing = sorted(set(state) - have)
    if missing:
        raise UsageError(f"weights={path!r} are not this layer's{f' (under {prefix!r})' if prefix else ''}: they "
                         f"lack {missing[:10]}{' ...' if len(missing) > 10 else ''} (they hold {len(have)} tensors, "
                         f"e.g. {sorted(have)[:3]})")  # fmt: skip
    extra = sorted(have - set(state))
    if extra and rank == 0:
        log.warning("raydist: weights=%s hold tensors the layer does not have, not loaded: %s", path, extra[:10])
    for name, tensor in state.items():
        if not holds_piece(tensor):  # another pipeline stage's
            continue
        shape = tuple(int(d) for d in tensor.shape)
        there = tuple(reader.shape(name))
        if (there[::-1] if name in transposed else there) != shape:
            raise UsageError(f"weights={path!r} are not this layer's: {name!r} is {there} there"
                             f"{' (a Linear weight, [out, in] in safetensors)' if name in transposed else ''}, "
                             f"{shape} in the layer")  # fmt: skip
        layout = layout_of_tensor(tensor) if tensor.is_dist() else None
        box = handover.shard_box(layout, rank, shape)
        local = reader.read(name, box[::-1]).T if name in transposed else reader.read(name, box)
        target = tensor._local_value() if tensor.is_dist() else tensor
        dtype = np.dtype(weights.paddle_dtype(target.dtype))
        if local.dtype != dtype and local.dtype.kind != dtype.kind:
            raise UsageError(f"weights={path!r}: {name!r} is {local.dtype} there, {dtype} in the layer")
        target.set_value(np.array(local, dtype=dtype, order="C"))
