"""Drop-in replacement for DI-engine's ``pytorch_ddp_dist_helper``.

Code written against the old helper keeps working after changing its import::

    from asyncdist.compat import get_rank, get_world_size, allreduce, dist_mode

with the helper's bugs fixed: no hard-coded port and no lasting ``os.environ``
writes (only the scoped one of :func:`asyncdist._env.gloo_on_loopback`);
``get_rank``/``get_world_size`` answer 0/1 outside any group instead of
hiding failures; ``dist_init`` works without CUDA and never computes
``rank % device_count``; ``dist_mode`` keeps the return value, finalizes on
error and wraps ``async def`` functions; ``allreduce(..., async_op=True)``
returns a handle (with ``.wait()``, like a torch work) instead of dropping it.

Collectives run through a :class:`~asyncdist.DistSession`: the one
``dist_init`` opened, or one adopting a default group initialised elsewhere.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ._handle import Handle
from ._session import DistSession
from .errors import AsyncDistError, SessionClosed

__all__ = [
    "allreduce",
    "broadcast",
    "dist_finalize",
    "dist_init",
    "dist_mode",
    "error_wrapper",
    "get_group",
    "get_rank",
    "get_world_size",
]

logger = logging.getLogger("asyncdist.compat")

F = TypeVar("F", bound=Callable[..., Any])

_session: DistSession | None = None  # opened by dist_init
_adopted: DistSession | None = None  # wraps a default group someone else made
_groups: dict[Any, DistSession] = {}  # get_group's process groups -> their sub-sessions


def error_wrapper(fn: Callable[..., Any], default_ret: Any) -> Callable[..., Any]:
    """Wrap ``fn`` so that an ``Exception`` inside it returns ``default_ret``.

    The exception is logged (``asyncdist.compat`` logger, debug level) rather
    than silently lost. Use it for optional probes, not for initialisation.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:
            logger.debug("error_wrapper(%s) returned its default", fn, exc_info=True)
            return default_ret

    return wrapper


def get_rank() -> int:
    """This process's rank in the default group; 0 outside any group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The default group's size; 1 outside any group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _release(session: DistSession, why: str) -> None:
    """Close ``session``, logging (not raising) a failure it reports on the way."""
    try:
        session.close()
    except AsyncDistError as exc:
        logger.warning("%s: %s", why, exc)


def _forget_adopted() -> None:
    """Release the session adopting a default group, and the groups split from it.

    An adopted session does not own its group: closing it stops its worker
    threads and releases its side groups, never the user's default group.
    """
    global _adopted
    adopted, _adopted = _adopted, None
    if adopted is None:
        return
    _release(adopted, "releasing the adopted session")
    for group, sub in list(_groups.items()):
        if sub.closed:  # split from it: closed with it
            del _groups[group]


def _session_for(group: Any, op: str) -> DistSession:
    global _adopted
    if group is not None and group is not dist.group.WORLD:
        try:
            return _groups[group]
        except KeyError:
            raise ValueError(
                f"{op}: group was not made by asyncdist.compat.get_group; pass one of its "
                "groups or None"
            ) from None
    if _session is not None and not _session.closed:
        return _session
    if _adopted is not None and (
        _adopted.closed or not dist.is_initialized() or _adopted.group is not dist.group.WORLD
    ):
        # The group it adopted was destroyed (and maybe re-initialised) behind
        # compat's back: stop its workers before adopting anew.
        _forget_adopted()
    if not dist.is_initialized():
        raise SessionClosed(f"{op}: no process group; call dist_init() first")
    if _adopted is None:
        _adopted = DistSession().__enter__()
    return _adopted


def _group_rank(session: DistSession, global_rank: int, op: str, what: str) -> int:
    if isinstance(global_rank, bool) or not isinstance(global_rank, int):
        raise TypeError(f"{op}: {what} must be an int rank, not {type(global_rank).__name__}")
    if session.group is dist.group.WORLD:
        return global_rank
    try:
        return dist.get_group_rank(session.group, global_rank)
    except (RuntimeError, ValueError):
        raise ValueError(f"{op}: global rank {global_rank} is not in this group") from None


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False
) -> Handle[torch.Tensor] | None:
    """Broadcast ``tensor`` from global rank ``src`` to every rank of ``group``.

    Returns a :class:`~asyncdist.Handle` if ``async_op``, else ``None`` after
    the broadcast completed.
    """
    session = _session_for(group, "broadcast")
    handle = session.broadcast(tensor, src=_group_rank(session, src, "broadcast", "src"))
    if async_op:
        return handle
    handle.wait()
    return None


def allreduce(
    tensor: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Handle[torch.Tensor] | None:
    """Reduce ``tensor`` in place across ``group`` (default: every rank).

    ``op`` is a ``torch.distributed.ReduceOp`` (default ``SUM``) or an
    asyncdist name (``"mean"``...). Returns a :class:`~asyncdist.Handle` if
    ``async_op``, else ``None`` after the reduction completed.
    """
    handle = _session_for(group, "allreduce").allreduce(tensor, op=op)
    if async_op:
        return handle
    handle.wait()
    return None


def get_group(group_size: int) -> Any:
    """The process group of this rank's block of ``group_size`` consecutive ranks.

    Every rank must call it (every rank creates every group, as torch
    requires). Pass the result as ``group=`` to :func:`broadcast` and
    :func:`allreduce`.

    Raises:
        ValueError: ``group_size`` does not divide the world size.
    """
    sub = _session_for(None, "get_group").split(group_size)
    _groups[sub.group] = sub
    return sub.group


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
    """
    global _session
    if _session is not None and not _session.closed:
        raise AsyncDistError("dist_init: already initialised; call dist_finalize() first")
    if backend is not None and backend.lower() == "nccl" and not torch.cuda.is_available():
        logger.warning("dist_init: no CUDA device here; using gloo instead of nccl")
        backend = "gloo"
    session = DistSession(
        backend,
        rank=rank,
        world_size=world_size,
        master_addr=addr,
        master_port=None if port is None else int(port),
    )
    session.__enter__()
    _session = session
    return session.rank, session.world_size


def dist_finalize() -> None:
    """Release the process group (``dist_init``'s, or the default one). Idempotent.

    A session compat opened to adopt a default group made elsewhere is
    released too (its worker threads stop), before that group is destroyed.
    """
    global _session
    session, _session = _session, None
    try:
        _forget_adopted()
    finally:
        _groups.clear()
        if session is not None:
            session.close()
        elif dist.is_initialized():
            dist.destroy_process_group()


def dist_mode(func: F) -> F:
    """Decorate ``func`` to run between :func:`dist_init` and :func:`dist_finalize`.

    The wrapper returns ``func``'s value, finalizes even when ``func`` raises,
    and works on ``async def`` functions.
    """
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            dist_init()
            try:
                return await func(*args, **kwargs)
            finally:
                dist_finalize()

        return cast(F, async_wrapper)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dist_init()
        try:
            return func(*args, **kwargs)
        finally:
            dist_finalize()

    return cast(F, wrapper)
