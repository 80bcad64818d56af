"""One rank of an unmodified SPMD Paddle script: ``python -m raydist.integrations.spmd SCRIPT [ARGS...]``.

`raydist launch` starts this in a subprocess of each rank's actor, with the
environment ``paddle.distributed.launch`` would set. It applies raydist's
Paddle fixes first (`raydist.compat.apply`, the same that raydist's own ranks
apply: on CPU the gloo rings and collectives, pipeline send/recv, stage
parameters and the pipeline degree), so scripts that use the static
``dist.to_static`` API run on gloo too; then it runs the script as ``__main__``
with the script's own arguments.

When the script has ended (returned, ``sys.exit``, or raised), its status is
written to the file descriptor ``RAYDIST_SCRIPT_END_FD`` names before the
interpreter shuts down: Paddle's or gloo's teardown may never end (a process
left on a futex after a failed collective), and the launcher then ends the
process after a grace period with the script's own status.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
import warnings


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m raydist.integrations.spmd SCRIPT [ARGS...]")
    script = argv[0]
    on_cpu = os.environ.get("PADDLE_DISTRI_BACKEND") == "gloo"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time noise (e.g. "No ccache found")
        import paddle
    from .. import compat

    compat.apply(use_gpu=not on_cpu)
    if on_cpu:
        paddle.set_device("cpu")
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = _exit_status(e.code)
        raise
    except BaseException:  # printed before the launcher learns the script ended, as Python would print it
        status = 1
        traceback.print_exc()
        sys.exit(1)
    finally:
        _tell_ended(status)


def _exit_status(code) -> int:
    """The process status ``sys.exit(code)`` gives."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed to stderr, status 1


def _tell_ended(status: int) -> None:
    fd = os.environ.get(END_FD)
    if fd is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.write(int(fd), f"{status}\n".encode())
        os.close(int(fd))
    except OSError:  # the launcher is gone
        pass


END_FD = "RAYDIST_SCRIPT_END_FD"


if __name__ == "__main__":
    main(sys.argv[1:])
