"""Drop-in replacement for DI-engine's ``pytorch_ddp_dist_helper`` as of v0.1.0.

Code written against that helper keeps working after changing its import::

    from asyncdist.compat import get_rank, get_world_size, allreduce, dist_mode

with the helper's bugs fixed: no hard-coded port and no lasting ``os.environ``
writes (only the scoped one of ``asyncdist._groups.gloo_on_loopback``);
``get_rank``/``get_world_size`` answer 0/1 outside any group instead of
hiding failures; ``dist_init`` works without CUDA and never computes
``rank % device_count``; ``dist_mode`` keeps the return value, finalizes on
error and wraps ``async def`` functions; ``async_op=True`` returns a handle
(with ``.wait()``, like a torch work) instead of dropping it.

Here, as in v0.1, ``allreduce`` is ``torch.distributed.all_reduce`` (a sum by
default). DI-engine's later releases, the ones ``pip install di-engine``
gives, changed it to a mean and added names: they are
[asyncdist.compat.ding][asyncdist.compat.ding].

Collectives run through a [DistSession][asyncdist.DistSession]: the one
``dist_init`` opened, or one adopting a default group initialised elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .._handle import Handle
from . import _shared
from . import ding as ding  # the later release: asyncdist.compat.ding
from ._shared import (
    allgather,
    broadcast,
    dist_finalize,
    error_wrapper,
    get_group,
    get_rank,
    get_world_size,
    simple_group_split,
)

__all__ = [
    "DistContext",
    "allgather",
    "allreduce",
    "broadcast",
    "dist_finalize",
    "dist_init",
    "dist_mode",
    "error_wrapper",
    "get_group",
    "get_rank",
    "get_world_size",
    "simple_group_split",
]

F = TypeVar("F", bound=Callable[..., Any])


def allreduce(
    tensor: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Handle[torch.Tensor] | None:
    """Reduce ``tensor`` in place across ``group`` (default: every rank).

    ``op`` is a ``torch.distributed.ReduceOp`` (default ``SUM``) or an
    asyncdist name (``"mean"``...). Returns a [Handle][asyncdist.Handle] if
    ``async_op``, else ``None`` after the reduction completed.
    """
    target = _shared.session_for(group, "allreduce")
    with _shared.issuing():
        handle = target.allreduce(tensor, op=op)
    return _shared.finish(handle, async_op)


def dist_init(
    backend: str | None = None,
    addr: str | None = None,
    port: int | str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[int, int]:
    """Initialise the default process group; return ``(rank, world_size)``.

    Arguments left ``None`` come from the launch environment (torchrun, SLURM)
    or default to a 1-process world on loopback with a free port. ``"nccl"``
    on a machine without CUDA falls back to gloo (and logs it), so scripts
    written for GPUs still run on a laptop.

    Raises:
        AsyncDistError: already initialised by ``dist_init``.
        InitError: the group could not be formed.
        TypeError, ValueError: ``port`` is not a port number.
    """
    session = _shared.open_session(backend, addr, port, rank, world_size, None)
    return session.rank, session.world_size


def dist_mode(func: F) -> F:
    """Decorate ``func`` to run between ``dist_init`` and ``dist_finalize``.

    The wrapper returns ``func``'s value, finalizes even when ``func`` raises,
    and works on ``async def`` functions.
    """
    return _shared.dist_mode(dist_init)(func)


class DistContext(_shared.Context):
    """``with DistContext() as session:``: ``dist_init`` on entry,
    ``dist_finalize`` on exit, however the block ends.

    Entering returns the [DistSession][asyncdist.DistSession] (the helper's
    returned ``None``). The arguments, all optional, are ``dist_init``'s,
    plus the session ``timeout`` (seconds or a ``timedelta``).
    """
