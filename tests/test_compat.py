"""asyncdist.compat: the seed helper's API, with its bugs fixed."""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.distributed as dist

from asyncdist import DistSession, Handle, SessionClosed, compat, spawn
from asyncdist._env import bind_loopback

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _finalized() -> Any:
    yield
    compat.dist_finalize()


def test_rank_and_world_size_outside_any_group() -> None:
    assert not dist.is_initialized()
    assert compat.get_rank() == 0
    assert compat.get_world_size() == 1


def test_error_wrapper_returns_default_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    def boom(x: int) -> int:
        raise ValueError(x)

    with caplog.at_level(logging.DEBUG, logger="asyncdist.compat"):
        assert compat.error_wrapper(boom, -1)(3) == -1
    assert "boom" in caplog.text
    assert compat.error_wrapper(lambda x: x + 1, -1)(3) == 4
    assert compat.error_wrapper(boom, None).__name__ == "boom"


def test_dist_init_without_cuda_and_finalize() -> None:
    rank, world_size = compat.dist_init("nccl" if not torch.cuda.is_available() else "gloo")
    assert (rank, world_size) == (0, 1)
    assert dist.is_initialized()
    assert dist.get_backend() == "gloo"
    with pytest.raises(RuntimeError, match="already initialised"):
        compat.dist_init()
    compat.dist_finalize()
    assert not dist.is_initialized()
    compat.dist_finalize()  # idempotent


