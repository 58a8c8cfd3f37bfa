"""Handles under plain asyncio, written the way asyncio users write it.

pytest-asyncio runs these (``@pytest.mark.asyncio``), not anyio. Rank 1 runs
in a child process (``_peer.late_peer``) and issues its side of each
collective ``LATE`` seconds after both ranks joined, so rank 0's handles are
really pending for about that long. Rank r contributes ``VALUES[r] * (i + 1)``
to the i-th allreduce, so every result is known exactly.

What works with a ``Handle`` (an awaitable, not a coroutine or a future):
``await h``, ``asyncio.wait_for(h, t)``, ``asyncio.gather(*hs)``,
``asyncio.ensure_future(h)`` and ``asyncio.shield(h)`` (both wrap it in a
task); ``asyncio.create_task`` needs a coroutine, e.g. ``create_task(wait(h))``
with ``async def wait(h): return await h``. Cancelling any of these cancels
the waiting, never the collective.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from _peer import late_peer

from asyncdist import DistSession, Handle

pytestmark = pytest.mark.timeout(60)

LATE = 1.0  # seconds rank 1 waits before issuing its collectives
TIMEOUT = 20.0
VALUES = (1.0, 10.0)  # rank r's contribution, times (i + 1) for the i-th allreduce


def expected(i: int) -> list[float]:
    return [sum(VALUES) * (i + 1)] * 4


def mine(i: int, rank: int = 0) -> torch.Tensor:
    return torch.full((4,), VALUES[rank] * (i + 1))


def _peer_allreduces(session: DistSession, late: float, count: int) -> list[list[float]]:
    """Rank 1: after ``late`` seconds, the matching ``count`` allreduces."""
    assert session.rank == 1
    assert session.world_size == 2
    time.sleep(late)
    tensors = [mine(i, rank=1) for i in range(count)]
    handles = [session.allreduce(t) for t in tensors]
    return [h.wait().tolist() for h in handles]


async def _wait(h: Handle[Any]) -> Any:
    return await h


@pytest.mark.asyncio
async def test_async_with_session_single_rank() -> None:
    async with DistSession() as s:
        assert (s.rank, s.world_size) == (0, 1)
        t = torch.arange(4.0)
        assert await s.allreduce(t) is t
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert s.closed


@pytest.mark.asyncio
async def test_wait_for_times_out_then_succeeds() -> None:
    async with late_peer(_peer_allreduces, LATE, 1) as peer, DistSession(timeout=TIMEOUT) as s:
        t = mine(0)
        h = s.allreduce(t)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(h, 0.1)
        assert not h.done(), "a timed-out wait_for leaves the collective pending"
        assert await asyncio.wait_for(h, TIMEOUT) is t
        assert t.tolist() == expected(0)
        assert h.done()
        assert await h is t, "awaiting again gives the result"
    assert peer.result == [expected(0)]


@pytest.mark.asyncio
async def test_gather_results_in_order() -> None:
    async with late_peer(_peer_allreduces, LATE, 3) as peer, DistSession(timeout=TIMEOUT) as s:
        tensors = [mine(i) for i in range(3)]
        handles = [s.allreduce(t) for t in tensors]
        assert not any(h.done() for h in handles)
        results = await asyncio.gather(*handles)
        assert all(r is t for r, t in zip(results, tensors, strict=True))
        assert [r.tolist() for r in results] == [expected(i) for i in range(3)]
    assert peer.result == [expected(i) for i in range(3)]


@pytest.mark.asyncio
async def test_asyncio_timeout() -> None:
    async with late_peer(_peer_allreduces, LATE, 1), DistSession(timeout=TIMEOUT) as s:
        t = mine(0)
        h = s.allreduce(t)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await h
        assert not h.done()
        async with asyncio.timeout(TIMEOUT):
            assert await h is t
        assert t.tolist() == expected(0)


@pytest.mark.asyncio
async def test_task_group_overlaps_work_with_a_pending_handle() -> None:
    async with late_peer(_peer_allreduces, LATE, 1), DistSession(timeout=TIMEOUT) as s:
        t = mine(0)
        h = s.allreduce(t)
        ticks = 0

        async def work() -> None:
            nonlocal ticks
            while not h.done():
                ticks += 1
                await asyncio.sleep(0.01)

        async with asyncio.TaskGroup() as tg:
            waiter = tg.create_task(_wait(h))
            tg.create_task(work())
        assert waiter.result() is t
        assert t.tolist() == expected(0)
        # ~LATE s of 10 ms sleeps; far fewer would mean the loop was held
        assert ticks >= 20, ticks


@pytest.mark.asyncio
async def test_shield() -> None:
    async with late_peer(_peer_allreduces, LATE, 2), DistSession(timeout=TIMEOUT) as s:
        # shield(h) directly: the handle is awaitable, shield wraps it in a task
        t0 = mine(0)
        h0 = s.allreduce(t0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(h0), 0.1)
        # with an explicit inner task, its result can be awaited after the timeout
        t1 = mine(1)
        h1 = s.allreduce(t1)
        inner = asyncio.ensure_future(h1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(inner), 0.1)
        assert not inner.cancelled(), "shield kept the inner task"
        assert not inner.done()
        assert await inner is t1
        assert await h0 is t0
        assert t0.tolist() == expected(0)
        assert t1.tolist() == expected(1)
        with pytest.raises(TypeError):  # create_task needs a coroutine
            asyncio.create_task(h0)  # type: ignore[arg-type]  # noqa: RUF006


@pytest.mark.asyncio
async def test_cancelled_task_never_cancels_the_collective() -> None:
    async with late_peer(_peer_allreduces, LATE, 1), DistSession(timeout=TIMEOUT) as s:
        t = mine(0)
        h = s.allreduce(t)
        task = asyncio.create_task(_wait(h))
        await asyncio.sleep(0.1)
        assert not task.done()
        assert not h.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert not h.done(), "cancelling the waiter left the collective pending"
        # nobody awaits now: the collective still completes on its own
        deadline = time.monotonic() + TIMEOUT
        while not h.done():
            assert time.monotonic() < deadline, "the collective never completed"
            await asyncio.sleep(0.01)
        assert h.exception() is None
        assert t.tolist() == expected(0)
        assert await h is t, "another await gets the result"
        assert h.wait() is t


@pytest.mark.asyncio
async def test_cancelled_ensure_future_task() -> None:
    async with late_peer(_peer_allreduces, LATE, 1), DistSession(timeout=TIMEOUT) as s:
        t = mine(0)
        h = s.allreduce(t)
        task = asyncio.ensure_future(h)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not h.done()
        assert await asyncio.wait_for(h, TIMEOUT) is t
        assert t.tolist() == expected(0)
