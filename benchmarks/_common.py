"""Shared helpers for the benchmark scripts: medians, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(os.environ.get("ASYNCDIST_BENCH_OUT", Path(__file__).parent / "results"))


def median(values: list[float]) -> float:
    return statistics.median(values)


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


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
