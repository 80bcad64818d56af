"""Shipping user code to the ranks: classes and functions of the user's own modules travel by value.

A script's or notebook's helpers, or a test module's models, are not
importable on the workers; installed packages are.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any

from ray import cloudpickle


def dumps(obj: Any, what: str) -> bytes:
    """Pickle ``obj`` for the ranks; a clear TypeError naming ``what`` if it cannot be."""
    for item in _walk(obj):
        module = sys.modules.get(getattr(item, "__module__", None) or "")
        if module is not None and _is_local(module):
            cloudpickle.register_pickle_by_value(module)
    try:
        buffer = io.BytesIO()
        _Pickler(buffer).dump(obj)
        return buffer.getvalue()
    except Exception as e:
        raise TypeError(f"{what} cannot be pickled for the ranks: {e}") from e


loads = cloudpickle.loads


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, plus Paddle's ProcessMesh (which does not pickle), so a
    builder may use a mesh made on the driver."""

    def reducer_override(self, obj):
        from paddle.distributed import ProcessMesh

        if isinstance(obj, ProcessMesh):
            return _process_mesh, (obj.mesh.tolist(), list(obj.dim_names))
        return super().reducer_override(obj)


def _process_mesh(mesh: list, dim_names: list):
    from paddle.distributed import ProcessMesh

    return ProcessMesh(mesh, dim_names=dim_names)


def _walk(obj):
    yield obj
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _walk(item)
    else:
        yield type(obj)


def _is_local(module) -> bool:
    """A module of the user's own (not installed), which remote workers may not import."""
    path = getattr(module, "__file__", None)
    if path is None or module.__name__ == "__main__" or module.__name__.split(".")[0] in ("raydist", "paddle"):
        return False
    installed = {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    installed.add(os.path.dirname(os.__file__))
    return not any(os.path.abspath(path).startswith(os.path.abspath(p) + os.sep) for p in installed)
