"""The exceptions asyncdist raises.

Hierarchy::

    AsyncDistError (RuntimeError)
    ├── InitError            the process group could not be formed
    ├── SessionClosed        the session is not open (never entered, or left)
    ├── SessionBroken        an earlier collective failed; the session is unusable
    ├── CollectiveMismatch   ranks issued different collectives (debug mode)
    └── CollectiveError      a launched collective did not complete
        ├── CollectiveTimeout   ... because a peer stayed silent (also a TimeoutError)
        └── PeerFailure         ... because a peer died or closed its connection

``AsyncDistError`` derives from ``RuntimeError`` so code written against plain
``torch.distributed`` (which raises ``RuntimeError``) keeps catching failures;
no asyncdist failure ever surfaces as a *bare* ``RuntimeError``.

Errors coming from torch or gloo are translated in exactly one place,
:func:`translate` (by exception type first, then by message), and chained
(``raise ... from exc``) so the original message stays visible.
"""

from __future__ import annotations

import functools
from typing import Literal

__all__ = [
    "AsyncDistError",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "InitError",
    "PeerFailure",
    "SessionBroken",
    "SessionClosed",
]


class AsyncDistError(RuntimeError):
    """Base class of every error asyncdist raises on its own account."""


class InitError(AsyncDistError):
    """Raised when a session cannot form its process group.

    Typical causes: the master address is unreachable, a rank never joined
    within the init timeout, or the launch environment is inconsistent.
    """


class SessionClosed(AsyncDistError):
    """Raised when a collective is issued on a session that is not open."""


class SessionBroken(AsyncDistError):
    """Raised when a collective is issued on a session after a fault.

    The fault that broke the session is chained as ``__cause__``.
    """


class CollectiveMismatch(AsyncDistError):
    """Raised on every rank when ranks issue different collectives.

    Only detected with ``DistSession(debug=True)`` (or ``ASYNCDIST_DEBUG=1``).
    """


class CollectiveError(AsyncDistError):
    """Raised when a launched collective fails to complete.

    Attributes:
        op: the collective's name, e.g. ``"allreduce"``.
        rank: the rank that observed the failure.
    """

    def __init__(self, message: str, *, op: str = "", rank: int = -1) -> None:
        super().__init__(message)
        self.op = op
        self.rank = rank


class CollectiveTimeout(CollectiveError, TimeoutError):
    """Raised when a collective does not complete within the session timeout.

    A live but silent peer (stuck, stopped, or issuing a different sequence
    of collectives) shows up this way.
    """


class PeerFailure(CollectiveError):
    """Raised when a peer died or closed its connection during a collective."""


_PEER_GONE_MARKERS = (
    "connection reset by peer",
    "connection closed by peer",
    "connection was likely closed",  # c10d's own sockets (TCPStore), on EOF
    "connection refused",
    "broken pipe",
    "socket closed",
    "end of file",
    "remote process exited",  # NCCL's ncclRemoteError
)
_TIMEOUT_MARKERS = ("timed out", "timeout")

_Kind = Literal["timeout", "peer", "store", "backend"]


@functools.cache
def _torch_errors() -> tuple[type[BaseException], ...]:
    """torch's ``(DistNetworkError, DistStoreError, DistError)``; empty without torch."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return ()
    return (dist.DistNetworkError, dist.DistStoreError, dist.DistError)


def _classify(exc: BaseException) -> _Kind:
    """Why ``exc`` happened: its type first, its message where the type is too broad.

    Python's ``TimeoutError``/``ConnectionError`` say it all. torch's
    ``DistNetworkError`` is a broken or silent socket, ``DistStoreError`` a
    rendezvous-store failure (mostly a wait that timed out), other
    ``DistError`` s (``DistBackendError``) a backend failure; gloo raises
    plain ``RuntimeError`` s, so for those only the text tells.
    """
    text = str(exc).lower()
    says_timeout = any(marker in text for marker in _TIMEOUT_MARKERS)
    says_peer_gone = any(marker in text for marker in _PEER_GONE_MARKERS)
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionError):  # reset, aborted, refused, broken pipe
        return "peer"
    torch_errors = _torch_errors()
    if torch_errors:
        network_error, store_error, dist_error = torch_errors
        if isinstance(exc, network_error):
            return "timeout" if says_timeout else "peer"
        if isinstance(exc, (store_error, dist_error)):
            if says_timeout:
                return "timeout"
            if says_peer_gone:
                return "peer"
            return "store" if isinstance(exc, store_error) else "backend"
    if says_timeout:
        return "timeout"
    if says_peer_gone:
        return "peer"
    return "backend"


def translate(exc: BaseException, *, op: str, rank: int, timeout: float | None) -> AsyncDistError:
    """Map an exception raised by torch/gloo for a collective to an asyncdist error.

    The exception's type decides first (``TimeoutError`` and a timed-out
    ``DistNetworkError``/``DistStoreError``/``DistBackendError`` ->
    :class:`CollectiveTimeout`; ``ConnectionError`` and ``DistNetworkError``
    -> :class:`PeerFailure`); where the type does not (gloo's plain
    ``RuntimeError``), its message does. Anything else is a
    :class:`CollectiveError`.

    The caller raises the result ``from exc``.  Exceptions that already are
    asyncdist errors are returned unchanged.
    """
    if isinstance(exc, AsyncDistError):
        return exc
    kind = _classify(exc)
    if kind == "timeout":
        limit = f"{timeout:g} s" if timeout is not None else "the group timeout"
        return CollectiveTimeout(
            f"{op} on rank {rank} did not complete within {limit}: a peer is alive but "
            "silent. Check that every rank issues the same collectives in the same "
            "order, and whether a peer is stuck or stopped.",
            op=op,
            rank=rank,
        )
    if kind == "peer":
        return PeerFailure(
            f"{op} on rank {rank} failed because a peer died or closed its connection. "
            "Check the logs of the other ranks for the first error.",
            op=op,
            rank=rank,
        )
    if kind == "store":
        return CollectiveError(
            f"{op} on rank {rank} failed in the rendezvous store: {exc}. Check that the "
            "master (MASTER_ADDR/MASTER_PORT) is still running and reachable.",
            op=op,
            rank=rank,
        )
    return CollectiveError(
        f"{op} on rank {rank} failed in the backend: {exc}. Check that every rank "
        "passes tensors of the same shape and dtype.",
        op=op,
        rank=rank,
    )
