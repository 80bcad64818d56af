"""Distributed checkpoints: every rank writes its own shards, in parallel; any mesh loads them.

A checkpoint is a directory (a local path, or any URI ``pyarrow.fs`` opens,
e.g. ``file://`` or ``s3://``) holding one ``rank-NNNNN.npz`` per rank that
wrote (each distinct shard is written once, by the rank that holds it) and a
``manifest.json`` written last: format, step, mode, versions, and for every
tensor its global shape, dtype, layout and which file holds which piece.

A save is atomic: on a local file system it is written under a temporary
name and renamed into place once complete; elsewhere the manifest, written
last, marks it complete. Either way a crash leaves no directory that looks
complete and is not, and raydist never overwrites a checkpoint.

Loading reassembles each tensor from the pieces and lets every rank keep the
shard its CURRENT layout gives it, so a checkpoint saved on one mesh loads on
another (Paddle's own reshard-on-load needs CUDA).
"""

from __future__ import annotations

import io
import json
import posixpath
import uuid
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, unquote

import numpy as np
from pyarrow import fs as pafs

from .topology import Layout, Mesh

FORMAT = "raydist-checkpoint-1"
MANIFEST = "manifest.json"
ABANDONED = ".abandoned-"  # in the name of a checkpoint moved aside (`abandon`)


def open_dir(path: str) -> tuple[pafs.FileSystem, str]:
    """The file system and the path in it of a checkpoint directory (local path or URI)."""
    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    import os

    return pafs.LocalFileSystem(), os.path.abspath(path)


def exists(path: str) -> bool:
    filesystem, where = open_dir(path)
    return filesystem.get_file_info(where).type != pafs.FileType.NotFound


def staging_dir(path: str) -> str:
    """Where a save of ``path`` is written before it is complete."""
    if "://" in path and not path.startswith("file://"):
        return path  # no atomic rename there: the manifest, written last, marks completion
    return f"{path.rstrip('/')}.saving-{uuid.uuid4().hex[:8]}"


def pieces_file(rank: int) -> str:
    """The name of the file in which ``rank`` writes its pieces."""
    return f"rank-{rank:05d}.npz"


def write_pieces(directory: str, rank: int, pieces: dict[str, np.ndarray]) -> str:
    """Write this rank's pieces into ``directory``; returns the file's name."""
    filesystem, where = open_dir(directory)
    filesystem.create_dir(where, recursive=True)
    name = pieces_file(rank)
    buffer = io.BytesIO()
    np.savez(buffer, **{_key(k): v for k, v in pieces.items()})  # type: ignore[arg-type]  # numpy's stub: allow_pickle
    with filesystem.open_output_stream(posixpath.join(where, name)) as out:
        out.write(buffer.getvalue())
    return name


def read_pieces(directory: str, name: str) -> dict[str, np.ndarray]:
    filesystem, where = open_dir(directory)
    with filesystem.open_input_file(posixpath.join(where, name)) as f:
        data = np.load(io.BytesIO(f.read()))
        return {_name(k): data[k] for k in data.files}


def commit(staged: str, path: str, manifest: dict[str, Any]) -> None:
    """Write the manifest (last), then move the staged directory into place."""
    filesystem, where = open_dir(staged)
    with filesystem.open_output_stream(posixpath.join(where, MANIFEST)) as out:
        out.write(json.dumps(manifest, indent=1, default=_plain).encode())
    if staged != path:
        target_fs, target = open_dir(path)
        target_fs.move(where, target)


def listing(path: str) -> list[str]:
    """Names in a directory."""
    filesystem, where = open_dir(path)
    return [posixpath.basename(i.path) for i in filesystem.get_file_info(pafs.FileSelector(where))]


def complete(directory: str, prefix: str = "step-") -> list[str]:
    """The complete checkpoints in ``directory`` whose names start with ``prefix``, oldest first
    (by name: raydist's are zero-padded). A staging directory (``*.saving-*``) is never one, nor
    an abandoned checkpoint (``*.abandoned-*``, `abandon`)."""
    if not exists(directory):
        return []
    filesystem, where = open_dir(directory)
    names = sorted(n for n in listing(directory) if n.startswith(prefix) and ".saving-" not in n
                   and ABANDONED not in n)  # fmt: skip
    found = filesystem.get_file_info([posixpath.join(where, n, MANIFEST) for n in names])
    return [posixpath.join(directory, n) for n, info in zip(names, found) if info.type == pafs.FileType.File]


def abandon(path: str) -> str:
    """Move the checkpoint at ``path`` aside, to ``<path>.abandoned-<id>``: a checkpoint of a timeline
    a restart went back from (`raydist.driver.model.saves`). Nothing loads it as a checkpoint of the
    run any more, and its name is free for the save of the new timeline; its files stay, for a look."""
    target = f"{path.rstrip('/')}{ABANDONED}{uuid.uuid4().hex[:8]}"
    filesystem, where = open_dir(path)
    filesystem.move(where, open_dir(target)[1])
    return target


