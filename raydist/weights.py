"""Weights in the formats Paddle's ecosystem reads and writes: safetensors, ``paddle.save`` files, and
Paddle's distributed checkpoints (``dist.save_state_dict``'s ``.metadata`` and ``.distcp`` files).

Export (`DistModel.export`) writes the model's FULL parameters under the Layer's structured names
(``model.layers.0.self_attn.q_proj.weight``), as ``save_pretrained`` does: one file, or shards
with an index (``model.safetensors.index.json``, ``model_state.pdparams.index.json``: PaddleFormers'
and Hugging Face's names). In safetensors files the weights of ``paddle.nn.Linear`` layers are
[out, in], Hugging Face's layout, which PaddleFormers' ``save_pretrained`` writes and its
``from_pretrained`` reads (Paddle holds them [in, out]); in ``paddle.save`` files, Paddle's own.
Each file is written by one rank, from pieces the others hand it rank to rank (`raydist.handover`);
the driver plans the files and writes the index, and holds no tensor.

Import (``to_static(..., weights=path)``) starts a model from such weights on any mesh: every rank
reads the part of each tensor its shard covers (`Reader.read` of a box). safetensors files are
mapped, and a rank reads only its slices; a ``paddle.save`` file is a pickle, read whole by each
rank that needs any of it; a distributed checkpoint's pieces are read file by file, the files that
overlap the rank's shards only.

Both sides import this module: the driver plans and checks (numpy, json, safetensors' header), the
ranks read and write (Paddle only where a format needs it, imported there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from . import handover

FORMATS = ("safetensors", "paddle")  # what `DistModel.export` writes


@dataclasses.dataclass(frozen=True)
class Weights:
    """Weights to start a model from (``to_static(..., weights=Weights(path, prefix="lm."))``; a plain
    path is ``Weights(path)``). ``path``: a safetensors file or directory, a ``paddle.save`` state dict
    (or its shards and index), or a directory of ``dist.save_state_dict``. ``prefix``: where they sit in
    the layer: a tensor named ``n`` in the files sets the layer's ``prefix + n`` (a model wrapped in a
    Layer of yours: ``self.lm = LlamaForCausalLM(...)`` takes ``prefix="lm."``); the layer's tensors
    outside the prefix keep the builder's values."""

    path: str
    prefix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"weights must be a path or raydist.Weights, got {type(self.path).__name__}")
        if not isinstance(self.prefix, str):
            raise TypeError(f"Weights.prefix must be a str, got {type(self.prefix).__name__}")
        object.__setattr__(self, "path", os.path.abspath(os.fspath(self.path)))  # the ranks' working dir is another
        detect(self.path)  # a ValueError that says what is there


Box = list[tuple[int, int]]  # [start, stop) per dim of a tensor

# format -> (the one file's name, a shard's name, the index's name): PaddleFormers' (paddleformers.utils.env)
_NAMES = {
    "safetensors": ("model.safetensors", "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json"),
    "paddle": ("model_state.pdparams", "model_state-{:05d}-of-{:05d}.pdparams", "model_state.pdparams.index.json"),
}


def parse_size(size: int | str) -> int:
    """Bytes from ``5_000_000_000`` or "5GB", "500MB", "10KiB" (``save_pretrained``'s ``max_shard_size``)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", str(size), re.I)
    if not match:
        raise ValueError(f"max_shard_size takes bytes or a size such as '5GB' or '500MiB', got {size!r}")
    number, unit, binary = float(match[1]), match[2].upper(), bool(match[3])
    return int(number * (1024 if binary else 1000) ** " KMGT".index(unit or " "))


def plan_files(tensors: dict[str, tuple[tuple[int, ...], str]], format: str,
               max_shard_bytes: int) -> list[tuple[str, list[str]]]:  # fmt: skip
    """The files of an export of ``tensors`` ({name: (shape, dtype)}, in the Layer's order): (file name,
    the names in it), each file up to ``max_shard_bytes`` unless one tensor alone is larger."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    groups: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in tensors.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    one, shard, _ = _NAMES[format]
    if len(groups) == 1:
        return [(one, groups[0])]
    return [(shard.format(i + 1, len(groups)), names) for i, names in enumerate(groups)]


