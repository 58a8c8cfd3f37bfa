from __future__ import annotations

import pytest

from asyncdist import errors
from asyncdist.errors import (
    AsyncDistError,
    CollectiveError,
    CollectiveTimeout,
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
