"""Per-op tracing to the Chrome trace format (open in Perfetto or chrome://tracing).

Each collective becomes a complete event ("ph": "X") from launch to
completion on its rank's "collectives" track; ``session.span(name)`` adds
compute spans on the "compute" track, so overlap is visible at a glance.
Times are wall-clock microseconds, comparable across ranks of one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from ._handle import Handle
from ._op import Op
from ._progress import Recorder

TRACKS = {"collectives": 1, "compute": 2}


def _now_us() -> float:
    return time.time_ns() / 1000.0


def _complete(
    name: str, start: float, rank: int, track: str, args: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A complete event ("ph": "X") on ``rank``'s ``track``, from ``start`` until now."""
    event = {
        "name": name,
        "ph": "X",
        "ts": start,
        "dur": _now_us() - start,
        "pid": rank,
        "tid": TRACKS[track],
    }
    if args is not None:
        event["args"] = args
    return event


class Tracer:
    """Collects this rank's events; cheap enough to leave on for a run."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(event)

    def record(self, op: Op, nbytes: int) -> None:
        """Trace ``op`` from now until it completes."""
        start = _now_us()
        rank, name = self.rank, op.name

        def completed() -> None:
            error = op.error()
            args = {"bytes": nbytes, "error": None if error is None else str(error)}
            self._add(_complete(name, start, rank, "collectives", args))

        op.on_done(completed)  # at the real completion time, not when observed

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = _now_us()
        try:
            yield
        finally:
            self._add(_complete(name, start, self.rank, "compute"))

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)


def chrome_trace(events_by_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A Chrome trace document with one process per rank."""
    events: list[dict[str, Any]] = []
    for rank, rank_events in enumerate(events_by_rank):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for track, tid in TRACKS.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}}
            )
        events.extend(rank_events)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(path: str | os.PathLike[str], events_by_rank: list[list[dict[str, Any]]]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(chrome_trace(events_by_rank)))
    return target


def rank_path(path: str | os.PathLike[str], rank: int) -> Path:
    """``trace.json`` -> ``trace.rank3.json``."""
    target = Path(path)
    return target.with_name(f"{target.stem}.rank{rank}{target.suffix or '.json'}")


def rank_events(rank: int, world_size: int, events: list[dict[str, Any]]) -> list[list[Any]]:
    """Events by rank, holding only this rank's own (a per-rank trace file)."""
    return [events if r == rank else [] for r in range(world_size)]


class Traced(Protocol):
    """What a traced lane offers ``TraceBlock``."""

    rank: int
    world_size: int

    @property
    def tracer(self) -> Recorder | None: ...

    @tracer.setter
    def tracer(self, tracer: Recorder | None) -> None: ...


class TraceBlock:
    """The block of ``session.trace(path)``: ``with`` in sync code, ``async with`` in async code.

    Every rank enters it. On a normal exit the ranks gather their events
    (an object collective) and rank 0 writes ``path``; ``async with`` awaits
    that gather, so the loop keeps running while a peer is late. If the block
    raises, each rank writes its own ``path`` with ``.rank<r>`` inserted and
    nothing is exchanged (a peer may be gone).
    """

    __slots__ = ("_gather", "_path", "_started", "_traced", "_tracer")

    def __init__(
        self,
        path: str | os.PathLike[str],
        traced: Traced,
        gather: Callable[[list[dict[str, Any]]], Handle[list[Any]]],
    ) -> None:
        self._path = path
        self._traced = traced
        self._gather = gather
        self._started = False
        self._tracer: Recorder | None = None

    def __enter__(self) -> None:
        tracer = self._traced.tracer
        self._started = tracer is None
        if tracer is None:
            tracer = self._traced.tracer = Tracer(self._traced.rank)
        self._tracer = tracer

    async def __aenter__(self) -> None:
        self.__enter__()

    def _leave(self, failed: bool) -> Handle[list[Any]] | None:
        """Stop tracing; the gather to wait for, on a normal exit."""
        traced, tracer = self._traced, self._tracer
        assert tracer is not None
        if self._started:
            traced.tracer = None
        if failed:
            events = rank_events(traced.rank, traced.world_size, tracer.snapshot())
            write(rank_path(self._path, traced.rank), events)
            return None
        return self._gather(tracer.snapshot())

    def _write(self, events: list[list[dict[str, Any]]]) -> None:
        if self._traced.rank == 0:
            write(self._path, events)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        gathered = self._leave(exc is not None)
        if gathered is not None:
            self._write(gathered.wait())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        gathered = self._leave(exc is not None)
        if gathered is not None:
            self._write(await gathered)
