"""Progress: what moves a session tree's collectives to completion, and what it shares.

A session tree is a session with its channels and sub-sessions: every lane
formed from one entered ``DistSession``. The lanes of a tree share one
``Tree`` record, made when the root lane is: its ``Health`` (a fault on any
lane breaks them all), its one ``Watchdog`` thread, its tracer, the root's
leave notices, its timeout, debug and loopback settings and the defaults a
new lane's routes take (backend, device, whether CPU tensors ride gloo).
A lane reads them from the record; nothing walks up a chain of parents.

Threads, and who owns them:

* ``Watchdog``: one daemon thread per tree, started with the root lane and
  stopped (joined) when the root lane closes. Every lane registers its
  outstanding handles with it, so a channel or a sub-session costs no
  watchdog thread of its own. About once a second it settles finished
  handles nobody looked at (so a failure breaks the session even when no one
  waits) and declares lost those that made no progress within the timeout.
* ``Completer``: one per lane, lazy: a daemon thread per ordering key,
  started by the first job of that key (gloo works without a future,
  object exchanges, debug agreement). An idle lane has none.

Leaving a session: ``leaving_how`` names how its block ended (for the notice
peers read), ``quiet_interrupt`` hides a raw backend error under a Ctrl-C,
and ``Health.report`` surfaces failures nobody waited on.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .errors import AsyncDistError, Departure, FinishError, Leaving, translate

if TYPE_CHECKING:
    from ._store import LeaveNotices

logger = logging.getLogger("asyncdist")

# Seconds the watchdog allows past the session timeout before it declares a
# collective lost; the backend's timeout normally fires first.
WATCHDOG_GRACE = 3.0


class Health:
    """Fault state shared by every lane of a session tree and their handles.

    Holds no reference to a process group: a handle settled on a gloo worker
    thread must never drop a group's last reference there (see ``_groups``).
    """

    __slots__ = ("debug", "fault", "fault_seen", "last_progress", "rank", "timeout")

    def __init__(self, *, rank: int, timeout: float, debug: bool = False) -> None:
        self.rank = rank
        self.timeout = timeout
        self.debug = debug  # debug mode: mismatches are caught before the backend
        self.fault: BaseException | None = None
        self.fault_seen = False  # the user was shown a fault of this session
        self.last_progress = time.monotonic()

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    def record_fault(self, exc: BaseException) -> None:
        """Break the tree with ``exc``, unless a fault broke it already."""
        if self.fault is None:
            self.fault = exc

    def mark_seen(self, error: BaseException | None) -> None:
        """``error`` reached the user; a fault (not a local error) counts as seen."""
        if isinstance(error, AsyncDistError) and not isinstance(error, FinishError):
            self.fault_seen = True

    def translate(
        self,
        exc: BaseException,
        *,
        op: str,
        left: Callable[[], Departure | None] | None = None,
    ) -> AsyncDistError:
        """``errors.translate`` for this session's rank, timeout and debug mode
        (``left``: see there); breaks nothing."""
        return translate(
            exc, op=op, rank=self.rank, timeout=self.timeout, left=left, debug=self.debug
        )

    def fail(
        self,
        exc: BaseException,
        *,
        op: str,
        left: Callable[[], Departure | None] | None = None,
    ) -> AsyncDistError:
        """Translate a backend error raised straight to the caller, break the
        session with it and mark it seen; the caller raises the result.
        ``left``: see ``translate``."""
        error = self.translate(exc, op=op, left=left)
        if error is not exc:
            error.__cause__ = exc
        self.record_fault(error)
        self.mark_seen(error)
        return error

    def report(self, unseen: Iterable[BaseException | None], *, raise_errors: bool) -> None:
        """Surface failures of outstanding collectives nobody waited on (a
        session's exit): nothing is lost.

        A fault is raised when the block exited normally; otherwise (or for
        local errors, like a refused unpickle or a FinishError) it is logged.
        So is the fault that broke the session, if no error of it ever
        reached the user (the watchdog found it on a handle nobody waited on).
        """
        faults = [error for error in unseen if error is not None]
        if self.fault is not None and not self.fault_seen and self.fault not in faults:
            faults.insert(0, self.fault)
        for error in faults:
            logger.warning("rank %d: unobserved failure at session exit: %s", self.rank, error)
        fault = next(
            (e for e in faults if isinstance(e, AsyncDistError) and not isinstance(e, FinishError)),
            None,
        )
        if fault is not None and raise_errors:
            self.fault_seen = True  # once, not again at a parent session's exit
            raise fault


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


class Watched(Protocol):
    """What the watchdog needs of an outstanding collective (``_op.Op``)."""

    def done(self) -> bool: ...

    def budget(self) -> float: ...

    def expire(self) -> None: ...


class Watchdog:
    """Declares a session tree's collectives lost when they stop making progress.

    One daemon thread per tree, not per lane nor per handle: each lane
    registers its queue of outstanding handles with ``watch`` and takes it
    back with ``unwatch`` when it closes. The backend's own timeout (the
    group timeout) normally fires first; this is the backstop for a
    collective the backend never finishes. A pending handle expires once
    neither it was launched nor anything completed in the last
    ``timeout + WATCHDOG_GRACE`` seconds.
    """

    def __init__(self, health: Health) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, collections.deque[Any]] = {}  # by id: deques compare by value
        self._stop = threading.Event()
        self._limit = health.timeout + WATCHDOG_GRACE
        self._thread = threading.Thread(
            target=self._run, name=f"asyncdist-watchdog-r{health.rank}", daemon=True
        )
        self._thread.start()

    def watch(self, outstanding: collections.deque[Any]) -> None:
        """Watch a lane's outstanding handles (the lane appends to the queue)."""
        with self._lock:
            self._watched[id(outstanding)] = outstanding

    def unwatch(self, outstanding: collections.deque[Any]) -> None:
        with self._lock:
            self._watched.pop(id(outstanding), None)

    def _run(self) -> None:
        period = min(1.0, self._limit / 4)
        while not self._stop.wait(period):
            self.check()

    def check(self) -> None:
        with self._lock:
            lanes = list(self._watched.values())
        for outstanding in lanes:
            handle: Watched
            for handle in _snapshot(outstanding):
                if not handle.done() and handle.budget() <= 0:
                    handle.expire()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._watched.clear()


