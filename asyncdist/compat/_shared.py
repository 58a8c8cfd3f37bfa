"""What both releases of DI-engine's helper share: the session behind them,
and the names whose meaning never changed.

The helper was a set of module-level functions over torch's default group.
Here they run through one [DistSession][asyncdist.DistSession] per process: the one
``dist_init`` opened, or one adopting a default group initialised elsewhere.
Both [asyncdist.compat][asyncdist.compat] (v0.1) and
[asyncdist.compat.ding][asyncdist.compat.ding] (later releases) use this state, so
code mixing the two sees one session.

Every collective compat issues counts as one issuer
(``asyncdist._wakeup.issuing_as``): the helper's API is a single ordered
lane, as torch's default group is, and DI-engine issues on it from autograd
hooks (on autograd's threads on CUDA) as well as from the training loop.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import logging
import threading
from collections.abc import Callable, MutableSequence
from types import TracebackType
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from .. import _groups
from .._handle import Handle, combined
from .._session import DistSession
from .._wakeup import IssuerKey, issuing_as
from ..errors import AsyncDistError, InitError, SessionClosed

logger = logging.getLogger("asyncdist.compat")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# Process-wide state, as the helper's is: its API is plain functions over
# torch's default group, which is itself one per process, so there is no
# object to hold the session; dist_init, dist_finalize and session_for rebind it.
session: DistSession | None = None  # opened by dist_init
adopted: DistSession | None = None  # wraps a default group someone else made
groups: dict[Any, DistSession] = {}  # get_group's process groups -> their sub-sessions
released: list[Any] = []  # the groups the last dist_finalize() let go of (for the message)

_pending: list[Handle[Any]] = []  # async handles not yet waited by synchronize()
_pending_lock = threading.Lock()
_OWNER: IssuerKey = (-2, 0)  # the one issuer every compat collective counts as


def issuing() -> contextlib.AbstractContextManager[None]:
    """Collectives issued in the block count as compat's, from any thread."""
    return issuing_as(_OWNER, "asyncdist.compat")


def error_wrapper(fn: Callable[..., Any], default_ret: Any) -> Callable[..., Any]:
    """Wrap ``fn`` so that an ``Exception`` inside it returns ``default_ret``.

    The exception is logged (``asyncdist.compat`` logger, debug level) rather
    than silently lost. Use it for optional probes, not for initialisation.
    """
    return wrap_errors(fn, default_ret, None)


@functools.lru_cache(maxsize=128)  # DI-engine's one_time_warning: once per message
def _warn_once(message: str) -> None:
    logger.warning("%s", message)


def wrap_errors(
    fn: Callable[..., Any], default_ret: Any, warning_msg: str | None
) -> Callable[..., Any]:
    """``error_wrapper`` of either release: ``warning_msg`` (the later one's),
    unless ``None`` or empty, is logged as a warning on a failure, with the
    default and the error, once per distinct text; the exception is always
    logged at debug level."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            logger.debug("error_wrapper(%s) returned its default", fn, exc_info=True)
            if warning_msg:
                _warn_once(f"{warning_msg}\ndefault_ret = {default_ret}\terror = {exc}")
            return default_ret

    return wrapper


def get_rank() -> int:
    """This process's rank in the default group; 0 outside any group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The default group's size; 1 outside any group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# -- the session ----------------------------------------------------------------------


def _release(target: DistSession, why: str) -> None:
    """Close ``target``, logging (not raising) a failure it reports on the way."""
    try:
        target.close()
    except AsyncDistError as exc:
        logger.warning("%s: %s", why, exc)


def adopted_session() -> DistSession | None:
    """The session compat opened to adopt a default group initialised
    elsewhere, while it holds one (for tests and tools)."""
    return adopted


def pending_count() -> int:
    """How many async handles ``wait_pending`` has yet to wait for (for
    tests and tools)."""
    with _pending_lock:
        return len(_pending)


def forget_adopted() -> None:
    """Release the session adopting a default group, and the groups split from it.

    An adopted session does not own its group: closing it stops its worker
    threads and releases its side groups, never the user's default group.
    """
    global adopted
    old, adopted = adopted, None
    if old is None:
        return
    _release(old, "releasing the adopted session")
    for group, sub in list(groups.items()):
        if sub.closed:  # split from it: closed with it
            del groups[group]


