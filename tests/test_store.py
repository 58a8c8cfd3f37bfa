"""The generation handshake on a launcher agent's store (asyncdist/_store.py).

The ranks run as threads against one real ``TCPStore``, which stands in for
torchrun's agent store: it outlives the workers, so a restarted attempt finds
the dead attempt's keys in it.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist

from asyncdist import InitError
from asyncdist._env import LaunchEnv
from asyncdist._store import GENERATION_KEY, agree_generation

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10))


def _env(rank: int, world: int) -> LaunchEnv:
    return LaunchEnv("torchrun", rank, world, rank, "127.0.0.1", 1, agent_store=True)


def _in_threads(world: int, run: Callable[[int], str]) -> list[str | RuntimeError]:
    results: list[str | RuntimeError] = [RuntimeError("did not finish")] * world

    def one(rank: int) -> None:
        try:
            results[rank] = run(rank)
        except RuntimeError as exc:  # InitError, and the stand-in for a rank that never starts
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


def test_all_ranks_agree_on_one_fresh_generation(store: dist.TCPStore) -> None:
    first = _in_threads(3, lambda r: agree_generation(store, _env(r, 3), 5))
    assert all(isinstance(g, str) for g in first)
    assert len(set(first)) == 1
    again = _in_threads(3, lambda r: agree_generation(store, _env(r, 3), 5))
    assert len(set(again)) == 1
    assert again[0] != first[0], "a restarted attempt must not reuse the old keys"


def test_a_rank_that_reads_a_stale_generation_moves_to_the_live_one(
    store: dist.TCPStore,
) -> None:
    """The old attempt's rank 0 left its generation and welcomes behind; the new
    rank 0 starts late, so rank 1 reads the stale name first."""
    old = _in_threads(2, lambda r: agree_generation(store, _env(r, 2), 5))[0]
    assert store.get(GENERATION_KEY).decode() == old

    def run(rank: int) -> str:
        if rank == 0:
            time.sleep(1.5)  # rank 1 has read the stale name by now
        return agree_generation(store, _env(rank, 2), 10)

    new = _in_threads(2, run)
    assert new[0] == new[1]
    assert new[0] != old


def test_rank_zero_names_the_ranks_that_never_came(store: dist.TCPStore) -> None:
    def run(rank: int) -> str:
        if rank == 2:
            raise RuntimeError("rank 2 never starts")
        return agree_generation(store, _env(rank, 3), 1)

    results = _in_threads(3, run)
    assert isinstance(results[1], str)
    assert isinstance(results[0], InitError)
    assert "rank(s) 2 of 3" in str(results[0])


def test_a_rank_without_a_live_rank_zero_fails_within_its_timeout(
    store: dist.TCPStore,
) -> None:
    _in_threads(2, lambda r: agree_generation(store, _env(r, 2), 5))  # a dead attempt
    start = time.monotonic()
    with pytest.raises(InitError, match="no live rank 0"):
        agree_generation(store, _env(1, 2), 1.0)
    assert time.monotonic() - start < 5
