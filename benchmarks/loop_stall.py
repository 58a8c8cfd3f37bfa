"""Longest event-loop stall during calls that wait for a late peer.

Two local gloo ranks under asyncio. For each call, rank 1 joins it ``--late``
seconds after rank 0, while rank 0 runs a ticker task (5 ms sleeps) and
records the longest gap between ticks beyond the sleep: that is how long the
loop was held. Each call is made the way async code can make it with the
installed asyncdist: its async form where there is one (``split_async``,
``broadcast_parameters_async``, ``async with s.trace(...)``), else the sync
form. A stall near ``--late`` means the call blocked the loop until the peer
came; a few milliseconds mean it did not.

    python benchmarks/loop_stall.py [--late 1.0] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

TICK = 0.005
CASES = [
    "session entry",
    "split",
    "broadcast_parameters",
    "trace exit",
    "debug-mode collective",
    "object collective",
]


async def _measure(call: Any) -> float:
    """Run ``await call()`` beside a ticker; the loop's longest stall (s)."""
    import anyio

    longest = 0.0

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while True:
            await anyio.sleep(TICK)
            now = time.perf_counter()
            longest = max(longest, now - last - TICK)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(2 * TICK)  # the ticker runs before the call starts
        await call()
        tg.cancel_scope.cancel()
    return longest


async def _case(session: Any, case: str, late: float) -> float:
    import anyio
    import torch

    from asyncdist import DistSession

    rank = session.rank
    session.close()  # each case runs in fresh sessions
    if case == "session entry":
        if rank == 1:
            await anyio.sleep(late)
        entered: list[Any] = []

        async def enter() -> None:
            entered.append(await DistSession(timeout=60).__aenter__())

        stall = await _measure(enter)
        await entered[0].__aexit__(None, None, None)
        return stall
    async with DistSession(timeout=60, debug=case == "debug-mode collective") as s:
        if rank == 1:
            await anyio.sleep(late)  # only rank 0 is measured
        if case == "split":

            async def call() -> None:
                sub = await s.split_async(2) if hasattr(s, "split_async") else s.split(2)
                sub.close()

        elif case == "broadcast_parameters":
            sync = s.gradient_sync(torch.nn.Linear(64, 64))

            async def call() -> None:
                if hasattr(sync, "broadcast_parameters_async"):
                    await sync.broadcast_parameters_async()
                else:
                    sync.broadcast_parameters()

        elif case == "trace exit":
            path = Path(tempfile.mkdtemp()) / "trace.json"

            async def call() -> None:
                block = s.trace(path)
                if hasattr(block, "__aenter__"):
                    async with block:
                        pass
                else:
                    with block:
                        pass

        elif case == "debug-mode collective":

            async def call() -> None:
                await s.allreduce(torch.ones(4))

        else:

            async def call() -> None:
                await s.broadcast_object({"step": 1}, src=1)

        stall = await _measure(call) if rank == 0 else (await call(), 0.0)[1]
    return stall


def summarize(
    stalls: dict[str, list[float]], late: float, rounds: int, version: str
) -> tuple[str, list[str], list[list[str]]]:
    """The stalls per call (s) -> the table's title, columns and rows."""
    rows = [
        [case, f"{max(values) * 1e3:.1f}", f"{_common.median(values) * 1e3:.1f}"]
        for case, values in stalls.items()
    ]
    title = (
        f"longest event-loop stall while the peer is {late:g} s late "
        f"(asyncdist {version}, {rounds} rounds)"
    )
    return title, ["call", "max stall (ms)", "median (ms)"], rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--late", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    import asyncdist

    stalls: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            result = asyncdist.spawn(_case, 2, args=(case, args.late), timeout=60)
            stalls[case].append(result[0])
    title, columns, rows = summarize(stalls, args.late, args.rounds, asyncdist.__version__)
    return _common.publish(
        "loop_stall", title, columns, rows, {"late_s": args.late, "stalls_s": stalls}
    )


if __name__ == "__main__":
    sys.exit(main())