def session_for(group: Any, op: str) -> DistSession:
    """The session to issue ``op`` on for ``group`` (``None``: the default group).

    Raises:
        ValueError: ``group`` was not made by ``get_group``/``simple_group_split``.
        SessionClosed: there is no process group.
    """
    global adopted
    if group is not None and group is not dist.group.WORLD:
        try:
            return groups[group]
        except KeyError:
            if any(group is old for old in released):
                raise SessionClosed(
                    f"{op}: this group was released by dist_finalize(); after dist_init(), "
                    "make it again with get_group() (or simple_group_split())"
                ) from None
            raise ValueError(
                f"{op}: group was not made by asyncdist.compat's get_group or "
                "simple_group_split; pass one of those groups or None"
            ) from None
    if session is not None and not session.closed:
        return session
    if adopted is not None and (
        adopted.closed or not dist.is_initialized() or adopted.group is not dist.group.WORLD
    ):
        # The group it adopted was destroyed (and maybe re-initialised) behind
        # compat's back: stop its workers before adopting anew.
        forget_adopted()
    if not dist.is_initialized():
        raise SessionClosed(f"{op}: no process group; call dist_init() first")
    if adopted is None:
        adopted = DistSession().__enter__()
    return adopted


def group_rank(target: DistSession, global_rank: Any, op: str, what: str) -> int:
    """``global_rank``, a rank of the default group, as a rank of ``target``'s group.

    Raises:
        TypeError: not an int.
        ValueError: not a rank of that group.
    """
    if isinstance(global_rank, bool) or not isinstance(global_rank, int):
        raise TypeError(f"{op}: {what} must be an int rank, not {type(global_rank).__name__}")
    if target.group is dist.group.WORLD:
        if not 0 <= global_rank < target.world_size:
            raise ValueError(
                f"{op}: {what}={global_rank} is not a rank of the world of {target.world_size}"
            )
        return global_rank
    try:
        return dist.get_group_rank(target.group, global_rank)
    except (RuntimeError, ValueError):
        raise ValueError(f"{op}: global rank {global_rank} is not in this group") from None


def track(handle: Handle[T]) -> Handle[T]:
    """Remember an async op's handle until ``wait_pending`` waits for it."""
    with _pending_lock:
        _pending[:] = [h for h in _pending if not h.done()]
        _pending.append(handle)
    return handle


def wait_pending() -> None:
    """Wait for every async op launched through compat so far (in issue order).

    Raises:
        AsyncDistError: the first of them that failed.
    """
    with _pending_lock:
        handles = list(_pending)
        _pending.clear()
    for handle in handles:
        handle.wait()


def finish(handle: Handle[T], async_op: bool) -> Handle[T] | None:
    """torch's ``async_op`` convention: the (tracked) handle, or ``None`` once done."""
    if async_op:
        return track(handle)
    handle.wait()
    return None


def open_session(
    backend: str | None,
    addr: str | None,
    port: int | str | None,
    rank: int | None,
    world_size: int | None,
    timeout: float | datetime.timedelta | None,
) -> DistSession:
    """Open the session ``dist_init`` owns.

    Raises:
        AsyncDistError: already initialised by ``dist_init``.
        InitError: the group could not be formed.
    """
    global session
    if session is not None and not session.closed:
        raise AsyncDistError("dist_init: already initialised; call dist_finalize() first")
    if port is not None:
        port = _port(port)
    if backend is not None and backend.lower() == "nccl" and not torch.cuda.is_available():
        logger.warning("dist_init: no CUDA device here; using gloo instead of nccl")
        backend = "gloo"
    opened = DistSession(
        backend,
        rank=rank,
        world_size=world_size,
        master_addr=addr,
        master_port=port,
        timeout=timeout,
    )
    try:
        opened.__enter__()
    except InitError as exc:
        if "master_port=" in str(exc):  # the session's own argument: compat's is port=
            raise InitError(str(exc).replace("master_port=", "port=")) from exc.__cause__
        raise
    session = opened
    return opened


def _port(port: object) -> int:
    """``port`` (an int, or a string of digits as from the environment) as an int.

    Raises:
        TypeError: neither.
        ValueError: a string that is not a number.
    """
    if isinstance(port, bool) or not isinstance(port, (int, str)):
        raise TypeError(f"dist_init: port must be an int, not {type(port).__name__}")
    try:
        return int(port)
    except ValueError:
        raise ValueError(f"dist_init: port must be a port number, not {port!r}") from None


def dist_finalize() -> None:
    """Release the process group (``dist_init``'s, or the default one). Idempotent.

    Outstanding async ops are waited for (bounded by the session timeout)
    and the group is destroyed without a barrier, so a peer that already
    left or died cannot hang it. A session compat opened to adopt a default
    group made elsewhere is released too (its worker threads stop), before
    that group is destroyed: like the helper's, it destroys the default
    group whoever made it (``dist_init`` over a group made elsewhere included).
    """
    global session
    current, session = session, None
    with _pending_lock:
        _pending.clear()  # closing the session drains them
    try:
        forget_adopted()
    finally:
        released[:] = list(groups)
        groups.clear()
        try:
            if current is not None:
                current.close()  # destroys the group it made, not one it adopted
        finally:
            if dist.is_initialized():
                _groups.destroy_world()


