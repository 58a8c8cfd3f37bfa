"""split(): sub-sessions over blocks of consecutive ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncdist import DistSession, SessionClosed, spawn

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
