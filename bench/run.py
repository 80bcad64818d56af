"""Benchmarks: raydist next to plain multi-process Paddle, in ONE invocation.

    python -m bench [models] [--models mlp-mp2,...] [--runners native,loader,batches,compiled] [--steps 60]
                    [--warmup 10] [--repeat N] [--dispatch auto]
    python -m bench dispatch [--ranks 2,4,8,16,32,64] [--steps 300] [--paths calls,tree,...]
    python -m bench restart [--models mlp-dp2xmp2] [--repeat 3]
    python -m bench elastic [--models mlp-dp2xmp2,gpt-dp2xmp2] [--steps 24]
    python -m bench pipeline [--steps 40] [--repeat 3]
    python -m bench startup [--repeat 2] [--models mlp-mp2]
    python -m bench resume [--models gpt-mp2] [--steps 24] [--every 4] [--kill-after 10] [--repeat 3]
    python -m bench saves [--models gpt-mp2] [--steps 40] [--every 8] [--repeat 3]
    python -m bench peers [--models gpt-mp2,gpt-pp2] [--steps 40] [--every 1,10,100] [--check 10] [--rounds 3] [--idle-copies 0]
    python -m bench recovery [--models gpt-mp2,gpt-pp2] [--steps 30] [--every 10] [--kill-after 15] [--rounds 2]
    python -m bench chaos [--minutes 30] [--seed 7] [--cases dp2,mp2,dp2xmp2,pp2,sharding3] [--loops fit,plain] [--faults 8]
    python -m bench attach [--models gpt-mp2] [--steps 12] [--before 6] [--repeat 3]
    python -m bench small [--models mlp-mp2,wide-mp2] [--steps 300] [--repeat 3] [--compiled]
    python -m bench paired [--models mlp-mp2,wide-mp2] [--rounds 10] [--seconds 1] [--record-off]
    python -m bench profile [--models mlp-mp2] [--seconds 20] [--every 0]
    python -m bench COMMAND --help      (each command's options and defaults; --write: keep the table in bench/results/)

For each model, the same model, data and ranks under these runners, round-robin:
- *native*: N plain processes with paddle.distributed.launch's environment,
  Paddle's own DistModel over Paddle's own shard_dataloader;
- *raydist, loader*: raydist.to_static fed by raydist.shard_dataloader over a
  Ray Dataset (ranks read their own rows);
- *raydist, loader over a paddle.io.Dataset* (``loader-paddle``, not run by default):
  the same rows, read with Paddle's sampler instead of Ray Data;
- *raydist, driver batches*: numpy batches passed to ``dm(x, y)``;
- *raydist, driver batches, compiled graph* (``compiled``, not run by default):
  the same with ``dispatch="compiled"``, whose channels busy-wait.
Reports the mean step time (median of the runs; each run's over that median), steps/s, the ratio
to native, the CPU a rank's process spends per step (all its threads) and its share of the step,
time to first step, peak memory per rank, the share of time ranks wait for data, and
whether native and raydist's driver batches computed the losses of the same
model trained in ONE plain process (bench/reference.py). ``dispatch`` measures the
driver's own cost per step as the group grows (bench/dispatch.py); ``elastic``, what a
lost or joining node costs (bench/elastic.py); ``pipeline``, the bench GPT on two
pipeline stages next to dp2 and mp2, with each stage's bubble (bench/pipeline.py); ``startup``,
where a model's start goes (bench/startup.py); ``paired``, small steps with native and raydist
alive side by side taking turns in short chunks, ratios within one spell of the machine
(bench/paired.py); ``restart``, a killed rank's cost until the next
step, with and without spare ranks (bench/restart.py); ``resume``, a job killed and run
again, and ``attach``, a detached model attached by a new driver (bench/outlive.py); ``saves``, a checkpoint's stall
of the loop (bench/saves.py); ``peers``, peer memory's and the replica check's cost per step, and ``recovery``, a
lost node's cost with peer memory next to a checkpoint (bench/peers.py); ``chaos``, a fault soak: faults in
sequence, each run held to one plain process (bench/chaos.py, tests/chaos.py). Tables are
printed; with ``--write`` each is also kept in ``bench/results/<command line>.md`` with its date,
machine, versions and the code's commit, replacing the last table of the same command line.
BENCHMARKS.md quotes its figures from there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bench.common import DISPATCH, RATE_NOTE, ROOT, machine
from bench.compare import RUNNERS, models_table

COMMANDS = ("models", "dispatch", "restart", "elastic", "pipeline", "startup", "resume", "attach", "saves", "small",
            "paired", "profile", "timeline", "peers", "recovery", "chaos")


def _names(known: list[str]) -> Callable[[str], str]:
    """An argparse type: a comma-separated list of names among ``known``, kept as the string."""

    def check(text: str) -> str:
        unknown = [n for n in text.split(",") if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
        return text

    return check


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {text!r}") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"group sizes must be positive: {text!r}")
    return sizes


def parser() -> argparse.ArgumentParser:
    """``python -m bench [COMMAND] [options]``: one subcommand per table; ``models`` when none is named."""
    top = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog="Without a COMMAND, the options are models': python -m bench --repeat 3 is "
                                         "python -m bench models --repeat 3. python -m bench COMMAND --help: "
                                         "its options and defaults.")  # fmt: skip
    commands = top.add_subparsers(dest="what", metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text,
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
        sub.add_argument("--write", action="store_true",
                         help="also write the table to bench/results/ (replacing this command's last one)")
        return sub

    def dispatch_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--dispatch", default="auto", choices=["auto", "compiled", "calls", "tree"],
                         help="raydist's dispatch")  # fmt: skip

    sub = command("models", "raydist next to native Paddle: each model under each runner (the default command)")
    sub.add_argument("--models", default="mlp-mp2,mlp-dp2xmp2,gpt-mp2,gpt-dp2xmp2", help="bench/models.py's, comma-separated")
    sub.add_argument("--runners", default="native,loader,batches", type=_names(list(RUNNERS)), help="comma-separated")
    sub.add_argument("--steps", type=int, default=60, help="timed steps")
    sub.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    sub.add_argument("--repeat", type=int, default=1, help="runs of each runner, round-robin (medians)")
    dispatch_option(sub)
    sub = command("dispatch", "the driver's cost per step as the group grows, next to Ray's own (bench/dispatch.py)")
    sub.add_argument("--ranks", default="2,4,8,16,32,64", type=_sizes, help="group sizes, comma-separated")
    sub.add_argument("--steps", type=int, default=300, help="timed steps")
    sub.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    sub.add_argument("--repeat", type=int, default=3, help="rounds (medians)")
    sub.add_argument("--paths", default="ray-calls,calls,tree,ray-compiled,compiled",
                     help="the paths to measure, comma-separated (bench/dispatch.py's PATHS)")  # fmt: skip
    sub = command("restart", "a killed rank's cost until the next step, with and without spare ranks (bench/restart.py)")
    sub.add_argument("--models", default="mlp-dp2xmp2", help="comma-separated")
    sub.add_argument("--repeat", type=int, default=3, help="kills of each kind (medians)")
    dispatch_option(sub)
    sub = command("elastic", "what a lost or joining node costs, on clusters of its own (bench/elastic.py)")
    sub.add_argument("--models", default="mlp-dp2xmp2,gpt-dp2xmp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=24, help="steps per run")
    sub.add_argument("--repeat", type=int, default=1, help="runs of each kind (medians)")
    sub = command("pipeline", "the bench GPT on two pipeline stages next to dp2 and mp2 (bench/pipeline.py)")
    sub.add_argument("--steps", type=int, default=40, help="timed steps")
    sub.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    sub.add_argument("--repeat", type=int, default=1, help="runs of each (medians)")
    dispatch_option(sub)
    sub = command("resume", "a job killed and run again: time to its first step, steps computed twice (bench/outlive.py)")
    sub.add_argument("--models", default="gpt-mp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=24, help="steps per run")
    sub.add_argument("--every", type=int, default=4, help="checkpoint_every")
    sub.add_argument("--kill-after", type=int, default=10, help="steps completed when the driver is killed")
    sub.add_argument("--repeat", type=int, default=3, help="runs of each kind, round-robin (medians)")
    sub = command("attach", "a new driver attached to a detached model after a SIGKILL: time to its first step "
                            "(bench/outlive.py)")  # fmt: skip
    sub.add_argument("--models", default="gpt-mp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=12, help="steps per run")
    sub.add_argument("--before", type=int, default=6, help="steps the detached model's first driver runs")
    sub.add_argument("--repeat", type=int, default=3, help="runs of each kind, round-robin (medians)")
    sub = command("peers", "peer memory's and the replica check's cost per step, on 2 nodes (bench/peers.py)")
    sub.add_argument("--models", default="gpt-mp2,gpt-pp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=40, help="timed steps per run")
    sub.add_argument("--every", default="1,10,100", help="peer_memory values, comma-separated")
    sub.add_argument("--check", type=int, default=10, help="check_replicas")
    sub.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    sub.add_argument("--idle-copies", type=int, default=0,
                     help="then this many copies, each alone on the idle machine: their CPU (medians)")
    sub = command("chaos", "a fault soak: faults in sequence into fit and a plain loop, held to one process "
                           "(bench/chaos.py)")
    sub.add_argument("--minutes", type=float, default=30.0, help="rounds until this much time has passed")
    sub.add_argument("--seed", type=int, default=7, help="the first round's seed (the next round's is one more)")
    sub.add_argument("--cases", default="dp2xmp2,mp2,pp2,dp2,sharding3", help="tests/chaos.py's CASES, comma-separated")
    sub.add_argument("--loops", default="fit,plain", help="fit, plain or both, comma-separated")
    sub.add_argument("--faults", type=int, default=8, help="faults per round")
    sub.add_argument("--epochs", type=int, default=None, help="epochs of 24 steps per round (default: 40 steps a fault)")
    sub = command("recovery", "a lost node with peer memory next to a checkpoint, on 3 nodes (bench/peers.py)")
    sub.add_argument("--models", default="gpt-mp2,gpt-pp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=30, help="steps per run (one epoch)")
    sub.add_argument("--every", type=int, default=10, help="peer_memory, and checkpoint_every")
    sub.add_argument("--kill-after", type=int, default=15, help="steps done when the node goes")
    sub.add_argument("--rounds", type=int, default=2, help="runs of each, interleaved (medians)")
    sub = command("saves", "a checkpoint's stall of the loop, synchronous and in the background (bench/saves.py)")
    sub.add_argument("--models", default="gpt-mp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=40, help="steps per run")
    sub.add_argument("--every", type=int, default=8, help="a save every this many steps")
    sub.add_argument("--repeat", type=int, default=3, help="runs of each kind, round-robin (medians)")
    def small_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--models", default="mlp-mp2,wide-mp2", help="comma-separated")
        sub.add_argument("--warmup", type=int, default=20, help="steps before the timed ones")
        sub.add_argument("--reads", default="never,every 10,every step", help="how often the loop reads a loss, "
                         "comma-separated among: never, every 10, every step")  # fmt: skip

    sub = command("small", "small steps: the loader loop by how often it reads a loss, next to native (bench/small.py)")
    small_options(sub)
    sub.add_argument("--steps", type=int, default=300, help="timed steps")
    sub.add_argument("--repeat", type=int, default=3, help="rounds, each runner once per round (medians)")
    sub.add_argument("--compiled", action="store_true", help="each read also over a compiled graph")
    sub = command("paired", "small steps with native and raydist alive side by side, taking turns in short "
                            "chunks: ratios within one spell of the machine (bench/paired.py)")  # fmt: skip
    small_options(sub)
    sub.add_argument("--rounds", type=int, default=10, help="rounds, each runner one chunk per round (medians)")
    sub.add_argument("--seconds", type=float, default=1.0, help="about how long native's chunk of steps takes")
    sub.add_argument("--record-off", action="store_true",
                     help="also a raydist model whose ranks keep no step record and export no metrics")  # fmt: skip
    sub.add_argument("--dynamic", action="store_true",
                     help="also native eager Paddle and a raydist model in dynamic mode (dynamic=True)")
    sub = command("profile", "where rank 0's time goes in a loop of small steps, next to native (bench/profile.py)")
    sub.add_argument("--models", default="mlp-mp2", help="comma-separated")
    sub.add_argument("--seconds", type=int, default=20, help="how long py-spy samples each loop")
    sub.add_argument("--every", type=int, default=0, help="read a loss every this many steps (0: never)")
    sub = command("timeline", "a run's timeline drawn, a slow rank in it (bench/timeline.py)")
    sub.add_argument("--models", default="gpt-dp2xmp2", help="one model")
    sub.add_argument("--steps", type=int, default=30, help="steps on the picture")
    sub.add_argument("--warmup", type=int, default=40, help="steps before them")
    sub.add_argument("--slow-rank", type=int, default=1, help="the rank slowed (-1: none)")
    sub.add_argument("--slow-ms", type=float, default=20.0, help="how much slower each of its steps is")
    sub.add_argument("--out", default="docs/timeline.png", help="the picture (its trace beside it, .json)")
    sub = command("startup", "where a model's start goes (bench/startup.py)")
    sub.add_argument("--models", default="mlp-mp2", help="comma-separated")
    sub.add_argument("--repeat", type=int, default=2, help="models started one after another")
    return top


def parse(argv) -> argparse.Namespace:
    """The options of ``python -m bench`` + ``argv``; no COMMAND (options only, or none) is ``models``."""
    argv = list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["models", *argv]
    return parser().parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    DISPATCH[0] = getattr(args, "dispatch", "auto")

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.what == "resume":  # a head of its own
        from bench.outlive import resume_table

        table = resume_table(args.models.split(","), args.steps, args.every, args.kill_after, args.repeat)
        _write(args, argv, table)
        return
    if args.what == "attach":  # a head of its own
        from bench.outlive import attach_table

        table = attach_table(args.models.split(","), args.steps, args.before, args.repeat)
        _write(args, argv, table)
        return
    if args.what in ("peers", "recovery"):  # clusters of their own
        from bench.peers import cost_table, recovery_table

        if args.what == "peers":
            table = cost_table(args.models.split(","), args.steps, [int(k) for k in args.every.split(",")],
                               args.check, args.rounds, args.idle_copies)  # fmt: skip
        else:
            table = recovery_table(args.models.split(","), args.steps, args.every, args.kill_after, args.rounds)
        _write(args, argv, table)
        return
    if args.what == "chaos":  # clusters of its own
        from bench.chaos import chaos_table

        table, passed = chaos_table(args.minutes, args.seed, args.cases.split(","), args.loops.split(","),
                                    args.faults, args.epochs)  # fmt: skip
        _write(args, argv, table)
        sys.exit(0 if passed else 1)
    if args.what == "elastic":  # clusters of its own
        from bench.elastic import elastic_table

        table = elastic_table(args.models.split(","), args.steps, args.repeat)
        _write(args, argv, table)
        return
    ray.init(num_cpus=_ray_cpus(args), include_dashboard=False, log_to_driver=False)
    try:
        if args.what == "dispatch":
            from bench.dispatch import dispatch_table

            table = dispatch_table(args.ranks, args.steps, args.warmup, args.repeat, args.paths.split(","))
        elif args.what == "restart":
            from bench.restart import restart_table

            table = restart_table(args.models.split(","), args.repeat)
        elif args.what == "startup":
            from bench.startup import startup_table

            table = "\n\n".join(startup_table(args.repeat, n) for n in args.models.split(","))
        elif args.what == "saves":
            from bench.saves import saves_table

            table = saves_table(args.models.split(","), args.steps, args.every, args.repeat)
        elif args.what == "small":
            from bench.small import small_table

            table = small_table(args.models.split(","), args.steps, args.warmup, args.repeat, args.reads.split(","),
                                args.compiled)  # fmt: skip
        elif args.what == "paired":
            from bench.paired import paired_table

            table = paired_table(args.models.split(","), args.rounds, args.seconds, args.warmup,
                                 args.reads.split(","), args.record_off, args.dynamic)  # fmt: skip
        elif args.what == "profile":
            from bench.profile import profile_table

            table = profile_table(args.models.split(","), args.seconds, args.every)
        elif args.what == "timeline":
            from bench.timeline import timeline_table

            table = timeline_table(args.models, args.steps, args.warmup, None if args.slow_rank < 0 else args.slow_rank,
                                   args.slow_ms, args.out)  # fmt: skip
        elif args.what == "pipeline":
            from bench.pipeline import pipeline_table

            table = pipeline_table(args.steps, args.warmup, args.repeat)
        else:
            table = models_table(args)
    finally:
        ray.shutdown()
    _write(args, argv, table)


def _ray_cpus(args) -> int:
    """Logical CPUs of the bench's local Ray. ``small``, ``paired`` and ``profile`` get what raydist would
    start for their largest model (what a user gets), times the models ``paired`` keeps alive: more would let Ray Data start a worker process per
    logical CPU, whose idle polling takes CPU from every runner alike. The other commands start
    groups of many light ranks, so 32."""
    if args.what in ("small", "paired", "profile"):
        from bench.models import world_size
        from raydist.driver.cluster.connect import local_num_cpus

        alive = 1  # raydist models alive at once: paired keeps one more with each extra runner
        if args.what == "paired":
            alive += args.record_off + ("every step" in args.reads.split(","))
        return local_num_cpus(alive * max(world_size(n) for n in args.models.split(",")), 1)
    return max(32, os.cpu_count() or 1)


RESULTS = ROOT / "bench" / "results"


def result_path(argv: list[str]) -> Path:
    """Where ``--write`` keeps the table of ``python -m bench *argv``: one file per command line."""
    words = [w for w in argv if w != "--write"] or ["models"]
    slug = re.sub(r"[^A-Za-z0-9.,=-]+", "_", "_".join(words)).strip("_")
    return RESULTS / f"{slug}.md"


def _write(args, argv, table: str) -> None:
    print(table)
    if not args.write:
        return
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    steps = (f"py-spy on rank 0 for {args.seconds:g} s of each loop, {RATE_NOTE}" if args.what == "profile"
             else f"{args.steps} steps per run, {args.repeat} run(s) of each kind, medians"
             if args.what in ("elastic", "resume", "saves", "attach")
             else "models started one after another" if args.what == "startup"
             else "kill to next step, medians" if args.what == "restart"
             else f"{args.steps} timed steps per run, {args.rounds} interleaved rounds, medians" if args.what == "peers"
             else f"{args.steps} steps per run, {args.rounds} run(s) of each, interleaved, medians"
             if args.what == "recovery"
             else f"rounds for {args.minutes:g} minutes from seed {args.seed}, {args.faults} faults per round"
             if args.what == "chaos"
             else f"{args.rounds} rounds of chunks of about {args.seconds:g} s, medians"
             if args.what == "paired"
             else f"{args.steps} timed steps after {args.warmup} warm-up steps"
             + (f", {args.repeat} interleaved rounds, medians" if args.what == "small" else ""))  # fmt: skip
    dispatch = f"; dispatch {args.dispatch}" if hasattr(args, "dispatch") else ""
    command = shlex.join([w for w in argv if w != "--write"])
    path = result_path(argv)
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"# `python -m bench {command}`\n\n{stamp}, {machine()}, code {_commit()}; {steps}{dispatch}."
                    f"\n\n{table}\n")  # fmt: skip
    print(f"written to {path}")


def _commit() -> str:
    """The code's commit (with "+changes" when the tree differs from it)."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if git("status", "--porcelain") else "")


if __name__ == "__main__":
    main()
