"""Every Python example in README.md and docs/ runs as written."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _examples import run_example

from asyncdist import DistSession, spawn

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
    done = run_example(code, tmp_path)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{done.stderr}"
    # an example teaches what to write: it must not make torch or asyncdist warn
    assert "Warning:" not in done.stderr, f"{where} warns:\n{done.stderr}"


# The from-ddp guide's port of PyTorch's DDP tutorial, as a module the ranks import
PORT = "from_ddp_port"


def _ddp_tutorial(
    s: DistSession,
    save_every: int = 1,
    total_epochs: int = 3,
    batch_size: int = 32,
    snapshot_path: str = "snapshot.pt",
) -> dict[str, torch.Tensor]:
    """The tutorial's own loop (multigpu_torchrun.py) with DDP, on the port's
    data, model and optimizer, over the session's group (torch's default)."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    port = importlib.import_module(PORT)
    dataset, model, optimizer = port.load_train_objs()
    train_data = port.prepare_dataloader(dataset, batch_size)
    epochs_run = 0
    if os.path.exists(snapshot_path):
        snapshot = torch.load(snapshot_path)
        model.load_state_dict(snapshot["MODEL_STATE"])
        optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        epochs_run = snapshot["EPOCHS_RUN"]
    ddp = DDP(model)
    for epoch in range(epochs_run, total_epochs):
        train_data.sampler.set_epoch(epoch)
        for source, targets in train_data:
            optimizer.zero_grad()
            F.cross_entropy(ddp(source), targets).backward()
            optimizer.step()
        if s.rank == 0 and epoch % save_every == 0:
            snapshot = {
                "MODEL_STATE": ddp.module.state_dict(),
                "OPTIMIZER_STATE": optimizer.state_dict(),
                "EPOCHS_RUN": epoch + 1,
            }
            torch.save(snapshot, snapshot_path)
    # DDP hands rank 0's buffers over at the next forward (gradient_sync when
    # the step finishes): an eval forward takes them without updating them
    ddp.eval()
    with torch.no_grad():
        ddp(dataset[:2][0])
    return model.state_dict()


def _stopped_and_resumed(s: DistSession, which: str, folder: str) -> dict[str, torch.Tensor]:
    """Two epochs, a snapshot on rank 0; then a fresh start that resumes from
    it, to four."""
    run: Any = importlib.import_module(PORT).main if which == "asyncdist" else _ddp_tutorial
    path = os.path.join(folder, "snapshot.pt")
    run(s, total_epochs=2, snapshot_path=path)
    s.barrier().wait()  # rank 0 has written the snapshot
    return dict(run(s, total_epochs=4, snapshot_path=path))


@pytest.mark.timeout(150)
def test_the_ddp_tutorial_port_trains_as_ddp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The from-ddp guide's port and the DDP tutorial it ports end with the
    same parameters and buffers on every rank, bit for bit (2 ranks)."""
    page = ROOT / "docs" / "guides" / "from-ddp.md"
    [port] = [code for code in BLOCK.findall(page.read_text()) if "class Trainer" in code]
    (tmp_path / f"{PORT}.py").write_text(port)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawn's ranks inherit sys.path
    results = {}
    for which in ("asyncdist", "ddp"):
        (tmp_path / which).mkdir()
        results[which] = spawn(_stopped_and_resumed, 2, args=(which, str(tmp_path / which)))
    for rank, (ours, theirs) in enumerate(zip(results["asyncdist"], results["ddp"], strict=True)):
        assert list(ours) == list(theirs), "the same state_dict keys (no 'module.' prefix)"
        assert any("running_mean" in key for key in ours), "a model with buffers"
        for key, value in ours.items():
            assert torch.equal(value, theirs[key]), f"rank {rank}: {key} differs from DDP's"


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


def test_the_eager_launch_example_leaves_the_tensors_in_flight_alone() -> None:
    """concepts.md teaches launch, compute, await: the compute between the
    launch and the await must not read the tensors being reduced in place."""
    page = (ROOT / "docs" / "concepts.md").read_text()
    block = next(code for code in BLOCK.findall(page) if "wait_all(handles)" in code)
    lines = block.splitlines()
    launch = next(i for i, line in enumerate(lines) if "s.allreduce(b" in line)
    awaited = next(i for i, line in enumerate(lines) if "await wait_all(handles)" in line)
    between = [line.split("#")[0] for line in lines[launch + 1 : awaited]]
    assert not [line for line in between if "buckets" in line or re.search(r"\bb\b", line)]
