"""What a session and each channel cost a process at rest: OS threads and idle CPU.

Two local gloo ranks. Per process (rank 0's figures; the ranks are alike):
the threads of the process and its CPU use while nothing is issued, for a
session, with 1 and 4 channels, and with debug mode; beside them one raw
``torch.distributed.new_group`` (what a channel's own group costs in torch
itself: gloo's two worker threads and its TCP loop).

    python benchmarks/threads.py [--idle 2] [--channels 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common


def threads() -> int:
    """The OS threads of this process (gloo's included, not only Python's)."""
    return len(os.listdir("/proc/self/task"))


def idle_cpu(seconds: float) -> float:
    """The share of one core this process used while idle for ``seconds``
    (after half a second to settle: forming a group finishes in the background)."""
    time.sleep(0.5)
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return (time.process_time() - cpu) / (time.monotonic() - wall)


def _measure(label: str, idle: float, rows: list[dict[str, Any]], base: int) -> None:
    count = threads()
    rows.append({"setup": label, "threads": count, "added": count - base, "cpu": idle_cpu(idle)})


def _rank(session: Any, idle: float, channels: int) -> list[dict[str, Any]]:
    import datetime

    import torch
    import torch.distributed as dist

    from asyncdist import DistSession

    torch.set_num_threads(1)
    session.close()  # measure fresh sessions, one setup at a time
    rows: list[dict[str, Any]] = []
    base = threads()
    _measure("process, no session", idle, rows, base)
    for debug in (False, True):
        mode = ", debug" if debug else ""
        with DistSession(timeout=60, debug=debug) as s:
            s.allreduce(torch.ones(1)).wait()  # formed and used once
            _measure(f"session{mode}", idle, rows, base)
            formed = 0
            for wanted in (1, channels):
                while formed < wanted:
                    s.channel(f"c{formed}").allreduce(torch.ones(1)).wait()
                    formed += 1
                _measure(f"+ {formed} channel{'s' if formed > 1 else ''}{mode}", idle, rows, base)
            if not debug:
                before = threads()
                group = dist.new_group(
                    list(range(s.world_size)),
                    timeout=datetime.timedelta(seconds=60),
                    use_local_synchronization=True,
                )
                dist.all_reduce(torch.ones(1), group=group)
                raw = threads() - before
                rows.append({"setup": "one raw new_group", "threads": None, "added": raw})
                dist.destroy_process_group(group)
    return rows


def summarize(
    rows: list[dict[str, Any]], channels: int
) -> tuple[str, list[str], list[list[str]], dict[str, Any]]:
    """Rank 0's rows -> the table's title, columns and rows, and the JSON payload."""
    by = {row["setup"]: row for row in rows}
    session = by["session"]["threads"]
    per_channel = (by[f"+ {channels} channels"]["threads"] - session) / channels
    table = [
        [
            row["setup"],
            "" if row["threads"] is None else str(row["threads"]),
            f"{row['added']:+d}",
            "" if "cpu" not in row else f"{row['cpu'] * 100:.2f}",
        ]
        for row in rows
    ]
    payload = {
        "rows": rows,
        "threads_per_channel": per_channel,
        "raw_group_threads": by["one raw new_group"]["added"],
        "session_idle_cpu": by["session"]["cpu"],
    }
    title = f"At rest, per process: {per_channel:g} threads per channel"
    return title, ["setup", "threads", "vs bare", "idle CPU %"], table, payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--idle", type=float, default=2.0, help="seconds idle per setup")
    parser.add_argument("--channels", type=int, default=4)
    args = parser.parse_args(argv)
    import asyncdist

    rows = asyncdist.spawn(_rank, 2, args=(args.idle, args.channels), timeout=300)[0]
    title, columns, table, payload = summarize(rows, args.channels)
    _common.print_table(title, columns, table)
    path = _common.write_json("threads", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
