from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from asyncdist import DistSession, errors, spawn
from asyncdist._store import LeaveNotices
from asyncdist.errors import (
    AsyncDistError,
    CollectiveError,
    CollectiveTimeout,
    Departure,
    PeerFailure,
    translate,
)


def test_hierarchy() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, AsyncDistError)
        assert issubclass(cls, RuntimeError), "code catching RuntimeError keeps working"
    assert issubclass(CollectiveTimeout, TimeoutError)
    assert issubclass(PeerFailure, CollectiveError)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer.", PeerFailure),
        ("[pair.cc:598] Connection closed by peer [127.0.0.1]:2", PeerFailure),
        ("[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation", CollectiveTimeout),
        ("something else entirely", CollectiveError),
    ],
)
def test_translate_gloo_messages(message: str, expected: type[Exception]) -> None:
    error = translate(RuntimeError(message), op="allreduce", rank=3, timeout=3.0)
    assert type(error) is expected
    assert isinstance(error, CollectiveError)
    assert "allreduce" in str(error)
    assert "rank 3" in str(error)
    assert "Check " in str(error), "each message says what to check"
    assert error.op == "allreduce"
    assert error.rank == 3


def test_translate_keeps_asyncdist_errors() -> None:
    original = PeerFailure("x", op="a", rank=0)
    assert translate(original, op="b", rank=1, timeout=None) is original


def _torch_errors() -> list[tuple[BaseException, type[Exception]]]:
    import torch.distributed as dist

    return [
        # c10d's sockets (TCPStore, rendezvous): a closed peer, or a silent one
        (dist.DistNetworkError("Broken pipe"), PeerFailure),
        (
            dist.DistNetworkError(
                "Failed to recv, got 0 bytes. Connection was likely closed. "
                "Did the remote server shutdown or crash?"
            ),
            PeerFailure,
        ),
        (dist.DistNetworkError("Network is unreachable"), PeerFailure),
        (dist.DistNetworkError("Socket Timeout"), CollectiveTimeout),
        (
            dist.DistNetworkError(
                "The client socket has timed out after 1000ms while trying to connect to "
                "(127.0.0.1, 29500)."
            ),
            CollectiveTimeout,
        ),
        # the store: a wait that ran out (a peer never arrived), or another failure
        (dist.DistStoreError("wait timeout after 1000ms, keys: /k"), CollectiveTimeout),
        (dist.DistStoreError("Wait timeout"), CollectiveTimeout),
        (dist.DistStoreError("key not valid"), CollectiveError),
        # backends: classified by what the text says; anything else is a backend failure
        (
            dist.DistBackendError("NCCL error: remote process exited or there was a network error"),
            PeerFailure,
        ),
        (dist.DistBackendError("Watchdog caught collective operation timeout"), CollectiveTimeout),
        (dist.DistBackendError("invalid usage"), CollectiveError),
        (dist.DistError("Connection closed by peer"), PeerFailure),
        # Python's own: the type says it, whatever the text
        (TimeoutError(), CollectiveTimeout),
        (TimeoutError("recv"), CollectiveTimeout),
        (ConnectionResetError(), PeerFailure),
        (BrokenPipeError(), PeerFailure),
        (ConnectionAbortedError("gone"), PeerFailure),
        (ConnectionRefusedError(), PeerFailure),
    ]


@pytest.mark.parametrize(
    ("exc", "expected"),
    _torch_errors(),
    ids=lambda v: f"{type(v).__name__}:{v}"[:60] if isinstance(v, BaseException) else None,
)
def test_translate_by_exception_type(exc: BaseException, expected: type[Exception]) -> None:
    error = translate(exc, op="broadcast", rank=2, timeout=5.0)
    assert type(error) is expected
    assert "broadcast" in str(error)
    assert "rank 2" in str(error)
    assert "Check " in str(error), "each message says what to check"
    assert (error.op, error.rank) == ("broadcast", 2)  # type: ignore[attr-defined]


def test_translate_a_real_store_timeout() -> None:
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(milliseconds=20))
    with pytest.raises(dist.DistStoreError) as info:
        store.get("never-set")
    assert type(translate(info.value, op="barrier", rank=0, timeout=None)) is CollectiveTimeout


# -- a peer that left on purpose vs one that crashed -----------------------------------

CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")


def test_a_peer_that_left_on_purpose_is_named() -> None:
    left = Departure(1, "finished", "the session", "the session", 3)
    error = translate(CLOSED, op="allreduce", rank=0, timeout=5, left=lambda: left)
    assert isinstance(error, PeerFailure)
    assert str(error).startswith(
        "rank 1 left the session while this rank (0) still waited in allreduce #3: "
        "the ranks issued different numbers of collectives."
    )
    assert "died" not in str(error)
    on_channel = left._replace(lane="channel 'metrics'")
    error = translate(CLOSED, op="allreduce", rank=0, timeout=5, left=lambda: on_channel)
    assert "still waited in allreduce #3 on channel 'metrics':" in str(error)
    raised = left._replace(how="raised")
    error = translate(CLOSED, op="barrier", rank=0, timeout=5, left=lambda: raised)
    assert "rank 1 left the session by an exception" in str(error)
    assert "different numbers" not in str(error)


