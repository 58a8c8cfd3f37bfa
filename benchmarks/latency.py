"""Latency: what awaiting a Handle costs against torch's own ``work.wait()``.

Two local gloo ranks (spawned) run, for each message size, interleaved rounds
of the same allreduce issued four ways:

* ``raw``: ``dist.all_reduce(t, async_op=True).wait()``
* ``wait``: ``session.allreduce(t).wait()``
* ``asyncio`` / ``trio``: ``await session.allreduce(t)`` under that loop

Each round times a batch of ops per method; the figure per method is the
median over rounds, and the ratio is method / raw. Goal (issue 4): <= 1.05x
for <= 64 KiB, <= 1.02x for >= 1 MiB.

    python benchmarks/latency.py [--rounds N] [--max-mib 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

SIZES = [4, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26]  # bytes
METHODS = ["raw", "wait", "asyncio", "trio"]


def _batch(session: Any, method: str, tensor: Any, count: int) -> float:
    import anyio
    import torch.distributed as dist

    group = session.group
    if method == "raw":
        t0 = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(tensor, group=group, async_op=True).wait()
        return (time.perf_counter() - t0) / count
    if method == "wait":
        t0 = time.perf_counter()
        for _ in range(count):
            session.allreduce(tensor).wait()
        return (time.perf_counter() - t0) / count

    async def run() -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            await session.allreduce(tensor)
        return (time.perf_counter() - t0) / count

    return float(anyio.run(run, backend=method))


def _rank(session: Any, rounds: int, sizes: list[int]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for size in sizes:
        tensor = torch.zeros(max(1, size // 4), dtype=torch.float32)
        count = max(2, min(200, (1 << 22) // max(size, 1)))
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        for method in METHODS:  # warm-up
            _batch(session, method, tensor, count)
        for r in range(rounds):
            order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
            for method in order:
                samples[method].append(_batch(session, method, tensor, count))
        out[str(size)] = samples
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--max-mib", type=float, default=64)
    args = parser.parse_args(argv)
    import asyncdist

    sizes = [s for s in SIZES if s <= args.max_mib * (1 << 20)]
    results = asyncdist.spawn(_rank, 2, args=(args.rounds, sizes), timeout=600)
    samples = results[0]
    rows, table = [], []
    for size in sizes:
        med = {m: _common.median(samples[str(size)][m]) for m in METHODS}
        ratios = {m: med[m] / med["raw"] for m in METHODS[1:]}
        goal = 1.05 if size <= 1 << 16 else 1.02 if size >= 1 << 20 else None
        rows.append({"bytes": size, "median_s": med, "ratio": ratios, "goal": goal})
        table.append(
            [_common.human_bytes(size), f"{med['raw'] * 1e6:.1f}"]
            + [f"{ratios[m]:.3f}" for m in METHODS[1:]]
            + ["-" if goal is None else f"<= {goal}"]
        )
    _common.print_table(
        "await vs raw work.wait(), 2 gloo ranks (median of interleaved rounds)",
        ["size", "raw µs", "wait ×", "asyncio ×", "trio ×", "goal"],
        table,
    )
    path = _common.write_json("latency", {"rounds": args.rounds, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
