"""split(): sub-sessions over blocks of consecutive ranks."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _ports import listening
from _store_host import until_no_forming_is_held

from asyncdist import DistSession, InitError, SessionClosed, _groups, spawn

pytestmark = pytest.mark.timeout(90)


def _split(s: DistSession, size: int) -> dict[str, Any]:
    sub = s.split(size)
    t = torch.tensor([float(s.rank)])
    sub.allreduce(t).wait()
    b = torch.tensor([float(s.rank)])
    sub.broadcast(b, src=sub.world_size - 1).wait()
    gathered = sub.all_gather_object(s.rank).wait()
    s.allreduce(torch.ones(1)).wait()  # the parent still works alongside
    return {
        "rank": sub.rank,
        "world": sub.world_size,
        "sum": t.item(),
        "bcast": b.item(),
        "members": gathered,
        "main": sub.is_main,
    }


@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_into_blocks(size: int) -> None:
    results = spawn(_split, 4, args=(size,), timeout=30)
    for rank, out in enumerate(results):
        block = list(range(rank // size * size, rank // size * size + size))
        assert out["rank"] == rank % size
        assert out["world"] == size
        assert out["sum"] == float(sum(block))
        assert out["bcast"] == float(block[-1])
        assert out["members"] == block
        assert out["main"] == (rank % size == 0)


def _bad_split(s: DistSession) -> list[str]:
    messages = []
    for size in (3, 0, 5):
        with pytest.raises(ValueError, match="does not divide") as info:
            s.split(size)
        messages.append(str(info.value))
    with pytest.raises(TypeError):
        s.split("2")  # type: ignore[arg-type]
    # no group was created: both ranks are still in step
    t = torch.ones(1)
    s.allreduce(t).wait()
    assert t.item() == 2.0
    return messages


def test_sizes_that_do_not_divide_raise_before_any_group() -> None:
    assert all(spawn(_bad_split, 2, timeout=20)[0])


def _released_with_parent(s: DistSession) -> tuple[bool, bool]:
    sub = s.split(1)
    group = sub.group
    with sub:
        sub.allreduce(torch.ones(1)).wait()
    scoped_closed = sub.closed
    sub2 = s.split(2)
    s.close()
    try:
        sub2.allreduce(torch.ones(1))
    except SessionClosed:
        closed_with_parent = True
    else:
        closed_with_parent = False
    assert group is not None
    return scoped_closed, closed_with_parent and not dist.is_initialized()


def test_sub_sessions_are_released_with_their_parent() -> None:
    assert spawn(_released_with_parent, 2, timeout=20) == [(True, True)] * 2


def _a_later_block_fails(s: DistSession) -> tuple[int, int, str]:
    """Split into blocks of one; forming the second block's group fails on
    every rank (injected). The torch groups registered before and after."""
    from torch.distributed import distributed_c10d

    from asyncdist import CollectiveError

    real, calls = dist.new_group, []

    def failing_second(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("injected: the second block's group did not form")
        return real(*args, **kwargs)

    before = len(distributed_c10d._world.pg_map)
    dist.new_group = failing_second
    try:
        try:
            s.split(1)
        except CollectiveError as exc:
            told = type(exc).__name__
        else:
            told = "nothing"
    finally:
        dist.new_group = real
    return before, len(distributed_c10d._world.pg_map), told


def test_a_split_whose_later_block_fails_leaves_no_group_registered() -> None:
    """Rank 0's own block formed first; the second block's failure must not
    leave it registered (in an adopted world it would outlive the session)."""
    for before, after, told in spawn(_a_later_block_fails, 2, timeout=30):
        assert told == "CollectiveError"
        assert after == before


# -- a rendezvous given up on ------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_rendezvous_given_up_on_refuses_every_forming_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a silent store leaves: the forming thread, held. Its caller
    stops waiting at the timeout plus the grace; until the held forming
    returns, nothing forms in this process (it may yet write torch's group
    state); what it formed late goes to ``late``, and forming works again."""
    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.2)
    release, dropped = threading.Event(), []

    def held() -> str:
        release.wait(10)
        return "a group formed late"

    started = time.monotonic()
    with pytest.raises(_groups.StoreSilent) as told:
        _groups.rendezvous(held, "the test's forming", 0.3, late=dropped.append)
    assert 0.5 <= time.monotonic() - started < 1.5
    assert str(told.value) == (
        "the test's forming: the rendezvous store did not answer within 0.5 s; its host is "
        "stopped or frozen, or cut off from this process"
    )
    refused = "this process gave up on the test's forming: its rendezvous store stopped"
    with pytest.raises(InitError, match=refused):
        DistSession(rank=0, world_size=1, timeout=5).__enter__()
    assert not dist.is_initialized()
    release.set()
    until_no_forming_is_held()
    assert dropped == ["a group formed late"]
    with DistSession(rank=0, world_size=1, timeout=5) as s:  # forming works again
        assert s.allreduce(torch.ones(1)).wait().item() == 1.0


