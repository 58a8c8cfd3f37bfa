"""The asyncdist command: demo, info, bench."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from asyncdist import __main__ as cli
from asyncdist.__main__ import main

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


def test_info_describes_the_local_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "local" in out
    assert "loopback only" in out
    assert "gloo" in out


def test_info_under_torchrun_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "node7",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(key, value)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torchrun" in out
    assert "3 / 4" in out
    assert "node7:29500" in out


def test_demo_trains_and_reports() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncdist", "demo", "--steps", "10"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.lstrip().startswith("asyncdist demo: starting 2 ranks on gloo")
    assert "nan" not in done.stdout
    assert "communication hidden by overlap" in done.stdout
    assert "bytes reduced per step" in done.stdout


def test_demo_rejects_too_few_steps() -> None:
    with pytest.raises(SystemExit, match="at least 6"):
        main(["demo", "--steps", "2"])


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "The asyncdist command" in out
    assert "``" not in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncdist import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"asyncdist {__version__}"


FAKE_RUN_ALL = """
def run(args):
    print(f"quick={args.quick} only={args.only}")
    return 3
"""


def test_bench_passes_its_options_to_run_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run_all.py").write_text(FAKE_RUN_ALL)
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["bench", "--quick", "--only", "latency,ddp"]) == 3
    assert "quick=True only=['latency', 'ddp']" in capsys.readouterr().out
    assert main(["bench"]) == 3
    assert f"quick=False only={list(cli.BENCHMARKS)}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--only", "latency,nonsense"])
    assert "unknown benchmark(s) nonsense" in capsys.readouterr().err


def test_bench_help_lists_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "--quick" in out
    assert "--only" in out


def test_run_all_uses_the_same_options_and_suite() -> None:
    source = (ROOT / "benchmarks" / "run_all.py").read_text()
    tree = ast.parse(source)
    suite = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "SUITE" for t in node.targets)
    )
    assert isinstance(suite, ast.Dict)
    assert tuple(ast.literal_eval(key) for key in suite.keys if key is not None) == cli.BENCHMARKS
    assert "add_bench_arguments" in source
    assert "add_argument" not in source, "run_all.py defines no options of its own"


def test_demo_progress_shows_no_loss_before_the_first_step() -> None:
    from rich.console import Console

    from asyncdist import _demo

    console = Console(record=True, width=100, force_terminal=False)
    progress, task = _demo.progress_bar(10, console=console)
    console.print(progress)
    first = console.export_text()
    assert "step 0/10" in first
    assert "loss" not in first
    assert "nan" not in first
    progress.update(task, advance=1, loss="loss 2.303")
    console.print(progress)
    assert "loss 2.303" in console.export_text()


# -- the benchmark suite itself (benchmarks/run_all.py and its tables) ----------------------

BENCH_EXTRA = "pip install 'asyncdist[bench]'"
NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "  # what `pip install -e .` leaves out
    "from asyncdist.__main__ import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.fixture
def benchmarks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """benchmarks/run_all.py, loaded as ``asyncdist bench`` loads it, its
    results going to ``tmp_path``; the benchmark modules are unloaded after."""
    before = set(sys.modules)
    monkeypatch.setenv("ASYNCDIST_BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    assert spec is not None
    assert spec.loader is not None
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    assert tmp_path == run_all._common.RESULTS
    yield run_all
    for name in set(sys.modules) - before:
        where = getattr(sys.modules[name], "__file__", None) or ""
        if Path(where).parent.name in ("benchmarks", "tools"):  # bare names: latency, ...
            del sys.modules[name]


def test_bench_without_matplotlib_runs_and_skips_the_plots(tmp_path: Path) -> None:
    """In a venv without the bench extra, ``asyncdist bench`` runs the
    benchmarks, skips the plots with a notice naming the extra, exits 0."""
    env = dict(os.environ, ASYNCDIST_BENCH_OUT=str(tmp_path))
    env.pop("COLUMNS", None)  # rich's width: 80 when not a terminal
    done = subprocess.run(
        [sys.executable, "-c", NO_MATPLOTLIB, "bench", "--quick", "--only", "latency"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output
    notices = [line for line in output.splitlines() if BENCH_EXTRA in line]
    assert len(notices) == 1, output
    assert "plots skipped" in notices[0]
    assert (tmp_path / "latency.json").is_file()
    assert not list(tmp_path.glob("*.png"))
    # a smoke run: the goals are shown, not judged
    assert "MISSED" not in output
    assert "not comparable with the goals" in output
    assert "…" not in output


def test_bench_only_plots_what_ran(benchmarks: ModuleType, tmp_path: Path) -> None:
    """``--only X`` draws X's plots from this run, never others from old results."""
    pytest.importorskip("matplotlib")
    old = {"rows": [{"bytes": 4, "ratio": {"wait": 1.0, "asyncio": 1.1, "trio": 1.2}}]}
    (tmp_path / "latency.json").write_text(json.dumps(old))  # a previous run's
    ran: list[str] = []

    def fake(name: str) -> Any:
        def bench(argv: list[str]) -> int:
            ran.append(name)
            return 0

        return bench

    for name in ("fusion", "latency"):
        benchmarks.SUITE[name] = (fake(name), [], [])
    assert benchmarks.run(argparse.Namespace(only=["fusion"], quick=False)) == 0
    assert ran == ["fusion"]
    assert not list(tmp_path.glob("*.png")), "latency.png redrawn from old results"
    assert benchmarks.plot(["fusion", "debug_cost", "loop_stall", "concurrency"]) == []
    assert benchmarks.run(argparse.Namespace(only=["latency"], quick=False)) == 0
    assert [p.name for p in tmp_path.glob("*.png")] == ["latency.png"]