def write_index(directory: str, format: str, files: list[tuple[str, list[str]]], total_size: int) -> None:
    """The index of a sharded export (none for one file): which file holds each tensor."""
    if len(files) < 2:
        return
    weight_map = {name: file for file, names in files for name in names}
    with open(os.path.join(directory, _NAMES[format][2]), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)


def write_file(path: str, format: str, arrays: dict[str, np.ndarray]) -> None:
    """One file of an export, written under a temporary name and renamed into place once whole."""
    temp = f"{path}.writing-{os.getpid()}"
    if format == "safetensors":
        from safetensors.numpy import save_file

        # "pt": the format Hugging Face's loaders accept (PaddleFormers' do not look)
        save_file({n: np.ascontiguousarray(a) for n, a in arrays.items()}, temp, metadata={"format": "pt"})
    else:
        import paddle

        paddle.save({n: np.ascontiguousarray(a) for n, a in arrays.items()}, temp)  # type: ignore[arg-type]  # arrays too
    os.replace(temp, path)


# -- reading ---------------------------------------------------------------------------------


def detect(path: str) -> str:
    """The format of the weights at ``path``: "safetensors", "paddle" or "distcp"; a ValueError that says
    what was found if none (a raydist checkpoint is `DistModel.load`'s)."""
    if os.path.isfile(path):
        if path.endswith((".safetensors", ".safetensors.index.json")):
            return "safetensors"
        if path.endswith((".pdparams", ".pdparams.index.json")) or _pickled(path):
            return "paddle"
        raise ValueError(f"weights={path!r}: not a .safetensors or .pdparams file (or an index of them)")
    if not os.path.isdir(path):
        raise ValueError(f"weights={path!r}: no such file or directory")
    names = os.listdir(path)
    if "manifest.json" in names:
        raise ValueError(f"weights={path!r} is a raydist checkpoint: load it with dm.load(path), which also "
                         "restores the optimizer's state and the learning rate")  # fmt: skip
    if any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    if any(n.endswith(".pdparams") for n in names):
        return "paddle"
    if any(n.endswith(".metadata") for n in names) and any(n.endswith(".distcp") for n in names):
        return "distcp"
    raise ValueError(f"weights={path!r}: a directory with no *.safetensors, *.pdparams, or *.metadata and *.distcp "
                     f"files (it holds {sorted(names)[:8]})")  # fmt: skip


def _pickled(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"  # a pickle's PROTO opcode: paddle.save's files


class Reader:
    """Weights to read from: the `names` of the tensors, each one's global `shape`, and `read` of a box."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, box: Box) -> np.ndarray:
        raise NotImplementedError


def open_weights(path: str) -> Reader:
    """The `Reader` of the weights at ``path`` (any format `detect` knows)."""
    return {"safetensors": SafetensorsReader, "paddle": PaddleReader, "distcp": DistcpReader}[detect(path)](path)


def _files(path: str, suffix: str, index_name: str) -> tuple[dict[str, str] | None, list[str]]:
    """({tensor: file} from the index, or None if there is none; the files) of a single file, a directory
    with an index (or the index itself), or a directory of files."""
    if os.path.isfile(path) and not path.endswith(".index.json"):
        return None, [path]
    index = path if os.path.isfile(path) else os.path.join(path, index_name)
    directory = os.path.dirname(index)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            where = {name: os.path.join(directory, file) for name, file in json.load(f)["weight_map"].items()}
        return where, sorted(set(where.values()))
    return None, [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(suffix)]


class SafetensorsReader(Reader):
    """safetensors files (one, or shards with ``model.safetensors.index.json``): each read maps its file
    and copies only the box."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self._open = safe_open
        self._where: dict[str, str] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in _files(path, ".safetensors", _NAMES["safetensors"][2])[1]:
            with safe_open(file, framework="np") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    self._where[name] = file
                    self._meta[name] = (tuple(piece.get_shape()), _dtype(piece.get_dtype()))

    def names(self) -> set[str]:
        return set(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def read(self, name: str, box: Box) -> np.ndarray:
        with self._open(self._where[name], framework="np") as f:
            return np.asarray(f.get_slice(name)[tuple(slice(a, b) for a, b in box)])


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "BF16": "uint16"}  # fmt: skip


def _dtype(name: str) -> str:
    return _SAFETENSORS_DTYPES.get(name, name.lower())


class PaddleReader(Reader):
    """``paddle.save`` files of a state dict (one, or shards with ``model_state.pdparams.index.json``):
    a pickle is read whole, once, by each rank that needs a tensor in it."""

    def __init__(self, path: str):
        where, files = _files(path, ".pdparams", _NAMES["paddle"][2])
        self._loaded: dict[str, dict[str, np.ndarray]] = {}
        self._where = where if where is not None else {n: file for file in files for n in self._load(file)}

    def _load(self, file: str) -> dict[str, np.ndarray]:
        if file not in self._loaded:
            import paddle

            state = paddle.load(file, return_numpy=True)
            self._loaded[file] = {n: np.asarray(v) for n, v in _flat(state)}
        return self._loaded[file]

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._load(self._where[name])[name].shape)

    def read(self, name: str, box: Box) -> np.ndarray:
        return self._load(self._where[name])[name][tuple(slice(a, b) for a, b in box)]


