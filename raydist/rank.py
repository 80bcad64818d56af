"""What runs inside one rank's Ray actor.

Paddle is imported in `RankActor.setup`, not at the top: Paddle reads
``CUDA_VISIBLE_DEVICES`` and its ``FLAGS_*`` when it is imported, and the
environment a rank needs is known only after every actor has been placed.
So the driver can import this module (to name the actor class) without
importing Paddle's rank-side pieces.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import logging
import os
import resource
import socket
import threading
import time
import traceback
import warnings

import numpy as np
import ray

from . import pickling
from .env import RankPlace
from .errors import RankFailed, UsageError

# Paddle's C++ log level in ranks unless asked for Paddle's logs: warnings
# and errors only (Paddle's default prints every INFO line).
QUIET_GLOG_LEVEL = "2"
# Paddle warnings every rank repeats and no user can act on.
NOISE = ("Tensor do not have 'place' interface",)
NOISE_LOGS = ("is not built by `lazy init`",)
# How long a step waits for its loader batch before giving up (a reader that
# fails tells its group at once).
DATA_TIMEOUT_S = 600.0


def reports_rank(method):
    """Raise a failure of ``method`` as `RankFailed`, naming this rank (usage errors pass as they are)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except UsageError:
            raise
        except Exception:
            raise RankFailed(self.rank, traceback.format_exc()) from None

    return wrapper


@dataclasses.dataclass
class StepStats:
    """When a rank's steps started, and what its loader steps waited for data (s) and read (rows)."""

    starts: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=100_000))
    wait: float = 0.0
    rows: int = 0


