"""The exceptions asyncdist raises.

Hierarchy::

    AsyncDistError (RuntimeError)
    ├── InitError            the process group could not be formed
    ├── SessionClosed        the session is not open (never entered, or left)
    ├── SessionBroken        an earlier collective failed; the session is unusable
    │   └── MembershipLost   an elastic session could not go on (too few ranks,
    │                        no majority, evicted, re-forming timed out)
    ├── CollectiveMismatch   ranks issued different collectives (debug mode)
    └── CollectiveError      a launched collective did not complete
        ├── CollectiveTimeout   ... because a peer stayed silent (also a TimeoutError)
        ├── PeerFailure         ... because a peer died, or left the session early
        ├── MembershipChanged   ... because an elastic session is re-forming
        └── FinishError         ... because its local finishing step failed on this
                                rank (the session stays usable)

``AsyncDistError`` derives from ``RuntimeError`` so code written against plain
``torch.distributed`` (which raises ``RuntimeError``) keeps catching failures;
no asyncdist failure ever surfaces as a *bare* ``RuntimeError``.

Errors coming from torch or gloo are translated in exactly one place,
``translate`` (by exception type first, then by message), and chained
(``raise ... from exc``) so the original message stays visible; a local
step that fails after the collective completed (``finish_failed``) likewise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, NamedTuple

__all__ = [
    "AsyncDistError",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "FinishError",
    "InitError",
    "MembershipChanged",
    "MembershipLost",
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
    """Raised when a peer died or closed its connection during a collective.

    A peer that *left the session* on purpose (its block ended while this
    rank still waited: the ranks issued different numbers of collectives;
    or it raised, was interrupted with Ctrl-C, or was cancelled) is told
    apart from one that vanished, and the message says which. A peer that
    vanished may have been aborted by gloo, which is how gloo reports
    mismatched collectives: the message then points at ``debug=True``.
    """


class MembershipChanged(CollectiveError):
    """Raised in an elastic session when the world a collective (or a
    ``commit``) belongs to is being re-formed: a peer died, went silent or
    was cut off. ``async with world:`` catches it (and the ``PeerFailure`` or
    ``CollectiveTimeout`` that started it), and the elastic loop re-forms.

    Attributes:
        generation: the world (by generation) that ended.
        reason: what ended it, in words.
    """

    def __init__(
        self, message: str, *, op: str = "", rank: int = -1, generation: int = -1, reason: str = ""
    ) -> None:
        super().__init__(message, op=op, rank=rank)
        self.generation = generation
        self.reason = reason


class MembershipLost(SessionBroken):
    """Raised when an elastic session cannot form its next world: fewer
    ranks than ``min_world_size`` are left (for a joiner: none is left to
    take it in), the survivors are not a strict majority of the last world
    (the other side of a partition may go on), this rank was left out of the
    new world, the re-forming did not finish within the session timeout, or
    the same ranks keep failing at the same step (a program error, not a
    lost peer). The message names which, and who is gone.

    Attributes:
        why: ``"too_few"``, ``"no_majority"``, ``"evicted"``, ``"timeout"``,
            ``"coordinator"`` (the store that coordinates the members is
            unreachable), ``"no_progress"`` (every rank alive, two re-forms
            in a row at the same commit) or ``"finished"`` (a joiner came
            after every member had finished).
    """

    def __init__(self, message: str, *, why: str = "") -> None:
        super().__init__(message)
        self.why = why


class FinishError(CollectiveError):
    """Raised when the step that finishes a collective on this rank fails:
    the divide of ``"mean"``, the copy into the result tensor, the unpacking
    of a coalesced buffer.

    The collective itself completed on the wire, so this is a local error:
    the session stays usable. The tensors given to the call may hold an
    unfinished result (the sum of a ``"mean"``). torch's own error (for
    example autograd refusing an in-place update of a leaf that requires
    grad) is chained as ``__cause__``.
    """


Leaving = Literal["finished", "raised", "interrupted", "cancelled", "timed_out"]
"""How a rank's block left a lane: it ended normally, by an exception, by
``KeyboardInterrupt`` (Ctrl-C, SIGINT), by cancellation of its task, or
(however the block ended) after a collective of the lane timed out there."""


class Departure(NamedTuple):
    """A peer's notice that it left a lane on purpose (see ``translate``)."""

    rank: int  # the peer, by its rank in the session
    how: Leaving  # how its block ended
    left: str  # what it left: "the session", "the sub-session of ranks 0..1", ...
    lane: str  # where this rank waited: the same, or "channel 'metrics'", ...
    number: int  # the collective this rank waited in: that lane's n-th, from 1


