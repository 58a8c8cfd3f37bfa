"""Handle semantics: eager launch, awaiting, waiting, cancellation, wait_all."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

from asyncdist import DistSession, Handle, PeerFailure, spawn, wait_all

pytestmark = pytest.mark.timeout(60)

LATE = 1.0  # seconds the late rank waits before joining a collective


def test_no_public_constructor() -> None:
    with pytest.raises(TypeError, match="no public constructor"):
        Handle()


def test_result_wait_and_repr() -> None:
    with DistSession() as s:
        t = torch.ones(3)
        h = s.allreduce(t)
        assert h.wait() is t
        assert h.wait() is t, "waiting twice is fine"
        assert h.done()
        assert h.exception() is None
        assert repr(h) == "<Handle allreduce done>"
        assert h.op == "allreduce"


@pytest.mark.anyio
async def test_await_twice_then_wait() -> None:
    async with DistSession() as s:
        t = torch.ones(3)
        h = s.allreduce(t)
        assert await h is t
        assert await h is t
        assert h.wait() is t


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_completed_handle_returns_without_yielding() -> None:
    """asyncio's convention: awaiting a done future does not yield."""
    async with DistSession() as s:
        h = s.broadcast(torch.ones(2))
        h.wait()
        with anyio.CancelScope() as scope:
            scope.cancel()
            # A cancelled scope would raise at any checkpoint; a done handle has none.
            result = await h
            assert await wait_all([h, h]) == [result, result]
        assert not scope.cancelled_caught
        assert torch.equal(result, torch.ones(2))
        ran = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _append(ran))  # scheduled, but not run until we yield
            for _ in range(100):
                await h
            assert ran == [], "awaiting a done handle let another task run"
        assert ran == [1]


async def _append(ran: list[int]) -> None:
    ran.append(1)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_on_trio_awaiting_a_completed_handle_is_a_checkpoint() -> None:
    """trio's rule: every await is a cancel point and a schedule point, even
    when nothing needs waiting for."""
    async with DistSession() as s:
        t = torch.ones(2)
        h = s.allreduce(t)
        h.wait()
        for done in h, wait_all([h, s.broadcast(torch.ones(1))]):
            done.wait()
            with anyio.CancelScope() as scope:
                scope.cancel()
                await done
            assert scope.cancelled_caught, f"await {done!r} ignored a cancelled scope"
        assert await h is t, "the handle stays valid after a cancelled await"
        # a loop of quick awaits is cancellable...
        awaited = 0
        with anyio.move_on_after(0.05) as scope:
            while awaited < 2_000_000:
                await h
                awaited += 1
        assert scope.cancelled_caught, f"{awaited} awaits never noticed the deadline"
        # ...and leaves the other tasks their turn
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for _ in range(200):
                await h
            seen = ticks
            tg.cancel_scope.cancel()
        assert seen >= 50, f"a sibling task ran {seen} times during 200 awaits"


@pytest.mark.anyio
async def test_wait_all_results_in_order() -> None:
    async with DistSession() as s:
        tensors = [torch.full((2,), float(i)) for i in range(5)]
        handles = [s.allreduce(t) for t in tensors]
        assert await wait_all(handles) == tensors
        assert wait_all(handles).wait() == tensors
        assert wait_all([]).wait() == []
    with pytest.raises(TypeError, match="Handles"):
        wait_all([1])  # type: ignore[list-item]


# -- two ranks, one of them late -------------------------------------------------


def _eager(session: DistSession) -> float:
    """The handle completes although nobody awaits it."""
    if session.rank == 1:
        time.sleep(LATE)
    t = torch.full((4,), float(session.rank + 1))
    h = session.allreduce(t)
    deadline = time.monotonic() + 20
    while not h.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert torch.equal(t, torch.full((4,), 3.0)), "values final once done"
    return float(t[0])


def test_eager_launch_completes_without_waiting() -> None:
    assert spawn(_eager, 2, timeout=20) == [3.0, 3.0]


def _wait_timeout(session: DistSession) -> bool:
    if session.rank == 1:
        time.sleep(LATE)
    t = torch.ones(4)
    h = session.allreduce(t)
    if session.rank == 0:
        with pytest.raises(TimeoutError):
            h.wait(timeout=0.1)
        assert not h.done()
    h.wait()
    return torch.equal(t, torch.full((4,), 2.0))


