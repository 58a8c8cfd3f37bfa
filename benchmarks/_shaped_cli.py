"""Shared main() of the shaped-link benchmarks: check the machine, run, print, save."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import _common
import _netns

RATES = {"1gbit": 1e9, "2gbit": 2e9, "500mbit": 5e8, "100mbit": 1e8}


def main(
    name: str,
    doc: str,
    options: dict[str, Any],
    summarize: Callable[..., tuple[list[str], list[list[str]], dict[str, Any]]],
    argv: list[str] | None = None,
) -> int:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", choices=sorted(RATES))
    parser.add_argument("--reps", type=int, default=options.get("reps", 10))
    parser.add_argument("--smoke", action="store_true", help="a smoke run: goals not judged")
    args = parser.parse_args(argv)
    missing = _netns.require()
    if missing:
        print(f"{name}: cannot shape a link here: {missing}", file=sys.stderr)
        return 3
    opts = dict(options, reps=args.reps, rate_bits=RATES[args.rate], smoke=args.smoke)
    with _netns.ShapedLink(args.rate) as link:
        results = link.run(name, opts)
    columns, rows, summary = summarize(results, opts, smoke=args.smoke)
    _common.print_table(title(name, args.rate), columns, rows, smoke=args.smoke)
    path = _common.write_json(
        name,
        {"rate": args.rate, "options": opts, "ranks": results, "smoke": args.smoke, **summary},
    )
    print(f"wrote {path}")
    return 0


def title(name: str, rate: str) -> str:
    """The title of a shaped-link benchmark's table."""
    return f"{name}: 2 ranks, two namespaces, veth shaped to {rate} (tbf)"
