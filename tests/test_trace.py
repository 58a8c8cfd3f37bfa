"""Per-op tracing: Chrome trace files with collectives and compute spans per rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from asyncdist import DistSession, spawn

pytestmark = pytest.mark.timeout(60)


def _now_us() -> float:
    return time.time_ns() / 1000.0  # the trace's clock: wall-clock microseconds


def _traced(s: DistSession, path: str) -> tuple[float, float]:
    start = _now_us()
    with s.trace(path):
        h = s.allreduce(torch.ones(1000))
        with s.span("compute"):
            time.sleep(0.05)
        h.wait()
        s.broadcast(torch.ones(10), src=1).wait()
    # Every event in the file was recorded before the block's exit took its snapshot.
    end = _now_us()
    return start, end


def test_trace_block_writes_one_file_for_all_ranks(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    blocks = spawn(_traced, 2, args=(str(path),))
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for rank, (start, end) in enumerate(blocks):
        mine = sorted((e for e in events if e["pid"] == rank), key=lambda e: e["name"])
        assert [(e["name"], e["tid"]) for e in mine] == [
            ("allreduce", 1),  # the collectives track
            ("broadcast", 1),
            ("compute", 2),  # the compute track
        ]
        allreduce, broadcast, compute = mine
        assert allreduce["args"]["bytes"] == 4000
        assert broadcast["args"]["bytes"] == 40
        assert allreduce["args"]["error"] is None
        for event in mine:
            # launched and completed inside the block, as measured on this rank
            assert start <= event["ts"]
            assert 0 < event["dur"] <= end - start
            assert event["ts"] + event["dur"] <= end
        assert compute["dur"] >= 50_000 * 0.9  # microseconds
        assert allreduce["ts"] <= compute["ts"], "the allreduce was launched first"
        assert compute["ts"] + compute["dur"] <= broadcast["ts"]


def test_session_trace_writes_a_file_per_rank(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    with DistSession(trace=path) as s:
        s.allreduce(torch.ones(3)).wait()
        with s.span("step"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.rank0.json"]
    doc = json.loads((tmp_path / "run.rank0.json").read_text())
    events = sorted((e for e in doc["traceEvents"] if e["ph"] == "X"), key=lambda e: e["name"])
    assert [(e["name"], e["pid"], e["tid"]) for e in events] == [
        ("allreduce", 0, 1),
        ("step", 0, 2),
    ]
    allreduce, step = events
    assert allreduce["args"]["bytes"] == 12
    assert allreduce["ts"] <= step["ts"]


def test_span_without_tracing_is_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a default trace file would land
    with DistSession() as s:
        span = s.span("nothing")
        with span:
            s.allreduce(torch.ones(3)).wait()
        with pytest.raises(KeyError), s.span("failing"):
            raise KeyError("not swallowed")
        assert list(tmp_path.iterdir()) == [], "no tracing, no file"
        # Had a span started tracing, this block would hold its events too.
        with s.trace(tmp_path / "block.json"), s.span("inside"):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["block.json"]
    doc = json.loads((tmp_path / "block.json").read_text())
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"] == ["inside"]
