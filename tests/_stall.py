"""A check that the event loop keeps running: ``async with no_stall(): ...``.

A ticker task sleeps ``TICK`` seconds in a loop while the body runs; any gap
between two of its wake-ups beyond ``TICK`` is time the loop could not run
tasks, i.e. something held the loop thread. The largest gap is the *stall*.
Works on asyncio and trio (anyio only). conftest.py runs every async test
inside one of these; tests that want the figure open their own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

TICK = 0.005  # seconds the ticker sleeps between wake-ups

# The bound separates scheduler noise from a blocking wait for a peer.
# Noise, measured here (2 shared cores) as the largest gap over a whole test
# (peer process start, session entry/exit, the collectives), 66 tests: idle,
# 0.001-0.08 s; with two extra CPU-bound processes hogging both cores,
# median 0.02 s, p90 0.04 s, worst 0.17 s (the loop thread waiting for a core,
# or for the GIL behind a busy thread).
# Signal: a call that blocks the loop until a late peer arrives stalls it for
# the peer's lateness, which these tests set to >= 1 s (measured 1.00 s for
# debug verification before it moved off the loop), and the self-test's
# time.sleep(0.5) for 0.5 s. 0.3 s sits above the worst loaded noise and well
# below both signals.
STALL_BOUND = 0.3


class StallMeter:
    """What :func:`no_stall` measured: ``max_stall`` (seconds)."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self.max_stall = 0.0
        self._last = time.monotonic()

    def _tick(self) -> None:
        now = time.monotonic()
        self.max_stall = max(self.max_stall, now - self._last - TICK)
        self._last = now

    def _close(self) -> None:
        # the body may have blocked right before it ended, with no wake-up since
        now = time.monotonic()
        self.max_stall = max(self.max_stall, now - self._last - TICK)

    async def _run(self) -> None:
        while True:
            await anyio.sleep(TICK)
            self._tick()

    def message(self, what: str = "the test") -> str:
        return (
            f"the event loop stalled for {self.max_stall:.3f} s during {what} "
            f"(bound {self.bound:g} s): something blocked the loop thread "
            "(a blocking wait for a peer, a sync join, time.sleep...)"
        )


@asynccontextmanager
async def no_stall(
    bound: float = STALL_BOUND, what: str = "the block"
) -> AsyncIterator[StallMeter]:
    """Run the body while measuring the loop's largest stall; fail above ``bound``.

    Yields the :class:`StallMeter` (read ``max_stall`` after the block).

    Raises:
        AssertionError: on exit, if the loop stalled longer than ``bound``
            (an exception from the body wins; the stall is added as a note).
    """
    meter = StallMeter(bound)
    error: BaseException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(meter._run)
        try:
            yield meter
        except anyio.get_cancelled_exc_class():
            raise  # belongs to a scope outside; let the task group handle it
        except BaseException as exc:  # noqa: BLE001 - re-raised below, unwrapped
            # Raised inside the task group it would come out wrapped in an
            # ExceptionGroup; keep the body's own exception (and pytest's
            # skip/fail outcomes) as they are.
            error = exc
        finally:
            meter._close()
            tg.cancel_scope.cancel()
    if error is not None:
        if meter.max_stall > bound:
            error.add_note(meter.message(what))
        raise error
    assert meter.max_stall <= bound, meter.message(what)
