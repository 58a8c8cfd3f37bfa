"""What issuing a collective keeps: the lane's queue of outstanding ops, and
the objects each op holds while it is outstanding.

Costs in time live in ``benchmarks/scaling.py``; these are the structural
properties those costs rest on, each able to fail on the code before them.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import pytest
import torch

from asyncdist import DistSession, _lane
from asyncdist._collectives import lane_of
from asyncdist._handle import op_of
from asyncdist.errors import CollectiveError

pytestmark = pytest.mark.timeout(60)


def test_an_outstanding_op_keeps_two_objects_for_the_cyclic_gc() -> None:
    """Every GC-tracked object a pending op keeps is walked by each
    collection while it is outstanding (a burst of 10,000 small allreduces
    holds tens of thousands): the op and its handle, nothing more."""
    with DistSession() as s:
        tensors = [torch.ones(1) for _ in range(200)]
        s.barrier().wait()
        gc.collect()
        gc.disable()
        try:
            before = {id(o) for o in gc.get_objects()}
            handles = [s.allreduce(t) for t in tensors]
            handles += [s.allreduce(t, op="mean") for t in tensors[:100]]
            kept = [o for o in gc.get_objects() if id(o) not in before]
        finally:
            gc.enable()
        per_op = {}
        for kind in {type(o).__name__ for o in kept}:
            per_op[kind] = sum(type(o).__name__ == kind for o in kept) / len(handles)
        # "mean" keeps its divide (a partial and its arguments): 2 of 3 ops do not
        assert len(kept) <= 2.7 * len(handles), per_op
        for h in handles:
            h.wait()


def test_a_launch_lets_go_of_ops_once_settled() -> None:
    with DistSession() as s:
        lane = lane_of(s)
        assert lane is not None
        first = s.allreduce(torch.ones(2))
        first.wait()
        second = s.allreduce(torch.ones(2))
        assert op_of(first) not in lane.drain(), "a waited op is let go at the next launch"
        assert op_of(second) in lane.drain()
        second.wait()


def test_past_the_backlog_a_launch_settles_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that issues and never waits: below ``BACKLOG`` the waiters
    and the watchdog settle its ops; past it, each launch does, so what the
    lane holds stays as long as what is really in flight."""
    monkeypatch.setattr(_lane, "BACKLOG", 8)
    with DistSession() as s:
        lane = lane_of(s)
        assert lane is not None
        handles = [s.allreduce(torch.ones(1)) for _ in range(40)]
        time.sleep(0.3)  # 40 one-element allreduces on one rank finish in milliseconds
        s.allreduce(torch.ones(1)).wait()
        assert len(lane.drain()) <= 8 + 1
        lane.tree.watchdog.check()  # settles whatever finished
        s.allreduce(torch.ones(1)).wait()
        assert len(lane.drain()) <= 2
        assert all(h.done() and h.exception() is None for h in handles)


@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
def test_an_allreduce_torch_refuses_raises_an_asyncdist_error_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, traced: bool
) -> None:
    """Both ways an allreduce launches (without a ``Spec``, and with one
    under a tracer): torch refusing the call raises a ``CollectiveError``
    naming the op, not a bare ``RuntimeError``; nothing stays outstanding,
    and the next allreduce works."""
    from asyncdist import _wire

    real = _wire.allreduce

    def refusing(group: Any, tensor: torch.Tensor, reduction: Any) -> Any:
        raise RuntimeError("refused for the test")

    with DistSession() as s, contextlib.ExitStack() as stack:
        if traced:
            stack.enter_context(s.trace(tmp_path / "trace.json"))
        lane = lane_of(s)
        assert lane is not None
        monkeypatch.setattr(_wire, "allreduce", refusing)
        with pytest.raises(CollectiveError, match="allreduce on rank 0 failed") as info:
            s.allreduce(torch.ones(2))
        assert isinstance(info.value.__cause__, RuntimeError)
        assert lane.drain() == []
        monkeypatch.setattr(_wire, "allreduce", real)
        assert s.allreduce(torch.ones(2)).wait().tolist() == [1.0, 1.0]
