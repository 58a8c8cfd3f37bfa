"""docs/collectives.md shows what its examples print, and says what they do.

tests/test_docs.py runs every example; this checks what the collectives
page claims about one of them: the output shown under the rank-0 helpers'
example is what running it prints (the logger's line once, from rank 0).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _examples import run_example

PAGE = Path(__file__).resolve().parent.parent / "docs" / "collectives.md"
# the example of the rank-0 helpers, and the text block that follows it
EXAMPLE = re.compile(
    r"^```python\n((?:(?!^```).)*?)^```\n\n(?:(?!```).)*?^```text\n(.*?)^```", re.S | re.M
)
MARKER = "s.logger("  # how the example is found


def _example() -> tuple[str, list[str]]:
    found = [(code, shown) for code, shown in EXAMPLE.findall(PAGE.read_text()) if MARKER in code]
    assert len(found) == 1, f"one example with {MARKER!r} and the output it prints"
    code, shown = found[0]
    return code, [line for line in shown.splitlines() if line.strip()]


@pytest.mark.timeout(150)
def test_the_logger_example_prints_what_the_page_shows(tmp_path: Path) -> None:
    code, shown = _example()
    done = run_example(code, tmp_path)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    printed = (done.stdout + done.stderr).splitlines()
    logged = [line for line in shown if MARKER not in line and "INFO" in line]
    assert logged, f"the page shows no logged line: {shown}"
    for line in shown:
        # once: s.print and s.logger emit on rank 0 only (3 ranks run the example)
        assert printed.count(line) == 1, f"{line!r} printed {printed.count(line)} times:\n{printed}"


def test_debug_mode_is_not_what_refuses_two_tasks_on_one_lane() -> None:
    """Two tasks issuing on one lane at once are refused in every mode; the
    debug section must not say debug mode is what does it."""
    text = PAGE.read_text()
    debug = text[text.index("## Debug mode") :]
    debug = debug[: debug.find("\n## ", 1) if "\n## " in debug[1:] else None]
    assert "turns two tasks" not in debug
    assert re.search(r"two tasks .*refused in every mode", debug, re.S | re.I), debug
