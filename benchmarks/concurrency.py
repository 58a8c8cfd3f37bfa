"""Concurrency: a 4 B allreduce issued while a 64 MiB allreduce is in flight.

On the same lane (the session) the small op waits behind the bulk one; on a
channel of its own it runs beside it. Each latency is a ratio to the idle 4 B
latency; the bulk's throughput is compared with and without a stream of 4 B
ops on the channel alongside. Two ranks, interleaved repetitions, medians:
on loopback (two local gloo ranks) and, with root and ``tc``, on a
tbf-shaped veth link between two network namespaces. Goal (issue 12): own
channel <= 2x idle; bulk throughput kept >= 0.95.

    python benchmarks/concurrency.py [--reps 10] [--mib 64] [--no-shaped] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import _netns

GOAL_LATENCY, GOAL_THROUGHPUT = 2.0, 0.95


def _loopback(session: Any, options: dict[str, Any]) -> dict[str, Any]:
    import _shaped_worker
    import torch

    torch.set_num_threads(1)
    return dict(_shaped_worker.concurrency(session, options))


def _row(where: str, r: dict[str, Any]) -> list[str]:
    med = r["median_s"]
    return [
        where,
        f"{med['idle'] * 1e3:.2f}",
        f"{r['same_lane_x_idle']:.1f}×",
        f"{r['own_channel_x_idle']:.1f}×",
        f"{r['bulk_gbit_s']['alone']:.2f}",
        f"{r['bulk_throughput_kept']:.3f}",
    ]


def summarize(
    results: dict[str, Any], mib: int, smoke: bool = False
) -> tuple[str, list[str], list[list[str]], dict[str, Any]]:
    """Rank 0's figures per link -> the table's title, columns and rows, and
    the JSON summary (the worst link against the goals; ``smoke`` recorded)."""
    rows = [_row(where, r) for where, r in results.items()]
    worst_latency = max(r["own_channel_x_idle"] for r in results.values())
    worst_kept = min(r["bulk_throughput_kept"] for r in results.values())
    summary = {
        "own_channel_x_idle_worst": worst_latency,
        "bulk_throughput_kept_worst": worst_kept,
        "goals": {"own_channel_x_idle": GOAL_LATENCY, "bulk_throughput_kept": GOAL_THROUGHPUT},
        "met": worst_latency <= GOAL_LATENCY and worst_kept >= GOAL_THROUGHPUT,
        "smoke": smoke,
    }
    title = f"a 4 B allreduce while a {mib} MiB allreduce is in flight (2 gloo ranks)"
    columns = ["link", "idle ms", "same lane", "own channel", "bulk Gb/s", "bulk kept"]
    return title, columns, rows, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--no-shaped", action="store_true", help="loopback only")
    parser.add_argument("--smoke", action="store_true", help="a smoke run: goals not judged")
    args = parser.parse_args(argv)
    import asyncdist

    options = {"reps": args.reps, "mib": args.mib, "alongside": 20}
    results: dict[str, Any] = {
        "loopback": asyncdist.spawn(_loopback, 2, args=(options,), timeout=300)[0]
    }
    missing = "" if not args.no_shaped else "--no-shaped"
    missing = missing or _netns.require()
    if missing:
        print(f"concurrency: no shaped link ({missing}); loopback only", file=sys.stderr)
    else:
        with _netns.ShapedLink(args.rate) as link:
            results[f"shaped {args.rate}"] = link.run("concurrency", options)[0]
    title, columns, rows, summary = summarize(results, args.mib, args.smoke)
    return _common.publish(
        "concurrency", title, columns, rows, {"options": options, "links": results, **summary}
    )


if __name__ == "__main__":
    sys.exit(main())
