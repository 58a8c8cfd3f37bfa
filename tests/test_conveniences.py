"""The conveniences a training loop expects: uneven all_gather, gather_object,
allreduce_tree, print / logger on the main rank, and main_first.

Each multi-rank test runs 2 and 3 ranks, on asyncio and trio. Waits that
depend on a late peer are measured with ``_stall.no_stall`` inside the ranks
themselves: a call that blocked the loop until the peer came would stall it
for about ``LATE`` s.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from _stall import STALL_BOUND, no_stall

from asyncdist import DistSession, PeerFailure, spawn

pytestmark = pytest.mark.timeout(120)

LATE = 1.0  # seconds a peer is late for the call under test
ROWS = [2, 0, 3]  # rows each rank passes to the uneven all_gather (rank 1: none)
Pair = collections.namedtuple("Pair", "loss count")


def _rows(rank: int) -> torch.Tensor:
    return torch.arange(ROWS[rank] * 2, dtype=torch.float32).reshape(ROWS[rank], 2) + 100 * rank


def _metrics(rank: int, count: torch.dtype = torch.int64) -> dict[str, Any]:
    return {
        "loss": torch.tensor([1.0 + rank, 2.0]),
        "steps": 10 + rank,  # an int
        "acc": [0.5 * rank, Pair(float(rank), torch.tensor([rank], dtype=count))],
        "lr": 0.1,
    }


# -- one tour over every convenience, async ---------------------------------------------


async def _tour(s: DistSession, marker: str) -> dict[str, Any]:
    r, w = s.rank, s.world_size
    out: dict[str, Any] = {}

    # uneven all_gather, with a plain collective issued while its two steps run
    if r == 1:
        await anyio.sleep(LATE)  # the others wait for rank 1 in the row exchange
    async with no_stall() as meter:
        started = time.monotonic()
        gathered = s.all_gather(_rows(r), uneven=True)
        summed = s.allreduce(torch.tensor([float(r)]))
        rows = await gathered
        out["uneven_waited"] = time.monotonic() - started
    out["uneven_stall"] = meter.max_stall
    out["rows"] = [t.tolist() for t in rows]
    out["summed"] = (await summed).item()

    out["gather_object"] = await s.gather_object({"rank": r, "name": f"w{r}"}, dst=w - 1)

    tree = _metrics(r, torch.float32)  # "mean" of an int64 tensor would raise
    loss = tree["loss"]
    out["mean"] = await s.allreduce_tree(tree, op="mean")
    out["loss_in_place"] = out["mean"]["loss"] is loss
    out["sum"] = await s.allreduce_tree(_metrics(r), op="sum")
    out["max"] = await s.allreduce_tree((r, [float(r)]), op="max")
    out["empty"] = await s.allreduce_tree({"nothing": []})

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        s.print("epoch", 3, "done", sep="-")
    out["printed"] = printed.getvalue()

    records: list[str] = []
    handler = _Collect(records)
    base = logging.getLogger(f"conveniences.tour.{r}")
    base.addHandler(handler)
    base.setLevel(logging.INFO)
    try:
        s.logger(base).info("main only %d", 1)
        s.logger(base, main_only=False).warning("everyone")
        s.logger(base).debug("below the level")
    finally:
        base.removeHandler(handler)
    out["logged"] = records

    # main_first: rank 0 builds the "cache" late; the others wait for it
    async with no_stall() as meter:
        started = time.monotonic()
        async with s.main_first():
            out["marker_seen"] = await anyio.Path(marker).exists()
            if r == 0:
                await anyio.sleep(LATE)
                await anyio.Path(marker).write_text("built")
        out["main_first_waited"] = time.monotonic() - started
    out["main_first_stall"] = meter.max_stall
    return out


class _Collect(logging.Handler):
    def __init__(self, records: list[str]) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.rank}:{record.levelname}:{record.getMessage()}")  # type: ignore[attr-defined]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_tour_of_the_conveniences(world: int, backend: str, tmp_path: Path) -> None:
    marker = str(tmp_path / "cache")
    results = spawn(_tour, world, args=(marker,), timeout=30, async_backend=backend)
    expected_rows = [_rows(r).tolist() for r in range(world)]
    for r, out in enumerate(results):
        # uneven all_gather: every rank's own rows, trimmed; order kept with the allreduce
        assert out["rows"] == expected_rows
        assert out["summed"] == sum(range(world))
        assert out["uneven_stall"] < STALL_BOUND, out["uneven_stall"]
        if r != 1:
            assert out["uneven_waited"] >= LATE - 0.1, "rank 1 was not late: proves nothing"

        # gather_object: only dst gets the list
        if r == world - 1:
            assert out["gather_object"] == [{"rank": j, "name": f"w{j}"} for j in range(world)]
        else:
            assert out["gather_object"] is None

        # allreduce_tree: same structure, numbers back as numbers
        mean = out["mean"]
        assert mean["loss"].tolist() == [1.0 + (world - 1) / 2, 2.0]
        assert out["loss_in_place"]
        assert mean["steps"] == pytest.approx(10 + (world - 1) / 2)
        assert isinstance(mean["steps"], float)
        assert mean["lr"] == pytest.approx(0.1)
        assert isinstance(mean["acc"], list)
        assert isinstance(mean["acc"][1], Pair)
        assert mean["acc"][0] == pytest.approx(0.5 * (world - 1) / 2)
        summed = out["sum"]
        assert summed["steps"] == sum(10 + j for j in range(world))
        assert type(summed["steps"]) is int
        assert summed["acc"][1].count.tolist() == [sum(range(world))]
        assert summed["acc"][1].count.dtype == torch.int64
        assert summed["lr"] == pytest.approx(0.1 * world)
        assert out["max"] == (world - 1, [float(world - 1)])
        assert out["empty"] == {"nothing": []}

        # print and logger: main rank only (everyone with main_only=False)
        assert out["printed"] == ("epoch-3-done\n" if r == 0 else "")
        main = ["0:INFO:main only 1"] if r == 0 else []
        assert out["logged"] == [*main, f"{r}:WARNING:everyone"]

        # main_first: rank 0 ran first; the others entered after it left, loop running
        assert out["marker_seen"] == (r != 0)
        assert out["main_first_stall"] < STALL_BOUND, out["main_first_stall"]
        assert out["main_first_waited"] >= LATE - 0.1


# -- the sync forms -------------------------------------------------------------------


def _sync(s: DistSession, marker: str) -> dict[str, Any]:
    r = s.rank
    out: dict[str, Any] = {}
    with s.main_first():
        out["marker_seen"] = Path(marker).exists()
        if r == 0:
            time.sleep(0.3)
            Path(marker).write_text("built")
    out["rows"] = [t.shape[0] for t in s.all_gather(_rows(r), uneven=True).wait()]
    out["gathered"] = s.gather_object(r * 10, dst=0).wait()
    out["tree"] = s.allreduce_tree({"n": 1, "x": [torch.ones(2)]}).wait()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        s.print("only once")
    out["printed"] = printed.getvalue()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sync_forms(world: int, tmp_path: Path) -> None:
    results = spawn(_sync, world, args=(str(tmp_path / "cache"),), timeout=30)
    for r, out in enumerate(results):
        assert out["marker_seen"] == (r != 0)
        assert out["rows"] == ROWS[:world]
        assert out["gathered"] == ([j * 10 for j in range(world)] if r == 0 else None)
        assert out["tree"]["n"] == world
        assert out["tree"]["x"][0].tolist() == [float(world)] * 2
        assert out["printed"] == ("only once\n" if r == 0 else "")


# -- failures -------------------------------------------------------------------------


async def _main_fails(s: DistSession) -> str:
    try:
        async with s.main_first():
            if s.rank == 0:
                raise ValueError("no network")
            return "ran the block"
    except ValueError as exc:
        outcome = f"own: {exc}"
    except PeerFailure as exc:
        outcome = f"peer: {exc}"
    # the session is still usable on every rank
    t = await s.allreduce(torch.ones(1))
    return f"{outcome} | {t.item()}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_main_first_when_the_main_rank_fails(world: int, backend: str) -> None:
    results = spawn(_main_fails, world, timeout=30, async_backend=backend)
    assert results[0] == f"own: no network | {float(world)}"
    for out in results[1:]:
        assert out.startswith("peer: main_first on rank"), out
        assert "rank 0 raised ValueError(no network)" in out
        assert out.endswith(f"| {float(world)}")


def _uneven_mismatch(s: DistSession) -> str:
    tensor = torch.zeros(2, 3) if s.rank == 0 else torch.zeros(1, 4)
    try:
        s.all_gather(tensor, uneven=True).wait()
    except ValueError as exc:
        message = str(exc)
    else:
        message = "no error"
    s.barrier().wait()  # the session stays in step and usable
    return message


def test_uneven_all_gather_names_ranks_that_differ_beyond_the_first_dimension() -> None:
    results = spawn(_uneven_mismatch, 2, timeout=30)
    for r, message in enumerate(results):
        assert message == (
            f"all_gather on rank {r}: only the first dimension may differ between ranks, "
            "got float32[2, 3] on rank 0, float32[1, 4] on rank 1"
        )


def _debug_uneven(s: DistSession) -> list[int]:
    return [t.shape[0] for t in s.all_gather(_rows(s.rank), uneven=True).wait()]


def test_uneven_all_gather_passes_debug_verification() -> None:
    assert spawn(_debug_uneven, 3, timeout=30, debug=True) == [ROWS] * 3


def test_bad_inputs_fail_before_launch() -> None:
    with DistSession() as s:
        with pytest.raises(ValueError, match="0-d tensor"):
            s.all_gather(torch.tensor(1.0), uneven=True)
        with pytest.raises(TypeError, match="uneven must be a bool"):
            s.all_gather(torch.ones(2), uneven="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="dst=1 is outside"):
            s.gather_object("x", dst=1)
        with pytest.raises(TypeError, match=r"tree\['ok'\] is a bool"):
            s.allreduce_tree({"ok": True})
        with pytest.raises(TypeError, match=r"tree\[1\] is a str"):
            s.allreduce_tree([1.0, "loss"])
        with pytest.raises(ValueError, match=r"'mean' of a torch\.int64 tensor"):
            s.allreduce_tree({"n": torch.ones(1, dtype=torch.int64)}, op="mean")
        with pytest.raises(ValueError, match="unknown reduce op"):
            s.allreduce_tree({}, op="median")
        with pytest.raises(TypeError, match="logger: name must be"):
            s.logger(3)  # type: ignore[arg-type]
        # nothing was launched: the session is usable
        assert s.allreduce_tree({"n": 2}).wait() == {"n": 2}