@pytest.mark.timeout(30)
def test_a_forming_that_waited_behind_one_given_up_on_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The formings' pattern: check, take the gloo lock, form. A second thread
    that checked while the first still waited (nothing was held yet) then
    waits for the lock, which the first lets go of as it gives up: it is
    refused at its rendezvous, not formed beside the held one."""
    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.2)
    release, checked, outcome = threading.Event(), threading.Event(), []

    def second() -> None:
        try:
            _groups.refuse_while_held()  # passes: nothing is held yet
        finally:
            checked.set()
        with _groups.gloo_on_loopback(False):  # waits for the first to give up
            try:
                outcome.append(_groups.rendezvous(lambda: "formed", "the second", 1.0))
            except InitError as exc:
                outcome.append(exc)

    other = threading.Thread(target=second)
    try:
        with _groups.gloo_on_loopback(False):
            other.start()
            assert checked.wait(10)
            with pytest.raises(_groups.StoreSilent):
                _groups.rendezvous(lambda: release.wait(10), "the first", 0.3)
        other.join(10)
        assert len(outcome) == 1, outcome
        assert isinstance(outcome[0], InitError), outcome
        assert "gave up on the first" in str(outcome[0])
    finally:
        release.set()
        other.join(10)
        until_no_forming_is_held()


@pytest.mark.timeout(30)
def test_a_session_is_refused_before_it_adopts_a_group_while_a_forming_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A default group that exists while a forming is held may be the one
    that forming registered late, about to be destroyed: it is not adopted."""
    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.2)
    release = threading.Event()
    adopted: list[Any] = []
    adopt_world = _groups.adopt_world
    monkeypatch.setattr(_groups, "adopt_world", lambda *a: adopted.append(a) or adopt_world(*a))
    with pytest.raises(_groups.StoreSilent):
        _groups.rendezvous(lambda: release.wait(10), "the held one", 0.3)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(InitError, match="gave up on the held one"):
            DistSession().__enter__()
        assert adopted == []
    finally:
        dist.destroy_process_group()
        release.set()
        until_no_forming_is_held()


@pytest.mark.timeout(30)
def test_a_rendezvous_answered_in_time_gives_its_result_or_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.2)
    assert _groups.rendezvous(lambda: 7, "a forming", 1.0) == 7

    def refused() -> None:
        raise RuntimeError("a member did not join")

    with pytest.raises(RuntimeError, match="a member did not join"):
        _groups.rendezvous(refused, "a forming", 1.0)
    # one that fails after its caller gave up hands nothing to ``late``
    release, dropped = threading.Event(), []

    def fails_late() -> None:
        release.wait(10)
        raise RuntimeError("the store closed")

    with pytest.raises(TimeoutError):
        _groups.rendezvous(fails_late, "a forming", 0.1, late=dropped.append)
    release.set()
    until_no_forming_is_held()
    assert dropped == []
    _groups.refuse_while_held()  # nothing held: no error


# -- split over a frozen store -------------------------------------------------------------


def _frozen_split(
    host: Any, monkeypatch: pytest.MonkeyPatch, what: str
) -> tuple[float, BaseException]:
    """Split a world of one on ``host``'s store once that host froze; the
    seconds the split took and its error (the session is left broken)."""
    from _store_host import one_rank_on

    from asyncdist import CollectiveTimeout, SessionBroken

    one_rank_on(host, monkeypatch)
    with DistSession(timeout=1) as s:
        if what == "blocks":
            host.stop()
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout) as told:
            s.split(1)
        elapsed = time.monotonic() - started
        with pytest.raises(SessionBroken):  # the whole session is, not the split alone
            s.allreduce(torch.ones(1))
        host.kill()  # (the session's exit then finds its store closed)
    return elapsed, told.value


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["blocks", "side group"])
def test_a_split_over_a_frozen_store_is_a_collective_timeout(
    monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """``split`` forms its blocks' groups, then the sub-session's objects side
    group, over the session's store: that store's host freezing at either
    held the split forever. It is a CollectiveTimeout at the timeout plus
    the grace now (a world of one on a launcher agent's store)."""
    from _store_host import store_host

    from asyncdist._store import forget_address

    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.5)
    before = listening()
    gc.disable()  # what the session left must go with it, not with a collection
    try:
        with store_host() as host:
            if what == "side group":  # the blocks form, then the host freezes
                form_blocks = _groups.form_blocks

                def then_freeze(*args: Any, **kwargs: Any) -> Any:
                    group = form_blocks(*args, **kwargs)
                    host.stop()
                    return group

                monkeypatch.setattr(_groups, "form_blocks", then_freeze)
            elapsed, error = _frozen_split(host, monkeypatch, what)
            until_no_forming_is_held()
            forget_address("127.0.0.1", host.port)  # the store this process kept for it
        # the error is kept (as a user's handler may): its traceback must not
        # keep the destroyed groups' gloo sockets listening (the held
        # forming's thread, ended, lets go of its forming a moment later)
        deadline = time.monotonic() + 5
        while not listening() <= before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listening() <= before
    finally:
        gc.enable()
    assert 1.5 <= elapsed < 1.5 + 2.0
    forming = {
        "blocks": "the forming of the group of block 0 of 1 ranks",
        "side group": "the objects side group's forming",
    }[what]
    told = f"{forming}: the rendezvous store did not answer within 1.5 s"
    assert told in str(error.__cause__), error
    assert f"split on rank 0 did not complete: {told}" in str(error)
    assert "alive but silent" not in str(error)  # the store is, not a peer
    assert not dist.is_initialized()
