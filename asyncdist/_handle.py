"""Handle: a launched collective, awaitable on asyncio or trio, or waited on synchronously.

A collective is issued by the session *before* its handle exists; the handle
only observes completion.  Completion reaches it by one of two paths:

* the torch ``Future`` of the work: its done-callback runs on a gloo worker
  thread, finishes the result (e.g. divides for "mean") and marks the
  handle's ``_Completion``;
* for works gloo gives no future (``reduce_scatter``, ``send``/``recv``): a
  :class:`Completer` thread per ordering key waits on the works in issue
  order.  One thread serves every handle of that key; none is parked per
  handle.

Waiters are woken from that thread without blocking it: a sync waiter through
a ``threading.Event``, an async waiter through :mod:`._wakeup`.

Nothing a completion callback holds may reference the process group: gloo
drops the callback on its worker thread, and if that dropped the last
reference to the group, gloo would join its own thread and abort.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any, Generic, TypeVar

import anyio

from . import _wakeup
from .errors import CollectiveTimeout, translate

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# Seconds the handle's own watchdog allows past the session timeout before it
# declares a collective lost; the backend's timeout normally fires first.
WATCHDOG_GRACE = 3.0


class Health:
    """Per-session fault state shared by the session and its completions.

    Holds no reference to the process group (see the module docstring).
    """

    __slots__ = ("fault", "last_progress", "rank", "timeout")

    def __init__(self, *, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timeout
        self.fault: BaseException | None = None
        self.last_progress = time.monotonic()

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    def break_(self, exc: BaseException) -> None:
        if self.fault is None:
            self.fault = exc


class _Completion:
    """One-shot result cell, set from any thread, first setter wins."""

    __slots__ = ("_callbacks", "_error", "_event", "_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def _settle(self, value: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._value, self._error = value, error
            callbacks, self._callbacks = self._callbacks, []
            self._event.set()
        for callback in callbacks:
            callback()
        return True

    def set_result(self, value: Any) -> bool:
        return self._settle(value, None)

    def set_error(self, error: BaseException) -> bool:
        return self._settle(None, error)

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once done: now (on this thread) if already done,
        else on the thread that completes the cell.  It must not raise."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def remove_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def wait(self, timeout: float | None) -> bool:
        return self._event.wait(timeout)

    def error(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


def _settle_from(
    completion: _Completion,
    health: Health,
    op: str,
    outcome: Callable[[], Any],
) -> None:
    """Run ``outcome`` (which waits/checks the work and returns the result) and
    record what it gave.  Runs on a backend thread; never raises."""
    try:
        value = outcome()
    except BaseException as exc:  # noqa: BLE001 - everything must reach the waiter
        error = translate(exc, op=op, rank=health.rank, timeout=health.timeout)
        if error is not exc:
            error.__cause__ = exc
        health.break_(error)
        completion.set_error(error)
    else:
        health.progressed()
        completion.set_result(value)


class Completer:
    """Completes futureless works (gloo ``reduce_scatter``, ``send``/``recv``).

    One daemon thread per ordering key waits on that key's works in issue
    order; works of one key complete in that order anyway (one collective
    stream, or one peer and direction), so waiting in order never delays a
    completion behind an unrelated one.
    """

    _STOP = object()

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[Any]] = {}
        self._threads: list[threading.Thread] = []

    def submit(self, key: str, job: Callable[[], None]) -> None:
        with self._lock:
            jobs = self._queues.get(key)
            if jobs is None:
                jobs = self._queues[key] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._run, args=(jobs,), name=f"{self._name}:{key}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        jobs.put(job)

    @classmethod
    def _run(cls, jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            job = jobs.get()
            if job is cls._STOP:
                return
            job()
            del job

    def close(self, timeout: float | None) -> None:
        """Stop the threads once their queued works are done; wait up to
        ``timeout`` for them (threads stuck on a lost peer are left to the
        backend timeout; they are daemons)."""
        with self._lock:
            for jobs in self._queues.values():
                jobs.put(self._STOP)
            threads, self._threads, self._queues = self._threads, [], {}
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(remaining)


class Handle(Generic[T_co]):
    """A launched collective.

    The collective is already running when you hold its handle.  Await it
    (``await h``, on asyncio or trio) or call ``h.wait()`` to get its result;
    both can be repeated and mixed.  There is no public constructor: handles
    come from :class:`~asyncdist.DistSession` methods and :func:`wait_all`.
    """

    __slots__ = ("_completion", "_health", "_launched", "_op", "_work")

    _op: str
    _completion: _Completion
    _health: Health | None
    _launched: float
    _work: Any

    def __init__(self) -> None:
        raise TypeError("Handle has no public constructor; DistSession methods return handles")

    @classmethod
    def _create(cls, op: str, health: Health | None, work: Any = None) -> Handle[Any]:
        self = object.__new__(cls)
        self._op = op
        self._completion = _Completion()
        self._health = health
        self._launched = time.monotonic()
        self._work = work
        return self

    # -- inspection --------------------------------------------------------

    @property
    def op(self) -> str:
        """The collective's name, e.g. ``"allreduce"``."""
        return self._op

    def done(self) -> bool:
        """True once the collective finished (successfully or not)."""
        return self._completion.done()

    def exception(self) -> BaseException | None:
        """The error the collective ended with, ``None`` if pending or successful."""
        return self._completion.error()

    def __repr__(self) -> str:
        if not self.done():
            status = "pending"
        elif (error := self.exception()) is not None:
            status = f"failed: {type(error).__name__}"
        else:
            status = "done"
        return f"<Handle {self._op} {status}>"

    # -- the watchdog --------------------------------------------------------

    def _watchdog_remaining(self) -> float:
        """Seconds until this handle is declared lost (inf without a session)."""
        health = self._health
        if health is None:
            return math.inf
        since = max(self._launched, health.last_progress)
        return since + health.timeout + WATCHDOG_GRACE - time.monotonic()

    def _expire(self) -> None:
        health = self._health
        assert health is not None
        error = CollectiveTimeout(
            f"{self._op} on rank {health.rank} made no progress for "
            f"{health.timeout + WATCHDOG_GRACE:g} s (timeout {health.timeout:g} s): a peer "
            "is alive but silent. Check that every rank issues the same collectives in "
            "the same order, and whether a peer is stuck or stopped.",
            op=self._op,
            rank=health.rank,
        )
        health.break_(error)
        self._completion.set_error(error)

    # -- waiting -------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> T_co:
        """Block until the collective finishes and return its result.

        Args:
            timeout: seconds to wait at most; ``None`` waits until the
                collective completes or the session timeout declares it lost.

        Raises:
            TimeoutError: ``timeout`` passed first; the handle stays valid
                and can be waited on again.
            CollectiveTimeout, PeerFailure, CollectiveError: the collective failed.
        """
        completion = self._completion
        if not completion.done():
            limit = math.inf if timeout is None else time.monotonic() + timeout
            while True:
                watchdog = self._watchdog_remaining()
                user = limit - time.monotonic()
                chunk = min(watchdog, user)
                if completion.wait(None if chunk == math.inf else max(0.0, chunk)):
                    break
                if self._watchdog_remaining() <= 0:
                    self._expire()
                    break
                if limit - time.monotonic() <= 0:
                    raise TimeoutError(
                        f"{self._op} did not finish within {timeout:g} s; the handle stays "
                        "valid and can be waited on again"
                    )
        result: T_co = completion.result()
        return result

    def synchronize(self) -> T_co:
        """Like :meth:`wait`, and for CUDA work also block the host until the
        device has finished it (not only the current stream)."""
        result = self.wait()
        if self._work is not None and hasattr(self._work, "synchronize"):
            self._work.synchronize()
        return result

    async def _wait_async(self) -> T_co:
        completion = self._completion
        if not completion.done():
            event = anyio.Event()
            wake = _wakeup.current_waker()

            def on_done() -> None:
                wake(event.set)

            completion.add_callback(on_done)
            try:
                while not completion.done():
                    with anyio.move_on_after(self._watchdog_remaining()):
                        await event.wait()
                    if not completion.done() and self._watchdog_remaining() <= 0:
                        self._expire()
            finally:
                completion.remove_callback(on_done)
        result: T_co = completion.result()
        return result

    def __await__(self) -> Generator[Any, None, T_co]:
        return self._wait_async().__await__()

    # -- completion (called by the session) -----------------------------------

    def _complete_with(self, outcome: Callable[[], Any]) -> Callable[[], None]:
        """A job that settles this handle with ``outcome()``; holds no group."""
        completion, health, op = self._completion, self._health, self._op
        assert health is not None

        def job() -> None:
            _settle_from(completion, health, op, outcome)

        return job

    def _attach_future(self, future: Any, finish: Callable[[], Any]) -> None:
        """Settle from a torch ``Future``'s done-callback (gloo worker thread)."""
        completion, health, op = self._completion, self._health, self._op
        assert health is not None

        def on_future(fut: Any) -> None:
            def outcome() -> Any:
                fut.value()  # raises the backend's error, if any
                return finish()

            _settle_from(completion, health, op, outcome)

        future.add_done_callback(on_future)

    def _fail_now(self, error: BaseException) -> None:
        self._completion.set_error(error)


