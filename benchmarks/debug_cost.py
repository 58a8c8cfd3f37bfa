"""Debug mode's cost: a 1 KiB allreduce with debug=True vs without, per collective.

Two local gloo ranks; each round opens a session with debug off and one with
it on and times a batch of allreduces in each (medians of rounds).

    python benchmarks/debug_cost.py [--rounds 7]
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

OPS = 200


def _rank(session: Any, rounds: int) -> dict[str, list[float]]:
    import torch

    from asyncdist import DistSession

    session.close()  # measure in fresh sessions, with and without debug
    times: dict[str, list[float]] = {"off": [], "on": []}
    tensor = torch.ones(256)
    for r in range(rounds):
        for debug in (False, True) if r % 2 else (True, False):
            with DistSession(timeout=60, debug=debug) as s:
                s.allreduce(tensor).wait()
                t0 = time.perf_counter()
                for _ in range(OPS):
                    s.allreduce(tensor).wait()
                times["on" if debug else "off"].append((time.perf_counter() - t0) / OPS)
    return times


def summarize(
    times: dict[str, list[float]],
) -> tuple[str, list[str], list[list[str]], dict[str, Any]]:
    """Rank 0's timings -> the table's title, columns and rows, and the JSON payload."""
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    rows = [["off", f"{off * 1e6:.0f}", ""], ["on", f"{on * 1e6:.0f}", f"{(on - off) * 1e6:.0f}"]]
    payload = {"off_s": off, "on_s": on, "added_s": on - off, "samples": times}
    title = "debug=True: cost per collective (1 KiB allreduce, 2 gloo ranks)"
    return title, ["debug", "µs per allreduce", "added µs"], rows, payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    import asyncdist

    times = asyncdist.spawn(_rank, 2, args=(args.rounds,), timeout=300)[0]
    title, columns, rows, payload = summarize(times)
    return _common.publish("debug_cost", title, columns, rows, payload)


if __name__ == "__main__":
    sys.exit(main())
