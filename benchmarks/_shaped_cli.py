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
    summarize: Callable[
        [list[dict[str, Any]], dict[str, Any]], tuple[list[str], list[list[str]], dict[str, Any]]
    ],
    argv: list[str] | None = None,
) -> int:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", choices=sorted(RATES))
    parser.add_argument("--reps", type=int, default=options.get("reps", 10))
    args = parser.parse_args(argv)
    missing = _netns.require()
    if missing:
        print(f"{name}: cannot shape a link here: {missing}", file=sys.stderr)
        return 3
    opts = dict(options, reps=args.reps, rate_bits=RATES[args.rate])
    with _netns.ShapedLink(args.rate) as link:
        results = link.run(name, opts)
    columns, rows, summary = summarize(results, opts)
    _common.print_table(
        f"{name}: 2 ranks, two namespaces, veth shaped to {args.rate} (tbf)", columns, rows
    )
    path = _common.write_json(
        name, {"rate": args.rate, "options": opts, "ranks": results, **summary}
    )
    print(f"wrote {path}")
    return 0
