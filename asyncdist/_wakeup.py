"""Waiting on the running asyncio or trio loop for a completion signalled from another thread.

Completion of a collective is observed on a backend thread (a gloo worker, or
asyncdist's completer thread).  That thread must hand the wake-up to the loop
without blocking: asyncio's ``loop.call_soon_threadsafe`` and trio's
``TrioToken.run_sync_soon`` do exactly that (a self-pipe write), unlike
``anyio.from_thread.run_sync``, which blocks the caller until the loop ran.
The waiting task sleeps on the loop's own primitive (an asyncio future, a
trio task reschedule), so cancellation works natively, and nothing is left
behind when the loop is gone before the wake-up arrives.

This is the only module that knows which event loop is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import sniffio

Callback = Callable[[], None]

# asyncio's running loop of this thread, or None: the C function behind
# ``asyncio.get_running_loop``, without the exception that one raises when
# no loop runs (``issuer_key`` asks on every launch).
_running_loop = asyncio._get_running_loop


async def wait_for(
    add_callback: Callable[[Callback], None], remove: Callable[[Callback], None]
) -> None:
    """Sleep until ``add_callback``'s callback fires (from any thread).

    A cancel point on both loops: cancelling the waiting task removes the
    callback and leaves whatever it watched untouched.
    """
    if sniffio.current_async_library() == "trio":
        await _wait_trio(add_callback, remove)
    else:
        await _wait_asyncio(add_callback, remove)


def on_trio() -> bool:
    """Whether this runs in a trio task, in one attribute read: trio names
    itself in sniffio's thread-local while it runs. (``current_async_library()``
    reads it too, but answers asyncio only after looking up the running task:
    more than a done handle's fast path should spend.)"""
    return sniffio.thread_local.name == "trio"


async def trio_checkpoint() -> None:
    """What awaiting something already complete owes a trio loop (trio's rule:
    every await is a cancel point and a schedule point, so a loop of quick
    awaits neither starves the other tasks nor misses a cancellation).
    asyncio's convention differs (a done future does not yield): callers
    check ``on_trio()`` first, which keeps asyncio's fast path a plain return.

    Raises:
        trio.Cancelled: the surrounding scope is cancelled.
    """
    import trio

    await trio.lowlevel.checkpoint()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # it may have been cancelled meanwhile
        future.set_result(None)


async def _wait_asyncio(
    add_callback: Callable[[Callback], None], remove: Callable[[Callback], None]
) -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    add_callback(wake)
    try:
        await future
    finally:
        remove(wake)


async def _wait_trio(
    add_callback: Callable[[Callback], None], remove: Callable[[Callback], None]
) -> None:
    import trio

    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    waiting = [True]  # touched only on the trio thread

    def reschedule() -> None:
        if waiting[0]:
            waiting[0] = False
            trio.lowlevel.reschedule(task)

    def wake() -> None:
        try:
            token.run_sync_soon(reschedule)
        except trio.RunFinishedError:
            pass

    def abort(_: Any) -> trio.lowlevel.Abort:
        waiting[0] = False
        remove(wake)
        return trio.lowlevel.Abort.SUCCEEDED

    add_callback(wake)
    await trio.lowlevel.wait_task_rescheduled(abort)


def in_async_context() -> bool:
    """True when called from a task of a running asyncio or trio loop (where
    blocking would stall the loop), False from plain threads."""
    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return False
    return True


# Who issues a collective, on a lane's check: ``(thread, task)`` (thread >= 0),
# or a helper's key (first item below 0), which ``issuing_as`` sets.
IssuerKey = tuple[int, ...]

# Who issues, when a helper issues on someone's behalf from whatever thread
# runs it (gradient hooks run on autograd's threads on CUDA): (key, name).
# Module state because a ContextVar must be made once, not per use (each one
# made lives on in every context); its value is per thread and task, not
# process-wide.
_ISSUING_AS: contextvars.ContextVar[tuple[IssuerKey, str] | None] = contextvars.ContextVar(
    "asyncdist_issuing_as", default=None
)


def family_key() -> IssuerKey:
    """The key of the helpers the calling task (or thread) makes, apart
    from the task itself: ``(-1, n)``, shared by every helper it makes.
    What a task launches on a family's behalf, outside the family's own
    ordered path, is ``(-1, n, *that task's key)`` (see
    ``one_after_another``)."""
    return (-1, hash(issuer_key()))


def own_key(owner: object) -> IssuerKey:
    """A key of ``owner``'s own, shared with nothing: ``(-3, id)``."""
    return (-3, id(owner))


@contextlib.contextmanager
def issuing_as(key: IssuerKey, name: str) -> Iterator[None]:
    """Collectives issued inside the block count as issued by ``key`` (a
    ``helper_key``, or a helper's fixed key whose first item is below 0),
    from any thread or task (``name`` appears in messages)."""
    token = _ISSUING_AS.set((key, name))
    try:
        yield
    finally:
        _ISSUING_AS.reset(token)


def issuer_key() -> IssuerKey:
    """Who is issuing, cheaply: ``(thread, task)`` ids (task 0 outside any
    task), or the key ``issuing_as`` gave."""
    return who_issues()[0]


def who_issues() -> tuple[IssuerKey, str | None]:
    """``issuer_key()``, with the name ``issuing_as`` gave it (``None`` for
    a task or thread issuing as itself: ``current_issuer`` names it). Keys
    that ``issuing_as`` gives may be shared by several helpers, each with
    its own name."""
    override = _ISSUING_AS.get()
    if override is not None:
        return override
    thread = threading.get_ident()
    # Asked on every launch, so not through ``sniffio.current_async_library``,
    # which in plain code raises twice to say "none" (about 1 µs): trio marks
    # the threads it runs on in sniffio's thread-local, and asyncio's running
    # loop is one C call away.
    if sniffio.thread_local.name == "trio":
        import trio

        return (thread, id(trio.lowlevel.current_task())), None
    if _running_loop() is None:
        return (thread, 0), None
    task = asyncio.current_task()
    return (thread, 0 if task is None else id(task)), None


def one_after_another(last: IssuerKey, new: IssuerKey) -> bool:
    """Whether ``new`` issuing after ``last`` is sequential by construction:
    the same issuer, or a thread's plain code and a task on that same thread
    (``anyio.run`` inside sync code, or sync code after it returned), which
    cannot both run at once. In a helper family (``family_key``), what the
    family launches on its ordered path (``(-1, n)``: gradient hooks, in
    autograd's order) and what a task launches for it (``(-1, n, thread,
    task)``) follow each other; two tasks' launches for one family follow
    the rule for the two tasks."""
    if last == new:
        return True
    if len(last) == 2 and len(new) == 2:
        return last[0] == new[0] >= 0 and 0 in (last[1], new[1])
    if last[:2] != new[:2] or last[0] != -1:
        return False
    return len(last) == 2 or len(new) == 2 or one_after_another(last[2:], new[2:])


def current_issuer() -> str:
    """Who is issuing a collective: the running task, or else the thread."""
    override = _ISSUING_AS.get()
    if override is not None:
        return override[1]
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return f"thread {threading.get_ident()}"
    if library == "trio":
        import trio

        trio_task = trio.lowlevel.current_task()
        return f"trio task {trio_task.name!r} ({id(trio_task):#x})"
    task = asyncio.current_task()
    name = task.get_name() if task is not None else "?"
    return f"asyncio task {name!r} ({id(task):#x})"
