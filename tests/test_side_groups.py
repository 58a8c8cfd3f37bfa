"""Side groups: each lane's objects group is a gloo group of asyncdist's own,
formed with the lane, keyed apart from every other lane's and session's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncdist import DistSession, PeerFailure, spawn

pytestmark = pytest.mark.timeout(90)


def _dead_before_objects(s: DistSession, out: str) -> None:
    s.barrier().wait()
    if s.rank == 1:
        os._exit(0)
    time.sleep(0.3)  # rank 1 is gone
    t0 = time.monotonic()
    try:
        s.broadcast_object({"step": 1}).wait()
    except PeerFailure as exc:
        record = {"elapsed": time.monotonic() - t0, "message": str(exc)}
        Path(out).write_text(json.dumps(record))


def test_a_peer_dead_before_the_first_object_collective_fails_it_at_once(
    tmp_path: Path,
) -> None:
    """The objects group formed with the session, so its connections tell of
    the death (formed at this first use, it would wait for the dead peer
    until the timeout, 30 s here)."""
    out = tmp_path / "rank0.json"
    with pytest.raises(PeerFailure, match="rank 1 exited with code 0"):
        spawn(_dead_before_objects, 2, args=(str(out),), timeout=30)
    report = json.loads(out.read_text())
    assert report["elapsed"] < 2.0, report
    assert "broadcast_object" in report["message"]


def _first_objects_in_opposite_orders(s: DistSession) -> list[Any]:
    """Rank 0 sends its first objects on a, b, then the session; rank 1 the
    other way round: each lane's objects travel on its own group and thread."""
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
    """Debug mode's fingerprint group forms on its own thread, next to the
    objects group."""
    t = torch.full((2,), float(s.rank))
    s.allreduce(t).wait()
    return [t.tolist(), s.gather_object(s.rank, dst=0).wait()]


def test_debug_mode_agrees_on_its_own_side_group() -> None:
    got = spawn(_debug_and_objects, 2, timeout=30, debug=True)
    assert got == [[[1.0, 1.0], [0, 1]], [[1.0, 1.0], None]]
