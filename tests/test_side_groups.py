"""Side groups: each lane's objects group forms at its first object
collective, never at entry, and its members meet whatever they did before."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from asyncdist import DistSession, spawn

pytestmark = pytest.mark.timeout(90)


def _native_threads() -> int:
    """Threads of this process that Python did not start (gloo's)."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def _entry_then_objects(s: DistSession) -> dict[str, int]:
    s.barrier().wait()
    at_entry = _native_threads()
    s.allreduce(torch.ones(1)).wait()
    after_tensors = _native_threads()
    assert s.broadcast_object({"rank": s.rank}, src=1).wait() == {"rank": 1}
    return {
        "at_entry": at_entry,
        "after_tensors": after_tensors,
        "after_objects": _native_threads(),
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_the_objects_group_forms_at_the_first_object_collective_not_at_entry() -> None:
    for counts in spawn(_entry_then_objects, 2, timeout=30):
        assert counts["after_tensors"] == counts["at_entry"], counts
        # its gloo worker and its device's loop: a group of its own, formed now
        assert counts["after_objects"] >= counts["at_entry"] + 2, counts


def _first_objects_in_opposite_orders(s: DistSession) -> list[Any]:
    """Rank 0 sends its first objects on a, b, then the session; rank 1 the
    other way round. Each lane's group forms on its own completer thread, so
    neither waits for the other's order (torch-named groups formed this way
    would never meet)."""
    a, b = s.channel("a"), s.channel("b")
    lanes = [("a", a), ("b", b), ("session", s)]
    if s.rank == 1:
        lanes.reverse()
    handles = {name: lane.all_gather_object((name, s.rank)) for name, lane in lanes}
    return [handles[name].wait() for name in ("a", "b", "session")]


def test_first_object_collectives_meet_in_any_order_across_lanes() -> None:
    for got in spawn(_first_objects_in_opposite_orders, 2, timeout=30):
        assert got == [[(name, 0), (name, 1)] for name in ("a", "b", "session")]


def _adopted_sessions(s: DistSession) -> list[Any]:
    """Sessions that adopt the default group one after another share its
    store: each one's side groups and channels must key apart from the
    others'."""
    got = [s.all_gather_object(("outer", s.rank)).wait()]
    for i in range(3):
        with DistSession(timeout=10) as inner:
            if inner.rank == 1:  # rank 0 forms first: it must not read the keys of one before
                time.sleep(0.5)
            got.append(inner.all_gather_object((i, inner.rank)).wait())
            # a channel of each: over the whole world, its torch group is named
            # by a counter, not by its ranks, so it never reads the keys of the
            # one before (which a hash of the ranks would name alike)
            if inner.rank == 1:  # rank 0 forms it first, as above
                time.sleep(0.5)
            got.append(inner.channel("c").all_gather_object(i).wait())
    got.append(s.all_gather_object(("outer", s.rank)).wait())
    return got


def test_sessions_adopting_one_default_group_one_after_another_keep_their_groups_apart() -> None:
    want = [[("outer", 0), ("outer", 1)]]
    for i in range(3):
        want += [[(i, 0), (i, 1)], [i, i]]
    want.append([("outer", 0), ("outer", 1)])
    assert spawn(_adopted_sessions, 2, timeout=60) == [want, want]


def _debug_and_objects(s: DistSession) -> list[Any]:
    """Debug mode's fingerprint group forms at the first collective, on its
    own thread, next to the objects group."""
    t = torch.full((2,), float(s.rank))
    s.allreduce(t).wait()
    return [t.tolist(), s.gather_object(s.rank, dst=0).wait()]


def test_debug_mode_forms_its_fingerprint_group_at_first_use() -> None:
    got = spawn(_debug_and_objects, 2, timeout=30, debug=True)
    assert got == [[[1.0, 1.0], [0, 1]], [[1.0, 1.0], None]]
