"""Op: the internal record of one launched collective, behind its public ``Handle``.

A lane makes an ``Op`` just before it issues the collective and ``attach``es
the torch work once torch accepted it; the public ``Handle`` (``_handle``)
wraps the op and only observes it. Whoever observes completion first (a
waiter, ``done()``, the tree's watchdog) *settles* the op: checks the work's
outcome, runs the op's finishing step (e.g. the division of "mean") exactly
once, and records the result or the translated error. ``AllOp`` is the op of
a handle over many (``wait_all``): done when its parts are.

How completion is observed, by kind of work:

* works with a torch ``Future`` (every gloo collective but the ones below):
  ``wait()`` blocks in torch's own ``work.wait()`` with the GIL released,
  exactly like raw torch code; ``await`` hooks the future's done-callback,
  which runs on a gloo worker thread and wakes the loop through
  ``._wakeup`` without blocking; ``done()`` asks ``work.is_completed()``.
* works gloo gives no future (``reduce_scatter``, ``send``/``recv``) and
  multi-step ops (object collectives): a ``Completer`` thread per
  ordering key runs them in issue order. One thread serves every handle of
  that key; none is parked per handle.

The session tree's ``Watchdog`` thread (``_progress``) looks at outstanding handles about once
a second: it settles finished ones nobody looked at (so a handle completes
without being awaited, and a failure breaks the session) and declares lost
those that made no progress within the timeout.

Whichever thread settles, it does so in the caller's autograd mode: torch's
grad mode and inference mode are thread-local, and a gloo worker thread, a
completer or the watchdog runs outside the mode the collective was issued
in. A tensor made under ``torch.inference_mode()`` cannot be updated in
place outside it, nor a leaf that requires grad with grad on; the divide of
"mean", gloo's copy of a reduce_scatter block into its output (done in
``work.wait()``) and the unpacking of coalesced buffers are such updates.
The mode is read at launch (two calls into torch, ~0.2 µs) and re-entered
only where the settling thread's own mode differs.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from . import _wakeup
from ._progress import WATCHDOG_GRACE, Health
from .errors import (
    CollectiveTimeout,
    Departure,
    finish_failed,
)

if TYPE_CHECKING:
    from ._store import LeaveNotices

T = TypeVar("T")

# (inference mode, grad mode) of a thread; the default is (False, True).
Mode = tuple[bool, bool]
_inference_on = torch.is_inference_mode_enabled  # read on every launch and settle
_grad_on = torch.is_grad_enabled
# Guards every op's outcome cell (``Op._claim``/``_set``/callbacks): held for
# a few field updates, so one lock serves all, and an op makes none.
_CELLS = threading.Lock()

# The four modes, made once: ``_MODES[inference][grad]`` (an op keeps its
# launch's mode without making a tuple of its own).
_MODES: tuple[tuple[Mode, Mode], tuple[Mode, Mode]] = (
    ((False, False), (False, True)),
    ((True, False), (True, True)),
)


def current_mode() -> Mode:
    """This thread's autograd mode."""
    return (_inference_on(), _grad_on())


def in_mode(mode: Mode, fn: Callable[[], T]) -> T:
    """``fn()`` in ``mode``, this thread's own mode restored after.

    Free when the thread is in ``mode`` already (every background thread is
    in the default mode, and so is most issuing code); otherwise it costs the
    two context managers, a few microseconds.
    """
    if mode == current_mode():
        return fn()
    inference, grad = mode
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return fn()


# A blocking wait returns to Python this often, so signal handlers (Ctrl-C,
# a launcher's SIGTERM) run promptly.
WAIT_SLICE = 0.5


