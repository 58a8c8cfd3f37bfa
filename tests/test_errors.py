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