def test_dist_finalize_destroys_a_group_dist_init_took_over() -> None:
    """``dist_init`` over a default group made elsewhere takes it over; the
    first ``dist_finalize`` destroys it, as the helper's did (it used to
    take a second call)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert compat.dist_init() == (0, 1)
    compat.dist_finalize()
    assert not dist.is_initialized()
    compat.dist_finalize()  # idempotent


@pytest.mark.parametrize(
    ("port", "error", "message"),
    [("abc", ValueError, "port must be a port number, not 'abc'"), (1.5, TypeError, "float")],
)
def test_dist_init_names_a_bad_port(port: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        compat.dist_init(port=port)
    assert not dist.is_initialized()


def test_dist_init_without_a_port_names_its_own_argument() -> None:
    with pytest.raises(RuntimeError, match="needs a master port: pass port=") as info:
        compat.dist_init("gloo", rank=1, world_size=2)
    assert "master_port=" not in str(info.value)


def test_a_group_used_after_dist_finalize_is_named_released() -> None:
    compat.dist_init()
    group = compat.get_group(1)
    compat.dist_finalize()
    compat.dist_init()
    with pytest.raises(SessionClosed, match="released by dist_finalize"):
        compat.allreduce(torch.ones(1), group=group)


def test_broadcast_and_allreduce_sync_and_async() -> None:
    compat.dist_init()
    t = torch.ones(3)
    assert compat.allreduce(t) is None
    handle = compat.allreduce(t, op=dist.ReduceOp.MAX, async_op=True)
    assert isinstance(handle, Handle)
    assert handle.wait() is t
    assert compat.broadcast(t, 0) is None
    assert isinstance(compat.broadcast(t, 0, async_op=True), Handle)


def test_collectives_without_a_group_fail_clearly() -> None:
    with pytest.raises(SessionClosed, match="dist_init"):
        compat.allreduce(torch.ones(1))


def test_collectives_on_a_default_group_made_elsewhere() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(2)
        compat.allreduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        compat.dist_finalize()
    assert not dist.is_initialized()


def test_dist_mode_keeps_return_value_and_finalizes_on_error() -> None:
    @compat.dist_mode
    def work(x: int) -> tuple[int, int]:
        assert dist.is_initialized()
        return x, compat.get_world_size()

    assert work(5) == (5, 1)
    assert not dist.is_initialized()

    @compat.dist_mode
    def fails() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError):
        fails()
    assert not dist.is_initialized()
    assert work.__name__ == "work"


def test_dist_context_returns_the_session() -> None:
    with compat.DistContext() as session:
        assert isinstance(session, DistSession)
        assert compat.get_world_size() == 1
        t = torch.ones(2)
        compat.allreduce(t)  # v0.1: a sum, here over one rank
        assert t.tolist() == [1.0, 1.0]
    assert not dist.is_initialized()


def test_dist_mode_on_async_functions() -> None:
    @compat.dist_mode
    async def work() -> float:
        await anyio.lowlevel.checkpoint()
        handle = compat.allreduce(torch.ones(1), async_op=True)
        assert handle is not None
        return float((await handle)[0])

    assert anyio.run(work) == 1.0
    assert not dist.is_initialized()


def _compat_ranks(session: DistSession) -> dict[str, Any]:
    # the session spawn opened is adopted by compat
    out: dict[str, Any] = {"rank": compat.get_rank(), "world": compat.get_world_size()}
    t = torch.arange(2, dtype=torch.int64) + 1 + 2 * compat.get_rank()
    compat.allreduce(t)
    out["seed_example"] = t.tolist()
    group = compat.get_group(2)
    g = torch.tensor([float(compat.get_rank())])
    compat.allreduce(g, group=group)
    out["group_sum"] = g.item()
    b = torch.tensor([float(compat.get_rank())])
    first_of_block = compat.get_rank() // 2 * 2 + 1
    compat.broadcast(b, first_of_block, group=group)
    out["group_bcast"] = b.item()
    with pytest.raises(ValueError, match="divide"):
        compat.get_group(3)
    # v0.1's other names: allgather (torch's all_gather) and simple_group_split
    gathered = [torch.zeros(2) for _ in range(4)]
    assert compat.allgather(gathered, torch.tensor([1.0, 2.0]) * compat.get_rank()) is None
    out["gathered"] = [t.tolist() for t in gathered]
    with pytest.raises(ValueError, match="3 tensors"):
        compat.allgather(gathered[:3], torch.zeros(2))  # refused before launch
    block = compat.simple_group_split(4, compat.get_rank(), 2)
    pair = [torch.zeros(1), torch.zeros(1)]
    handle = compat.allgather(pair, torch.tensor([float(compat.get_rank())]), block, True)
    assert isinstance(handle, Handle)
    out["block_gather"] = [t.item() for t in handle.wait()]
    with pytest.raises(ValueError, match="divide"):
        compat.simple_group_split(4, compat.get_rank(), 3)
    return out


def test_multi_rank_compat_and_get_group() -> None:
    results = spawn(_compat_ranks, 4, timeout=20)
    for rank, out in enumerate(results):
        assert out["rank"] == rank
        assert out["world"] == 4
        assert out["seed_example"] == [16, 20]  # 1+3+5+7, 2+4+6+8
        assert out["group_sum"] == (1.0 if rank < 2 else 5.0)
        assert out["group_bcast"] == (1.0 if rank < 2 else 3.0)
        assert out["gathered"] == [[0.0, 0.0], [1.0, 2.0], [2.0, 4.0], [3.0, 6.0]]
        assert out["block_gather"] == ([0.0, 1.0] if rank < 2 else [2.0, 3.0])


def _dist_init_explicit(session: DistSession, port: int) -> tuple[int, int]:
    session.close()  # leave spawn's group; dist_init makes its own
    try:
        return compat.dist_init("gloo", "127.0.0.1", str(port), session.rank, 2)
    finally:
        compat.dist_finalize()


def test_dist_init_with_explicit_address() -> None:
    from asyncdist._env import bind_loopback

    sock = bind_loopback()
    port = sock.getsockname()[1]
    sock.close()
    assert spawn(_dist_init_explicit, 2, args=(port,), timeout=20) == [(0, 2), (1, 2)]


def _asyncdist_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("asyncdist") and t.is_alive())


def _init_world_of_one() -> None:
    """A default group made by the user, not by asyncdist: gloo, world 1, a
    TCPStore on loopback with a port from the OS."""
    sock = bind_loopback()
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            sock.getsockname()[1],
            1,
            is_master=True,
            timeout=datetime.timedelta(seconds=10),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _adopt_once(adopted: list[DistSession]) -> None:
    _init_world_of_one()
    t = torch.ones(2)
    compat.allreduce(t)  # adopts the group
    assert t.tolist() == [1.0, 1.0]
    session = compat._shared.adopted_session()
    assert session is not None
    adopted.append(session)  # to close them all, even if the test fails


def _close_all(adopted: list[DistSession]) -> None:
    compat.dist_finalize()
    for session in adopted:
        session.close()  # a no-op once compat released it


@pytest.mark.timeout(30)
def test_re_adopting_a_re_initialised_default_group_leaks_no_threads() -> None:
    """The user destroys and re-inits the default group between cycles, never
    calling dist_finalize: each new adoption releases the stale one."""
    baseline = _asyncdist_threads()
    counts: list[int] = []
    adopted: list[DistSession] = []
    try:
        for _ in range(50):
            _adopt_once(adopted)
            dist.destroy_process_group()  # the user's own teardown; compat is not told
            counts.append(_asyncdist_threads() - baseline)
        assert len({id(s) for s in adopted}) == 50, "each new default group is adopted anew"
        assert max(counts) == counts[0], f"threads grow per cycle: {counts}"
        assert all(s.closed for s in adopted[:-1]), "each stale adoption was released"
        compat.dist_finalize()  # releases the last adopted session
        assert _asyncdist_threads() == baseline
        assert not dist.is_initialized()
    finally:
        _close_all(adopted)


@pytest.mark.timeout(30)
def test_dist_finalize_releases_the_adopted_session() -> None:
    baseline, adopted = _asyncdist_threads(), list[DistSession]()
    try:
        for _ in range(50):
            _adopt_once(adopted)
            assert _asyncdist_threads() > baseline, "an adopted session runs its workers"
            compat.dist_finalize()
            assert not dist.is_initialized()
            assert _asyncdist_threads() == baseline, "dist_finalize released the adopted session"
    finally:
        _close_all(adopted)


def test_collectives_after_the_user_destroyed_the_group_release_the_stale_session() -> None:
    baseline, adopted = _asyncdist_threads(), list[DistSession]()
    try:
        _adopt_once(adopted)
        dist.destroy_process_group()
        with pytest.raises(SessionClosed, match="dist_init"):
            compat.allreduce(torch.ones(1))
        assert _asyncdist_threads() == baseline, "the stale adopted session was released"
    finally:
        _close_all(adopted)