def _synthetic_tables(benchmarks: ModuleType, smoke: bool) -> dict[str, Any]:
    """Every benchmark's table from made-up results as wide as real ones, and
    missing every goal: {name: rich Table}."""
    import asyncdist

    common, shaped = benchmarks._common, sys.modules["_shaped_cli"]
    tables: dict[str, Any] = {}

    def runs(raw: float) -> dict[str, list[float]]:
        return {"raw": [raw], "wait": [raw * 1.4], "await": [raw * 2.1]}

    sizes = benchmarks.latency.SIZES
    lat = {str(s): {"asyncio": runs(0.21 * s / sizes[-1] + 3e-4)} for s in sizes}
    for per_size in lat.values():
        per_size["trio"] = per_size["asyncio"]
    title, columns, rows, _ = benchmarks.latency.summarize(lat, sizes, smoke)
    tables["latency"] = common.table(title, columns, rows, smoke=smoke)

    times = {"separate": [0.12442], "coalesced": [0.01523]}
    title, columns, rows, _ = benchmarks.fusion.summarize(times, smoke)
    tables["fusion"] = common.table(title, columns, rows, smoke=smoke)

    title, columns, rows, _ = benchmarks.debug_cost.summarize({"off": [0.0157], "on": [0.1492]})
    tables["debug_cost"] = common.table(title, columns, rows)

    stalls = {case: [1.0123, 0.0378] for case in benchmarks.loop_stall.CASES}
    version = asyncdist.__version__ + ".dev1234+g0123abcd"
    title, columns, rows = benchmarks.loop_stall.summarize(stalls, 1.0, 3, version)
    tables["loop_stall"] = common.table(title, columns, rows)

    at_rest = [
        {"setup": "process, no session", "threads": 2, "added": 0, "cpu": 0.0001},
        {"setup": "session", "threads": 9, "added": 7, "cpu": 0.0046},
        {"setup": "+ 1 channel", "threads": 12, "added": 10, "cpu": 0.0047},
        {"setup": "+ 4 channels", "threads": 21, "added": 19, "cpu": 0.0048},
        {"setup": "one raw new_group", "threads": None, "added": 3},
        {"setup": "+ 4 channels, debug", "threads": 60, "added": 58, "cpu": 0.0246},
    ]
    title, columns, rows, _ = benchmarks.threads.summarize(at_rest, 4)
    tables["threads"] = common.table(title, columns, rows)

    entry = {"raw": [0.0412], "session": [0.1234], "init": [0.0407], "rest": [0.0429]}
    entry |= {"first_object": [0.0398], "object": [0.0031]}
    entry |= {"root": [0.0021], "barrier": [0.0134], "side": [0.0105], "raw_init": [0.0311]}
    burst = {
        str(n): {"raw_issue": [1.2e-5], "raw_all": [1.2345e-3], "ad_issue": [9.9e-5]}
        | {"ad_all": [2.468e-3]}
        for n in benchmarks.scaling.BURSTS
    }
    memory = {
        "1000": {"raw": [2003.0], "ad": [2083.0]},
        "10000": {"raw": [2000.0], "ad": [12103.0]},
    }
    scaled = {
        "entry": entry,
        "burst": burst,
        "wait_all": {"wait": [1.234e-5], "await": [2.345e-5], "raw": [2.1e-7]},
        "memory": memory,
    }
    title, columns, rows, _ = benchmarks.scaling.summarize(
        {ws: [scaled] * ws for ws in (2, 4, 8)}, smoke
    )
    tables["scaling"] = common.table(title, columns, rows, smoke=smoke)

    link = {
        "median_s": {"idle": 0.00099},
        "same_lane_x_idle": 3125.4,
        "own_channel_x_idle": 12.3,
        "bulk_gbit_s": {"alone": 17.24},
        "bulk_throughput_kept": 0.863,
    }
    links = {"loopback": link, "shaped 500mbit": link}
    title, columns, rows, _ = benchmarks.concurrency.summarize(links, 64, smoke)
    tables["concurrency"] = common.table(title, columns, rows, smoke=smoke)

    step = {"comm_s": 0.0335, "compute_s": 0.0335, "sequential_s": 0.0671}
    overlap = [dict(step, overlapped_s=0.0612, efficiency=0.174)] * 2
    columns, rows, _ = benchmarks.overlap.summarize(overlap, {}, smoke=smoke)
    tables["overlap"] = common.table(shaped.title("overlap", "500mbit"), columns, rows, smoke=smoke)

    wire = {"bytes": 64 << 20, "median_s": 1.2345, "bound_s": 1.0737, "efficiency": 0.87}
    columns, rows, _ = benchmarks.bandwidth.summarize([wire] * 2, {}, smoke=smoke)
    tables["bandwidth"] = common.table(
        shaped.title("bandwidth", "500mbit"), columns, rows, smoke=smoke
    )

    arms = list(benchmarks.ddp.LABELS)
    one = {
        "ratio_vs_ddp": dict.fromkeys(arms, 1.234),
        "median_s": {arm: 1.6789 - i * 0.01 for i, arm in enumerate(arms)},
        "breakdown": {
            arm: {"backward": 0.2812, "exposed_comm": 1.3712, "optimizer": 0.1623} for arm in arms
        },
        "backward_vs_ddp": 1.2345,
        "backward_cpu_vs_ddp": 1.2345,
        "bf16_vs_ddp_bf16": 1.2345,
        "overlap_hides": -12.345,
        "overlap_can_hide": 0.875,
        "floor_vs_ddp": 0.7654,
        "comm_s": {"float32": 0.1404},
    }
    rank = {"configs": [dict(one, config=c) for c in benchmarks.ddp.CONFIGS]}
    columns, rows, _ = benchmarks.ddp.summarize([rank, rank], {}, smoke=smoke)
    tables["ddp"] = common.table(shaped.title("ddp", "500mbit"), columns, rows, smoke=smoke)
    death = {"next_step_s": 5.4812, "lost": 9.0, "step_s": 0.05123}
    title, columns, rows, _ = benchmarks.elastic.summarize(
        {"elastic": [death], "torchrun": [death], "torchft": [death]}, 10, smoke
    )
    tables["elastic"] = common.table(title, columns, rows, smoke=smoke)
    assert set(tables) == set(cli.BENCHMARKS)
    return tables


