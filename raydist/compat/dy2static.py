"""PaddleFormers' configs under dy2static (all devices).

Paddle 3.3.1's dy2static rewrites every bare ``super()`` in the code it converts into
``super(<first argument>.__class__, <first argument>)``
(``paddle/jit/dy2static/transformers/super_transformer.py``, ``SuperTransformer.visit_Call``).
For a method a subclass inherits, ``self.__class__`` is the subclass, so that ``super`` is
the method's own class again and the call recurses until ``RecursionError``. PaddleFormers'
``PretrainedConfig.__getattribute__`` calls ``super().__getattribute__``; every model's
config is a subclass of it (``LlamaConfig``...), and the models read their config in
``forward`` (``config.get(...)`` in ``nn/lm_head.py``, ``modeling.py``): converting any
PaddleFormers model fails, with Paddle's own ``dist.to_static`` too.

A config is plain Python data, not tensor code. Fix: before an engine converts a program (`Engine._build`),
the modules in `UNCONVERTED` that the process has imported are left unconverted
(``paddle.jit.ignore_module``, the list Paddle keeps for its own and NumPy's modules), so
their functions run as written. The modules are not imported here: importing PaddleFormers
changes Paddle's behaviour (it patches some of its functions), which a process that does
not use it must not get.

Canary: ``tests/test_compat.py::test_dy2static_defect_super_in_an_inherited_method_recurses``.
"""

from __future__ import annotations

import functools
import sys

from . import expect_source

# Modules whose code dy2static must run as plain Python (see the module docstring).
UNCONVERTED = ("paddleformers.transformers.configuration_utils",)

_applied = False
_ignored: set[str] = set()


def ignore_unconverted() -> list[str]:
    """Leave `UNCONVERTED`'s imported modules to run as plain Python; the names newly left."""
    import paddle

    new = [name for name in UNCONVERTED if name in sys.modules and name not in _ignored]
    if new:
        paddle.jit.ignore_module([sys.modules[name] for name in new])
        _ignored.update(new)
    return new


def apply() -> None:
    global _applied
    if _applied:
        return
    import paddle
    from paddle.distributed.auto_parallel.static import engine as _engine
    from paddle.jit.dy2static.transformers import super_transformer

    expect_source(super_transformer.SuperTransformer.visit_Call, "__class__", fix="dy2static")
    expect_source(_engine.Engine._build, "self.program_helper.build_program(mode)", fix="dy2static")
    if not hasattr(paddle.jit, "ignore_module"):
        from . import CompatError

        raise CompatError("raydist fix 'dy2static': Paddle no longer has paddle.jit.ignore_module")
    build = _engine.Engine._build

    @functools.wraps(build)
    def _build(self, mode):
        ignore_unconverted()  # the user's builder imported its model's modules by now
        return build(self, mode)

    _engine.Engine._build = _build
    _applied = True
