"""The ``raydist`` command (also ``python -m raydist``).

    raydist launch -n 4 [--address A] [--env K=V] [--no-env] script.py [args...]
    raydist status [--address A] [--json]
    raydist stop NAME [--address A] [--force]

Each finds its cluster as Ray's own CLI does: ``--address`` (``host:port``, or
``ray://host:port`` through Ray Client), else ``RAY_ADDRESS``, else the cluster
``ray start`` runs on this machine. ``status`` and ``stop`` never start a Ray of
their own: with no cluster there, they say so and exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from .integrations import launch as launching

ADDRESS_HELP = ("the Ray cluster: host:port, or ray://host:port through Ray Client (default: RAY_ADDRESS, else "
                "the cluster `ray start` runs on this machine)")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="raydist", description="raydist: PaddlePaddle's DistModel on Ray. Commands:")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launch = launching.arguments(commands.add_parser("launch", help=launching.DESCRIPTION,
                                                     description=launching.DESCRIPTION))  # fmt: skip
    launch.set_defaults(parser=launch)  # its errors name it
    status = commands.add_parser(
        "status", help="list every raydist model and launched script on the cluster",
        description="Every raydist model and launched script on the cluster: its name, whether it is detached, "
                    "the driver that holds it, its size and elastic bounds, mode, step, nodes and last "
                    "checkpoint, and each rank's pid, node, peak memory and last answer.",
    )  # fmt: skip
    status.add_argument("--address", help=ADDRESS_HELP)
    status.add_argument("--json", action="store_true", help="print JSON (a list of models) instead of a table")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds ranks have to answer (default 10)")
    stop = commands.add_parser(
        "stop", help="end a detached model: its ranks, placement group and record",
        description="End the detached model NAME: its ranks, their placement group and its record. A model a "
                    "live driver holds is refused unless --force (that driver's next call then fails). A model "
                    "that is not detached, or a launched script, ends with its driver; --force stops its ranks.",
    )  # fmt: skip
    stop.add_argument("name", metavar="NAME", help="the model's name (as `raydist status` lists it)")
    stop.add_argument("--address", help=ADDRESS_HELP)
    stop.add_argument("--force", action="store_true", help="end it even if a live driver holds it")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``raydist`` command line ``argv`` (default ``sys.argv[1:]``); its exit status."""
    top = parser()
    opts = top.parse_args(argv)
    if opts.command == "launch":
        return launching.command(opts, opts.parser)
    return {"status": status_command, "stop": stop_command}[opts.command](opts)


def cli() -> None:
    """The ``raydist`` console script."""
    raise SystemExit(main())


def _connect(address: str | None, why: str) -> bool:
    """Connect to the cluster quietly; False (said on stderr) if there is none."""
    import ray

    from .driver.cluster.connect import connect_to_cluster

    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray Client's "Passing the following kwargs..."
    try:
        connect_to_cluster(why, address, logging_level=logging.WARNING, log_to_driver=False)
    except LookupError as e:
        print(f"raydist: {e}", file=sys.stderr)
        return False
    except (ConnectionError, RuntimeError, ray.exceptions.RaySystemError) as e:
        print(f"raydist: could not connect to the Ray cluster at {address or 'RAY_ADDRESS'}: {e}", file=sys.stderr)
        return False
    return True


def status_command(opts: argparse.Namespace) -> int:
    from .driver.api.status import models

    if not _connect(opts.address, "list the raydist models of"):
        return 1
    found = models(opts.timeout)
    if opts.json:
        print(json.dumps([m.to_json() for m in found], indent=2))
    else:
        print(format_models(found))
    return 0


def stop_command(opts: argparse.Namespace) -> int:
    from .driver.api.status import models
    from .driver.lifecycle.detached import ModelHeldError, kill_named, stop

    if not _connect(opts.address, f"stop {opts.name!r} on"):
        return 1
    try:
        stop(opts.name, opts.force)
    except ModelHeldError as e:
        print(f"raydist stop: {e}", file=sys.stderr)
        return 1
    except LookupError as e:
        running = next((m for m in models() if m.name == opts.name), None)
        if running is None:
            print(f"raydist stop: {e}", file=sys.stderr)
            return 1
        what = "launched script" if running.kind == "script" else "model"
        if not opts.force and running.kind != "script":  # a launcher ends when its ranks are stopped, restarts or not
            print(f"raydist stop: the {what} {opts.name!r} is not detached: it ends with its driver ({running.holder})"
                  "; --force stops its ranks (the driver then fails, naming a rank)", file=sys.stderr)  # fmt: skip
            return 1
        count = kill_named(opts.name, None)
        print(f"stopped the {count} ranks of the {what} {opts.name!r}")
        return 0
    print(f"stopped the detached model {opts.name!r}: its ranks, placement group and record")
    return 0


def describe(event: dict) -> str:
    """An event (`raydist.driver.watching.events`) in a few words."""
    shown = {k: v for k, v in event.items() if k not in ("kind", "time", "model") and v is not None}
    return f"{event['kind']} " + ", ".join(f"{k} {v}" for k, v in shown.items())


def format_models(found: list) -> str:
    """``raydist status``'s table: a block per model, a line per rank."""
    from .driver.api.status import ago

    if not found:
        return "no raydist models or launched scripts on this cluster"
    blocks = []
    for m in found:
        if m.kind == "script":
            head = f"{m.name}  launched script {m.script}, launched by {m.holder or 'a driver that is gone'}"
        else:
            held = m.holder or "no live driver (raydist.attach takes it)"
            head = f"{m.name}  {'detached model' if m.detached else 'model'}, held by {held}"
        size = f"{m.size} ranks" if m.bounds is None or m.bounds[0] == m.bounds[1] else \
            f"{m.size} ranks (elastic, {m.bounds[0]} to {m.bounds[1]})"
        facts = [size, f"on {len(m.nodes)} node{'s' if len(m.nodes) != 1 else ''}"]
        if m.kind == "script":
            facts.append(f"restarted {m.restarts or 0} time{'s' if m.restarts != 1 else ''}")
        if m.kind == "model":
            facts += [f"mode {m.mode or '-'}", f"step {m.step if m.step is not None else '-'}",
                      f"last checkpoint {m.last_checkpoint or 'none'}"]  # fmt: skip
        rows = [("RANK", "PID", "NODE", "DEVICE", "MODE", "STEP", "PEAK MiB", "LAST ANSWER")]
        for r in m.ranks:
            rows.append((str(r.rank), str(r.pid), f"{r.node_ip} {r.node_id[:8]}", r.device, r.mode or "-",
                         "-" if r.step is None else str(r.step), f"{r.peak_rss_mib:.0f}", ago(r.last_answer)))
        rows += [(str(rank), "-", "-", "-", "-", "-", "-", "no answer") for rank in m.missing]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        said = [f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {describe(e)}" for e in m.events]
        blocks.append("\n".join([head, "  " + ", ".join(facts), *table, *(["  last events:", *said] if said else [])]))
    return "\n\n".join(blocks)