class Returns:
    """A finishing step that only gives back ``value``: the result is known
    at launch (a tensor reduced in place). An op given one keeps the value
    and drops the object, one object fewer per outstanding op for the
    cyclic GC to walk."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


class Op:
    """One launched collective: its torch work, its completion, its result.

    Internal: the public face is ``Handle``. Any thread may settle it;
    ``wait``/``join``/``settled`` wait for it.
    """

    __slots__ = (
        "_callbacks",
        "_claimed",
        "_done",
        "_error",
        "_finish",
        "_gate",
        "_health",
        "_hooked",
        "_launched",
        "_mode",
        "_notices",
        "_number",
        "_value",
        "_work",
        "name",
        "observed",
        "streamed",
    )

    name: str  # the collective's name, e.g. "allreduce"
    observed: bool  # someone got the result or the error from this op
    streamed: bool  # NCCL: completion is stream-ordered, torch's wait() never blocks the host
    _health: Health | None
    _launched: float
    _mode: Mode  # the issuing thread's autograd mode, re-entered to settle
    _work: Any  # a torch Work with a future; None when a Completer settles the op
    _finish: Callable[[], Any] | None  # None: the result is ``_value`` already
    _hooked: bool
    _notices: LeaveNotices | None  # where to read that a peer left on purpose
    _number: int  # this collective is its lane's n-th (from 1)
    # The outcome, a one-shot cell set from any thread (first setter wins):
    # ``_claimed`` by the settler, ``_done`` once ``_value``/``_error`` are in,
    # all under the one ``_CELLS`` lock. A thread that blocks until done
    # sleeps on ``_gate``, a lock made held by the first such waiter and
    # released once done; most ops never need one (``wait`` sleeps in torch's
    # ``work.wait``), and every object an op keeps is one more for the
    # cyclic GC to walk while the op is outstanding.
    _gate: threading.Lock | None
    _claimed: bool
    _done: bool
    _callbacks: list[Callable[[], None]] | None  # made at the first callback
    _value: Any
    _error: BaseException | None

    def __init__(
        self,
        name: str,
        health: Health | None,
        finish: Callable[[], Any],
        notices: LeaveNotices | None = None,
        number: int = 0,
    ) -> None:
        """An op for a collective about to be issued; ``attach`` gives it the
        work once torch accepted it. ``notices``/``number``: which of its
        lane's collectives it is, for the message when a peer left the lane."""
        self._notices = notices
        self._number = number
        self.name = name
        self._gate = None
        self._claimed = self._done = False
        self._callbacks = None
        self._value = self._error = None
        self._health = health
        self._launched = time.monotonic()
        self._mode = _MODES[_inference_on()][_grad_on()]
        self._work = None
        self._finish = finish
        if type(finish) is Returns:  # the result is known: keep it, not the step
            self._value, self._finish = finish.value, None
        self._hooked = False
        self.observed = False
        self.streamed = False

    def attach(self, work: Any, *, streamed: bool = False, hook: bool = False) -> None:
        """Observe ``work`` (a torch Work with a future; ``None`` when a
        completer settles the op). ``hook``: settle from the future's
        callback at once, for a waiter that may already be parked on the
        completion (a launch deferred to another thread)."""
        self.streamed = streamed
        self._work = work
        if hook:
            self.hook()

    def release(self, fault: BaseException | None) -> None:
        """Let go of the torch work: its lane closed and destroyed the group.

        A work keeps its group's transport alive (gloo: the context, its
        sockets and its I/O thread). An op the program still holds (through
        its handle), or one kept by a reference cycle (a fault's traceback
        reaches the frames that hold it), must not keep that past the
        session. An op still pending in a broken session is lost with it: it
        fails with the session's ``fault``. NCCL ops, and pending ones of a
        healthy session (none after a drain), keep their work.
        """
        if self.streamed or self._work is None:
            return
        if not self.done():
            if fault is None:
                return
            if self._claim():
                self._set(None, fault)
        self._work = None

    def fail(self, error: BaseException) -> None:
        """Settle with ``error`` before anything was launched (a local error)."""
        if self._claim():
            self._set(None, error)

    def interrupt(self, error: BaseException) -> None:
        """Settle with ``error`` now, whatever the work does: its world ended
        (``Lane.interrupt``). Unlike ``fail``, it does not wait for a claim:
        a completer's thread claims a futureless op and then blocks in the
        work, which ends only at the backend's timeout. The settling that
        comes later finds the op settled and changes nothing."""
        self._set(None, error)

    # -- inspection --------------------------------------------------------

    def done(self) -> bool:
        """True once the collective finished (successfully or not); for NCCL
        work, once the device finished it."""
        work = self._work
        if not self._done and work is not None and work.is_completed():
            self.settle(work.wait)  # returns at once, or raises the backend's error
        if self.streamed and self._done and self._error is None:
            return bool(work.is_completed())  # settled at enqueue; the device may still run
        return self._done

    def has_outcome(self) -> bool:
        """Whether the op is settled: it has its result or error (pure:
        unlike ``done``, it does not ask the work)."""
        return self._done

    def exception(self) -> BaseException | None:
        """The error the collective ended with, ``None`` if pending or
        successful; an error read here counts as seen."""
        if self.done():
            self.observed = True
            if self._health is not None:
                self._health.mark_seen(self._error)
        return self._error

    def error(self) -> BaseException | None:
        """The error, if settled with one; pure (nothing counts as seen)."""
        return self._error

    def status(self) -> str:
        """``pending``, ``done`` or ``failed: <error type>``, for a repr (pure)."""
        if not self.done():
            return "pending"
        error = self.error()
        return "done" if error is None else f"failed: {type(error).__name__}"

    def on_done(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once settled (at the real completion: the
        work's future is hooked), on the settling thread; it must not raise."""
        self.hook()
        self._add_callback(callback)

    # -- settling (any thread) -----------------------------------------------

    def settle(self, check: Callable[[], object]) -> None:
        """If first to claim it, settle this op: ``check()`` raises the
        backend's error, if any (a fault: it breaks the session); else
        ``finish()`` gives the result, or a local error (the session stays
        usable). Both run in the mode the collective was issued in, on
        whichever thread this is (see the module docstring). Never raises."""
        if not self._claim():
            return
        mode = self._mode
        if mode is _MODES[_inference_on()][_grad_on()]:  # current_mode(), without a tuple
            self._conclude(check)
        else:
            with torch.inference_mode(mode[0]), torch.set_grad_enabled(mode[1]):
                self._conclude(check)

    def as_caller(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the mode this collective was issued in (a launch
        deferred to another thread)."""
        return in_mode(self._mode, fn)

    def _conclude(self, check: Callable[[], object]) -> None:
        """``settle`` once claimed."""
        health = self._health
        assert health is not None
        try:
            check()
        except BaseException as exc:  # noqa: BLE001 - everything must reach the waiter
            error = health.translate(exc, op=self.name, left=self.departure_reader())
            if error is not exc:
                # The backend's traceback is this frame and, through it, its
                # callers' (with their works and groups): the session keeps its
                # fault, and must not keep those alive past its end.
                error.__cause__ = exc.with_traceback(None)
            health.record_fault(error)
            self._set(None, error)
            return
        health.progressed()
        try:
            value = self._value if self._finish is None else self._finish()
        except BaseException as exc:  # noqa: BLE001 - a local error (e.g. a refused unpickle)
            # The collective itself went fine: no fault, the session stays usable.
            local = finish_failed(exc, op=self.name, rank=health.rank)
            if local is not exc:
                local.__cause__ = exc
            self._set(None, local)
        else:
            self._set(value, None)

    def departure_reader(self) -> Callable[[], Departure | None] | None:
        """A function that reads whether a peer left this op's lane on
        purpose (for ``translate``), or None where no lane tells."""
        notices, health = self._notices, self._health
        if notices is None or health is None:
            return None
        return functools.partial(notices.departure, health.rank, self._number)

    def budget(self) -> float:
        """Seconds left before the watchdog declares this op lost."""
        health = self._health
        assert health is not None
        since = max(self._launched, health.last_progress)
        return since + health.timeout + WATCHDOG_GRACE - time.monotonic()

    def expire(self) -> None:
        """Declare the collective lost: it made no progress within the limit."""
        health = self._health
        assert health is not None
        limit = health.timeout + WATCHDOG_GRACE
        error = CollectiveTimeout(
            f"{self.name} on rank {health.rank} made no progress for {limit:g} s "
            f"(session timeout {health.timeout:g} s): a peer is alive but silent. Check "
            "that every rank issues the same collectives in the same order, and whether "
            "a peer is stuck or stopped.",
            op=self.name,
            rank=health.rank,
        )
        health.record_fault(error)
        self._set(None, error)

    # -- waiting -------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> Any:
        """``Handle.wait``."""
        # No local for the work: a raised error's traceback keeps this frame,
        # which would keep the work (and its group's transport) alive.
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._done and self._work is not None:
            if self.streamed:
                self.settle(self._work.wait)  # NCCL: a stream dependency, the host goes on
            else:
                self._block(deadline)
        remaining = None if deadline is None else deadline - time.monotonic()
        if not self._gate_wait(remaining):
            raise TimeoutError(
                f"{self.name} did not finish within {timeout:g} s; the handle stays valid "
                "and can be waited on again"
            )
        return self.result()

    def result(self) -> Any:
        """The result of a settled op, safe to use on this thread's current
        CUDA stream; raises its error. Either counts as seen."""
        self.observed = True
        if self._health is not None:
            self._health.mark_seen(self._error)
        result = self._outcome()
        if self._work is not None:
            # Settled on another thread, maybe: order this thread's current stream
            # after the work (CUDA; for finished CPU work this returns at once).
            self._work.wait()
        return result

    def join(self) -> BaseException | None:
        """Wait without raising (the session's exit); the error nobody saw, if any."""
        if not self._done and self._work is not None:
            self._block(None)
        self._gate_wait(None)
        return None if self.observed else self._error

    def _block(self, deadline: float | None) -> None:
        """Wait in torch's ``work.wait`` (GIL released), in slices that end at
        ``deadline`` or when the watchdog would declare the work lost."""
        work = self._work
        while not self._done:
            budget = min(self.budget(), WAIT_SLICE)
            if deadline is not None:
                budget = min(budget, deadline - time.monotonic())
            try:
                work.wait(datetime.timedelta(seconds=max(budget, 0.001)))
                sliced = False  # (NCCL: ordered on the stream; is_completed may lag)
            except RuntimeError:  # the slice ran out, or the work failed
                sliced = not work.is_completed()
            if sliced:  # outside the except: an expiry must not chain the slice's error
                if deadline is not None and time.monotonic() >= deadline:
                    return
                if self.budget() <= 0:
                    self.expire()
                continue
            self.settle(work.wait)
            return

    def synchronize(self) -> Any:
        """``Handle.synchronize``."""
        result = self.wait()
        if self.streamed:
            torch.cuda.current_stream().synchronize()
        return result

    async def settled(self) -> None:
        """Sleep on the loop until this op is settled (a cancel point);
        the caller checked that it is not done yet."""
        self.hook()
        await _wakeup.wait_for(self._add_callback, self._remove_callback)

    async def join_async(self) -> BaseException | None:
        """``join`` for an async exit: waits on the loop, never raises."""
        if not self.done():
            await self.settled()
        return None if self.observed else self._error

    # -- the outcome cell ------------------------------------------------------

    def _claim(self) -> bool:
        """True for the first caller only: it must then ``_set`` the outcome."""
        with _CELLS:
            if self._claimed or self._done:
                return False
            self._claimed = True
            return True

    def _set(self, value: Any, error: BaseException | None) -> bool:
        with _CELLS:
            if self._done:
                return False
            self._value, self._error = value, error
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
            gate = self._gate
        if gate is not None:
            gate.release()
        for callback in callbacks or ():
            callback()
        return True

    def _add_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once done: now (on this thread) if already done,
        else on the thread that sets the outcome. It must not raise."""
        with _CELLS:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback()

    def _remove_callback(self, callback: Callable[[], None]) -> None:
        with _CELLS:
            if self._callbacks is not None and callback in self._callbacks:
                self._callbacks.remove(callback)

    def _gate_wait(self, timeout: float | None) -> bool:
        """Block until done or ``timeout`` seconds passed; True if done."""
        with _CELLS:
            if self._done:
                return True
            gate = self._gate
            if gate is None:
                gate = self._gate = threading.Lock()
                gate.acquire()  # released by ``_set``
        if gate.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            gate.release()  # let the next waiter through
            return True
        return self._done

    def _outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def hook(self) -> None:
        """Settle from the work's future callback (a gloo worker thread), so an
        async waiter is woken without any thread blocking for it."""
        if self._hooked or self._work is None:
            return
        self._hooked = True

        def on_future(future: Any) -> None:
            self.settle(future.value)

        self._work.get_future().add_done_callback(on_future)


class AllOp:
    """The op of a handle over many ([wait_all][asyncdist.wait_all]): done
    when every part is; its result is ``combine`` of theirs, in order."""

    __slots__ = ("_combine", "name", "parts")

    def __init__(
        self, name: str, parts: Sequence[Op | AllOp], combine: Callable[[list[Any]], Any]
    ) -> None:
        self.name = name
        self.parts = tuple(parts)
        self._combine = combine

    @property
    def streamed(self) -> bool:
        """Whether a part's completion is stream-ordered (NCCL)."""
        return any(part.streamed for part in self.parts)

    def done(self) -> bool:
        return all(part.done() for part in self.parts)

    def exception(self) -> BaseException | None:
        return next((e for p in self.parts if (e := p.exception()) is not None), None)

    def error(self) -> BaseException | None:
        return next((e for p in self.parts if (e := p.error()) is not None), None)

    def status(self) -> str:
        if not self.done():
            return "pending"
        error = self.error()
        return "done" if error is None else f"failed: {type(error).__name__}"

    def wait(self, timeout: float | None = None) -> Any:
        limit = None if timeout is None else time.monotonic() + timeout
        results = []
        for part in self.parts:
            remaining = None if limit is None else max(0.0, limit - time.monotonic())
            results.append(part.wait(remaining))
        return self._combine(results)

    def synchronize(self) -> Any:
        return self._combine([part.synchronize() for part in self.parts])

    async def wait_async(self) -> Any:
        """The result, awaited on the loop (``Handle.__await__``)."""
        # trio is owed one checkpoint in all (not one per part): a part's
        # sleep, or else one for the parts done already
        owed = _wakeup.on_trio()
        if owed and self.done():
            await _wakeup.trio_checkpoint()
            owed = False
        results = []
        for part in self.parts:
            if not part.done():
                await part.settled()
                owed = False
            results.append(part.result())  # the first failing part raises, in order
        if owed:  # the parts pending at first finished meanwhile
            await _wakeup.trio_checkpoint()
        return self._combine(results)

    async def settled(self) -> None:
        for part in self.parts:
            if not part.done():
                await part.settled()

    def result(self) -> Any:
        return self._combine([part.result() for part in self.parts])
