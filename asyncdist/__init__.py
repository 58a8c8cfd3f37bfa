"""asyncdist: an async-first, context-managed API over ``torch.distributed``."""

from ._channel import Channel as Channel
from ._elastic import ElasticState as ElasticState
from ._elastic import World as World
from ._elastic import Worlds as Worlds
from ._grad import GradientSync as GradientSync
from ._handle import Handle as Handle
from ._handle import wait_all as wait_all
from ._mainrank import MainFirst as MainFirst
from ._session import DistSession as DistSession
from ._session import State as State
from ._spawn import spawn as spawn
from ._trace import TraceBlock as TraceBlock
from ._version import __version__ as __version__
from .errors import AsyncDistError as AsyncDistError
from .errors import CollectiveError as CollectiveError
from .errors import CollectiveMismatch as CollectiveMismatch
from .errors import CollectiveTimeout as CollectiveTimeout
from .errors import FinishError as FinishError
from .errors import InitError as InitError
from .errors import MembershipChanged as MembershipChanged
from .errors import MembershipLost as MembershipLost
from .errors import PeerFailure as PeerFailure
from .errors import SessionBroken as SessionBroken
from .errors import SessionClosed as SessionClosed

__all__ = [
    "AsyncDistError",
    "Channel",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DistSession",
    "ElasticState",
    "FinishError",
    "GradientSync",
    "Handle",
    "InitError",
    "MainFirst",
    "MembershipChanged",
    "MembershipLost",
    "PeerFailure",
    "SessionBroken",
    "SessionClosed",
    "State",
    "TraceBlock",
    "World",
    "Worlds",
    "__version__",
    "spawn",
    "wait_all",
]
