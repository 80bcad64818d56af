"""``raydist launch``: run an unmodified SPMD Paddle script with one rank per Ray actor.

    raydist launch -n 4 [--gpus] [--address ADDR] [--max-restarts N] [--log-dir D] script.py [args...]
    python -m raydist launch -n 4 script.py [args...]

What ``python -m paddle.distributed.launch`` does on one machine, on a Ray cluster: each
rank runs the script in a process of its own with the environment Paddle's launcher sets
(`raydist.env`), its output streamed here with a ``[rank i]`` prefix (``--ranks-filter``:
only those ranks'; ``--log-dir``: every rank's in ``workerlog.N`` there, Paddle's names), and
the exit status is the script's: non-zero as soon as any rank fails (its traceback is on
stderr), and then the other ranks are stopped. With ``--max-restarts N`` a failure ends every
rank and the script starts again on all of them, up to N times, each restart logged with its
cause; the ranks see how many came before in ``PADDLE_RESTART_COUNT`` (and the limit in
``PADDLE_MAX_RESTART``, Paddle's launcher's name for it), so a script that resumes from its
latest checkpoint goes on. A rank's process that outlives its script's end
(Paddle's or gloo's teardown stuck, seen after a failed collective) is ended after
`LINGER_GRACE_S`, with the script's status, and the launch says which rank lingered. On
CPU the ranks run with raydist's Paddle fixes (`raydist.compat`), so scripts that use
``dist.to_static`` work on gloo too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Collection, Sequence

import ray

from ..driver.cluster.config import GroupConfig, call_each_on, call_on
from ..driver.cluster.connect import init_ray
from ..driver.cluster.group import RankGroup
from ..driver.lifecycle.detached import Holder
from ..driver.lifecycle.preemption import DrainWatch
from ..env import QUIET_GLOG_LEVEL, launching_env
from ..options import PlacementConfig
from ..protocol import Member
from .spmd import END_FD

log = logging.getLogger("raydist")


class ScriptActor(Member):
    """One rank of a launched script: it runs the script in a child process of its own.

    `start` starts it; `output` hands what it printed to the launcher, a batch per call. Not a
    streaming generator: Ray Client (``raydist launch --address ray://...``) has none."""

    def start(self, env: dict[str, str], path: str, source: str, args: list[str], cwd: str) -> None:
        """Run an SPMD script as this rank, in a child process that dies with this actor."""
        if not (os.path.isfile(path) and open(path, encoding="utf-8").read() == source):
            path = os.path.join(tempfile.mkdtemp(prefix="raydist-launch-"), os.path.basename(path))
            with open(path, "w", encoding="utf-8") as f:  # another node: the driver's copy
                f.write(source)
        ended_r, ended_w = os.pipe()  # the script's status, written as it ends (raydist.integrations.spmd)
        child = subprocess.Popen(
            dying_with_this_process([sys.executable, "-m", "raydist.integrations.spmd", path, *args]),
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1", END_FD: str(ended_w)}, pass_fds=(ended_w,),
            cwd=cwd if os.path.isdir(cwd) else os.path.dirname(path),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
        )  # fmt: skip
        os.close(ended_w)
        self._items: queue.Queue = queue.Queue()
        quiet = env.get("GLOG_minloglevel") == QUIET_GLOG_LEVEL
        threading.Thread(target=self._follow, args=(child, ended_r, quiet), name="raydist-script",
                         daemon=True).start()  # fmt: skip

    def output(self, wait_s: float = 1.0) -> list[tuple[str, object]]:
        """What the script did since the last call, waiting up to ``wait_s`` for something:
        ("out" | "err", line) as it prints, ("lingered", seconds) if its process outlived the
        script's end by `LINGER_GRACE_S` and was killed, then ("exit", status): the script's own."""
        items = []
        try:
            items.append(self._items.get(timeout=wait_s))
            while len(items) < OUTPUT_BATCH:
                items.append(self._items.get_nowait())
        except queue.Empty:
            pass
        if items:
            self.answered = time.time()
        return items

    def _follow(self, child: subprocess.Popen, ended_r: int, quiet: bool) -> None:
        lines: queue.Queue = queue.Queue()
        ended: list = []  # [(status, when)] once the script has ended

        def pump(stream, kind):
            for line in stream:
                lines.put((kind, line.rstrip("\n")))
            lines.put(None)

        def wait_for_end():
            with os.fdopen(ended_r) as f:
                text = f.read().strip()
            if text:
                ended.append((int(text), time.monotonic()))

        for stream, kind in ((child.stdout, "out"), (child.stderr, "err")):
            threading.Thread(target=pump, args=(stream, kind), daemon=True).start()
        threading.Thread(target=wait_for_end, daemon=True).start()
        open_streams, in_flags_dump, lingered = 2, False, None
        while open_streams:
            try:
                item = lines.get(timeout=0.2)
            except queue.Empty:
                since = time.monotonic() - ended[0][1] if ended else 0.0
                if lingered is None and since > LINGER_GRACE_S and child.poll() is None:
                    lingered = since
                    child.kill()  # its pipes close with it
                continue
            if item is None:
                open_streams -= 1
                continue
            if quiet and item[0] == "err":  # init_parallel_env lists every non-default FLAG
                if "Modified FLAGS detected" in item[1]:
                    in_flags_dump = True
                    continue
                if in_flags_dump:
                    in_flags_dump = not item[1].startswith("=====")
                    continue
            self._items.put(item)
        code = child.wait()
        if lingered is not None:
            self._items.put(("lingered", round(lingered, 1)))
        self._items.put(("exit", ended[0][0] if ended else code))


STOPPED = "stopped by raydist stop (or ray.kill)"  # a rank's status when it was ended on purpose
DRAINING = "preemption notice"  # a rank's status when its node is being drained: the script restarts elsewhere

OUTPUT_BATCH = 1000  # lines a call of `ScriptActor.output` hands over at most


# How long a script's process may outlive the script (Paddle's and gloo's teardown) before it is killed.
LINGER_GRACE_S = 3.0


# The first thing a launched script's process runs (``python -c``, before it execs the script's command):
# it asks the kernel to kill it when its parent dies. Done in the child, which has one thread, not through
# Popen's ``preexec_fn`` (which runs between fork and exec in the actor, a multi-threaded process: unsafe, per
# the subprocess docs). argv: the parent's pid, then the command.
_DIE_WITH_PARENT = """\
import ctypes, ctypes.util, os, signal, sys
parent, command = int(sys.argv[1]), sys.argv[2:]
try:
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):  # no prctl: not Linux
    pass
if os.getppid() != parent:  # the parent died before prctl: no signal would come
    sys.exit(1)
os.execvp(command[0], command)
"""


def dying_with_this_process(command: list[str]) -> list[str]:
    """``command`` run so that its process is killed when this one dies (Linux), so no script outlives
    its rank: through a trampoline (`_DIE_WITH_PARENT`) that sets ``PR_SET_PDEATHSIG`` on itself."""
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def launch(
    script: str,
    args: Sequence[str] = (),
    num_workers: int = 2,
    *,
    use_gpu: bool = False,
    paddle_logs: bool = False,
    name: str | None = None,
    stdout=None,
    stderr=None,
    env: dict[str, str] | None = None,
    pass_env: bool = True,
    max_restarts: int = 0,
    log_dir: str | None = None,
    ranks_filter: Collection[int] | None = None,
    resources_per_rank: dict[str, float] | None = None,
    placement_strategy: str = "PACK",
) -> int:
    """Run ``script`` on ``num_workers`` ranks; returns its exit status (0 when every rank succeeded).

    Connects to the Ray that is initialised, or starts a local one. Every rank's script sees this
    process's environment, as under ``paddle.distributed.launch``, but for the variables that
    describe this machine (`raydist.env.MACHINE_VARIABLES`); ``pass_env=False``: none of it.
    ``env``: more variables for every rank. Paddle's rank variables (``PADDLE_TRAINER_ID``, the
    endpoints...) win over both, and ``PADDLE_RESTART_COUNT``/``PADDLE_MAX_RESTART``.

    ``max_restarts``: after a rank's failure, start the script again on every rank, up to this
    many times (0: a failure ends the launch; restarting helps scripts that resume from their
    own checkpoints). ``log_dir``: every rank's output (stdout and stderr) also in
    ``log_dir/workerlog.N``, appended across restarts; ``ranks_filter``: the ranks whose output
    goes to ``stdout``/``stderr`` (default all). ``resources_per_rank``, ``placement_strategy``:
    as `raydist.DistModel`'s.
    """
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    with open(script, encoding="utf-8") as f:
        source = f.read()
    given = {**(launching_env(os.environ) if pass_env else {}), **(env or {})}
    config = GroupConfig(num_workers, use_gpu, PlacementConfig(resources_per_rank, placement_strategy),
                         name=name or "raydist-launch", paddle_logs=paddle_logs, actor_class=ScriptActor)  # fmt: skip
    started = init_ray(num_workers, resources_per_rank, use_gpu)
    logs = WorkerLogs(log_dir, num_workers) if log_dir else None
    shown = set(range(num_workers)) if ranks_filter is None else set(ranks_filter)
    drains = DrainWatch() if max_restarts else None  # with no restart left to make, a notice changes nothing
    try:
        for restart in range(max_restarts + 1):
            restarts = {"PADDLE_RESTART_COUNT": str(restart), "PADDLE_MAX_RESTART": str(max_restarts)}
            codes = _run_once(config, script, source, args, {**given, **restarts}, restart, logs, shown, stdout,
                              stderr, drains if restart < max_restarts else None)  # fmt: skip
            if codes is None:  # interrupted
                return 130
            status = _status(codes, stderr, restarting=restart < max_restarts and STOPPED not in codes)
            if status == 0 or restart == max_restarts or STOPPED in codes:
                return status
            note = f"raydist launch: restart {restart + 1} of {max_restarts}, after {_cause(codes)}"
            print(note, file=stderr, flush=True)
            if logs is not None:
                logs.note(note)
    finally:
        if drains is not None:
            drains.stop()
        if logs is not None:
            logs.close()
        if started:
            ray.shutdown()
    return 1  # not reached


def _run_once(config: GroupConfig, script: str, source: str, args: Sequence[str], given: dict[str, str],
              restart: int, logs: WorkerLogs | None, shown: set[int], stdout, stderr,
              drains: DrainWatch | None = None) -> list | None:  # fmt: skip
    """One run of the script on a group of its own: each rank's status (None: interrupted). ``drains``:
    a preemption notice for a node of the group ends the run at once, before the node goes, its ranks'
    status `DRAINING` (the restart is placed on the other nodes: Ray places nothing on a draining one)."""
    num_workers = config.num_workers
    group = RankGroup(config)
    codes: list[int | str | None] = [None] * num_workers  # each rank's exit status, or what ended it
    lock, failed = threading.Lock(), threading.Event()
    lingered: dict[int, float] = {}  # rank -> seconds its process outlived its script, then killed

    def follow(rank: int, actor) -> None:
        try:
            while codes[rank] is None:
                for kind, value in ray.get(call_on([actor], ScriptActor.output)[0]):
                    if kind == "exit":
                        codes[rank] = value
                    elif kind == "lingered":
                        lingered[rank] = value
                    else:
                        if logs is not None:
                            logs.write(rank, value)
                        if rank in shown:
                            with lock:
                                print(f"[rank {rank}] {value}", file=stdout if kind == "out" else stderr, flush=True)
        except ray.exceptions.RayActorError as e:
            if codes[rank] is None and not failed.is_set():
                if "ray.kill" in str(e):  # `raydist stop` (or ray.kill): the launch ends, with no restart
                    codes[rank] = STOPPED
                else:
                    codes[rank] = f"process died: {str(e).strip().splitlines()[0] if str(e).strip() else 'killed'}"
        except Exception as e:  # a bug of ours must not hang the launcher
            if codes[rank] is None:
                codes[rank] = f"{type(e).__name__}: {e}"
        if codes[rank] != 0:
            failed.set()

    cwd = os.getcwd()
    # Paddle's launcher also names the pod; DistModel then joins the group via fleet.init
    pod = {"POD_NAME": uuid.uuid4().hex[:6]}
    card = {"kind": "script", "script": os.path.basename(script), "holder": str(Holder.here()), "restarts": restart}
    group.tell(Member.describe, card)
    call_each_on(group.actors, ScriptActor.start, [({**given, **rank_env, **pod}, os.path.abspath(script), source,
                                                    list(args), cwd) for rank_env in group.envs])  # fmt: skip
    threads = [threading.Thread(target=follow, args=(r, a), daemon=True) for r, a in enumerate(group.actors)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads) and not failed.is_set():
            failed.wait(0.2)
            notice = drains.notice(group.nodes) if drains is not None else None
            if notice is not None:
                for rank, node in enumerate(group.nodes):
                    if node in notice.nodes and codes[rank] is None:
                        codes[rank] = f"{DRAINING}: {notice}"
                failed.set()
    except KeyboardInterrupt:
        group.shutdown()
        return None
    finally:
        if failed.is_set():
            group.shutdown()  # stops the other ranks, and their scripts with them
        for t in threads:
            t.join(timeout=30)
        group.shutdown()
    for rank, seconds in sorted(lingered.items()):
        print(f"raydist launch: rank {rank}'s process lingered after its script ended (Paddle's or gloo's "
              f"teardown); it was ended after {seconds:.0f} s, with the script's status {codes[rank]}",
              file=stderr)  # fmt: skip
    return codes


def _cause(codes: list) -> str:
    """What ended a run, for the restart's line: its first failed rank and how."""
    rank, code = next((r, c) for r, c in enumerate(codes) if c not in (0, None))
    if isinstance(code, str) and code.startswith(DRAINING):
        ranks = ", ".join(str(r) for r, c in enumerate(codes) if c == code)
        return f"a {code} (it runs ranks {ranks})"
    if isinstance(code, int) and code < 0:  # the script's process was ended by a signal (-9: SIGKILL)
        return f"rank {rank} was ended by {_signal_name(-code)} (status {code})"
    return f"rank {rank} exited with status {code}" if isinstance(code, int) else f"rank {rank} failed ({code})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class WorkerLogs:
    """``log_dir/workerlog.N``: each rank's stdout and stderr as it prints them (Paddle's launcher's names)."""

    def __init__(self, log_dir: str, num_workers: int) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self._files = [open(os.path.join(log_dir, f"workerlog.{r}"), "a", encoding="utf-8", buffering=1)
                       for r in range(num_workers)]  # fmt: skip

    def write(self, rank: int, line: str) -> None:
        self._files[rank].write(line + "\n")

    def note(self, line: str) -> None:
        """A line of the launcher's own, in every rank's log (a restart and its cause)."""
        for f in self._files:
            f.write(line + "\n")

    def close(self) -> None:
        for f in self._files:
            f.close()


def _status(codes: list, stderr, restarting: bool = False) -> int:
    bad = [(r, c) for r, c in enumerate(codes) if c not in (0, None)]
    if not bad:
        return 0 if all(c == 0 for c in codes) else 1
    rank, code = bad[0]
    if restarting:
        return code if isinstance(code, int) and 0 < code < 256 else 1
    others = "; the other ranks were stopped" if len(codes) > 1 else ""
    if isinstance(code, int):
        print(f"raydist launch: rank {rank} exited with status {code}{others}", file=stderr)
        return code if 0 < code < 256 else 1
    print(f"raydist launch: rank {rank} failed ({code}){others}", file=stderr)
    return 1


DESCRIPTION = ("Run an unmodified SPMD Paddle script (as for python -m paddle.distributed.launch) "
               "with one rank per Ray actor.")


def arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``raydist launch``'s arguments, added to ``parser``."""
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    parser.add_argument("--gpus", action="store_true", help="one GPU per rank, NCCL (default: CPU, gloo)")
    parser.add_argument("--address", help="Ray cluster address, ray:// for Ray Client (default: RAY_ADDRESS, "
                                          "else the cluster `ray start` runs here, else a local Ray)")  # fmt: skip
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="one more environment variable for every rank (repeatable)")  # fmt: skip
    parser.add_argument("--no-env", action="store_true",
                        help="give the ranks none of this shell's environment (by default they get all of it but "
                             "the variables that describe this machine: its paths, user, shell, virtualenv, "
                             "devices, Ray's own)")  # fmt: skip
    parser.add_argument("--paddle-logs", action="store_true", help="keep Paddle's INFO logs (glog) in the ranks")
    parser.add_argument("--name", help="prefix of the rank actors' names (default raydist-launch)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="after a rank fails, end every rank and start the script again on all of them, up to "
                             "N times (default 0: for scripts that do not resume from their own checkpoints, a "
                             "restart would only run them again from the start); the ranks see "
                             "PADDLE_RESTART_COUNT")  # fmt: skip
    parser.add_argument("--log-dir", metavar="D",
                        help="also write each rank's stdout and stderr to D/workerlog.N (appended across restarts)")
    parser.add_argument("--ranks-filter", metavar="R[,R...]",
                        help="print only these ranks' output here (default: every rank's, prefixed)")
    parser.add_argument("--resources-per-rank", metavar="JSON",
                        help='the Ray resources of each rank, e.g. \'{"CPU": 4, "rank_node": 1}\' '
                             '(default {"CPU": 1}, or {"CPU": 1, "GPU": 1} with --gpus)')  # fmt: skip
    parser.add_argument("--placement-strategy", default="PACK",
                        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                        help="how the ranks' placement group spreads them over nodes (default PACK)")
    parser.add_argument("script", help="the SPMD script, run as python script.py on every rank")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def command(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``raydist launch`` as ``opts`` say; its exit status."""
    from ..driver.cluster.connect import connect_to_cluster

    if opts.nproc < 1:
        parser.error("-n must be at least 1")
    if not os.path.isfile(opts.script):
        parser.error(f"no such script: {opts.script}")
    env = {}
    for pair in opts.env:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            parser.error(f"--env takes KEY=VALUE, got {pair!r}")
        env[key] = value
    if opts.max_restarts < 0:
        parser.error("--max-restarts must be 0 or more")
    ranks = None
    if opts.ranks_filter is not None:
        try:
            ranks = {int(r) for r in opts.ranks_filter.split(",")}
        except ValueError:
            parser.error(f"--ranks-filter takes ranks like 0,2; got {opts.ranks_filter!r}")
        if not all(0 <= r < opts.nproc for r in ranks):
            parser.error(f"--ranks-filter: the ranks are 0..{opts.nproc - 1}; got {opts.ranks_filter!r}")
    resources = None
    if opts.resources_per_rank is not None:
        try:
            resources = json.loads(opts.resources_per_rank)
        except json.JSONDecodeError as e:
            parser.error(f"--resources-per-rank takes a JSON object such as '{{\"CPU\": 4}}': {e}")
        if not isinstance(resources, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
            for k, v in resources.items()
        ):
            parser.error(f"--resources-per-rank takes a JSON object of resource names to amounts; got "
                         f"{opts.resources_per_rank!r}")  # fmt: skip
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if opts.address:
        try:
            connect_to_cluster(f"launch {opts.script} on", opts.address)
        except LookupError as e:
            print(f"raydist launch: {e}", file=sys.stderr)
            return 1
    try:
        return launch(opts.script, opts.args, opts.nproc, use_gpu=opts.gpus, paddle_logs=opts.paddle_logs,
                      name=opts.name, env=env, pass_env=not opts.no_env, max_restarts=opts.max_restarts,
                      log_dir=opts.log_dir, ranks_filter=ranks, resources_per_rank=resources,
                      placement_strategy=opts.placement_strategy)  # fmt: skip
    except ValueError as e:  # ranks the cluster cannot place (a resource no node has)
        print(f"raydist launch: {e}", file=sys.stderr)
        return 1
    finally:
        if opts.address:
            ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``raydist launch``'s arguments, without the ``launch`` (``python -m raydist.launch ...``)."""
    parser = arguments(argparse.ArgumentParser(prog="raydist launch", description=DESCRIPTION))
    return command(parser.parse_args(argv), parser)


if __name__ == "__main__":
    raise SystemExit(main())
