"""Calls that wait for a peer keep the event loop running (DESIGN: "Never block
the event loop").

This process is rank 0; rank 1 (``_peer.late_peer``) is late by ``LATE``
seconds for the call under test, so a call that blocked the loop thread
until the peer arrived would stall it for about ``LATE`` s, far above
``_stall.STALL_BOUND``. Each test measures the stall around the call with
its own ``no_stall()`` and prints it (``pytest -s`` shows it); every async
test also runs under the autouse check in conftest.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import torch
from _peer import late_peer
from _stall import STALL_BOUND, no_stall

import asyncdist._store
from asyncdist import DistSession

pytestmark = pytest.mark.timeout(60)

LATE = 1.0  # seconds the peer is late for the call under test
TIMEOUT = 20.0
HERE = Path(__file__).parent


def report(what: str, stall: float) -> None:
    print(f"max loop stall during {what}: {stall:.3f} s")


# -- peers (rank 1, in a child process) ----------------------------------------------


def _peer_present(session: DistSession) -> int:
    return session.world_size


def _peer_broadcast_object(session: DistSession, late: float) -> object:
    time.sleep(late)
    return session.broadcast_object(None, src=0).wait()


def _peer_allreduce(session: DistSession, late: float) -> list[float]:
    time.sleep(late)
    return session.allreduce(torch.full((4,), 10.0)).wait().tolist()


def _peer_split(session: DistSession, late: float) -> tuple[int, list[float]]:
    time.sleep(late)
    with session.split(2) as sub:
        return sub.world_size, sub.allreduce(torch.full((2,), 10.0)).wait().tolist()


def _model(rank: int) -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
    return model


def _peer_broadcast_parameters(session: DistSession, late: float) -> list[float]:
    model = _model(session.rank)
    sync = session.gradient_sync(model)
    time.sleep(late)
    sync.broadcast_parameters()
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


def _peer_trace(session: DistSession, late: float, path: str) -> None:
    with session.trace(path):
        session.allreduce(torch.full((4,), 10.0)).wait()
        time.sleep(late)  # leaves its trace block late


# -- calls that are non-blocking today ----------------------------------------------


@pytest.mark.anyio
async def test_session_entry_while_the_peer_joins_late() -> None:
    async with late_peer(_peer_present, join_late=LATE) as peer:
        async with no_stall() as meter:
            started = time.monotonic()
            async with DistSession(timeout=TIMEOUT) as s:
                waited = time.monotonic() - started
                assert (s.rank, s.world_size) == (0, 2)
        report("session entry", meter.max_stall)
        assert waited >= LATE, "the peer was not late: the test proves nothing"
    assert peer.result == 2
    assert ("127.0.0.1", peer.port) not in asyncdist._store.kept_addresses(), (
        "store connection leaked"
    )


@pytest.mark.anyio
async def test_broadcast_object() -> None:
    async with (
        late_peer(_peer_broadcast_object, LATE) as peer,
        DistSession(timeout=TIMEOUT) as s,
    ):
        async with no_stall() as meter:
            assert await s.broadcast_object({"step": 7}) == {"step": 7}
        report("broadcast_object", meter.max_stall)
    assert peer.result == {"step": 7}


@pytest.mark.anyio
async def test_await_allreduce() -> None:
    async with late_peer(_peer_allreduce, LATE) as peer, DistSession(timeout=TIMEOUT) as s:
        t = torch.full((4,), 1.0)
        async with no_stall() as meter:
            started = time.monotonic()
            assert await s.allreduce(t) is t
            waited = time.monotonic() - started
        report("await allreduce", meter.max_stall)
        assert waited >= LATE / 2, "the peer was not late: the test proves nothing"
        assert t.tolist() == [11.0] * 4
    assert peer.result == [11.0] * 4


# -- calls whose async form is new: split_async, broadcast_parameters_async, ---------
# -- `async with trace()`, debug verification --------------------------------------


@pytest.mark.anyio
async def test_split_async() -> None:
    async with late_peer(_peer_split, LATE) as peer, DistSession(timeout=TIMEOUT) as s:
        async with no_stall() as meter:
            sub = await s.split_async(2)
        report("split_async", meter.max_stall)
        async with sub:
            assert sub.world_size == 2
            assert (await sub.allreduce(torch.full((2,), 1.0))).tolist() == [11.0] * 2
    assert peer.result == (2, [11.0] * 2)


@pytest.mark.anyio
async def test_broadcast_parameters_async() -> None:
    async with (
        late_peer(_peer_broadcast_parameters, LATE) as peer,
        DistSession(timeout=TIMEOUT) as s,
    ):
        model = _model(s.rank)
        sync = s.gradient_sync(model)
        async with no_stall() as meter:
            await sync.broadcast_parameters_async()
        report("broadcast_parameters_async", meter.max_stall)
        sync.remove()
        assert all(bool((p == 1.0).all()) for p in model.parameters())
    assert peer.result == [1.0] * (3 * 2 + 2)


@pytest.mark.anyio
async def test_trace_exit(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    async with late_peer(_peer_trace, LATE, str(path)), DistSession(timeout=TIMEOUT) as s:
        async with no_stall() as meter, s.trace(path):
            await s.allreduce(torch.full((4,), 1.0))
        report("trace block exit", meter.max_stall)
    events = json.loads(path.read_text())
    assert events, "rank 0 wrote the merged trace"


@pytest.mark.anyio
async def test_debug_verification() -> None:
    async with (
        late_peer(_peer_allreduce, LATE, debug=True) as peer,
        DistSession(timeout=TIMEOUT, debug=True) as s,
    ):
        t = torch.full((4,), 1.0)
        async with no_stall() as meter:
            h = s.allreduce(t)  # the fingerprint exchange waits for the peer
            assert await h is t
        report("allreduce with debug=True", meter.max_stall)
        assert t.tolist() == [11.0] * 4
    assert peer.result == [11.0] * 4


# -- the check itself ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_check_fails_on_a_blocking_call(backend: str) -> None:
    """A sync test (so the autouse check does not wrap it) running its own loop."""
    measured: list[float] = []

    async def blocking() -> None:
        async with no_stall() as meter:
            measured.append(meter.max_stall)
            time.sleep(0.5)  # noqa: ASYNC251 - holds the loop thread, as a blocking wait for a peer would
        measured.append(meter.max_stall)  # not reached

    with pytest.raises(AssertionError, match=r"the event loop stalled for 0\.\d+ s") as info:
        anyio.run(blocking, backend=backend)
    assert measured == [0.0]
    stall = float(str(info.value).split("stalled for ")[1].split(" s")[0])
    report("time.sleep(0.5)", stall)
    assert stall >= 0.45

    async def cooperative() -> float:
        async with no_stall() as meter:
            await anyio.sleep(0.5)
        return meter.max_stall

    stall = anyio.run(cooperative, backend=backend)
    report("anyio.sleep(0.5)", stall)
    assert stall < STALL_BOUND


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_body_error_wins_with_the_stall_as_a_note(backend: str) -> None:
    async def main() -> None:
        async with no_stall():
            time.sleep(0.4)  # noqa: ASYNC251 - a stall on purpose
            raise KeyError("mine")

    with pytest.raises(KeyError) as info:
        anyio.run(main, backend=backend)
    assert any("stalled" in note for note in info.value.__notes__)


INNER_TESTS = """
import asyncio, time
import anyio, pytest