def test_wait_timeout_leaves_handle_valid() -> None:
    assert spawn(_wait_timeout, 2, timeout=20) == [True, True]


async def _cancel_then_await(session: DistSession) -> dict[str, object]:
    if session.rank == 1:
        await anyio.sleep(LATE)
    t = torch.full((8,), float(session.rank))
    h = session.allreduce(t, op="sum")
    report: dict[str, object] = {}
    if session.rank == 0:
        with anyio.move_on_after(0.2) as scope:
            await h
        report["cancelled"] = scope.cancelled_caught
        report["done_after_cancel"] = h.done()
        try:  # fail_after: the same, as a TimeoutError
            with anyio.fail_after(0.1):
                await h
            report["fail_after"] = "no timeout"
        except TimeoutError:
            report["fail_after"] = "TimeoutError"
    result = await h
    report["value"] = result.tolist()
    return report


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancelling_the_wait_never_cancels_the_collective(backend: str) -> None:
    rank0, rank1 = spawn(_cancel_then_await, 2, timeout=20, async_backend=backend)
    assert rank0["cancelled"] is True
    assert rank0["done_after_cancel"] is False
    assert rank0["fail_after"] == "TimeoutError"
    assert rank0["value"] == [1.0] * 8
    assert rank1["value"] == [1.0] * 8


async def _loop_stays_free(session: DistSession) -> dict[str, int]:
    """While rank 0 awaits 300 handles of a late peer, its loop keeps running
    other tasks and no thread is started per handle."""
    if session.rank == 1:
        await anyio.sleep(LATE)
    ticks = 0
    threads_before = threading.active_count()
    tensors = [torch.full((16,), float(i)) for i in range(300)]
    handles = [session.allreduce(t) for t in tensors]
    threads_during = threading.active_count()

    async def ticker() -> None:
        nonlocal ticks, threads_during
        while True:
            await anyio.sleep(0.01)
            ticks += 1
            threads_during = max(threads_during, threading.active_count())

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        # awaited in reverse order: completion order does not matter
        results = [await h for h in reversed(handles)]
        tg.cancel_scope.cancel()
    results.reverse()
    assert all(torch.equal(r, torch.full((16,), 2.0 * i)) for i, r in enumerate(results))
    # the most threads seen while the handles were awaited
    return {"ticks": ticks, "extra_threads": threads_during - threads_before}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_awaiting_never_blocks_the_loop_nor_parks_threads(backend: str) -> None:
    rank0, _ = spawn(_loop_stays_free, 2, timeout=20, async_backend=backend)
    assert rank0["ticks"] >= 20, "the event loop was blocked while awaiting"
    assert rank0["extra_threads"] <= 0, "a thread was started per handle"


async def _first_object_collective(session: DistSession) -> int:
    """The first object collective (gradient_sync's first step makes one) must
    not block the loop while a peer is late: its side group formed at entry."""
    if session.rank == 1:
        await anyio.sleep(LATE)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        value = await session.broadcast_object({"step": 1}, src=1, allowed=[])
        tg.cancel_scope.cancel()
    assert value == {"step": 1}
    return ticks


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_first_object_collective_does_not_block_the_loop(backend: str) -> None:
    ticks, _ = spawn(_first_object_collective, 2, timeout=20, async_backend=backend)
    assert ticks >= 20, "the loop was blocked while the peer was late"


def _repr_of_a_failed_handle(session: DistSession) -> tuple[str, str] | None:
    """Printing a failed handle must not count as seeing its error: leaving the
    session still raises the fault nobody waited on."""
    if session.rank == 1:
        raise SystemExit(0)  # leaves its session: rank 0's allreduce fails
    h = session.allreduce(torch.ones(4))
    deadline = time.monotonic() + 20
    while not h.done():
        assert time.monotonic() < deadline, "the peer's departure was never noticed"
        time.sleep(0.01)
    shown = repr(h)
    try:
        session.close()
    except PeerFailure as exc:
        return shown, type(exc).__name__
    return shown, "nothing raised at exit"


def test_repr_is_pure() -> None:
    result, _ = spawn(_repr_of_a_failed_handle, 2, timeout=10, join_timeout=40)
    assert result == ("<Handle allreduce failed: PeerFailure>", "PeerFailure"), (
        "repr marked the error as seen"
    )
