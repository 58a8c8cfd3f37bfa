"""Overlap: a 4 MiB allreduce hidden behind "device compute" of the same length.

Two ranks in two network namespaces joined by a tbf-shaped veth pair; the
"device compute" is a GIL-free sleep (the host idles, as while a GPU kernel
runs). Efficiency = (sequential - overlapped) / (sequential - max(comm, compute)),
medians of interleaved repetitions. Goal (issue 4): >= 0.95.

    python benchmarks/overlap.py [--rate 1gbit] [--reps 15]
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
            f"{r['comm_s'] * 1e3:.1f}",
            f"{r['compute_s'] * 1e3:.1f}",
            f"{r['sequential_s'] * 1e3:.1f}",
            f"{r['overlapped_s'] * 1e3:.1f}",
            f"{r['efficiency']:.3f}",
        ]
        for rank, r in enumerate(results)
    ]
    efficiency = min(r["efficiency"] for r in results)
    rows.append(["goal", "", "", "", "", _common.verdict(">= 0.95", efficiency >= 0.95, smoke)])
    columns = ["rank", "comm ms", "compute ms", "sequential ms", "overlapped ms", "efficiency"]
    return columns, rows, {"efficiency": efficiency, "goal": 0.95, "met": efficiency >= 0.95}


if __name__ == "__main__":
    sys.exit(_shaped_cli.main("overlap", __doc__ or "", {"mib": 4, "reps": 15}, summarize))