@pytest.mark.anyio
async def test_anyio_blocks():
    time.sleep(0.5)

@pytest.mark.asyncio
async def test_asyncio_blocks():
    time.sleep(0.5)

@pytest.mark.anyio
async def test_anyio_sleeps():
    await anyio.sleep(0.5)

@pytest.mark.asyncio
async def test_asyncio_sleeps():
    await asyncio.sleep(0.5)

@pytest.mark.anyio
async def test_anyio_fixture(tmp_path):
    assert tmp_path.exists()

@pytest.mark.asyncio
async def test_asyncio_fixture(tmp_path):
    assert tmp_path.exists()
"""


def test_every_async_test_runs_under_the_check(tmp_path: Path) -> None:
    """conftest's wrapping fails a blocking async test under anyio (asyncio and
    trio) and pytest-asyncio, passes cooperative ones, and keeps fixtures."""
    for name in ("conftest.py", "_stall.py"):
        (tmp_path / name).write_text((HERE / name).read_text())
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "test_inner.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    failed = sorted(
        line.split("::")[1].split(" ")[0] for line in out.splitlines() if line.startswith("FAILED")
    )
    assert failed == [
        "test_anyio_blocks[asyncio]",
        "test_anyio_blocks[trio]",
        "test_asyncio_blocks",
    ], out
    assert "3 failed, 6 passed" in out, out
    assert out.count("the event loop stalled for") >= 3, out