def staged(directory: str) -> list[str]:
    """Staging directories in ``directory``: saves that never completed."""
    return [posixpath.join(directory, n) for n in listing(directory) if ".saving-" in n] if exists(directory) else []


def write_json(path: str, data: Any) -> None:
    """Write a small JSON file whole or not at all (a local file is renamed into place)."""
    filesystem, where = open_dir(path)
    text = json.dumps(data, indent=1, default=_plain).encode()
    temp = where if "://" in path and not path.startswith("file://") else f"{where}.writing-{uuid.uuid4().hex[:8]}"
    with filesystem.open_output_stream(temp) as out:
        out.write(text)
    if temp != where:
        filesystem.move(temp, where)


def read_json(path: str) -> Any | None:
    """A JSON file's content, or None if there is none."""
    filesystem, where = open_dir(path)
    try:
        with filesystem.open_input_file(where) as f:
            return json.loads(f.read())
    except (FileNotFoundError, OSError):
        return None


def remove(path: str) -> None:
    """Delete a directory (best effort)."""
    filesystem, where = open_dir(path)
    try:
        filesystem.delete_dir(where)
    except (FileNotFoundError, OSError):
        pass


def read_manifest(path: str) -> dict[str, Any]:
    filesystem, where = open_dir(path)
    try:
        with filesystem.open_input_file(posixpath.join(where, MANIFEST)) as f:
            manifest = json.loads(f.read())
    except (FileNotFoundError, OSError) as e:
        raise ValueError(f"{path} is not a complete raydist checkpoint (no {MANIFEST}): {e}") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a raydist checkpoint of format {FORMAT}")
    return manifest


def manifest(meta: dict, files: dict[str, dict[int, str]], **info: Any) -> dict[str, Any]:
    """The manifest of a checkpoint of tensors ``meta`` ({name: (shape, dtype, layout)})."""
    tensors = {
        name: {"shape": list(shape), "dtype": dtype, "layout": layout_to_json(layout),
               "files": {str(r): f for r, f in files[name].items()}}  # fmt: skip
        for name, (shape, dtype, layout) in meta.items()
    }
    saved_at = datetime.now(timezone.utc).isoformat(timespec="seconds")  # e.g. 2025-01-31T09:30:00+00:00
    return {"format": FORMAT, "saved_at": saved_at, **info, "tensors": tensors}


def writers(meta: dict, holders: dict[str, list[int]]) -> dict[int, list[str]]:
    """Which rank writes which tensors: one holder of each distinct piece (the first of
    ``holders[name]`` for dense ones)."""
    plan: dict[int, list[str]] = {}
    for name, (_, _, layout) in meta.items():
        for rank in layout.readers() if layout is not None else holders[name][:1]:
            plan.setdefault(rank, []).append(name)
    return plan


def assemble(directory: str, tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    """The FULL value of each tensor of a manifest, read from its pieces (each file once)."""
    cache: dict[str, dict[str, np.ndarray]] = {}
    out = {}
    for name, entry in tensors.items():
        pieces = {}
        for rank, file in entry["files"].items():
            if file not in cache:
                cache[file] = read_pieces(directory, file)
            pieces[int(rank)] = cache[file][name]
        layout = layout_from_json(entry["layout"])
        out[name] = next(iter(pieces.values())) if layout is None else layout.assemble(pieces)
    return out


def layout_to_json(layout: Layout | None) -> dict | None:
    if layout is None:
        return None
    m = layout.mesh
    return {"mesh_shape": list(m.shape), "process_ids": list(m.process_ids), "dim_names": list(m.dim_names),
            "dims_mapping": list(layout.dims_mapping), "partial": [list(p) for p in layout.partial]}  # fmt: skip


def layout_from_json(data: dict | None) -> Layout | None:
    if data is None:
        return None
    mesh = Mesh(tuple(data["mesh_shape"]), tuple(data["process_ids"]), tuple(data["dim_names"]))
    return Layout(mesh, tuple(data["dims_mapping"]), tuple((int(d), str(r)) for d, r in data["partial"]))


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (a scheduler's state may hold them) as JSON numbers and lists."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _key(name: str) -> str:
    """A tensor's name as an npz member name, which is a path: percent-encoded, "/" included."""
    return quote(name, safe="")


def _name(key: str) -> str:
    if "\\x2f" in key:  # written before percent-encoding, which never writes a backslash: "/" was "\x2f"
        return key.replace("\\x2f", "/")
    return unquote(key)
