"""Shipping user code to the ranks: the user's own modules travel by value.

A script's or notebook's helpers (``mymodels.py`` beside the script), or a
test module's models, are not importable on other nodes; installed packages
are. cloudpickle sends functions and classes of importable modules by
reference, so every module of the user's own that the payload reaches
(through a builder's globals, a class's methods, an instance's class...) is
registered to travel by value. Paddle's ``ProcessMesh`` does not pickle; it
travels as its ids and dim names.
"""

from __future__ import annotations

import functools
import io
import os
import site
import sys
import sysconfig
import types
from typing import Any

from ray import cloudpickle

loads = cloudpickle.loads


def dumps(obj: Any, what: str) -> bytes:
    """Pickle ``obj`` for the ranks; a clear TypeError naming ``what`` if it cannot be."""
    try:
        while True:  # registering a module by value can reach further modules
            pickler = _Pickler(io.BytesIO())
            pickler.dump(obj)
            new = [m for m in pickler.modules if _is_local(m) and not _by_value(m)]
            if not new:
                return pickler.buffer.getvalue()
            for module in new:
                cloudpickle.register_pickle_by_value(module)
    except Exception as e:
        raise TypeError(f"{what} cannot be pickled for the ranks: {e}") from e


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle that notes the modules of the classes, functions and modules it meets."""

    def __init__(self, buffer: io.BytesIO):
        super().__init__(buffer)
        self.buffer = buffer
        self.modules: set[types.ModuleType] = set()

    def reducer_override(self, obj):
        from paddle.distributed import ProcessMesh

        if isinstance(obj, ProcessMesh):
            return _process_mesh, (obj.mesh.tolist(), list(obj.dim_names))
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj)
        elif isinstance(obj, (type, types.FunctionType)):
            module = sys.modules.get(getattr(obj, "__module__", None) or "")
            if module is not None:
                self.modules.add(module)
        return super().reducer_override(obj)


def _process_mesh(mesh: list, dim_names: list):
    from paddle.distributed import ProcessMesh

    return ProcessMesh(mesh, dim_names=dim_names)


def _by_value(module: types.ModuleType) -> bool:
    return module.__name__ in cloudpickle.list_registry_pickle_by_value()


def _is_local(module: types.ModuleType) -> bool:
    """A module of the user's own (not installed, not the standard library), which remote workers may not import."""
    path = getattr(module, "__file__", None)
    top = module.__name__.partition(".")[0]
    if path is None or module.__name__ == "__main__" or top in ("raydist", "paddle") or top in sys.stdlib_module_names:
        return False
    path = os.path.realpath(path)
    return not any(path.startswith(d + os.sep) for d in _installed_dirs())


@functools.cache
def _installed_dirs() -> tuple[str, ...]:
    """Where installed packages and the standard library live: this interpreter's install scheme
    (``sysconfig``: a venv's own when in one), the site directories, the user's site directory."""
    paths = sysconfig.get_paths()
    dirs = [paths[k] for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths]
    dirs += getattr(site, "getsitepackages", list)()  # not in old virtualenvs' site.py
    dirs.append(site.getusersitepackages())
    return tuple(sorted({os.path.realpath(d) for d in dirs if d}))
