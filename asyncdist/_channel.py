"""Channel: an independent, ordered lane of a session over the same ranks.

Collectives pair up across ranks by issue order *per lane*. A session is one
lane; each channel is another, with its own process group(s), its own
outstanding handles and its own object (and debug) side groups, so two tasks
that issue concurrently stay correct as long as each uses its own lane. A
channel's lane shares its session tree's health (a fault on any lane breaks
the session) and closes with the session's lane. A channel is only its name
and its lane: it keeps no pointer back to its session.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio

from ._collectives import Collectives
from ._lane import Lane


class Channel(Collectives):
    """An independent lane over the session's ranks, with the whole collective surface.

    Made by [DistSession.channel][asyncdist.DistSession.channel] (every rank,
    same program order); there is no public constructor.
    """

    __slots__ = ("_name",)

    _lane: Lane

    def __init__(self, name: str, lane: Lane) -> None:
        self._name = name
        self._lane = lane

    @property
    def name(self) -> str:
        """The name every rank formed this channel under."""
        return self._name

    @property
    def closed(self) -> bool:
        """True once the session was left."""
        return self._lane.closed

    def __repr__(self) -> str:
        lane = self._lane
        state = "closed" if lane.closed else "broken" if lane.health.fault else "open"
        return f"<Channel {self._name!r} rank={self.rank}/{self.world_size} {state}>"


def check_channel_name(name: Any) -> None:
    if not isinstance(name, str):
        raise TypeError(f"channel: name must be a string, not {type(name).__name__}")
    if not name:
        raise ValueError("channel: name must not be empty")


class Channels:
    """The channels of one session, by name, and their forming.

    A name forms its channel once per rank, whichever task or thread asks
    first: its peers form its groups once, so a second forming would no
    longer pair with theirs. One forming at a time (a lock); async callers
    that ask for a name being formed await that forming.
    """

    __slots__ = ("_formed", "_forming", "_lock")

    def __init__(self) -> None:
        self._formed: dict[str, Channel] = {}
        # names being formed by form_async, and the lock every forming holds
        self._forming: dict[str, anyio.Event] = {}
        self._lock = threading.Lock()

    def form(self, name: str, usable: Callable[[], Lane]) -> Channel:
        """The channel ``name``, formed on ``usable()``'s lane if new.

        Raises:
            SessionClosed, SessionBroken: (from ``usable``) the session is not usable.
            CollectiveError: a peer did not join in time.
        """
        channel = self._formed.get(name)
        if channel is not None:
            return channel
        with self._lock:
            lane = usable()
            channel = self._formed.get(name)
            if channel is None:
                channel = self._formed[name] = Channel(name, lane.channel(name))
        return channel

    async def form_async(
        self, name: str, usable: Callable[[], object], form: Callable[[str], Channel]
    ) -> Channel:
        """``form`` for async code: a new channel's groups form on a worker
        thread (``form(name)``); a name being formed is awaited."""
        while True:
            usable()
            channel = self._formed.get(name)
            if channel is not None:
                return channel
            forming = self._forming.get(name)
            if forming is None:
                break
            await forming.wait()  # then look again: it failed if the session broke
        self._forming[name] = done = anyio.Event()
        try:
            return await anyio.to_thread.run_sync(form, name)
        finally:
            del self._forming[name]
            done.set()

    def names(self) -> tuple[str, ...]:
        """The names formed, in the order they were."""
        return tuple(self._formed)

    def reform(self, names: tuple[str, ...], form: Callable[[str], Lane]) -> None:
        """Give each channel of ``names`` a lane of a new world (``form(name)``,
        in that order, as every member does), keeping the ``Channel`` objects
        the program holds; channels not in ``names`` are dropped."""
        formed = {}
        for name in names:
            channel = self._formed.get(name)
            lane = form(name)
            if channel is None:
                channel = Channel(name, lane)
            else:
                channel._lane = lane
            formed[name] = channel
        self._formed = formed

    def clear(self) -> None:
        self._formed.clear()
