"""DistSession: lifecycle, environment, reduce ops, bad input, faults."""

from __future__ import annotations

import datetime
import gc
import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
from _ports import free_port, listening

from asyncdist import (
    CollectiveTimeout,
    DistSession,
    InitError,
    PeerFailure,
    SessionBroken,
    SessionClosed,
    spawn,
)
from asyncdist._session import State

pytestmark = pytest.mark.timeout(60)


def test_local_default_properties_and_release() -> None:
    with DistSession() as s:
        assert (s.rank, s.world_size, s.local_rank) == (0, 1, 0)
        assert s.backend == "gloo"
        assert s.device == torch.device("cpu")
        assert s.is_main
        assert not s.closed
        assert s.state is State.OPEN
        assert s.group is dist.group.WORLD
        assert dist.is_initialized()
    assert s.closed
    assert s.state is State.CLOSED
    assert not dist.is_initialized()


def test_local_default_listens_on_loopback_only() -> None:
    before = listening()
    with DistSession():
        during = listening() - before
        assert during, "the local default should host its store"
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in during), during
    assert listening() <= before, "the store's socket was not released"


def test_sessions_one_after_another() -> None:
    for i in range(5):
        with DistSession(timeout=10) as s:
            t = torch.full((2,), float(i))
            assert torch.equal(s.allreduce(t).wait(), t)
        assert not dist.is_initialized()


def test_adopts_an_initialised_group_and_leaves_it() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with DistSession() as s:
            assert s.group is dist.group.WORLD
            s.allreduce(torch.ones(1)).wait()
        assert dist.is_initialized(), "an adopted group must not be destroyed"
        with pytest.raises(InitError, match="world_size=1"):
            DistSession(world_size=2).__enter__()
    finally:
        dist.destroy_process_group()


def test_adopting_reads_the_local_rank_like_a_new_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One rule for both paths: under SLURM the local rank is SLURM_LOCALID.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with DistSession() as s:
            assert s.local_rank == 3
    finally:
        dist.destroy_process_group()


def test_exit_by_exception_releases_the_group() -> None:
    with pytest.raises(KeyError), DistSession() as s:
        s.allreduce(torch.ones(2))
        raise KeyError("boom")
    assert s.closed
    assert not dist.is_initialized()


@pytest.mark.anyio
async def test_async_exit_by_cancellation_releases_the_group() -> None:
    with anyio.move_on_after(0.05):
        async with DistSession() as s:
            s.allreduce(torch.ones(2))
            await anyio.sleep(10)
    assert s.closed
    assert not dist.is_initialized()


@pytest.mark.anyio
async def test_aclose_drains_and_releases_the_group() -> None:
    s = await DistSession().__aenter__()
    t = torch.full((2,), 3.0)
    h = s.allreduce(t, op="mean")
    await s.aclose()
    assert s.closed
    assert not dist.is_initialized()
    assert h.done()
    assert t.tolist() == [3.0, 3.0]
    await s.aclose()  # closing twice is fine


def test_closed_session_refuses_collectives() -> None:
    s = DistSession()
    with pytest.raises(SessionClosed, match="unopened"):
        s.allreduce(torch.ones(1))
    with s:
        pass
    with pytest.raises(SessionClosed, match="broadcast on rank 0: the session is closed"):
        s.broadcast(torch.ones(1))
    s.close()  # closing twice is fine
    with pytest.raises(SessionClosed, match="rank 0 was closed"), s:
        pass


def test_constructor_validates_timeout() -> None:
    with pytest.raises(ValueError, match="positive"):
        DistSession(timeout=0)
    with pytest.raises(TypeError, match="timedelta"):
        DistSession(timeout="10")  # type: ignore[arg-type]
    assert DistSession(timeout=datetime.timedelta(seconds=5)).timeout == 5.0


