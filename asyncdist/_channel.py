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
