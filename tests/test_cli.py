"""The asyncdist command: demo, info, bench."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
