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
    # an example teaches what to write: it must not make torch or asyncdist warn
    assert "Warning:" not in done.stderr, f"{where} warns:\n{done.stderr}"


def test_guides_quote_no_benchmark_figures_of_their_own() -> None:
    """Measured figures live on the benchmarks page only; guides link to it
    (two pages quoting one run drift apart)."""
    figure = re.compile(r"\d\.\d+ ?×|\b\d+ ?% of the hideable|\(DDP:? \d")
    for page in sorted((ROOT / "docs" / "guides").glob("*.md")):
        found = figure.findall(page.read_text())
        assert not found, f"{page.name} quotes {found}; link to docs/benchmarks.md instead"
    assert "(../benchmarks.md)" in (ROOT / "docs" / "guides" / "overlap.md").read_text()


# A Sphinx role as mkdocstrings (Google style) leaves it in the page: raw text.
SPHINX_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj):(?:<code>|`)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built docs site: ``ASYNCDIST_DOCS_SITE`` names a build to reuse
    (CI's ``nox -s docs`` output), else it is built here."""
    reuse = os.environ.get("ASYNCDIST_DOCS_SITE")
    if reuse:
        return Path(reuse)
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert done.returncode == 0, f"mkdocs build failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.mark.timeout(180)
def test_built_pages_show_no_raw_sphinx_roles(site: Path) -> None:
    api = site / "api" / "index.html"
    assert "DistSession" in api.read_text(), "the API reference was rendered"
    leftovers = {
        str(page.relative_to(site)): SPHINX_ROLE.findall(page.read_text())
        for page in site.rglob("*.html")
    }
    leftovers = {page: found for page, found in leftovers.items() if found}
    assert not leftovers, f"raw Sphinx roles in the built site: {leftovers}"


def test_docstrings_use_no_sphinx_roles() -> None:
    """The same, for every docstring (rendered or not), without a build."""
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "asyncdist").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SPHINX_ROLE.search(line)
    ]
    assert not found, f"Sphinx roles (write [name][asyncdist.name] or ``name``): {found}"
