"""spawn: results, async functions, failures, and no children left behind."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from asyncdist import AsyncDistError, DistSession, PeerFailure, spawn

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


# -- results come back by value, whatever they are -------------------------------------


def _tensor(session: DistSession) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + 10 * session.rank


def test_tensor_result() -> None:
    results = spawn(_tensor, 2)
    for rank, result in enumerate(results):
        assert isinstance(result, torch.Tensor)
        assert result.dtype == torch.float32
        assert torch.equal(result, torch.arange(4, dtype=torch.float32) + 10 * rank)


def _tensors(session: DistSession) -> list[torch.Tensor]:
    t = torch.full((3,), float(session.rank))
    return [t, torch.tensor([session.rank], dtype=torch.int64), torch.zeros(0)]


def test_list_of_tensors_result() -> None:
    for rank, (full, mine, empty) in enumerate(spawn(_tensors, 2)):
        assert torch.equal(full, torch.full((3,), float(rank)))
        assert torch.equal(mine, torch.tensor([rank], dtype=torch.int64))
        assert empty.shape == (0,)


def _nested_with_views(session: DistSession) -> dict[str, Any]:
    big = torch.arange(1 << 20, dtype=torch.float64).reshape(1024, 1024)  # 8 MiB
    return {
        "views": [big[3, 5:9], big[:2, :3].t()],
        "pair": (session.rank, big[1000:1002, 1000:1002]),
    }


def test_nested_container_with_views_sends_only_the_viewed_values() -> None:
    big = torch.arange(1 << 20, dtype=torch.float64).reshape(1024, 1024)
    for rank, result in enumerate(spawn(_nested_with_views, 2)):
        assert set(result) == {"views", "pair"}
        row, corner_t = result["views"]
        assert row.dtype == torch.float64
        assert torch.equal(row, big[3, 5:9])
        assert corner_t.shape == (3, 2)
        assert torch.equal(corner_t, big[:2, :3].t())
        assert isinstance(result["pair"], tuple)
        assert result["pair"][0] == rank
        assert torch.equal(result["pair"][1], big[1000:1002, 1000:1002])
        for t in (row, corner_t, result["pair"][1]):
            # the 8 MiB storage behind each view did not travel
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _bfloat16(session: DistSession) -> torch.Tensor:
    return torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16) * (session.rank + 1)


def test_bfloat16_result() -> None:
    for rank, result in enumerate(spawn(_bfloat16, 2)):
        assert result.dtype == torch.bfloat16
        expected = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16) * (rank + 1)
        assert torch.equal(result, expected)


def _unpicklable_on_rank_1(session: DistSession) -> object:
    return threading.Lock() if session.rank == 1 else "fine"


def test_unpicklable_result_is_a_clear_error_naming_the_rank() -> None:
    with pytest.raises(AsyncDistError, match="rank 1 returned a lock that cannot be pickled"):
        spawn(_unpicklable_on_rank_1, 2)


class _LockedError(Exception):
    def __init__(self) -> None:
        super().__init__("carries a lock")
        self.lock = threading.Lock()


def _raises_unpicklable(session: DistSession) -> None:
    if session.rank == 1:
        raise _LockedError


def test_unpicklable_exception_is_a_clear_error_naming_the_rank() -> None:
    with pytest.raises(AsyncDistError, match="rank 1 raised _LockedError: carries a lock") as info:
        spawn(_raises_unpicklable, 2)
    assert "_raises_unpicklable" in "\n".join(info.value.__notes__)


class _TwoArgError(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}+{b}")  # pickles, but cannot be rebuilt from its args


def _raises_unrebuildable(session: DistSession) -> None:
    if session.rank == 0:
        raise _TwoArgError(1, 2)


def test_exception_that_cannot_be_unpickled_is_a_clear_error_naming_the_rank() -> None:
    with pytest.raises(AsyncDistError, match="rank 0's message could not be unpickled"):
        spawn(_raises_unrebuildable, 2)


def test_lambda_is_refused_before_any_process_starts() -> None:
    t0 = time.monotonic()
    with pytest.raises(TypeError, match="define fn at module level") as info:
        spawn(lambda session: session.rank, 2)
    assert "<lambda>" in str(info.value)
    assert time.monotonic() - t0 < 1.0, "nothing was started"

    def nested(session: DistSession) -> int:
        return session.rank

    with pytest.raises(TypeError, match="not a lambda or a function nested"):
        spawn(nested, 2)


def _aborts(session: DistSession) -> None:
    import resource

    if session.rank == 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.abort()
    session.allreduce(torch.ones(4)).wait()


def test_sigabrt_points_at_mismatched_collectives_and_debug_mode() -> None:
    with pytest.raises(PeerFailure, match="rank 0 exited with code -6") as info:
        spawn(_aborts, 2, timeout=20)
    message = str(info.value)
    assert "SIGABRT" in message
    assert "how gloo reports mismatched collectives" in message
    assert "debug=True" in message
    assert "ASYNCDIST_DEBUG=1" in message


def _fails_while_the_other_computes(session: DistSession, stamp: str) -> None:
    if session.rank == 1:
        Path(stamp).write_text(repr(time.time()))
        raise KeyError("rank 1 fails on its own")
    time.sleep(40)  # not in a collective: nothing tells this rank


def test_an_own_failure_is_raised_at_once(tmp_path: Path) -> None:
    stamp = str(tmp_path / "failed_at")
    with pytest.raises(KeyError, match="rank 1 fails on its own"):
        spawn(_fails_while_the_other_computes, 2, args=(stamp,), timeout=20)
    delay = time.time() - float(Path(stamp).read_text())
    # the others' grace (3 s) plus reaping; it was 10 s
    assert delay < 5.0, f"spawn raised {delay:.1f} s after the failure"


_UNGUARDED = """
from asyncdist import spawn


def work(session):
    return session.rank


try:
    spawn(work, 2)  # no `if __name__ == "__main__":` around it
except Exception as exc:
    if __name__ == "__main__":  # a rank re-running this file runs it as __mp_main__
        print(f"PARENT: {type(exc).__name__}: {exc}", flush=True)
    raise
"""


def test_a_script_without_the_main_guard_is_told_what_to_add(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    elapsed = time.monotonic() - t0
    assert done.returncode != 0
    parent = [line for line in done.stdout.splitlines() if line.startswith("PARENT: ")]
    assert parent, done.stdout + done.stderr
    assert 'if __name__ == "__main__":' in parent[0], parent[0]
    assert "rank" in parent[0]
    # raised when the first rank exits (each rank imports torch first)
    assert elapsed < 30.0, f"took {elapsed:.1f} s"


def test_the_launching_guide_gives_spawns_whole_signature() -> None:
    import inspect
    import re

    guide = Path(__file__).parent.parent / "docs" / "guides" / "launching.md"
    found = re.search(r"`(spawn\(fn, .*?\))`", guide.read_text(), re.S)
    assert found, "the guide states spawn's signature"
    documented = " ".join(found.group(1).split())
    actual = inspect.signature(spawn)
    parts = []
    for name, param in actual.parameters.items():
        if param.kind is param.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        default = param.default
        if default is param.empty:
            parts.append(name)
        else:
            shown = "()" if default == () else f"{default:g}" if type(default) is float else None
            parts.append(f"{name}={shown or repr(default).replace(chr(39), chr(34))}")
    assert documented == f"spawn({', '.join(parts)})"