def dist_mode(init: Callable[[], object]) -> Callable[[F], F]:
    """``dist_mode`` for a release whose ``dist_init`` is ``init``."""

    def decorate(func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                init()
                try:
                    return await func(*args, **kwargs)
                finally:
                    dist_finalize()

            return cast(F, async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            init()
            try:
                return func(*args, **kwargs)
            finally:
                dist_finalize()

        return cast(F, wrapper)

    return decorate


class Context:
    """``with Context(...) as session:``: ``open_session`` on entry,
    ``dist_finalize`` on exit (however the block ends)."""

    _default_timeout: float | datetime.timedelta | None = None

    def __init__(
        self,
        backend: str | None = None,
        addr: str | None = None,
        port: int | str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> None:
        self._args = (backend, addr, port, rank, world_size)
        self._timeout = self._default_timeout if timeout is None else timeout

    def __enter__(self) -> DistSession:
        return open_session(*self._args, self._timeout)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        dist_finalize()


# -- collectives the releases share -----------------------------------------------------


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False
) -> Handle[torch.Tensor] | None:
    """Broadcast ``tensor`` from global rank ``src`` to every rank of ``group``.

    Returns a [Handle][asyncdist.Handle] if ``async_op``, else ``None`` after
    the broadcast completed.
    """
    target = session_for(group, "broadcast")
    root = group_rank(target, src, "broadcast", "src")
    with issuing():
        handle = target.broadcast(tensor, src=root)
    return finish(handle, async_op)


def allgather(
    tensor_list: MutableSequence[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Handle[MutableSequence[torch.Tensor]] | None:
    """Gather ``tensor`` from every rank of ``group`` into ``tensor_list``
    (``torch.distributed.all_gather``): element ``j`` receives rank ``j``'s.

    Returns a [Handle][asyncdist.Handle] (result: ``tensor_list``, filled)
    if ``async_op``, else ``None`` once ``tensor_list`` is filled.

    Raises:
        TypeError, ValueError: ``tensor_list`` is not a list of one tensor per
            rank shaped like ``tensor`` (checked before anything is launched).
    """
    op = "allgather"
    target = session_for(group, op)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: tensor must be a torch.Tensor, not {type(tensor).__name__}")
    if not isinstance(tensor_list, MutableSequence):
        raise TypeError(f"{op}: tensor_list must be a list, not {type(tensor_list).__name__}")
    if len(tensor_list) != target.world_size:
        raise ValueError(
            f"{op}: tensor_list has {len(tensor_list)} tensors; the group has "
            f"{target.world_size} ranks"
        )
    for out in tensor_list:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{op}: tensor_list holds a {type(out).__name__}, not a tensor")
        if out.shape != tensor.shape or out.dtype != tensor.dtype:
            raise ValueError(
                f"{op}: every tensor in tensor_list must have tensor's shape and dtype "
                f"({tuple(tensor.shape)}, {tensor.dtype}), got ({tuple(out.shape)}, {out.dtype})"
            )
    with issuing():
        gathered = target.all_gather(tensor)

    def fill(results: list[Any]) -> MutableSequence[torch.Tensor]:
        for out, got in zip(tensor_list, results[0], strict=True):
            out.copy_(got)
        return tensor_list

    return finish(combined(op, [gathered], fill), async_op)


def simple_group_split(world_size: int, rank: int, num_groups: int) -> Any:
    """Split the world into ``num_groups`` blocks of consecutive ranks and
    return the process group of ``rank``'s block.

    Every rank must call it (every rank creates every group, as torch
    requires). Pass the result as ``group=`` to the collectives.

    Raises:
        TypeError: an argument is not an int.
        ValueError: ``world_size``/``rank`` are not this process's, or
            ``num_groups`` does not divide the world.
    """
    op = "simple_group_split"
    for what, value in (("world_size", world_size), ("rank", rank), ("num_groups", num_groups)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{op}: {what} must be an int, not {type(value).__name__}")
    target = session_for(None, op)
    if (world_size, rank) != (target.world_size, target.rank):
        raise ValueError(
            f"{op}: world_size={world_size}, rank={rank} do not describe this process "
            f"(rank {target.rank} of {target.world_size})"
        )
    if num_groups < 1 or world_size % num_groups:
        raise ValueError(
            f"{op}: num_groups={num_groups} does not divide the world size {world_size} "
            "into equal groups"
        )
    return get_group(world_size // num_groups)


def get_group(group_size: int | None) -> Any:
    """The process group of this rank's block of ``group_size`` consecutive
    ranks (``None``: the whole world).

    Every rank must call it (every rank creates every group, as torch
    requires). Pass the result as ``group=`` to the collectives.

    Raises:
        TypeError: ``group_size`` is not an int.
        ValueError: ``group_size`` does not divide the world size.
    """
    target = session_for(None, "get_group")
    sub = target.split(target.world_size if group_size is None else group_size)
    groups[sub.group] = sub
    return sub.group
