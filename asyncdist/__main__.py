"""The asyncdist command: demo, info, bench and coordinator.

Plain text on purpose: this docstring is ``asyncdist --help``'s description.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from ._version import __version__

# benchmarks/run_all.py's suite, in the order it runs (tests check that the two agree)
BENCHMARKS = (
    "latency",
    "fusion",
    "debug_cost",
    "loop_stall",
    "threads",
    "scaling",
    "concurrency",
    "overlap",
    "bandwidth",
    "ddp",
    "elastic",
)


def _benchmark_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}"
        )
    return names or list(BENCHMARKS)


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``asyncdist bench`` and ``benchmarks/run_all.py``, defined
    once for both: ``--quick`` and ``--only NAMES`` (parsed to a list of names)."""
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument(
        "--only",
        type=_benchmark_names,
        default=list(BENCHMARKS),
        metavar="NAMES",
        help="comma-separated subset of " + ", ".join(BENCHMARKS) + " (default: all)",
    )
    return parser


def _demo(args: argparse.Namespace) -> int:
    from . import _demo
    from ._session import GRADIENTS
    from ._spawn import spawn

    if args.steps < 6:
        raise SystemExit("asyncdist demo: --steps must be at least 6")
    _demo.starting(args.world_size, args.backend)
    results = spawn(
        _demo.train,
        args.world_size,
        args=(args.steps, args.bucket_mb),
        backend=args.backend,
        timeout=120,
        channels=[GRADIENTS],  # gradient_sync's channel, formed on entry, off the loop
    )
    _demo.report(results[0])
    return 0


def _info(args: argparse.Namespace) -> int:
    import anyio
    import torch
    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table

    from . import __version__
    from ._env import choose_backend, choose_device, detect
    from .errors import AsyncDistError

    table = Table(title="what DistSession() would do here", show_header=False)
    table.add_column("key")
    table.add_column("value")
    try:
        env = detect()
        device = choose_device(None, None, env.local_rank)
        backend = choose_backend(None, device)
        where = (
            f"{env.master_addr}:{env.master_port}"
            if env.master_port
            else ("127.0.0.1 (loopback only), port from the OS")
        )
        rows = [
            ("launcher", env.launcher),
            ("rank / world size", f"{env.rank} / {env.world_size}"),
            ("local rank", str(env.local_rank)),
            ("master", where),
            ("store", "launcher agent's" if env.agent_store else "hosted by rank 0"),
            ("backend", backend),
            ("device", str(device)),
        ]
    except (AsyncDistError, ValueError) as exc:
        rows = [("environment", f"[red]{exc}[/]")]
    rows += [
        ("asyncdist", __version__),
        ("torch", torch.__version__),
        ("anyio", anyio.__version__ if hasattr(anyio, "__version__") else _version("anyio")),
        ("gloo / nccl available", f"{dist.is_gloo_available()} / {dist.is_nccl_available()}"),
        ("CUDA devices", str(torch.cuda.device_count())),
        ("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "(unset)")),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
    return 0


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _benchmarks_dir() -> Path | None:
    for candidate in (
        Path.cwd() / "benchmarks",
        Path(__file__).resolve().parent.parent / "benchmarks",
    ):
        if (candidate / "run_all.py").is_file():
            return candidate
    return None


def _bench(args: argparse.Namespace) -> int:
    where = _benchmarks_dir()
    if where is None:
        print(
            "asyncdist bench: no benchmarks/ directory here; run it from a clone of the "
            "asyncdist repository",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(where))
    spec = importlib.util.spec_from_file_location("run_all", where / "run_all.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {where / 'run_all.py'}")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    return int(run_all.run(args))


def _coordinator(args: argparse.Namespace) -> int:
    from ._coordinator import serve

    where = f"{args.host or '*'}:{args.port}"
    try:
        print(f"asyncdist coordinator on {where}", flush=True)
        why = serve(args.host, args.port, args.timeout)
    except RuntimeError as exc:  # the port is taken, or the address is not this host's
        print(f"asyncdist coordinator: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    print(f"asyncdist coordinator on {where}: done ({why})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncdist", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", action="version", version=f"asyncdist {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small model on local ranks, with overlap")
    demo.add_argument("--world-size", type=int, default=2, help="local ranks (default 2)")
    demo.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    demo.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    demo.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size (MiB)")
    demo.set_defaults(run=_demo)

    info = commands.add_parser("info", help="what a DistSession would do in this environment")
    info.set_defaults(run=_info)

    bench = commands.add_parser(
        "bench",
        help="run the benchmark suite (benchmarks/run_all.py)",
        description="Run the benchmark suite (benchmarks/run_all.py of a clone): JSON and "
        "plots under benchmarks/results/, a summary on the terminal.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(run=_bench)

    coordinator = commands.add_parser(
        "coordinator",
        help="host an elastic session's coordinator until the session is over",
        description="Host the coordinator store of an elastic session (DistSession(elastic=True)) "
        "in this process, which must outlive the ranks; start them with "
        "ASYNCDIST_COORDINATOR=host:port. Exits once every member left, or once no member's "
        "heartbeat moved for twice the timeout. A SLURM step's task 0 starts one by itself.",
    )
    coordinator.add_argument("--port", type=int, required=True, help="the port to listen on")
    coordinator.add_argument(
        "--host", default="", help="the address to listen on (default: every interface)"
    )
    coordinator.add_argument(
        "--timeout", type=float, default=1800.0, help="the session's timeout, s (default 1800)"
    )
    coordinator.set_defaults(run=_coordinator)

    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