BAD_INPUTS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("allreduce", {"tensor": [1.0, 2.0]}, TypeError, "torch.Tensor"),
    ("allreduce", {"tensor": torch.ones(4, 4).t()}, ValueError, "contiguous"),
    ("allreduce", {"tensor": torch.ones(2), "op": "median"}, ValueError, "unknown reduce op"),
    ("allreduce", {"tensor": torch.ones(2), "op": 3}, TypeError, "ReduceOp"),
    ("allreduce", {"tensor": torch.ones(2, dtype=torch.int64), "op": "mean"}, ValueError, "mean"),
    (
        "allreduce",
        {"tensor": torch.ones(2, dtype=torch.complex64), "op": "max"},
        ValueError,
        "complex",
    ),
    ("allreduce", {"tensor": torch.ones(2), "op": "band"}, ValueError, "integer"),
    ("allreduce", {"tensor": torch.ones(2, dtype=torch.int16)}, ValueError, "gloo cannot"),
    ("allreduce", {"tensor": torch.ones(2).to_sparse()}, ValueError, "sparse"),
    ("broadcast", {"tensor": torch.ones(2), "src": 1}, ValueError, "outside"),
    ("broadcast", {"tensor": torch.ones(2), "src": -1}, ValueError, "outside"),
    ("broadcast", {"tensor": torch.ones(2), "src": 0.0}, TypeError, "int"),
    ("broadcast", {"tensor": None}, TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize(("method", "kwargs", "error", "match"), BAD_INPUTS)
def test_bad_input_fails_before_launch_and_session_stays_usable(
    method: str, kwargs: dict[str, Any], error: type[Exception], match: str, tmp_path: Path
) -> None:
    # The session's trace records every launched collective: the refused call
    # must leave no event, the good one after it exactly one.
    with DistSession(trace=tmp_path / "t.json") as s:
        with pytest.raises(error, match=match):
            getattr(s, method)(**kwargs)
        assert s.state is State.OPEN
        assert s.allreduce(torch.ones(2)).wait().tolist() == [1.0, 1.0]
    doc = json.loads((tmp_path / "t.rank0.json").read_text())
    launched = [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert launched == ["allreduce"], "nothing may be launched by a refused call"


# -- several ranks ----------------------------------------------------------------


def _reduce_ops(session: DistSession) -> dict[str, list[float]]:
    r, n = session.rank, session.world_size
    out = {}
    for op in ("sum", "mean", "min", "max", "product", dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        t = torch.tensor([r + 1.0, -(r + 1.0)])
        out[str(op)] = session.allreduce(t, op=op).wait().tolist()
    i = torch.tensor([r + 1], dtype=torch.int64)
    out["int_sum"] = session.allreduce(i).wait().tolist()
    b = torch.full((3,), float(r))
    out["bcast"] = session.broadcast(b, src=n - 1).wait().tolist()
    return out


def test_reduce_ops_against_hand_values() -> None:
    results = spawn(_reduce_ops, 3, timeout=20)
    # ranks contribute 1, 2, 3 (and their negatives)
    for out in results:
        assert out["sum"] == [6.0, -6.0]
        assert out["mean"] == [2.0, -2.0]
        assert out["min"] == [1.0, -3.0]
        assert out["max"] == [3.0, -1.0]
        assert out["product"] == [6.0, -6.0]
        assert out[str(dist.ReduceOp.SUM)] == [6.0, -6.0]
        assert out[str(dist.ReduceOp.AVG)] == [2.0, -2.0], "AVG on gloo: sum, then divide"
        assert out["int_sum"] == [6]
        assert out["bcast"] == [2.0, 2.0, 2.0]


def _seed_complex_example(session: DistSession) -> list[complex]:
    tensor = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat) + 2 * session.rank * (1 + 1j)
    return session.allreduce(tensor).wait().tolist()


def test_complex_allreduce_from_the_seed_documentation() -> None:
    assert spawn(_seed_complex_example, 2) == [[4 + 4j, 6 + 6j]] * 2


def _silent_peer(session: DistSession, out: str) -> None:
    if session.rank == 1:
        time.sleep(session.timeout + 4)  # alive, but never joins
        return
    t0 = time.monotonic()
    try:
        session.allreduce(torch.ones(4)).wait()
    except CollectiveTimeout as exc:
        elapsed = time.monotonic() - t0
        t1 = time.monotonic()
        try:
            session.allreduce(torch.ones(4))
        except SessionBroken as broken:
            Path(out).write_text(
                json.dumps(
                    {
                        "elapsed": elapsed,
                        "broken_after": time.monotonic() - t1,
                        "message": str(exc),
                        "chained": broken.__cause__ is exc,
                    }
                )
            )


def test_silent_peer_raises_collective_timeout(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    t0 = time.monotonic()
    spawn(_silent_peer, 2, args=(str(out),), timeout=2)
    report = json.loads(out.read_text())
    assert 2.0 <= report["elapsed"] <= 2.0 + 5.0
    assert report["broken_after"] < 0.1, "a broken session must refuse at once"
    assert report["chained"]
    assert "allreduce" in report["message"]
    assert "rank 0" in report["message"]
    assert time.monotonic() - t0 < 30, "exit of the broken session hung"


def _dead_peer(session: DistSession, out: str) -> None:
    if session.rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        session.allreduce(torch.ones(1 << 20)).wait()
    except PeerFailure as exc:
        Path(out).write_text(
            json.dumps(
                {
                    "elapsed": time.monotonic() - t0,
                    "state": session.state.value,
                    "message": str(exc),
                }
            )
        )


def test_dead_peer_raises_peer_failure(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    with pytest.raises(PeerFailure, match="rank 1 exited with code 0"):
        spawn(_dead_peer, 2, args=(str(out),), timeout=30)
    report = json.loads(out.read_text())
    assert report["elapsed"] < 5.0, "a dead peer must be noticed quickly, not at the timeout"
    assert report["state"] == "broken"
    assert "allreduce" in report["message"]


def test_init_error_when_a_rank_never_joins() -> None:
    t0 = time.monotonic()
    # world of 2, only rank 0 here: the store is ours, no peer ever comes
    session = DistSession(rank=0, world_size=2, master_port=free_port(), timeout=2)
    with pytest.raises(InitError, match="could not form"):
        session.__enter__()
    assert time.monotonic() - t0 < 2 + 5
    assert not dist.is_initialized()


_RANK1 = """
import sys, torch
from asyncdist import DistSession
with DistSession(rank=1, world_size=2, master_addr="127.0.0.1", master_port=int(sys.argv[1]),
                 timeout=20) as s:
    s.allreduce(torch.ones(2)).wait()
"""


def test_a_failed_entry_leaves_later_sessions_able_to_form() -> None:
    """A failure inside torch's ``init_process_group`` (here: no rank 1) used to
    leave torch's group-name counter advanced: this rank's next group was then
    named "1" while a fresh peer's was "0", and the two waited for each other's
    keys until the timeout (found by tests/test_netfaults.py, partition at entry)."""
    failed = DistSession(
        rank=0, world_size=2, master_addr="127.0.0.1", master_port=free_port(), timeout=1
    )
    with pytest.raises(InitError):
        failed.__enter__()
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", _RANK1, str(port)])
    try:
        t = torch.ones(2)
        with DistSession(
            rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=20
        ) as s:
            s.allreduce(t).wait()
        assert t.tolist() == [2.0, 2.0]
        assert peer.wait(30) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait()


_SILENT_RANK1 = """
import sys, time, torch
from asyncdist import DistSession
print("imported", flush=True)
with DistSession(rank=1, world_size=2, master_addr="127.0.0.1", master_port=int(sys.argv[1]),
                 timeout=30) as s:
    s.allreduce(torch.ones(2)).wait()
    time.sleep(10)
"""


def _gloo_threads() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # ended meanwhile
            pass
    return [name for name in names if "gloo" in name]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_a_fault_keeps_no_gloo_thread_past_the_session() -> None:
    """After a timeout the program still holds the handles and the error (whose
    traceback reaches their frames); leaving must still end gloo's I/O threads
    at once, not at the next garbage collection (found by tests/test_netfaults.py)."""
    port = free_port()
    peer = subprocess.Popen(
        [sys.executable, "-c", _SILENT_RANK1, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert peer.stdout is not None
    peer.stdout.readline()  # torch imported: it joins well within our 2 s
    gc.disable()  # only references count, as between two collections
    try:
        with (
            pytest.raises(CollectiveTimeout),
            DistSession(
                rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=2
            ) as s,
        ):
            s.allreduce(torch.ones(2)).wait()
            handles = [
                s.allreduce(torch.ones(2)),
                s.allreduce(torch.ones(1 << 20)),
                s.broadcast(torch.ones(3), src=1),
            ]
            for handle in handles:
                handle.wait()
        assert len(handles) == 3  # still held
        assert not _gloo_threads()
    finally:
        gc.enable()
        peer.kill()
        peer.communicate()  # reaps it and closes the pipe