class _AllHandle(Handle[list[Any]]):
    """The handle :func:`wait_all` returns: done when every part is."""

    __slots__ = ("_parts",)

    _parts: tuple[Handle[Any], ...]

    def done(self) -> bool:
        return all(part.done() for part in self._parts)

    def exception(self) -> BaseException | None:
        return next((e for p in self._parts if (e := p.exception()) is not None), None)

    def wait(self, timeout: float | None = None) -> list[Any]:
        limit = None if timeout is None else time.monotonic() + timeout
        results = []
        for part in self._parts:
            remaining = None if limit is None else max(0.0, limit - time.monotonic())
            results.append(part.wait(remaining))
        return results

    def synchronize(self) -> list[Any]:
        return [part.synchronize() for part in self._parts]

    async def _wait_async(self) -> list[Any]:
        return [await part for part in self._parts]


def wait_all(handles: Iterable[Handle[T]]) -> Handle[list[T]]:
    """One handle over many: its result is the list of their results, in order.

    ``await wait_all(hs)`` or ``wait_all(hs).wait()``.  If a part fails, waiting
    raises that part's error (the first failing part in order).
    """
    parts = tuple(handles)
    for part in parts:
        if not isinstance(part, Handle):
            raise TypeError(f"wait_all takes Handles, not {type(part).__name__}")
    self = _AllHandle._create("wait_all", None)
    assert isinstance(self, _AllHandle)
    self._parts = parts
    return self  # type: ignore[return-value]

