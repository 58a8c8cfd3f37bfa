"""The wheel: installable, typed, versioned in one place."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import asyncdist

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_wheel_contains_the_package_and_py_typed(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("asyncdist-*.whl")
    assert asyncdist.__version__ in wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "asyncdist/py.typed" in names
    assert "asyncdist/__main__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert re.search(r"^Requires-Dist: torch>=2\.4", text, re.M)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "asyncdist = asyncdist.__main__:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_version_lives_in_one_place() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text
    assert 'path = "asyncdist/_version.py"' in text
