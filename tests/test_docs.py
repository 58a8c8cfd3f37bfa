"""Every Python example in README.md and docs/ runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _examples() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for i, code in enumerate(BLOCK.findall(page.read_text())):
            found.append((f"{page.relative_to(ROOT)}#{i + 1}", code))
    return found


EXAMPLES = _examples()


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 10


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("where", "code"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_example_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=140,
        env=env,
        check=False,
    )
    assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{done.stderr}"
