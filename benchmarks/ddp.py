"""DDP: step time of gradient_sync vs torch DistributedDataParallel vs the seed's way.

The seed's way is DI-engine's helper: backward, then a blocking allreduce per
gradient. An MLP (4 x 1024 wide, ~4.2 M parameters) trains on two ranks in
two namespaces over a tbf-shaped link; the three methods alternate step by
step (medians). Goals (issue 4): asyncdist / DDP <= 1.00, and a speedup over
the seed's way at least DDP's.

    python benchmarks/ddp.py [--rate 1gbit] [--reps 10]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _shaped_cli


def summarize(
    results: list[dict[str, Any]], opts: dict[str, Any]
) -> tuple[list[str], list[list[str]], dict[str, Any]]:
    r = results[0]
    med = r["median_s"]
    ratio = max(x["ratio_vs_ddp"] for x in results)
    ours = min(x["speedup_over_seed"]["asyncdist"] for x in results)
    theirs = max(x["speedup_over_seed"]["ddp"] for x in results)
    rows = [
        [
            "asyncdist gradient_sync",
            f"{med['asyncdist'] * 1e3:.0f}",
            f"{ratio:.3f}",
            f"{ours:.2f}x",
        ],
        ["torch DDP", f"{med['ddp'] * 1e3:.0f}", "1.000", f"{theirs:.2f}x"],
        [
            "seed: backward, then allreduce each grad",
            f"{med['seed'] * 1e3:.0f}",
            f"{med['seed'] / med['ddp']:.3f}",
            "1.00x",
        ],
        ["compute alone (fwd+bwd)", f"{r['compute_s'] * 1e3:.0f}", "", ""],
    ]
    met = ratio <= 1.0 and ours >= theirs
    rows.append(
        [
            "goal",
            "",
            f"<= 1.00 {'ok' if ratio <= 1.0 else 'MISSED'}",
            f">= DDP's {'ok' if ours >= theirs else 'MISSED'}",
        ]
    )
    return (
        ["method", "step ms (median)", "÷ DDP", "speedup over seed"],
        rows,
        {"ratio_vs_ddp": ratio, "speedup_asyncdist": ours, "speedup_ddp": theirs, "met": met},
    )


OPTIONS = {
    "width": 1024,
    "depth": 4,
    "batch": 64,
    "bucket_mb": 4.0,
    "first_bucket_mb": 1.0,
    "reps": 10,
}

if __name__ == "__main__":
    sys.exit(_shaped_cli.main("ddp", __doc__ or "", OPTIONS, summarize))
