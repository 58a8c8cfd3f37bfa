"""Running a docs page's example as a user would: a script of its own, in a
fresh interpreter, outside any launcher's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# a launcher's variables would make the example join that job instead
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_PORT")


def run_example(code: str, where: Path, timeout: float = 140) -> subprocess.CompletedProcess[str]:
    """Write ``code`` to ``where/example.py`` and run it there; never raises
    for the example's exit status (the caller asserts on it)."""
    script = where / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
