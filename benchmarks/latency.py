"""Latency: what awaiting a Handle costs against torch's own ``work.wait()``.

Two local gloo ranks (spawned) run, for each message size, interleaved rounds
of the same allreduce issued four ways:

* ``raw``: ``dist.all_reduce(t, async_op=True).wait()``
* ``wait``: ``session.allreduce(t).wait()``
* ``asyncio`` / ``trio``: ``await session.allreduce(t)`` under that loop

Methods alternate op by op (rotating order) inside one event loop per
backend; each op is timed alone and the figure is the per-op median, the
ratio method / raw from the same run. Goal (issue 4): <= 1.05x
for <= 64 KiB, <= 1.02x for >= 1 MiB.

A second table prices awaiting a handle that is already done, per loop:
``h.wait()``, ``await h`` and a bare ``anyio.lowlevel.checkpoint()``, in
interleaved batches (one op is too short to time alone). On trio every
``await h`` is a checkpoint (issue 23), so there it costs about one
checkpoint more than ``wait()``; on asyncio a done handle does not yield.

    python benchmarks/latency.py [--reps N] [--max-mib 64] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

SIZES = [4, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26]  # bytes


def _rank(session: Any, reps: int, sizes: list[int]) -> dict[str, Any]:
    """Per size, per loop: ``reps`` rounds of raw / wait / await, one op each,
    in rotating order; every op timed on its own (medians resist noise)."""
    import anyio
    import anyio.lowlevel
    import torch
    import torch.distributed as dist

    group = session.group

    async def measure(tensor: Any, count: int) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {"raw": [], "wait": [], "await": []}
        clock = time.perf_counter
        for r in range(count):
            for k in range(3):
                method = ("raw", "wait", "await")[(r + k) % 3]
                t0 = clock()
                if method == "raw":
                    dist.all_reduce(tensor, group=group, async_op=True).wait()
                elif method == "wait":
                    session.allreduce(tensor).wait()
                else:
                    await session.allreduce(tensor)
                times[method].append(clock() - t0)
        return times

    async def measure_done(handle: Any, batches: int, ops: int) -> dict[str, list[float]]:
        methods = ("wait", "await", "yield")
        times: dict[str, list[float]] = {m: [] for m in methods}
        clock, checkpoint = time.perf_counter, anyio.lowlevel.checkpoint
        for r in range(batches):
            for k in range(3):
                method = methods[(r + k) % 3]
                t0 = clock()
                if method == "wait":
                    for _ in range(ops):
                        handle.wait()
                elif method == "await":
                    for _ in range(ops):
                        await handle
                else:
                    for _ in range(ops):
                        await checkpoint()
                times[method].append((clock() - t0) / ops)
        return times

    out: dict[str, Any] = {}
    for size in sizes:
        tensor = torch.zeros(max(1, size // 4), dtype=torch.float32)
        count = max(5, min(reps, (reps << 20) // max(size, 1)))
        out[str(size)] = {}
        for backend in ("asyncio", "trio"):
            anyio.run(measure, tensor, 3, backend=backend)  # warm-up
            out[str(size)][backend] = anyio.run(measure, tensor, count, backend=backend)
    done = session.allreduce(torch.zeros(1))
    done.wait()
    batches = max(10, reps // 3)
    out["done"] = {}
    for backend in ("asyncio", "trio"):
        anyio.run(measure_done, done, 2, DONE_OPS, backend=backend)  # warm-up
        out["done"][backend] = anyio.run(measure_done, done, batches, DONE_OPS, backend=backend)
    return out


DONE_OPS = 200  # awaits of a done handle per timed batch


def summarize_done(
    results: dict[str, Any],
) -> tuple[str, list[str], list[list[str]], list[dict[str, Any]]] | None:
    """Rank 0's timings of a done handle, per loop -> the second table's
    title, columns and rows, and its JSON rows (None if not measured)."""
    if "done" not in results:
        return None
    rows, table = [], []
    for backend, runs in results["done"].items():
        med = {method: _common.median(times) for method, times in runs.items()}
        ratio = med["await"] / med["wait"]
        rows.append({"loop": backend, "median_s": med, "await_x_wait": ratio})
        table.append(
            [backend]
            + [f"{med[m] * 1e6:.2f}" for m in ("wait", "await", "yield")]
            + [f"{ratio:.2f}"]
        )
    return (
        "a done handle: per-op medians, interleaved batches",
        ["loop", "wait() µs", "await µs", "checkpoint µs", "await/wait ×"],
        table,
        rows,
    )


def summarize(
    results: dict[str, Any], sizes: list[int], smoke: bool = False
) -> tuple[str, list[str], list[list[str]], list[dict[str, Any]]]:
    """Rank 0's timings per size -> the table's title, columns and rows, and
    the JSON rows (medians, ratios to raw, goal met)."""
    rows, table = [], []
    for size in sizes:
        runs = results[str(size)]
        med = {
            "raw": _common.median(runs["asyncio"]["raw"] + runs["trio"]["raw"]),
            "wait": _common.median(runs["asyncio"]["wait"] + runs["trio"]["wait"]),
            "asyncio": _common.median(runs["asyncio"]["await"]),
            "trio": _common.median(runs["trio"]["await"]),
        }
        raw = {
            "wait": med["raw"],
            "asyncio": _common.median(runs["asyncio"]["raw"]),
            "trio": _common.median(runs["trio"]["raw"]),
        }
        ratios = {m: med[m] / raw[m] for m in ("wait", "asyncio", "trio")}
        goal = 1.05 if size <= 1 << 16 else 1.02 if size >= 1 << 20 else None
        met = goal is None or max(ratios.values()) <= goal
        rows.append({"bytes": size, "median_s": med, "ratio": ratios, "goal": goal, "met": met})
        table.append(
            [_common.human_bytes(size), f"{med['raw'] * 1e6:.0f}"]
            + [f"{ratios[m]:.3f}" for m in ("wait", "asyncio", "trio")]
            + ["-" if goal is None else _common.verdict(f"<= {goal}", met, smoke)]
        )
    return (
        "allreduce: asyncdist / raw work.wait(), 2 gloo ranks, per-op medians (interleaved)",
        ["size", "raw µs", "wait ×", "asyncio ×", "trio ×", "goal"],
        table,
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reps", type=int, default=300, help="ops per method and size (fewer for big sizes)"
    )
    parser.add_argument("--max-mib", type=float, default=64)
    parser.add_argument("--smoke", action="store_true", help="a smoke run: goals not judged")
    args = parser.parse_args(argv)
    import asyncdist

    sizes = [s for s in SIZES if s <= args.max_mib * (1 << 20)]
    results = asyncdist.spawn(_rank, 2, args=(args.reps, sizes), timeout=600)
    title, columns, table, rows = summarize(results[0], sizes, args.smoke)
    _common.print_table(title, columns, table, smoke=args.smoke)
    payload: dict[str, Any] = {"reps": args.reps, "smoke": args.smoke, "rows": rows}
    done = summarize_done(results[0])
    if done is not None:
        title, columns, table, payload["done_handle"] = done
        _common.print_table(title, columns, table)
    path = _common.write_json("latency", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