def mismatch_hint(*, debug: bool = False) -> str:
    """What a rank that gloo aborted (``gloo::EnforceNotMet``, SIGABRT) most
    likely means, and how to find out: one text for spawn, which sees the
    rank die, and for the ranks that see it vanish (under torchrun the only
    ones that report). ``debug``: debug mode was on, so mismatches are caught
    before gloo sees them."""
    hint = (
        "This is how gloo reports mismatched collectives: ranks that issued different "
        "ops, or tensors of different shapes or dtypes, in the same place."
    )
    if debug:
        return hint + " Debug mode was on, so look for a crash in native code (its stderr)."
    return hint + (
        " Run with debug=True (or ASYNCDIST_DEBUG=1) to get a CollectiveMismatch on every "
        "rank naming what differs."
    )


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


def translate(
    exc: BaseException,
    *,
    op: str,
    rank: int,
    timeout: float | None,
    left: Callable[[], Departure | None] | None = None,
    debug: bool = False,
) -> AsyncDistError:
    """Map an exception raised by torch/gloo for a collective to an asyncdist error.

    The exception's type decides first (``TimeoutError`` and a timed-out
    ``DistNetworkError``/``DistStoreError``/``DistBackendError`` ->
    [CollectiveTimeout][asyncdist.errors.CollectiveTimeout]; ``ConnectionError`` and
    ``DistNetworkError`` -> [PeerFailure][asyncdist.errors.PeerFailure]); where the
    type does not (gloo's plain ``RuntimeError``), its message does. Anything else is a
    [CollectiveError][asyncdist.errors.CollectiveError].

    ``left``, asked only when a peer closed its connection, reads whether
    that peer left the session on purpose (a bounded look-up in the store);
    the message then says so (and how: finished, raised, interrupted,
    cancelled) instead of blaming a crash. A peer gone without a notice
    died: the message adds what a rank that gloo aborted means (see
    ``mismatch_hint``, worded for ``debug`` mode).

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
        departure = None if left is None else left()
        if departure is not None:
            return PeerFailure(_left_early(departure, op=op, rank=rank), op=op, rank=rank)
        # No notice: the peer vanished mid-collective. Under torchrun this is
        # all a user sees of a rank gloo aborted, so say what that means.
        return PeerFailure(
            f"{op} on rank {rank} failed because a peer died or closed its connection "
            "without leaving the session. Check the logs of the other ranks for the first "
            "error; gloo::EnforceNotMet there (that rank was killed by SIGABRT) means gloo "
            f"aborted it. {mismatch_hint(debug=debug)}",
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


def finish_failed(exc: BaseException, *, op: str, rank: int) -> BaseException:
    """What the handle raises when ``op``'s finishing step raised ``exc``.

    torch's ``RuntimeError`` s become a [FinishError][asyncdist.errors.FinishError]
    (the caller chains ``exc`` as its cause). Asyncdist errors, and the errors a
    finishing step raises on purpose with their own documented type (a refused
    unpickle's ``pickle.UnpicklingError``, an uneven all_gather's ``ValueError``),
    are returned unchanged.
    """
    if not isinstance(exc, RuntimeError) or isinstance(exc, AsyncDistError):
        return exc
    cause = str(exc).strip()
    if not cause.endswith("."):
        cause += "."
    return FinishError(
        f"{op} on rank {rank}: the collective completed, but the step that finishes it "
        f"on this rank (the divide of 'mean', the copy into the result, or unpacking) "
        f"failed: {cause} The session stays usable; this call's tensors may hold an "
        "unfinished result. Check them: the step runs in the grad and inference mode "
        "the call was issued in, so a tensor that requires grad needs the call issued "
        "under torch.no_grad().",
        op=op,
        rank=rank,
    )


def _left_early(departure: Departure, *, op: str, rank: int) -> str:
    peer, lane, number, how = departure.rank, departure.lane, departure.number, departure.how
    where = "" if lane == departure.left else f" on {lane}"
    waited = f"while this rank ({rank}) still waited in {op} #{number}{where}"
    if how == "finished":
        return (
            f"rank {peer} left {departure.left} {waited}: the ranks issued different numbers "
            f"of collectives. #{number} counts the collectives rank {rank} issued on {lane}; "
            "check that every rank issues as many (uneven data, or a loop or an early "
            "return that differs by rank)."
        )
    if how == "interrupted":
        return (
            f"rank {peer} was interrupted (KeyboardInterrupt: Ctrl-C or SIGINT) and left "
            f"{departure.left} {waited}: the interrupt ended it, no rank crashed."
        )
    if how == "timed_out":
        return (
            f"rank {peer} gave up waiting for the others in a collective (its session timed "
            f"out) and left {departure.left} {waited}: this rank, or another, was slower "
            "than the session timeout, or stuck. Raise DistSession(timeout=...) if such a "
            "delay is expected."
        )
    if how == "cancelled":
        return (
            f"rank {peer} left {departure.left} because its task was cancelled (a cancel "
            "scope or timeout ended its block; under asyncio, Ctrl-C interrupts a program "
            f"by cancelling its main task) {waited}. Check rank {peer}'s log if that was "
            "not meant."
        )
    return (
        f"rank {peer} left {departure.left} by an exception {waited}. Check rank {peer}'s "
        "log: that exception is the first error."
    )