def _render(table: Any, width: int) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False)
    console.print(table)
    return console.export_text()


def test_benchmark_tables_fit_80_columns(benchmarks: ModuleType) -> None:
    """Every table fits a terminal of 80 columns as it is: no cell wrapped or
    shortened to "…" (ddp's used to show "gradient_s…")."""
    for smoke in (False, True):
        for name, table in _synthetic_tables(benchmarks, smoke).items():
            natural = _render(table, 1000)
            widest = max(len(line.rstrip()) for line in natural.splitlines())
            assert widest <= 80, f"{name}: {widest} columns wide\n{natural}"
            at_80 = _render(table, 80)
            assert "…" not in at_80, f"{name}:\n{at_80}"
            assert "..." not in at_80, f"{name}:\n{at_80}"


def test_quick_run_does_not_judge_the_goals(benchmarks: ModuleType) -> None:
    """``--quick`` (a smoke run) shows the goals unjudged, saying why; a full
    run still reports a miss."""
    judged = _synthetic_tables(benchmarks, smoke=False)
    for name in ("latency", "fusion", "overlap", "bandwidth", "ddp", "scaling", "elastic"):
        assert "MISSED" in _render(judged[name], 80), name
    for name, table in _synthetic_tables(benchmarks, smoke=True).items():
        text = _render(table, 80)
        assert "MISSED" not in text, f"{name}:\n{text}"
        if name in ("latency", "fusion", "overlap", "bandwidth", "ddp", "scaling", "elastic"):
            assert "smoke run (--quick)" in text, f"{name}:\n{text}"
    # every benchmark with goals is told so under --quick, and only there
    for name, (_, full, quick) in benchmarks.SUITE.items():
        goals = ("latency", "fusion", "concurrency", "overlap", "bandwidth", "ddp", "scaling")
        goals += ("elastic",)
        if name in goals:
            assert "--smoke" in quick, name
        assert "--smoke" not in full, name