def test_a_peer_that_was_interrupted_is_not_blamed() -> None:
    interrupted = Departure(1, "interrupted", "the session", "the session", 7)
    message = str(translate(CLOSED, op="allreduce", rank=0, timeout=5, left=lambda: interrupted))
    assert message.startswith(
        "rank 1 was interrupted (KeyboardInterrupt: Ctrl-C or SIGINT) and left the session "
        "while this rank (0) still waited in allreduce #7: the interrupt ended it, "
        "no rank crashed."
    ), message
    assert "exception" not in message
    assert "first error" not in message
    cancelled = interrupted._replace(how="cancelled")
    message = str(translate(CLOSED, op="allreduce", rank=0, timeout=5, left=lambda: cancelled))
    assert message.startswith("rank 1 left the session because its task was cancelled"), message
    assert "exception" not in message


def test_without_a_notice_a_closed_connection_is_a_peer_that_died() -> None:
    error = translate(CLOSED, op="allreduce", rank=0, timeout=5, left=lambda: None)
    assert isinstance(error, PeerFailure)
    assert "a peer died or closed its connection" in str(error)


def test_a_peer_gone_without_a_notice_points_at_mismatched_collectives() -> None:
    error = translate(CLOSED, op="allreduce", rank=0, timeout=5, left=lambda: None)
    message = str(error)
    assert "without leaving the session" in message
    assert "gloo::EnforceNotMet" in message
    assert "how gloo reports mismatched collectives" in message
    assert "debug=True" in message
    assert "ASYNCDIST_DEBUG=1" in message
    left = Departure(1, "finished", "the session", "the session", 3)
    told = str(translate(CLOSED, op="allreduce", rank=0, timeout=5, left=lambda: left))
    assert "debug=True" not in told, "a peer that left on purpose is not a mismatch"


def test_in_debug_mode_a_vanished_peer_is_not_told_to_turn_debug_on() -> None:
    error = translate(CLOSED, op="allreduce", rank=0, timeout=5, left=lambda: None, debug=True)
    message = str(error)
    assert "Debug mode was on" in message
    assert "Run with debug=True" not in message


def test_notices_are_read_only_for_a_closed_connection() -> None:
    def never() -> None:
        raise AssertionError("read for a timeout")

    error = translate(
        RuntimeError("Timed out waiting 5000ms"), op="x", rank=0, timeout=5, left=never
    )
    assert isinstance(error, CollectiveTimeout)


def _fewer_collectives_on_rank_1(session: DistSession, where: str) -> str:
    lane = session if where == "session" else session.channel("metrics")
    t = torch.ones(4)
    lane.allreduce(t).wait()
    if session.rank == 1:
        return "left"  # one allreduce fewer: rank 0 waits in its second
    try:
        lane.allreduce(t).wait()
    except PeerFailure as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["session", "channel"])
def test_a_rank_that_finished_early_is_named_on_the_waiting_rank(where: str) -> None:
    message, left = spawn(_fewer_collectives_on_rank_1, 2, args=(where,), timeout=20)
    assert left == "left"
    expected = "rank 1 left the session while this rank (0) still waited in allreduce #2"
    assert message.startswith(expected), message
    assert "the ranks issued different numbers of collectives" in message
    if where == "channel":
        assert "#2 on channel 'metrics'" in message


def _sub_session_left_by_an_exception(session: DistSession) -> str:
    try:
        with session.split(2) as sub:
            sub.barrier().wait()
            if session.rank == 1:
                raise KeyError("rank 1 gives up")
            sub.allreduce(torch.ones(2)).wait()
    except KeyError:
        return "raised"
    except PeerFailure as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
def test_a_rank_that_left_a_sub_session_by_an_exception_is_named() -> None:
    message, raised = spawn(_sub_session_left_by_an_exception, 2, timeout=20)
    assert raised == "raised"
    assert message.startswith(
        "rank 1 left the sub-session of ranks 0..1 by an exception while this rank (0) "
        "still waited in allreduce #2."
    ), message


def test_leave_notices_are_bounded_and_namespaced() -> None:
    store = dist.HashStore()
    root = LeaveNotices(store, "s0", range(3), "the session")
    channel = root.child("channel:m", range(3), "channel 'm'")
    other = LeaveNotices(store, "s1", range(3), "the session")  # the next session
    assert channel.departure(0, 4) is None
    root.post(2, "finished")
    assert channel.departure(0, 4) == Departure(2, "finished", "the session", "channel 'm'", 4)
    assert channel.departure(2, 4) is None, "a rank's own notice is not a peer's"
    assert other.departure(0, 1) is None
    root.release()
    assert channel.departure(0, 4) is None, "released: nothing is read"