class RankActor:
    """One rank: its process group membership and its static DistModel."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.runner = None
        self.reader = None
        self.staging = None
        self.collect = False  # whether the driver reads this rank's step results (set per mode)
        self._thread_device = None
        self.stats = StepStats()
        self.device = "cpu"

    # -- placement and rendezvous -------------------------------------------------

    def place(self) -> tuple[RankPlace, int]:
        return here(), os.getpid()

    def free_port(self) -> int:
        return free_port()

    def port_is_free(self, port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True

    @reports_rank
    def setup(self, env: dict[str, str], use_gpu: bool, paddle_logs: bool = False) -> list[str]:
        """Join the process group; returns the compatibility fixes applied.

        ``paddle_logs``: keep Paddle's INFO logs (C++ glog and Python); by
        default a rank shows only warnings and errors.
        """
        quiet = _stderr_to_nowhere if not paddle_logs else contextlib.nullcontext
        if not paddle_logs:
            os.environ.setdefault("GLOG_minloglevel", QUIET_GLOG_LEVEL)
            logging.disable(logging.INFO)
            for text in NOISE:
                warnings.filterwarnings("ignore", message=f".*{text}")
            logging.getLogger("auto_parallel").addFilter(lambda r: not any(t in r.getMessage() for t in NOISE_LOGS))
        fixes, self.device = join(env, use_gpu, quiet)
        import paddle

        # Paddle's handler prints a C++ "FatalError" dump when a rank is
        # killed on shutdown or after a peer's failure; the death is expected.
        paddle.base.core.disable_signal_handler()
        from .reader import Staging

        place = paddle.CUDAPlace(int(env["FLAGS_selected_gpus"])) if use_gpu else paddle.CPUPlace()
        self.staging = Staging(place)
        return fixes

    # -- the model ---------------------------------------------------------------

    @reports_rank
    def build(self, payload: bytes) -> dict:
        """Build the layer and the optimizer; report the meshes the layer uses."""
        import paddle

        from .runner import StaticRunner, mesh_of

        build_layer, loss, optimizer_factory, strategy, metrics = pickling.loads(payload)
        layer = build_layer()
        if not isinstance(layer, paddle.nn.Layer):
            raise UsageError(f"build_layer must return a paddle.nn.Layer, it returned {type(layer).__name__}")
        meshes = []
        for p in layer.parameters():
            if p.is_dist():
                mesh = mesh_of(p.process_mesh)
                if mesh not in meshes:
                    meshes.append(mesh)
        beyond = sorted({i for m in meshes for i in m.process_ids if i >= self.world_size})
        if beyond:
            raise UsageError(
                f"the model's mesh uses processes {beyond}, but the group has {self.world_size} ranks "
                f"(num_workers={self.world_size}): raise num_workers to {max(beyond) + 1}"
            )
        optimizer = optimizer_factory(layer.parameters()) if optimizer_factory is not None else None
        if optimizer is not None and not isinstance(optimizer, paddle.optimizer.Optimizer):
            inner = getattr(optimizer, "_inner_opt", None)  # dist.shard_optimizer's wrapper
            if not isinstance(inner, paddle.optimizer.Optimizer):
                raise UsageError(
                    f"optimizer must return a paddle.optimizer.Optimizer, it returned {type(optimizer).__name__}"
                )
        if optimizer is not None:
            from .compat.engine import shard_by_strategy

            optimizer = shard_by_strategy(optimizer, strategy, layer.parameters())
        self.runner = StaticRunner(layer, loss, optimizer, strategy, metrics)
        return {"meshes": meshes}

    @reports_rank
    def set_specs(self, inputs, labels) -> None:
        self.runner.set_specs(inputs, labels)

    @reports_rank
    def set_mode(self, mode: str):
        plan = self.runner.set_mode(mode)
        self.collect = self.rank in plan.readers()
        return plan

    @reports_rank
    def run(self, message: tuple):
        """One step, as `raydist.dispatch` delivers it: the same message to every rank.

        ``("arrays", [global arrays])``: take this rank's shards (views).
        ``("loader", loader, epoch, step, keys)``: take the batch this rank's
        reader staged. Returns this rank's local results if the driver reads
        them (``collect``, from the mode switch), else None.
        """
        self.stats.starts.append(time.monotonic())
        if self._thread_device != threading.get_ident():
            self._enter_device()
        if message[0] == "arrays":
            # copies: the message's arrays live in the channel's buffer, which
            # Ray reuses only once nothing refers to them
            local = [np.array(a) for a in self.runner.local(message[1], self.rank)]
        else:
            local = self._staged(*message[1:])
        return self.runner.step(local, self.collect)

    def _staged(self, loader: int, epoch: int, step: int, keys: list) -> list:
        batch, waited = self.staging.take((loader, epoch, step), timeout=DATA_TIMEOUT_S)
        if self.reader is not None:
            self.reader.consumed(loader, epoch, step)
        self.stats.wait += waited
        self.stats.rows += batch[keys[0]].shape()[0]
        return [batch[k] for k in keys]

    def _enter_device(self) -> None:
        # Steps may run on a thread of Ray's (compiled graphs): Paddle's device
        # is per thread.
        import paddle

        paddle.set_device(self.device)
        self._thread_device = threading.get_ident()

    @reports_rank
    def program(self, kind: str, mode: str | None) -> str:
        return self.runner.program(kind, mode)

    @reports_rank
    def state_dict(self, mode: str):
        return self.runner.state_dict(mode)

    @reports_rank
    def state_meta(self, mode: str = "all"):
        return self.runner.state_meta(mode)

    @reports_rank
    def set_state(self, full: dict) -> None:
        self.runner.set_state(full, self.rank)

    @reports_rank
    def save_pieces(self, directory: str, names: list) -> str:
        """Write this rank's shards of ``names`` into a checkpoint directory; the file's name."""
        from .checkpoint import write_pieces

        state = self.runner.state_dict("all")
        return write_pieces(directory, self.rank, {n: state[n][0] for n in names})

    @reports_rank
    def load_state(self, directory: str, tensors: dict) -> None:
        """Set ``tensors`` (manifest entries) from a checkpoint; this rank keeps its own shards."""
        from .checkpoint import assemble

        self.runner.set_state(assemble(directory, tensors), self.rank)

    # -- raydist launch: a script in a process of its own -----------------------------

    @ray.method(num_returns="streaming")
    def run_script(self, env: dict[str, str], path: str, source: str, args: list[str], cwd: str,
                   paddle_logs: bool = False):  # fmt: skip
        """Run an SPMD script as this rank (see `raydist.launch`), in a child process
        that dies with this actor. Yields ("out" | "err", line) as the script
        prints, then ("exit", status)."""
        import queue
        import subprocess
        import sys
        import tempfile

        if not (os.path.isfile(path) and open(path, encoding="utf-8").read() == source):
            path = os.path.join(tempfile.mkdtemp(prefix="raydist-launch-"), os.path.basename(path))
            with open(path, "w", encoding="utf-8") as f:  # another node: the driver's copy
                f.write(source)
        child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        if not paddle_logs:
            child_env.setdefault("GLOG_minloglevel", QUIET_GLOG_LEVEL)
        child = subprocess.Popen(
            [sys.executable, "-m", "raydist.spmd", path, *args], env=child_env,
            cwd=cwd if os.path.isdir(cwd) else os.path.dirname(path),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, preexec_fn=_die_with_parent,
        )  # fmt: skip
        lines: queue.Queue = queue.Queue()

        def pump(stream, kind):
            for line in stream:
                lines.put((kind, line.rstrip("\n")))
            lines.put(None)

        for stream, kind in ((child.stdout, "out"), (child.stderr, "err")):
            threading.Thread(target=pump, args=(stream, kind), daemon=True).start()
        open_streams, in_flags_dump = 2, False
        while open_streams:
            item = lines.get()
            if item is None:
                open_streams -= 1
                continue
            if not paddle_logs and item[0] == "err":  # init_parallel_env lists every non-default FLAG
                if "Modified FLAGS detected" in item[1]:
                    in_flags_dump = True
                    continue
                if in_flags_dump:
                    in_flags_dump = not item[1].startswith("=====")
                    continue
            yield item
        yield ("exit", child.wait())

    # -- a ShardDataloader's data: a thread of its own, beside the steps -------------

    @ray.method(concurrency_group="data")
    def data_open(self, loader: int, epoch: int, start: int, steps: int, source, batch_size: int,
                  drop_last: bool, keys: list, members: list, prefetch: int, chunk: int) -> None:  # fmt: skip
        """Read an epoch of this rank's group for ``members`` (see `raydist.reader.Reader`)."""
        if self.reader is None:
            from .reader import Reader

            self.reader = Reader(self.staging)
        self.reader.open(loader, epoch, start, steps, source, batch_size, drop_last, keys, members, prefetch, chunk)

    @ray.method(concurrency_group="data")
    def data_stage(self, loader: int, epoch: int, first_step: int, batches: list) -> None:
        self.staging.put(loader, epoch, first_step, batches)

    @ray.method(concurrency_group="data")
    def data_fail(self, loader: int, epoch: int, error: str) -> None:
        self.staging.fail(loader, epoch, error)

    @ray.method(concurrency_group="data")
    def ping(self) -> int:
        """Answers even while a step runs (another thread): tells the driver this rank is alive."""
        return self.rank

    def take_stats(self) -> dict:
        """The step figures since the last call (and reset them): see `StepStats`."""
        stats, self.stats = self.stats, StepStats()
        return {"starts": list(stats.starts), "wait": stats.wait, "rows": stats.rows}

    @ray.method(concurrency_group="data")
    def status(self) -> dict:
        """Who and where this rank is, its mode and its peak memory (resident, MiB).
        On the data thread: answers while a step runs."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"rank": self.rank, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "device": self.device, "mode": getattr(self.runner, "mode", None), "peak_rss_mib": peak}  # fmt: skip


def _die_with_parent() -> None:
    """In a child process: be killed when the rank actor dies (Linux), so no script outlives its rank."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        pass


# -- joining Paddle's process group: rank actors, and Ray Train's workers (raydist.train) --


def here() -> RankPlace:
    """Where this Ray worker runs (node, IP, the GPUs Ray gave it)."""
    ctx = ray.get_runtime_context()
    return RankPlace(ctx.get_node_id(), ray.util.get_node_ip_address(), tuple(str(g) for g in ray.get_gpu_ids()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join(env: dict[str, str], use_gpu: bool, quiet=contextlib.nullcontext) -> tuple[list[str], str]:
    """Join Paddle's process group with ``env`` (`raydist.env.paddle_env`), raydist's
    Paddle fixes applied; returns (the fixes, the device). ``quiet``: a context
    for Paddle's noisy import and init_parallel_env."""
    os.environ.update(env)
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time noise (e.g. "No ccache found")
        import paddle
    import paddle.distributed as dist

    from . import compat

    fixes = compat.apply(use_gpu)
    device = f"gpu:{env['FLAGS_selected_gpus']}" if use_gpu else "cpu"
    paddle.set_device(device)
    with quiet():  # init_parallel_env lists every non-default FLAG on stderr
        dist.init_parallel_env()
    return fixes, device


def _stderr_to_nowhere():
    return contextlib.redirect_stderr(io.StringIO())
