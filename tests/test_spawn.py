"""spawn: results, async functions, failures, and no children left behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from asyncdist import DistSession, PeerFailure, spawn

pytestmark = pytest.mark.timeout(60)


def _whoami(session: DistSession, tag: str) -> tuple[int, int, int, str, str]:
    return (session.rank, session.world_size, session.local_rank, session.backend, tag)


def test_returns_results_by_rank() -> None:
    assert spawn(_whoami, 3, args=("x",)) == [(r, 3, r, "gloo", "x") for r in range(3)]


async def _async_sum(session: DistSession) -> float:
    t = torch.tensor([float(session.rank)])
    return float((await session.allreduce(t))[0])


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_function(backend: str) -> None:
    assert spawn(_async_sum, 4, async_backend=backend) == [6.0] * 4


def _one_rank_raises(session: DistSession) -> None:
    if session.rank == 1:
        raise KeyError("only on rank 1")
    session.allreduce(torch.ones(4)).wait()  # rank 0 sees its peer leave


def test_first_failing_rank_error_is_reraised_naming_the_rank() -> None:
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="only on rank 1") as info:
        spawn(_one_rank_raises, 2, timeout=20)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on rank 1 of 2" in notes
    assert "_one_rank_raises" in notes, "the remote traceback is attached"
    assert time.monotonic() - t0 < 20


def _rank_exits(session: DistSession) -> None:
    if session.rank == 0:
        os._exit(7)
    session.allreduce(torch.ones(4)).wait()


def test_rank_dying_without_a_result() -> None:
    with pytest.raises(PeerFailure, match="rank 0 exited with code 7"):
        spawn(_rank_exits, 2, timeout=20)


def _hang(session: DistSession) -> None:
    time.sleep(60)


def test_join_timeout_kills_every_child() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        spawn(_hang, 2, join_timeout=5)
    assert time.monotonic() - t0 < 15
    mine = [p for p in psutil.Process().children() if "asyncdist" in " ".join(p.cmdline())]
    assert not mine


def _listening(session: DistSession) -> list[str]:
    return sorted(
        {
            c.laddr.ip
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
    )


def test_spawned_ranks_listen_on_loopback_only() -> None:
    for addresses in spawn(_listening, 2):
        assert all(ip.startswith("127.") or ip == "::1" for ip in addresses), addresses


@pytest.mark.parametrize("world_size", [0, -1, True, 1.5])
def test_bad_world_size(world_size: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        spawn(_whoami, world_size)  # type: ignore[arg-type]
