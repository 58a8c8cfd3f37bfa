"""Fusion: allreduce_coalesced of 256 x 1 KiB tensors vs 256 separate allreduces.

Two local gloo ranks (spawned). The separate allreduces are all launched
before any is waited on (their best case). Medians of interleaved rounds.
Goal (issue 4): >= 20x.

    python benchmarks/fusion.py [--reps 15] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

COUNT, ELEMENTS = 256, 256  # 256 float32 = 1 KiB each


def _rank(session: Any, reps: int) -> dict[str, list[float]]:
    import torch

    from asyncdist import wait_all

    tensors = [torch.ones(ELEMENTS) for _ in range(COUNT)]
    times: dict[str, list[float]] = {"separate": [], "coalesced": []}
    for r in range(reps + 2):
        for mode in ("separate", "coalesced") if r % 2 else ("coalesced", "separate"):
            session.barrier().wait()
            t0 = time.perf_counter()
            if mode == "separate":
                wait_all([session.allreduce(t) for t in tensors]).wait()
            else:
                session.allreduce_coalesced(tensors).wait()
            if r >= 2:
                times[mode].append(time.perf_counter() - t0)
    return times


def summarize(
    times: dict[str, list[float]], smoke: bool = False
) -> tuple[str, list[str], list[list[str]], dict[str, Any]]:
    """Rank 0's timings -> the table's title, columns and rows, and the JSON payload."""
    sep, coal = statistics.median(times["separate"]), statistics.median(times["coalesced"])
    ratio = sep / coal
    rows = [
        ["256 separate allreduces", f"{sep * 1e3:.2f}", "1.0x"],
        ["allreduce_coalesced", f"{coal * 1e3:.2f}", f"{ratio:.1f}x"],
        ["goal", "", _common.verdict(">= 20x", ratio >= 20, smoke)],
    ]
    payload = {
        "separate_s": sep,
        "coalesced_s": coal,
        "speedup": ratio,
        "goal": 20,
        "met": ratio >= 20,
        "smoke": smoke,
        "samples": times,
    }
    title = "fusion: 256 x 1 KiB, 2 gloo ranks (median of interleaved rounds)"
    return title, ["method", "ms", "speedup"], rows, payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="a smoke run: goals not judged")
    args = parser.parse_args(argv)
    import asyncdist

    times = asyncdist.spawn(_rank, 2, args=(args.reps,), timeout=300)[0]
    title, columns, rows, payload = summarize(times, args.smoke)
    return _common.publish("fusion", title, columns, rows, payload, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