def _snapshot(outstanding: collections.deque[Any]) -> list[Any]:
    while True:
        try:
            return list(outstanding)
        except RuntimeError:  # appended to while copying; try again
            continue


class Recorder(Protocol):
    """A tree's tracer, as lanes and sessions use it (``_trace.Tracer``)."""

    def record(self, op: Any, nbytes: int) -> None: ...

    def span(self, name: str) -> contextlib.AbstractContextManager[None]: ...

    def snapshot(self) -> list[dict[str, Any]]: ...


@dataclass(eq=False, slots=True)
class Tree:
    """What every lane of one session tree shares.

    Made with the root lane (``Tree.start``), which closes it last. Read by
    every lane instead of walking up to its root.
    """

    health: Health
    watchdog: Watchdog
    timeout: float
    debug: bool
    # gloo groups listen on loopback only (a local world; see ``_groups``)
    loopback: bool
    # the routes a new lane takes: the device's backend, the device, and whether
    # CPU tensors of a CUDA lane ride gloo over the same group
    backend: str
    device: torch.device
    cpu_route: bool
    # the root lane's leave notices (a lane's own are ``notices.child(...)``)
    notices: LeaveNotices | None = None
    tracer: Recorder | None = None

    @classmethod
    def start(
        cls,
        *,
        rank: int,
        timeout: float,
        debug: bool,
        loopback: bool,
        backend: str,
        device: torch.device,
        cpu_route: bool,
    ) -> Tree:
        """A new tree's record; starts its watchdog thread."""
        health = Health(rank=rank, timeout=timeout, debug=debug)
        return cls(
            health=health,
            watchdog=Watchdog(health),
            timeout=timeout,
            debug=debug,
            loopback=loopback,
            backend=backend,
            device=device,
            cpu_route=cpu_route,
        )

    def close(self) -> None:
        """Stop the tree's watchdog (the root lane, closing, calls it)."""
        self.watchdog.close()


# -- leaving a session -----------------------------------------------------------


def leaving_how(exc: BaseException | None, cancelled: type[BaseException] | None = None) -> Leaving:
    """How a block ended, for the notice its peers read: an interrupt
    (Ctrl-C) is not a rank's failure, so it is told apart from an exception."""
    if exc is None:
        return "finished"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if cancelled is not None and isinstance(exc, cancelled):
        return "cancelled"
    return "raised"


def quiet_interrupt(exc: BaseException | None) -> None:
    """Hide a raw backend error that a ``KeyboardInterrupt`` leaving the
    session happened to interrupt the handling of.

    With every rank interrupted, a rank waiting in a collective often sees
    its peer leave first: gloo's "Connection closed by peer" is raised, and
    the interrupt lands while asyncdist handles it, so Python would print
    the raw error above the ``KeyboardInterrupt``. The peer's departure is
    reported, translated, when the session is left; the raw text is noise.
    """
    if not isinstance(exc, KeyboardInterrupt):
        return
    context = exc.__context__
    if not isinstance(context, RuntimeError) or isinstance(context, AsyncDistError):
        return
    tb = context.__traceback__
    package = __name__.partition(".")[0]
    while tb is not None:  # raised into asyncdist's code, never seen by the program
        if tb.tb_frame.f_globals.get("__name__", "").startswith(f"{package}."):
            exc.__suppress_context__ = True
            return
        tb = tb.tb_next
