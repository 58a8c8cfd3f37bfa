"""Shared helpers for the benchmark scripts: medians, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(os.environ.get("ASYNCDIST_BENCH_OUT", Path(__file__).parent / "results"))


def median(values: list[float]) -> float:
    return statistics.median(values)


def timed_calls(
    parts: dict[str, float],
    name: str,
    fn: Callable[..., Any],
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[..., Any]:
    """``fn``, wrapped to add each call's time by ``clock`` to ``parts[name]``
    (from 0; clear or reset ``parts`` to start a new tally)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name] = parts.get(name, 0.0) + clock() - t0

    return wrapper


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError


def write_json(name: str, payload: dict[str, Any]) -> Path:
    import torch

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    meta = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    path.write_text(json.dumps({"meta": meta, **payload}, indent=2))
    return path


SMOKE_CAPTION = "smoke run (--quick): goals shown, not judged"


def judged(met: bool, smoke: bool) -> str:
    """ "ok" or "MISSED"; nothing on a smoke run, whose few repetitions cannot
    tell a miss from noise."""
    return "" if smoke else "ok" if met else "MISSED"


def verdict(goal: str, met: bool, smoke: bool) -> str:
    """A goal's table cell: the goal and ``judged``'s word (the goal alone on a smoke run)."""
    return f"{goal} {judged(met, smoke)}".rstrip()


def table(title: str, columns: list[str], rows: list[list[str]], *, smoke: bool = False) -> Any:
    """A rich Table of right-aligned columns; a smoke run's says so in its caption.

    Keep titles, headers and cells short enough for the whole table to fit
    80 columns (tests/test_cli.py renders every benchmark's table at that
    width): rich shortens a cell that does not fit to "…", hiding figures.
    """
    from rich.table import Table

    out = Table(title=title, caption=SMOKE_CAPTION if smoke else None)
    for column in columns:
        out.add_column(column, justify="right")
    for row in rows:
        out.add_row(*row)
    return out


def print_table(
    title: str, columns: list[str], rows: list[list[str]], *, smoke: bool = False
) -> None:
    from rich.console import Console

    Console().print(table(title, columns, rows, smoke=smoke))


def publish(
    name: str,
    title: str,
    columns: list[str],
    rows: list[list[str]],
    payload: dict[str, Any],
    *,
    smoke: bool = False,
) -> int:
    """Print a benchmark's table, write its JSON under ``RESULTS`` and say
    where; the exit status of a run that completed (0)."""
    print_table(title, columns, rows, smoke=smoke)
    print(f"wrote {write_json(name, payload)}")
    return 0
