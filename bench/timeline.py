"""A run's timeline, drawn: ``dm.timeline`` of a loader loop, as a picture (README, "Watching a run").

    python -m bench timeline [--models gpt-dp2xmp2] [--steps 30] [--slow-rank 1] [--slow-ms 20] [--out PNG]

The model runs ``--warmup`` then ``--steps`` steps through its loader, every 10th loss
read; ``--slow-rank`` sleeps ``--slow-ms`` at the start of each of its steps (a setup hook,
`slow_steps`), so the picture shows what a straggler looks like. The trace of the last
``--steps`` steps is written beside the picture (``.json``) and drawn with matplotlib: a row
per rank's steps and one per rank's collectives, the driver's messages on top. The table:
each rank's median step, the part of it outside collectives, and the part inside.
"""

from __future__ import annotations

import os
import statistics


def slow_steps() -> None:
    """Ray's worker setup hook: rank $RAYDIST_BENCH_SLOW_RANK sleeps $RAYDIST_BENCH_SLOW_MS at each step's start."""
    import time

    from raydist.protocol import RankActor

    setup = RankActor.setup

    def setup_then_slow(self, *args, **kwargs):
        fixes = setup(self, *args, **kwargs)
        if self.rank == int(os.environ.get("RAYDIST_BENCH_SLOW_RANK", "-1")):
            step, pause = self.model.step, float(os.environ["RAYDIST_BENCH_SLOW_MS"]) / 1000

            def slow_step(message, staged):
                time.sleep(pause)
                return step(message, staged)

            self.model.step = slow_step
        return fixes

    setup_then_slow.__dict__.update(setup.__dict__)
    RankActor.setup = setup_then_slow


def timeline_table(name: str, steps: int, warmup: int, slow_rank: int | None, slow_ms: float, out: str) -> str:
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR  # as tests/faults.py passes a hook

    from bench.common import raydist_model, bench_loader, memory_dataset

    env = {} if slow_rank is None else {WORKER_PROCESS_SETUP_HOOK_ENV_VAR: "bench.timeline.slow_steps",
                                        "RAYDIST_BENCH_SLOW_RANK": str(slow_rank), "RAYDIST_BENCH_SLOW_MS": str(slow_ms)}
    loader = bench_loader(name, memory_dataset(name, warmup + steps))
    dm = raydist_model(name, loader, env_vars=env)
    try:
        for i, batch in enumerate(loader(), 1):
            loss = dm(batch["x"], batch["y"])
            if i % 10 == 0:
                float(loss)
        trace = dm.timeline(os.path.splitext(out)[0] + ".json", steps=steps)
    finally:
        dm.shutdown()
    draw(trace, out, f"{name}, the last {steps} steps" + (f"; rank {slow_rank} {slow_ms:g} ms slower" if slow_rank is not None else ""))
    rows = []
    for rank, (own, inside, whole) in enumerate(per_rank(trace)):
        rows.append(f"| {name} | {rank} | {whole:.2f} | {own:.2f} | {inside:.2f} |")
    offsets = ", ".join(f"{o / 1e3:.0f}" for o in trace["otherData"]["clock_offsets_ns"])
    return "\n".join(["| model | rank | step (ms, median) | outside collectives (ms) | in collectives (ms) |",
                      "|---|---:|---:|---:|---:|", *rows, "", f"Clock offsets found (µs): {offsets}; picture: {out}"])


def per_rank(trace: dict) -> list[tuple[float, float, float]]:
    """Each rank's medians (ms): a step's time outside its collectives, inside them, and whole."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    out = []
    for pid in sorted({e["pid"] for e in spans if e["pid"] > 0}):
        steps = [e for e in spans if e["pid"] == pid and e["name"].startswith("step ")]
        comms = [e for e in spans if e["pid"] == pid and e["tid"] == 2]
        parts = []
        for s in steps:
            inside = sum(c["dur"] for c in comms if s["ts"] <= c["ts"] and c["ts"] + c["dur"] <= s["ts"] + s["dur"])
            parts.append((s["dur"] - inside, inside, s["dur"]))
        out.append(tuple(statistics.median(p[i] for p in parts) / 1000 for i in range(3)))
    return out


def draw(trace: dict, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ranks = sorted({e["pid"] for e in spans if e["pid"] > 0})
    rows = [(0, 1, "driver: messages"), (0, 2, "driver: sends")]
    for pid in ranks:
        rows += [(pid, 1, f"rank {pid - 1}: steps"), (pid, 2, f"rank {pid - 1}: collectives")]
    colours = {"data wait": "tab:orange", "send": "tab:gray", "steps": "tab:gray"}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.2))
    start = min(e["ts"] for e in spans if e["pid"] > 0)
    for y, (pid, tid, _) in enumerate(rows):
        bars = [(e["ts"] - start, e["dur"], e["name"]) for e in spans if e["pid"] == pid and e["tid"] == tid
                and e["ts"] + e["dur"] >= start]
        for ts, dur, name in bars:
            colour = "tab:red" if tid == 2 and pid > 0 else colours.get(name.split(" ")[0] if pid == 0 else name,
                                                                        "tab:blue")
            ax.barh(len(rows) - 1 - y, max(dur, 1) / 1000, left=ts / 1000, height=0.7, color=colour,
                    edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for *_, label in reversed(rows)])
    ax.set_xlabel("ms (the driver's clock)")
    ax.set_title(title + ": steps blue, a batch's wait orange, collectives red, the driver's messages grey")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
