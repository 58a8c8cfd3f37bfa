"""The asyncdist command: demo, info, bench."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncdist.__main__ import main

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
    assert "communication hidden by overlap" in done.stdout
    assert "bytes reduced per step" in done.stdout


def test_demo_rejects_too_few_steps() -> None:
    with pytest.raises(SystemExit, match="at least 6"):
        main(["demo", "--steps", "2"])
