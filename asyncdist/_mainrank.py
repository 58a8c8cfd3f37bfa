"""What runs on rank 0 only: ``print``, ``logger`` and ``main_first``.

The lane methods of the same names (on every session, sub-session and
channel) delegate here. ``print`` and ``logger`` only read the lane's rank,
so they work before entry and after the session ended; ``main_first`` is
one broadcast per block, issued through the lane it is given.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Callable, Iterable, MutableMapping
from types import TracebackType
from typing import Any, Protocol, TextIO

from ._handle import Handle
from .errors import AsyncDistError, PeerFailure

MAIN_FIRST = "main_first"  # the op name main_first's broadcasts carry


class Ranked(Protocol):
    """A lane, as far as the rank-0 helpers read it."""

    @property
    def rank(self) -> int:
        """This process's rank on the lane (readable before entry and after the end)."""
        ...


def print_on_main(
    lane: Ranked,
    *values: object,
    sep: str | None,
    end: str | None,
    file: TextIO | None,
    flush: bool,
) -> None:
    """``print(*values)`` if this process is rank 0 of ``lane``."""
    if lane.rank == 0:
        builtins.print(*values, sep=sep, end=end, file=file, flush=flush)


def logger(
    lane: Ranked, name: str | logging.Logger, *, main_only: bool
) -> logging.LoggerAdapter[logging.Logger]:
    """The adapter of ``lane.logger(name)``.

    Raises:
        TypeError: ``name`` is neither a string nor a ``logging.Logger``.
    """
    if isinstance(name, str):
        name = logging.getLogger(name)
    elif not isinstance(name, logging.Logger):
        raise TypeError(
            f"logger: name must be a str or a logging.Logger, not {type(name).__name__}"
        )
    return _RankLogger(name, lane, main_only=main_only)


class _RankLogger(logging.LoggerAdapter[logging.Logger]):
    """The adapter of [logger][asyncdist.DistSession.logger]."""

    def __init__(self, logger: logging.Logger, lane: Ranked, *, main_only: bool) -> None:
        super().__init__(logger, {})
        self._ranked = lane
        self._main_only = main_only

    def isEnabledFor(self, level: int) -> bool:
        if self._main_only and self._ranked.rank != 0:
            return False
        return self.logger.isEnabledFor(level)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {"rank": self._ranked.rank, **(kwargs.get("extra") or {})}
        return msg, kwargs


class MainFirst:
    """The block of [main_first][asyncdist.DistSession.main_first], sync or async.

    Rank 0 runs its block at once and, leaving it, broadcasts whether it
    succeeded; the other ranks wait for that broadcast on entry. One
    broadcast per block on every rank, so the blocks pair up by order.
    """

    __slots__ = ("_broadcast", "_owner", "_usable")

    def __init__(
        self,
        lane: Ranked,
        usable: Callable[[str], Ranked],
        broadcast: Callable[[str, Any, int, Iterable[Any] | None], Handle[Any]],
    ) -> None:
        # usable(op): the lane's state, checked (raises when closed or broken);
        # broadcast(op, obj, src, allowed): an object broadcast named op
        self._owner = lane
        self._usable = usable
        self._broadcast = broadcast

    def _enter(self) -> Handle[Any] | None:
        """What the ranks but 0 wait for (None on rank 0)."""
        if self._usable(MAIN_FIRST).rank == 0:
            return None
        return self._broadcast(MAIN_FIRST, None, 0, ())

    def _check(self, failed: Any) -> None:
        if failed is not None:
            rank = self._owner.rank
            raise PeerFailure(
                f"{MAIN_FIRST} on rank {rank}: rank 0 raised {failed} inside its block, so "
                "this rank does not run it; see rank 0's error",
                op=MAIN_FIRST,
                rank=rank,
            )

    def _exit(self, exc: BaseException | None) -> Handle[Any] | None:
        """Rank 0 tells the others how its block ended; the handle to wait
        for when it succeeded (a failure must not be masked by a wait)."""
        if self._owner.rank != 0:
            return None
        if exc is None:
            return self._broadcast(MAIN_FIRST, None, 0, ())
        with contextlib.suppress(AsyncDistError):  # broken: the peers learn it anyway
            self._broadcast(MAIN_FIRST, f"{type(exc).__name__}({exc})", 0, ())
        return None

    def __enter__(self) -> None:
        handle = self._enter()
        if handle is not None:
            self._check(handle.wait())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        handle = self._exit(exc)
        if handle is not None:
            handle.wait()

    async def __aenter__(self) -> None:
        handle = self._enter()
        if handle is not None:
            self._check(await handle)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        handle = self._exit(exc)
        if handle is not None:
            await handle
