"""Channels: independent lanes for tasks that issue concurrently, and the misuse check."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.distributed as dist

from asyncdist import (
    AsyncDistError,
    CollectiveMismatch,
    DistSession,
    PeerFailure,
    SessionBroken,
    SessionClosed,
    spawn,
)

pytestmark = pytest.mark.timeout(120)

OPS = 200


async def _worker(lane: Any, tag: int, rank: int, world: int, seed: int) -> list[float]:
    """``OPS`` allreduces of rank- and tag-dependent values, with random
    awaits between them (different on every rank) so that two such workers
    interleave differently on every rank."""
    rng = random.Random(seed * 1000 + rank * 10 + tag)
    wrong = []
    for i in range(OPS):
        t = torch.full((3,), float(tag * 10_000 + i * 10 + rank))
        h = lane.allreduce(t)
        for _ in range(rng.randrange(3)):
            await anyio.lowlevel.checkpoint()
        if rng.random() < 0.3:
            await anyio.sleep(rng.random() / 1000)
        await h
        expected = world * (tag * 10_000 + i * 10) + sum(range(world))
        if t.tolist() != [float(expected)] * 3:
            wrong.append(float(t[0]))
    return wrong


async def _two_tasks_on_channels(s: DistSession, seed: int) -> list[list[float]]:
    train = await s.channel_async("train")
    metrics = s.channel("metrics")  # declared at entry: no wait
    results: list[list[float]] = [[], []]

    async def run(slot: int, lane: Any) -> None:
        results[slot] = await _worker(lane, slot + 1, s.rank, s.world_size, seed)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, 0, train)
        tg.start_soon(run, 1, metrics)
    return results


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_two_tasks_on_their_own_channels_get_exact_results(world: int, backend: str) -> None:
    results = spawn(
        _two_tasks_on_channels,
        world,
        args=(world,),
        timeout=60,
        async_backend=backend,
        channels=["metrics"],
    )
    assert results == [[[], []]] * world, "a collective paired with another task's"


async def _two_tasks_on_one_lane(s: DistSession) -> list[str]:
    """The same two workers on the session's one lane. Rank 1 starts late, so
    rank 0's first collective is outstanding when its second task issues:
    rank 0 must refuse it. The other ranks may or may not (their interleaving
    differs); whatever follows, every task stops at its first error and
    nothing hangs."""
    if s.rank == 1:
        await anyio.sleep(0.5)
    errors: list[str] = []

    async def run(tag: int) -> None:
        try:
            await _worker(s, tag, s.rank, s.world_size, 7)
        except AsyncDistError as exc:  # the refusal, or a peer that stopped
            errors.append(f"{type(exc).__name__}: {exc}")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 1)
            tg.start_soon(run, 2)
    return errors


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_two_tasks_on_one_lane_are_refused_on_the_issuing_rank(backend: str) -> None:
    errors = spawn(_two_tasks_on_one_lane, 2, timeout=10, async_backend=backend)[0]
    refused = [e for e in errors if e.startswith("CollectiveMismatch")]
    assert refused, errors
    assert "two tasks at once issue on the session" in refused[0]
    assert "channel(" in refused[0], "the message points at channels"
    assert "Nothing was launched" in refused[0]


def _threads_on_one_lane(s: DistSession) -> str:
    """Two threads: the second's call, while the first's is outstanding, is refused."""
    if s.rank == 1:
        time.sleep(1.0)  # keeps rank 0's first allreduce outstanding
        s.allreduce(torch.ones(2)).wait()
        return ""
    h = s.allreduce(torch.ones(2))
    caught: list[str] = []

    def other() -> None:
        try:
            s.allreduce(torch.ones(2))
        except CollectiveMismatch as exc:
            caught.append(str(exc))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    h.wait()
    return caught[0] if caught else "not refused"


def test_a_second_thread_is_refused_while_the_first_has_work_outstanding() -> None:
    message, _ = spawn(_threads_on_one_lane, 2, timeout=20)
    assert "two tasks at once" in message


def _sequential_issuers(s: DistSession) -> list[float]:
    """A thread's code and anyio.run inside it, or one task after another:
    sequential by construction, never refused, even with work outstanding."""
    if s.rank == 1:
        time.sleep(0.5)  # rank 0's first allreduce stays outstanding meanwhile
    first = torch.ones(1)
    h = s.allreduce(first)
    second = torch.ones(1)

    async def inner() -> None:
        await s.allreduce(second)

    anyio.run(inner)
    h.wait()
    third = torch.ones(1)
    pending = s.allreduce(third)  # back in the thread's code, after the task
    anyio.run(inner)  # another task, while the thread's third is outstanding
    pending.wait()
    return [float(first[0]), float(second[0]), float(third[0])]


def test_sequential_issuers_are_fine() -> None:
    assert spawn(_sequential_issuers, 2, timeout=20) == [[2.0, 4.0, 2.0]] * 2


def test_channels_are_named_once_and_checked() -> None:
    with DistSession(channels=["a"]) as s:
        a = s.channel("a")
        assert s.channel("a") is a
        assert a.name == "a"
        assert (a.rank, a.world_size, a.backend, a.device) == (0, 1, "gloo", torch.device("cpu"))
        assert a.group is not None
        assert a.group is not s.group
        assert repr(a) == "<Channel 'a' rank=0/1 open>"
        with pytest.raises(TypeError, match="name must be a string"):
            s.channel(3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="must not be empty"):
            s.channel("")
        t = torch.ones(2)
        assert a.allreduce(t).wait() is t
    with pytest.raises(TypeError, match="name must be a string"):
        DistSession(channels=[None])  # type: ignore[list-item]


def test_a_channel_closes_with_its_session() -> None:
    with DistSession() as s:
        ch = s.channel("x")
        pending = ch.allreduce(torch.ones(2))
    assert pending.done(), "leaving the session drains the channels"
    assert ch.closed
    assert ch.group is None
    with pytest.raises(SessionClosed, match="allreduce on rank 0: the session is closed"):
        ch.allreduce(torch.ones(2))


def _sub_channels(s: DistSession) -> list[float]:
    sub = s.split(2)
    ch = sub.channel("inner")
    t = torch.tensor([float(s.rank)])
    ch.allreduce(t).wait()
    return t.tolist()


def test_sub_sessions_have_channels() -> None:
    results = spawn(_sub_channels, 4, timeout=30)
    assert results == [[1.0], [1.0], [5.0], [5.0]]


async def _dead_peer(s: DistSession) -> dict[str, str] | None:
    a, b = s.channel("a"), s.channel("b")
    if s.rank == 1:
        await anyio.sleep(0.5)
        raise SystemExit(0)  # leaves while rank 0 waits on every lane
    handles = {"a": a.allreduce(torch.ones(4)), "b": b.allreduce(torch.ones(4))}
    handles["session"] = s.allreduce(torch.ones(4))
    outcome: dict[str, str] = {}
    started = time.monotonic()
    for name, h in handles.items():
        try:
            await h
            outcome[name] = "completed"
        except PeerFailure:
            outcome[name] = "PeerFailure"
    outcome["seconds"] = f"{time.monotonic() - started:.1f}"
    try:
        a.allreduce(torch.ones(1))
    except SessionBroken:
        outcome["after"] = "SessionBroken"
    return outcome


def test_a_dead_peer_fails_the_waiters_of_every_channel_within_the_bound() -> None:
    outcome, _ = spawn(_dead_peer, 2, timeout=5, join_timeout=40)
    assert outcome is not None
    assert {outcome[k] for k in ("a", "b", "session")} == {"PeerFailure"}, outcome
    assert float(outcome["seconds"]) < 5 + 3, "the session timeout plus the grace"
    assert outcome["after"] == "SessionBroken"


def test_threads_stay_flat_over_sessions_with_channels() -> None:
    def asyncdist_threads() -> int:
        return sum(t.name.startswith("asyncdist") for t in threading.enumerate())

    counts = []
    for _ in range(50):
        with DistSession(channels=["a", "b"]) as s:
            s.channel("a").allreduce(torch.ones(1))
            s.channel("b").broadcast_object({"x": 1}).wait()
        counts.append(asyncdist_threads())
    assert not dist.is_initialized()
    assert max(counts) == counts[0] == 0, counts


def _debug_on_a_channel(s: DistSession) -> str:
    ch = s.channel("c")
    s.allreduce(torch.ones(3)).wait()  # the session's lane is in step...
    try:  # ...the channel's is not: shapes differ
        ch.allreduce(torch.ones(2 if s.rank == 0 else 5)).wait()
    except CollectiveMismatch as exc:
        return str(exc)
    return "no mismatch detected"


def test_debug_mode_verifies_each_channel() -> None:
    for message in spawn(_debug_on_a_channel, 2, timeout=20, debug=True):
        assert "allreduce of float32[2] on rank 0 vs float32[5] on rank 1" in message


async def _one_channel_asked_for_twice(s: DistSession) -> tuple[bool, list[float]]:
    """Rank 0: two tasks ask for the new channel "m" at once; rank 1: one task.
    Rank 0 must form it once, or the ranks' groups no longer pair."""
    if s.rank == 0:
        got: list[Any] = []

        async def ask() -> None:
            got.append(await s.channel_async("m"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            tg.start_soon(ask)
        channel, same = got[0], got[0] is got[1]
    else:
        channel, same = await s.channel_async("m"), True
    t = torch.ones(2)
    with anyio.fail_after(10):
        await channel.allreduce(t)
        await s.allreduce(t)  # the session's own lane is still in step
    return same, t.tolist()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_channel_asked_for_by_two_tasks_at_once_forms_once(backend: str) -> None:
    results = spawn(
        _one_channel_asked_for_twice, 2, timeout=10, async_backend=backend, join_timeout=60
    )
    assert results == [(True, [4.0, 4.0])] * 2


def test_a_channel_over_a_frozen_store_is_a_collective_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A channel forms over the session's store: that store's host freezing
    there held the forming forever. It is a CollectiveTimeout at the timeout
    plus the grace now (a world of one on a launcher agent's store, which a
    child process hosts)."""
    from _store_host import one_rank_on, store_host, until_no_forming_is_held

    from asyncdist import CollectiveTimeout, _groups
    from asyncdist._store import forget_address

    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.5)
    with store_host() as host:
        one_rank_on(host, monkeypatch)
        with DistSession(timeout=1) as s:
            host.stop()
            started = time.monotonic()
            with pytest.raises(CollectiveTimeout) as told:
                s.channel("frozen")
            assert 1.5 <= time.monotonic() - started < 1.5 + 2.0
            said = "a channel's forming: the rendezvous store did not answer within 1.5 s"
            assert said in str(told.value.__cause__)
            assert f"channel on rank 0 did not complete: {said}" in str(told.value)
            assert "alive but silent" not in str(told.value)  # the store is, not a peer
            host.kill()  # (the session's exit then finds its store closed)
        until_no_forming_is_held()
        forget_address("127.0.0.1", host.port)  # the store this process kept for it