def test_backward_cpu_probe_summary(benchmarks: ModuleType) -> None:
    """benchmarks/backward_cpu.py (a probe outside the suite): its rows are
    the worse rank's, its parts add up to the hooks' whole, and its table
    fits 80 columns."""
    import backward_cpu  # on the path run_all set up

    def rank(scale: float) -> dict[str, Any]:
        arms = {"none": 5.0, "ddp": 6.0, "sync": 7.5}
        return {
            "arms": {a: {"fwd": 3.0 * scale, "bwd": b * scale} for a, b in arms.items()},
            "parts_ms": {"hooks": 2.0, "copies": 1.0, "launches": 0.5, "start": 0.2}
            | {"raw_launches": 0.3 * scale},
        }

    title, columns, rows, payload = backward_cpu.summarize([rank(1.0), rank(1.1)])
    by_arm = {row[0]: row for row in rows}
    assert by_arm["gradient_sync"][2] == "8.25"  # 7.5 * 1.1: the slower rank
    assert by_arm["gradient_sync"][3] == "+2.75"  # over autograd alone, 5.5
    assert by_arm["gradient_sync"][4] == "1.25"  # 8.25 / 6.6
    assert payload["hooks_rest_ms"] == pytest.approx(0.3)
    assert by_arm["launches, torch's own call"][2] == "0.33"  # the slower rank's
    assert payload["issue_path_ms"] == pytest.approx(0.5 - 0.33)
    text = _render(benchmarks._common.table(title, columns, rows), 80)
    assert "…" not in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80


def test_scaling_entry_parts(benchmarks: ModuleType) -> None:
    """benchmarks/scaling.py's entry rows: raw's figures come from the rank
    slowest in the raw arm, the session's parts from the rank slowest in the
    session arm, and the margin row is what 1.2x raw leaves a session."""
    scaling = benchmarks.scaling

    def rank(raw: float, session: float) -> dict[str, Any]:
        entry = {"raw": [raw], "raw_init": [raw * 0.75], "session": [session]}
        entry |= {"init": [session * 0.4], "rest": [session * 0.6], "root": [session * 0.1]}
        entry |= {"side": [session * 0.2], "barrier": [session * 0.15]}
        entry |= {"first_object": [0.001], "object": [0.0005]}
        burst = {"100": {"raw_issue": [1e-5], "raw_all": [1e-3], "ad_issue": [1.1e-5]}}
        burst["100"] |= {"ad_all": [1e-3]}
        memory = {"1000": {"raw": [2000.0], "ad": [2000.0]}}
        return {"entry": entry, "burst": burst, "wait_all": None, "memory": memory}

    # rank 0 is the raw arm's slowest, rank 1 the session's
    _, _, rows, payload = scaling.summarize({2: [rank(0.002, 0.003), rank(0.001, 0.004)]})
    by_label = {row[0].strip(): row[1] for row in rows}
    assert by_label["entry ms: raw init+barrier"] == "2.0"
    assert by_label["raw: its init ms"] == "1.5"
    assert by_label["entry ms: DistSession"] == "4.0"
    assert by_label["of it: side group ms"] == "0.8"
    assert by_label["of it: root lane ms"] == "0.4"
    assert by_label["of it: barrier ms"] == "0.6"
    assert by_label["1.2× leaves a session ms"] == "0.4"
    assert payload["world_sizes"]["2"]["entry_s"]["ratio"] == pytest.approx(2.0)
