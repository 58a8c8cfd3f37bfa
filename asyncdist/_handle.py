"""Handle: a launched collective, awaitable on asyncio or trio, or waited on synchronously.

``Handle`` is the public face of an internal operation record (``_op.Op``,
or ``_op.AllOp`` for a handle over many): it holds one op and offers only
the public API. It is final and has no public constructor; lanes make
handles with ``handle_of(op)``, and internal code that needs the record
(the session's drain, the tracer, tests) reads it with ``op_of(handle)``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any, Generic, TypeVar, final

from . import _wakeup
from ._op import AllOp, Op

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@final
class Handle(Generic[T_co]):
    """A launched collective.

    The collective is already running when you hold its handle.  Await it
    (``await h``, on asyncio or trio) or call ``h.wait()`` to get its result;
    both can be repeated and mixed.  Awaiting follows each loop's convention
    for something already complete: on asyncio a done handle returns at once,
    without yielding (like a done future); on trio every ``await h`` is a
    checkpoint (a cancel point and a schedule point), done or not.  There is
    no public constructor: handles come from
    [DistSession][asyncdist.DistSession] methods and [wait_all][asyncdist.wait_all].
    """

    __slots__ = ("_op",)

    _op: Op | AllOp

    def __init__(self) -> None:
        raise TypeError("Handle has no public constructor; DistSession methods return handles")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("Handle is final; it cannot be subclassed")

    @property
    def op(self) -> str:
        """The collective's name, e.g. ``"allreduce"``."""
        return self._op.name

    def done(self) -> bool:
        """True once the collective finished (successfully or not); for NCCL
        work, once the device finished it."""
        return self._op.done()

    def exception(self) -> BaseException | None:
        """The error the collective ended with, ``None`` if pending or successful."""
        return self._op.exception()

    def wait(self, timeout: float | None = None) -> T_co:
        """Block until the collective finishes and return its result.

        Args:
            timeout: seconds to wait at most; ``None`` waits until the
                collective completes or the session timeout declares it lost.

        Raises:
            TimeoutError: ``timeout`` passed first; the handle stays valid
                and can be waited on again.
            CollectiveTimeout, PeerFailure, CollectiveError: the collective failed.
            FinishError: the step that finishes it on this rank failed (the
                divide of "mean", a copy-back); the session stays usable.
        """
        result: T_co = self._op.wait(timeout)
        return result

    def synchronize(self) -> T_co:
        """Like [wait][asyncdist.Handle.wait], and for CUDA work also block the host until the
        device has finished it (not only ordered the current stream after it)."""
        result: T_co = self._op.synchronize()
        return result

    def __await__(self) -> Generator[Any, None, T_co]:
        # A generator rather than a coroutine's __await__: awaiting a done
        # handle on asyncio stays one frame and a plain return.
        op = self._op
        if type(op) is not Op:
            result: T_co = yield from op.wait_async().__await__()  # type: ignore[union-attr]
            return result
        if not op.done():
            yield from op.settled().__await__()
        elif _wakeup.on_trio():  # every await is a checkpoint there; not on asyncio
            yield from _wakeup.trio_checkpoint().__await__()
        return op.result()  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        # Pure: it must not mark an error as seen (that changes what leaving
        # the session raises).
        return f"<Handle {self._op.name} {self._op.status()}>"

    def __reduce__(self) -> Any:
        raise TypeError("a Handle belongs to the process that launched it; it cannot be pickled")


def handle_of(op: Op | AllOp) -> Handle[Any]:
    """The public handle over ``op`` (the one way handles are made)."""
    handle: Handle[Any] = object.__new__(Handle)
    handle._op = op
    return handle


def op_of(handle: Handle[Any]) -> Op | AllOp:
    """The operation record behind ``handle``: a seam for the package's own
    layers (the tracer, the session's drain) and for tests and tools."""
    return handle._op


def wait_all(handles: Iterable[Handle[T]]) -> Handle[list[T]]:
    """One handle over many: its result is the list of their results, in order.

    ``await wait_all(hs)`` or ``wait_all(hs).wait()``.  If a part fails, waiting
    raises that part's error (the first failing part in order).
    """
    parts = tuple(handles)
    for part in parts:
        if not isinstance(part, Handle):
            raise TypeError(f"wait_all takes Handles, not {type(part).__name__}")
    return combined("wait_all", parts, list)


def combined(op: str, parts: Iterable[Handle[Any]], combine: Callable[[list[Any]], T]) -> Handle[T]:
    """A handle done when all ``parts`` are, whose result is ``combine(results)``."""
    return handle_of(AllOp(op, [part._op for part in parts], combine))
