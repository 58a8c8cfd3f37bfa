"""Bandwidth: a 64 MiB allreduce against the line-rate bound 2(n-1)/n * size / rate.

Two ranks in two network namespaces joined by a tbf-shaped veth pair.
Goal (issue 4): >= 0.90 of line rate.

    python benchmarks/bandwidth.py [--rate 1gbit] [--reps 5]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import _shaped_cli


def summarize(
    results: list[dict[str, Any]], opts: dict[str, Any], smoke: bool = False
) -> tuple[list[str], list[list[str]], dict[str, Any]]:
    rows = [
        [
            str(rank),
            f"{r['bytes'] / 2**20:.0f} MiB",
            f"{r['median_s'] * 1e3:.0f}",
            f"{r['bound_s'] * 1e3:.0f}",
            f"{r['efficiency']:.3f}",
        ]
        for rank, r in enumerate(results)
    ]
    efficiency = min(r["efficiency"] for r in results)
    rows.append(["goal", "", "", "", _common.verdict(">= 0.90", efficiency >= 0.9, smoke)])
    return (
        ["rank", "size", "median ms", "line-rate bound ms", "fraction of line rate"],
        rows,
        {"efficiency": efficiency, "goal": 0.90, "met": efficiency >= 0.9},
    )


if __name__ == "__main__":
    sys.exit(_shaped_cli.main("bandwidth", __doc__ or "", {"mib": 64, "reps": 5}, summarize))