def _flat(state: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for name, value in state.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


class DistcpReader(Reader):
    """Paddle's distributed checkpoint (``dist.save_state_dict``, Paddle 3.3.1's
    ``paddle.distributed.flex_checkpoint.dcp``): the newest ``<id>.metadata`` (a pickle) lists each
    tensor's pieces (``state_dict_metadata``: global offset, local shape, dtype, global shape) and the
    ``.distcp`` file holding each (``storage_metadata``, keyed by a ``LocalTensorIndex``); a ``.distcp`` is
    a pickle of {flat key: numpy array}, one piece per key. A read assembles the box from the pieces that
    overlap it, unpickling only their files (each whole: a pickle cannot be read in part). Read here,
    not by ``dist.load_state_dict``, whose reshard on load needs CUDA in Paddle 3.3.1. Nested keys are
    Paddle's flat ones (joined by "."), bfloat16 is numpy's uint16 (its bits)."""

    def __init__(self, path: str):
        ids = [int(n.split(".")[0]) for n in os.listdir(path) if re.fullmatch(r"\d+\.metadata", n)]
        if not ids:
            raise ValueError(f"weights={path!r}: no <id>.metadata file of dist.save_state_dict")
        with open(os.path.join(path, f"{max(ids)}.metadata"), "rb") as f:
            metadata = pickle.load(f)  # Paddle's dataclasses: importable on a rank
        self._path = path
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for key, locals_ in metadata.state_dict_metadata.items():
            shape = locals_[0].global_shape
            if shape is None:
                dims = range(len(locals_[0].local_shape))
                shape = [max(m.global_offset[d] + m.local_shape[d] for m in locals_) for d in dims]
            self._meta[key] = (tuple(int(d) for d in shape), paddle_dtype(locals_[0].dtype))
        self._pieces: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str]]] = {}
        for index, file in metadata.storage_metadata.items():
            if getattr(index, "replica_id", None) not in (None, 0):  # save_replicas=True: the other copies
                continue
            if getattr(index, "is_flattened", False):
                raise ValueError(f"weights={path!r}: {index.tensor_key!r} is saved flattened (sharding stage 2/3 "
                                 "of Paddle's sharding v2), which raydist does not read; save it unflattened")
            offset = tuple(index.global_offset)
            shape = getattr(index, "local_shape", None) or next(
                m.local_shape for m in metadata.state_dict_metadata[index.tensor_key]
                if tuple(m.global_offset) == offset)
            self._pieces.setdefault(index.tensor_key, []).append((offset, tuple(shape), file))
        self._loaded: dict[str, dict[str, Any]] = {}

    def names(self) -> set[str]:
        return set(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def _file(self, file: str) -> dict[str, Any]:
        if file not in self._loaded:
            with open(os.path.join(self._path, file), "rb") as f:
                self._loaded[file] = pickle.load(f)
        return self._loaded[file]

    def read(self, name: str, box: Box) -> np.ndarray:
        out = np.empty([b - a for a, b in box], dtype=self._meta[name][1])
        for offset, local_shape, file in self._pieces[name]:
            piece_box = [(o, o + s) for o, s in zip(offset, local_shape)]
            if handover.overlaps(box, piece_box):
                handover.paste(out, box, np.asarray(self._file(file)[name]), piece_box)
        return out


def paddle_dtype(dtype: Any) -> str:
    """numpy's name of a Paddle dtype (bfloat16 as uint16, numpy having none, as Paddle's ``numpy()`` gives it)."""
    text = str(dtype).replace("paddle.", "")
    return {"bfloat16": "uint16"}.get(text, text)
