"""Channel: an independent, ordered lane of a session over the same ranks.

Collectives pair up across ranks by issue order *per lane*. A session is one
lane; each channel is another, with its own process group(s), its own
outstanding handles and its own object and debug side groups, so two tasks
that issue concurrently stay correct as long as each uses its own lane. A
channel shares the session's health (a fault on any lane breaks the session)
and its life (it closes with the session).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._collectives import Collectives
from ._comm import Comm

if TYPE_CHECKING:
    from ._session import DistSession


class Channel(Collectives):
    """An independent lane over the session's ranks, with the whole collective surface.

    Made by [DistSession.channel][asyncdist.DistSession.channel] (every rank,
    same program order); there is no public constructor.
    """

    __slots__ = ("_comm", "_name", "_session")

    def __init__(self, session: DistSession, name: str, comm: Comm) -> None:
        self._session = session
        self._name = name
        self._comm = comm

    def _lane(self, op: str) -> Comm:
        self._session._lane(op)  # open and healthy (the health is shared)
        return self._comm

    @property
    def name(self) -> str:
        """The name every rank formed this channel under."""
        return self._name

    @property
    def rank(self) -> int:
        """This process's rank on the channel (its rank in the session)."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """The number of ranks on the channel (the session's)."""
        return self._comm.world_size

    @property
    def backend(self) -> str:
        """``"gloo"`` or ``"nccl"``, as the session's."""
        return self._comm.backend

    @property
    def device(self) -> torch.device:
        """The device collectives on this channel run on (the session's)."""
        return self._comm.device

    @property
    def group(self) -> Any:
        """The channel's own ``torch.distributed`` process group (``None`` once closed)."""
        return self._comm.group

    @property
    def closed(self) -> bool:
        """True once the session was left."""
        return self._session.closed

    def __repr__(self) -> str:
        state = "closed" if self.closed else self._session.state.value
        return f"<Channel {self._name!r} rank={self.rank}/{self.world_size} {state}>"
