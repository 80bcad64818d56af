"""One rank of an unmodified SPMD Paddle script: ``python -m raydist.integrations.spmd SCRIPT [ARGS...]``.

`raydist launch` starts this in a subprocess of each rank's actor, with the
environment ``paddle.distributed.launch`` would set. On CPU it applies
raydist's Paddle fixes (`raydist.compat`) first, so scripts that use the
static ``dist.to_static`` API run on gloo too; then it runs the script as
``__main__`` with the script's own arguments.
"""

from __future__ import annotations

import os
import runpy
import sys
import warnings


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m raydist.integrations.spmd SCRIPT [ARGS...]")
    script = argv[0]
    if os.environ.get("PADDLE_DISTRI_BACKEND") == "gloo":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # import-time noise (e.g. "No ccache found")
            import paddle
        from .. import compat

        compat.apply(use_gpu=False)
        paddle.set_device("cpu")
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
