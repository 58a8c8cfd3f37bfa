"""debug=True: mismatched collectives raise CollectiveMismatch on every rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from asyncdist import CollectiveMismatch, DistSession, spawn
from asyncdist._debug import Fingerprint, Verifier, mismatch, pairwise

pytestmark = pytest.mark.timeout(90)


def _mismatch(s: DistSession, case: str) -> str:
    r = s.rank
    calls: dict[str, Callable[[], Any]] = {
        "shape": lambda: s.allreduce(torch.ones(4 if r == 0 else 8)),
        "dtype": lambda: s.allreduce(
            torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)
        ),
        "op": lambda: s.allreduce(torch.ones(4)) if r == 0 else s.broadcast(torch.ones(4)),
        "reduce": lambda: s.allreduce(torch.ones(4), op="sum" if r == 0 else "max"),
        "root": lambda: s.broadcast(torch.ones(4), src=r),
        "count": lambda: (s.barrier() if r == 0 else None, s.allreduce(torch.ones(4)))[1],
        # rank 0 sends rank 1 three elements; rank 1 expects two from rank 0
        "all_to_all": lambda: s.all_to_all([torch.ones(3 if r == 0 else 2)] * 2),
    }
    try:
        calls[case]().wait()
    except CollectiveMismatch as exc:
        message = str(exc)
    else:
        raise AssertionError("no mismatch detected")
    # nothing was launched: the session is still in step and usable
    t = torch.ones(2)
    s.allreduce(t).wait()
    assert t.tolist() == [2.0, 2.0]
    return message


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("shape", "allreduce of float32[4] on rank 0 vs float32[8] on rank 1"),
        ("dtype", "allreduce of float32[4] on rank 0 vs float64[4] on rank 1"),
        ("op", "allreduce on rank 0 vs broadcast on rank 1"),
        ("reduce", "allreduce with op sum on rank 0 vs max on rank 1"),
        ("root", "broadcast with root 0 on rank 0 vs 1 on rank 1"),
        ("count", "barrier on rank 0 vs allreduce on rank 1"),
        (
            "all_to_all",
            "all_to_all: rank 0 exchanges float32[3] with rank 1, which exchanges "
            "float32[2] with rank 0",
        ),
    ],
)
def test_mismatch_raises_on_every_rank_naming_both_sides(case: str, expected: str) -> None:
    messages = spawn(_mismatch, 2, args=(case,), timeout=20, debug=True)
    for message in messages:
        assert expected in message


async def _async_mismatch(s: DistSession) -> tuple[str, bool, list[float]]:
    """In async code the check runs off the loop: the call returns a handle at
    once and awaiting it raises the mismatch; nothing was launched."""
    h = s.allreduce(torch.ones(4 if s.rank == 0 else 8))
    returned_pending = not h.done()
    try:
        await h
    except CollectiveMismatch as exc:
        message = str(exc)
    else:
        raise AssertionError("no mismatch detected")
    t = torch.ones(2)
    await s.allreduce(t)
    return message, returned_pending, t.tolist()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_mismatch_arrives_with_the_handle(backend: str) -> None:
    results = spawn(_async_mismatch, 2, timeout=20, debug=True, async_backend=backend)
    for message, returned_pending, after in results:
        assert "allreduce of float32[4] on rank 0 vs float32[8] on rank 1" in message
        assert returned_pending, "the call waited for the check instead of returning"
        assert after == [2.0, 2.0], "the session is still in step"


async def _two_tasks(s: DistSession) -> str:
    """Two tasks issuing on one session at once: an error, not a hang."""
    if s.rank == 1:
        await anyio.sleep(0.5)  # keep rank 0's first handle pending
    errors: list[str] = []

    async def loop(tag: int) -> None:
        try:
            for _ in range(3):
                await s.allreduce(torch.ones(4) * tag)
                await anyio.lowlevel.checkpoint()
        except CollectiveMismatch as exc:
            errors.append(str(exc))

    async with anyio.create_task_group() as tg:
        tg.start_soon(loop, 1)
        tg.start_soon(loop, 2)
    return errors[0] if errors else ""


def test_concurrent_issuers_are_an_error_in_debug_mode() -> None:
    t0 = time.monotonic()
    messages = spawn(_two_tasks, 2, timeout=10, debug=True)
    assert any("two tasks at once" in m for m in messages), messages
    assert time.monotonic() - t0 < 60


def test_debug_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCDIST_DEBUG", "1")
    with DistSession() as s:
        assert s.debug
        s.allreduce(torch.ones(1)).wait()
    monkeypatch.setenv("ASYNCDIST_DEBUG", "0")
    assert not DistSession().debug


def test_fingerprint_round_trip_and_long_lists() -> None:
    fp = Fingerprint(3, "allreduce", ("float32[4]",), "sum", None)
    assert Fingerprint.decode(fp.encode()) == fp
    many = Fingerprint(1, "allreduce_coalesced", tuple(f"float32[{i}]" for i in range(500)))
    raw = many.encode()
    assert len(raw) == len(fp.encode())
    other = Fingerprint(1, "allreduce_coalesced", tuple(f"float32[{i}]" for i in range(501)))
    decoded = [Fingerprint.decode(raw), Fingerprint.decode(other.encode())]
    assert mismatch(decoded) is not None
    assert mismatch([fp, fp]) is None


def test_verifier_numbers_calls_and_checks() -> None:
    verifier = Verifier(rank=1)
    first = verifier.fingerprint("allreduce", (torch.ones(2),), reduce="sum")
    second = verifier.fingerprint("broadcast", (), root=0)
    assert (first.seq, second.seq) == (1, 2)
    assert first.tensors == ("float32[2]",)
    assert first.reduce == "sum"
    assert second.root == 0
    verifier.check("allreduce", [first, first])
    with pytest.raises(CollectiveMismatch, match=r"^broadcast on rank 1: collective #1"):
        verifier.check("broadcast", [first, replace(first, op="broadcast")])


def test_pairwise_fingerprints_compare_pair_by_pair() -> None:
    """all_to_all: rank i's tensors[j] must match rank j's tensors[i], so NCCL's
    uneven exchanges (shapes differing between ranks, pair by pair) are valid."""

    def fp(*shapes: str) -> Fingerprint:
        return Fingerprint(1, "all_to_all", shapes, extra={"pairwise": True})

    assert mismatch([fp("f[1]", "f[2]"), fp("f[2]", "f[3]")]) is None
    assert mismatch([fp("f[1]", "f[2]"), fp("f[4]", "f[3]")]) is not None
    plain = Fingerprint(1, "all_to_all", ("f[1]", "f[2]"))
    assert mismatch([fp("f[1]", "f[2]"), plain]) is not None, "mixed kinds still differ"
    long = fp(*(f"float32[{i}]" for i in range(500)))
    decoded = Fingerprint.decode(long.encode())
    assert pairwise(decoded), "the flag survives the digest of a long list"


def _long_lists(s: DistSession) -> tuple[list[float], list[float]]:
    """80 tensors: too many for a fingerprint to list, so it carries a digest."""
    tensors = [torch.full((i % 7 + 1,), float(s.rank + 1)) for i in range(80)]
    s.allreduce_coalesced(tensors).wait()
    tree = {f"k{i}": torch.full((i % 5 + 1,), float(s.rank + 1)) for i in range(80)}
    reduced = s.allreduce_tree(tree).wait()
    return [float(t[0]) for t in tensors], [float(t[0]) for t in reduced.values()]


def test_long_argument_lists_agree_across_processes() -> None:
    """Each rank is its own process, with its own hash randomisation: the
    digest of a long list must not depend on it."""
    results = spawn(_long_lists, 2, debug=True, timeout=30, join_timeout=60)
    assert results == [([3.0] * 80, [3.0] * 80)] * 2


_ENCODE = """
from asyncdist._debug import Fingerprint
shapes = tuple(f"float32[{i}, 3]" for i in range(80))
print(Fingerprint(7, "allreduce_coalesced", shapes, "sum").encode().hex())
"""


def test_long_fingerprint_is_the_same_in_every_process() -> None:
    import os
    import subprocess
    import sys

    encodings = []
    for seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", _ENCODE],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        encodings.append(done.stdout.strip())
    assert encodings[0] == encodings[1], "the digest depends on the process's hash seed"
    decoded = Fingerprint.decode(bytes.fromhex(encodings[0]))
    assert decoded.tensors[0].startswith("80 tensors, ")
