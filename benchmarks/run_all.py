"""Run every benchmark, write JSON and plots under benchmarks/results/, print a summary.

    python benchmarks/run_all.py [--quick] [--only latency,fusion,...]
    asyncdist bench [--quick]          # the same
    nox -s bench                       # the same, in its own environment

The shaped-link benchmarks (overlap, bandwidth, ddp) need root, ``ip`` and
``tc``; without them they say so, the others still run, and the exit status
is non-zero. Nothing is faked.

Plots (latency, overlap, ddp) are drawn for the benchmarks this run ran,
with matplotlib, the ``bench`` extra (``pip install 'asyncdist[bench]'``);
without it they are skipped with a notice. ``--quick`` is a smoke run: its
tables show the goals without judging them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common  # noqa: E402
import bandwidth  # noqa: E402
import concurrency  # noqa: E402
import ddp  # noqa: E402
import debug_cost  # noqa: E402
import elastic  # noqa: E402
import fusion  # noqa: E402
import latency  # noqa: E402
import loop_stall  # noqa: E402
import overlap  # noqa: E402
import scaling  # noqa: E402
import threads  # noqa: E402

from asyncdist.__main__ import add_bench_arguments  # noqa: E402  (the options, defined once)

# name: (main, its arguments, its arguments under --quick, a smoke run)
SUITE = {
    "latency": (latency.main, ["--reps", "300"], ["--reps", "60", "--max-mib", "16", "--smoke"]),
    "fusion": (fusion.main, ["--reps", "15"], ["--reps", "5", "--smoke"]),
    "debug_cost": (debug_cost.main, ["--rounds", "7"], ["--rounds", "3"]),
    "loop_stall": (loop_stall.main, ["--rounds", "3"], ["--rounds", "1"]),
    "threads": (threads.main, ["--idle", "3"], ["--idle", "0.5"]),
    "scaling": (
        scaling.main,
        ["--rounds", "5"],
        [
            "--world-sizes=2",
            "--rounds=2",
            "--reps=1",
            "--bursts=100,1000",
            "--handles=1000",
            "--memory=100,1000",
            "--smoke",
        ],
    ),
    "concurrency": (
        concurrency.main,
        ["--reps", "10"],
        ["--reps", "4", "--no-shaped", "--smoke"],
    ),
    "overlap": (
        lambda a: _shaped(overlap, "overlap", {"mib": 4, "reps": 15}, a),
        ["--reps", "15"],
        ["--reps", "5", "--smoke"],
    ),
    "bandwidth": (
        lambda a: _shaped(bandwidth, "bandwidth", {"mib": 64, "reps": 5}, a),
        ["--reps", "5"],
        ["--reps", "3", "--smoke"],
    ),
    "ddp": (
        lambda a: _shaped(ddp, "ddp", ddp.OPTIONS, a),
        ["--reps", "12"],
        ["--reps", "4", "--smoke"],
    ),
    "elastic": (elastic.main, ["--rounds", "5"], ["--rounds", "1", "--smoke"]),
}

BENCH_EXTRA = "pip install 'asyncdist[bench]'"
SMOKE_NOTE = "smoke run (--quick): the figures are not comparable with the goals"


def _shaped(module: object, name: str, options: dict[str, object], argv: list[str]) -> int:
    import _shaped_cli

    return _shaped_cli.main(name, module.__doc__ or "", options, module.summarize, argv)  # type: ignore[attr-defined]


def plot(ran: list[str]) -> list[Path]:
    """The plots of the benchmarks in ``ran`` (results of this run only):
    latency ratios by size, one overlapped step's timeline, ddp's step-time
    breakdown.

    Raises:
        ImportError: matplotlib is not installed (the ``bench`` extra).
    """
    drawn = [name for name in ("latency", "overlap", "ddp") if name in ran]
    if not drawn:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "latency" in drawn:
        written.append(
            plot_latency(plt, json.loads((_common.RESULTS / "latency.json").read_text()))
        )
    if "overlap" in drawn:
        written.append(
            plot_overlap(plt, json.loads((_common.RESULTS / "overlap.json").read_text()))
        )
    if "ddp" in drawn:
        data = json.loads((_common.RESULTS / "ddp.json").read_text())
        if "configs" in data["ranks"][0]:
            written.append(plot_ddp(plt, data))
            written.append(plot_sweep(plt, data))
    return written


def _save(plt: Any, fig: Any, name: str) -> Path:
    """Lay out ``fig``, write it under the results folder, and let it go."""
    fig.tight_layout()
    path = _common.RESULTS / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency(plt: Any, data: dict[str, Any]) -> Path:
    """Each waiting method's time over raw ``work.wait()``, per message size."""
    rows = data["rows"]
    labels = [_common.human_bytes(r["bytes"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.25
    for i, method in enumerate(("wait", "asyncio", "trio")):
        ax.bar(
            [x + (i - 1) * width for x in range(len(rows))],
            [r["ratio"][method] for r in rows],
            width,
            label=f"{method} / raw",
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.05, color="grey", linestyle="--", linewidth=0.8, label="goal <= 64 KiB")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("time / raw work.wait()")
    ax.set_title("allreduce latency, 2 gloo ranks (median per op)")
    ax.legend(fontsize=8)
    return _save(plt, fig, "latency.png")


def plot_overlap(plt: Any, data: dict[str, Any]) -> Path:
    """Rank 0's step: communication and compute sequential, then overlapped."""
    tl = data["ranks"][0]["timeline"]
    comm = data["ranks"][0]["comm_s"]
    seq = data["ranks"][0]["sequential_s"]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ms = 1e3
    ax.broken_barh(
        [(0, comm * ms), (comm * ms, (seq - comm) * ms)],
        (20, 8),
        facecolors=("tab:blue", "tab:orange"),
    )
    ax.broken_barh([(0, tl["comm_done"] * ms)], (9, 4), facecolors="tab:blue")
    ax.broken_barh(
        [(tl["compute_start"] * ms, (tl["compute_end"] - tl["compute_start"]) * ms)],
        (5, 4),
        facecolors="tab:orange",
    )
    ax.set_yticks([9, 24], ["overlapped", "sequential"])
    ax.set_xlabel(
        "ms from launch (blue: 4 MiB allreduce on a 1 Gbit/s link; orange: device compute)"
    )
    ax.set_title(f"one step, rank 0: efficiency {data['efficiency']:.2f}")
    return _save(plt, fig, "overlap_timeline.png")


def plot_ddp(plt: Any, data: dict[str, Any]) -> Path:
    """Rank 0's step-time breakdown per arm on the headline configuration:
    backward, exposed communication and optimizer stacked (their sum is the
    step), communication alone beside."""
    import ddp

    rank0 = data["ranks"][0]["configs"][0]
    arms = [arm for arm in ddp.LABELS if arm in rank0["breakdown"]]
    ms = 1e3
    fig, ax = plt.subplots(figsize=(8, 4.6))
    y = list(range(len(arms)))[::-1]
    left = [0.0] * len(arms)
    parts = (
        ("backward", "backward (fwd+bwd)", "tab:orange"),
        ("exposed_comm", "exposed communication", "tab:blue"),
        ("optimizer", "optimizer (Adam)", "tab:green"),
    )
    for key, label, color in parts:
        width = [rank0["breakdown"][arm][key] * ms for arm in arms]
        ax.barh(y, width, left=left, height=0.55, color=color, label=label)
        left = [a + b for a, b in zip(left, width, strict=True)]
    comm = [rank0["breakdown"][arm]["communication"] * ms for arm in arms]
    ax.barh(
        [v - 0.38 for v in y],
        comm,
        height=0.15,
        color="tab:blue",
        alpha=0.45,
        label="communication alone (on the wire)",
    )
    for v, arm in zip(y, arms, strict=True):
        step = rank0["median_s"][arm] * ms
        ax.text(
            step + 3,
            v,
            f"{step:.0f} ms  ({rank0['ratio_vs_ddp'][arm]:.2f}x DDP)",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(y, [ddp.LABELS[arm] for arm in arms], fontsize=8)
    ax.set_xlabel(f"ms per step, rank 0 (medians), {data['rate']} shaped link, 2 ranks")
    ax.set_xlim(0, max(left) * 1.35)
    ax.set_title(f"where a training step's time goes ({ddp.name(rank0['config'])})")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.16), ncol=2)
    return _save(plt, fig, "ddp_breakdown.png")


def plot_sweep(plt: Any, data: dict[str, Any]) -> Path:
    """Each configuration's step time over DDP's, per arm (the worse rank)."""
    import ddp

    configs = ddp.per_config(data["ranks"])
    arms = (
        ("sync", "gradient_sync", "tab:blue"),
        ("sync_step", "+ step overlap", "tab:green"),
        ("sync_bf16", "+ bf16", "tab:orange"),
        ("sync_both", "+ overlap + bf16", "tab:red"),
        ("ddp_bf16", "DDP + bf16 hook", "tab:grey"),
    )
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.16
    for i, (arm, label, color) in enumerate(arms):
        ax.bar(
            [x + (i - 2) * width for x in range(len(configs))],
            [c["ratio"][arm] for c in configs],
            width,
            label=label,
            color=color,
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(ddp.GOALS["sync"], color="tab:blue", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(configs)), [c["name"] for c in configs], rotation=35, fontsize=8)
    ax.set_ylabel("step time ÷ DDP's")
    ax.set_title(f"step time over DDP's, 2 ranks, {data['rate']} shaped link")
    ax.set_ylim(0, 1.3)
    ax.legend(fontsize=7, ncol=5, loc="upper center")
    return _save(plt, fig, "ddp_sweep.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    return run(add_bench_arguments(parser).parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run ``args.only`` (``--quick``: fewer repetitions); ``asyncdist bench`` calls this."""
    status = {}
    for name in args.only:
        bench, full, quick = SUITE[name]
        print(f"\n== {name}")
        status[name] = bench(quick if args.quick else full)
    try:
        written = plot([name for name, code in status.items() if code == 0])
    except ImportError as exc:  # matplotlib, from the bench extra
        print(f"\nplots skipped: {exc.name or 'matplotlib'} is not installed ({BENCH_EXTRA})")
    else:
        for path in written:
            print(f"wrote {path}")
    if args.quick:
        print(SMOKE_NOTE)
    failed = [n for n, code in status.items() if code]
    if failed:
        print(f"could not run: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
