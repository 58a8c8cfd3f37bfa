"""Thread-safe, non-blocking wake-up of the running asyncio or trio loop.

Completion of a collective is observed on a backend thread (a gloo worker, or
asyncdist's completer thread). To wake a task waiting on the event loop, that
thread must hand a callable to the loop without blocking: asyncio's
``loop.call_soon_threadsafe`` and trio's ``TrioToken.run_sync_soon`` do
exactly that (a self-pipe write), unlike ``anyio.from_thread.run_sync``, which
blocks the caller until the loop has run the function.

This is the only module that knows which event loop is running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio.lowlevel

Wake = Callable[[Callable[[], object]], None]


def current_waker() -> Wake:
    """Return ``wake(fn)``, callable from any thread, that runs ``fn`` on the
    current event loop's thread soon.

    ``wake`` never blocks and never raises: if the loop has already finished
    (the waiting task is gone), ``fn`` is dropped.
    """
    native = anyio.lowlevel.current_token().native_token
    schedule: Callable[[Callable[[], object]], object]
    if isinstance(native, asyncio.AbstractEventLoop):
        schedule = native.call_soon_threadsafe
    else:  # trio.lowlevel.TrioToken
        schedule = native.run_sync_soon  # type: ignore[attr-defined]

    def wake(fn: Callable[[], object]) -> None:
        try:
            schedule(fn)
        except RuntimeError:
            # asyncio: "Event loop is closed"; trio: RunFinishedError (a RuntimeError).
            pass

    return wake
