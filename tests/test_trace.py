"""Per-op tracing: Chrome trace files with collectives and compute spans per rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from asyncdist import DistSession, spawn

pytestmark = pytest.mark.timeout(60)


def _traced(s: DistSession, path: str) -> None:
    with s.trace(path):
        h = s.allreduce(torch.ones(1000))
        with s.span("compute"):
            time.sleep(0.05)
        h.wait()
        s.broadcast(torch.ones(10), src=1).wait()


def test_trace_block_writes_one_file_for_all_ranks(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    spawn(_traced, 2, args=(str(path),))
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = [e["name"] for e in events if e["pid"] == rank]
        assert names.count("allreduce") == 1
        assert names.count("broadcast") == 1
        assert "compute" in names
    compute = next(e for e in events if e["name"] == "compute")
    assert compute["dur"] >= 50_000 * 0.9  # microseconds
    allreduce = next(e for e in events if e["name"] == "allreduce" and e["pid"] == 0)
    assert allreduce["args"]["bytes"] == 4000
    assert allreduce["dur"] >= 0


def test_session_trace_writes_a_file_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.json"
    with DistSession(trace=path) as s:
        s.allreduce(torch.ones(3)).wait()
        with s.span("step"):
            pass
    doc = json.loads((tmp_path / "run.rank0.json").read_text())
    names = [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert names == ["allreduce", "step"] or sorted(names) == ["allreduce", "step"]


def test_span_without_tracing_is_free() -> None:
    with DistSession() as s, s.span("nothing"):
        pass
