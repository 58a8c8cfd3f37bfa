"""DistSession: the process group's lifecycle, and every collective.

This is the one module that issues collectives on ``torch.distributed``.
Each collective method checks its arguments on the calling rank, issues the
op with ``async_op=True`` at once, and returns a :class:`Handle` that only
observes completion.
"""

from __future__ import annotations

import collections
import datetime
import enum
import logging
import math
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import anyio
import torch
import torch.distributed as dist

from . import _ops
from ._env import LaunchEnv, detect, gloo_on_loopback, is_loopback
from ._handle import Completer, Handle, Health, Watchdog
from ._store import session_store
from .errors import AsyncDistError, InitError, SessionBroken, SessionClosed, translate

logger = logging.getLogger("asyncdist")

T = TypeVar("T")

DEFAULT_TIMEOUT = 1800.0  # torch's own default for gloo and NCCL groups


class State(enum.Enum):
    """Where a session is in its life."""

    UNOPENED = "unopened"
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


def _seconds(timeout: float | datetime.timedelta | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout must be seconds (a number) or a timedelta, not {type(timeout).__name__}"
        )
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return seconds


def _choose_device(device: Any, backend: str | None, local_rank: int) -> torch.device:
    """The session's device: explicit, else CUDA ``LOCAL_RANK`` for NCCL or when
    CUDA is present, else CPU.  Never ``rank % device_count``."""
    if device is not None:
        chosen = torch.device(device)
        if chosen.type == "cuda" and chosen.index is None:
            chosen = torch.device("cuda", local_rank)
    elif backend == "gloo":
        return torch.device("cpu")
    elif backend == "nccl" or torch.cuda.is_available():
        chosen = torch.device("cuda", local_rank)
    else:
        return torch.device("cpu")
    if chosen.type == "cuda":
        count = torch.cuda.device_count()
        if chosen.index is not None and chosen.index >= count:
            raise InitError(
                f"this process wants {chosen} (LOCAL_RANK={local_rank}) but sees "
                f"{count} CUDA device(s); start at most one process per GPU, or check "
                "CUDA_VISIBLE_DEVICES"
            )
    return chosen


def _choose_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, not {type(backend).__name__}")
    backend = backend.lower()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("the nccl backend needs a CUDA device; use backend='gloo' on CPU")
    return backend


class DistSession:
    """A process group's whole life, and the collectives on it.

    Entering (``with`` or ``async with``) forms the group from the launch
    environment, or adopts a default group that is already initialised (and
    then leaves it initialised). Leaving, however it happens, waits for
    outstanding collectives (bounded by ``timeout``) and destroys the group it
    created, without any barrier a dead peer could hang.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default NCCL when the device is
            CUDA, else gloo.
        init_method: a torch init URL (``"tcp://host:port"``, ``"file://..."``);
            default: asyncdist's own rendezvous from the environment.
        rank, world_size, master_addr, master_port: override what the launch
            environment says (torchrun, then SLURM, then a 1-process world).
        timeout: seconds (or a ``timedelta``) that bound forming the group and
            every collective; default 1800, as in torch.
        device: the device collectives run on; default CUDA ``LOCAL_RANK`` when
            CUDA is available, else CPU.
        debug: check before each collective that all ranks issue the same op
            (also ``ASYNCDIST_DEBUG=1``).
    """

    def __init__(
        self,
        backend: str | None = None,
        *,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        device: str | torch.device | int | None = None,
        debug: bool = False,
    ) -> None:
        self._requested_backend = backend
        self._init_method = init_method
        self._requested = {
            "rank": rank,
            "world_size": world_size,
            "master_addr": master_addr,
            "master_port": master_port,
        }
        self._timeout = _seconds(timeout)
        self._requested_device = device
        self._debug = debug or os.environ.get("ASYNCDIST_DEBUG", "") not in ("", "0")
        self._state = State.UNOPENED
        self._rank = 0
        self._world_size = 1
        self._local_rank = 0
        self._backend = ""
        self._device = torch.device("cpu")
        self._group: Any = None
        self._owns_group = False
        self._owned_store: dist.Store | None = None
        self._env: LaunchEnv | None = None
        self._health = Health(rank=0, timeout=self._timeout)
        self._completer: Completer | None = None
        self._watchdog: Watchdog | None = None
        self._outstanding: collections.deque[Handle[Any]] = collections.deque()
        self._loopback = False  # the world is confined to this machine's loopback
        self._parent: DistSession | None = None
        self._children: list[DistSession] = []

    # -- properties ------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the session's group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the session's group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """This process's index on its machine (``LOCAL_RANK``)."""
        return self._local_rank

    @property
    def backend(self) -> str:
        """``"gloo"`` or ``"nccl"`` (empty before the session is entered)."""
        return self._backend

    @property
    def device(self) -> torch.device:
        """The device collectives of this session run on."""
        return self._device

    @property
    def group(self) -> Any:
        """The underlying ``torch.distributed`` process group (``None`` until entered)."""
        return self._group

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self._rank == 0

    @property
    def timeout(self) -> float:
        """Seconds that bound each collective."""
        return self._timeout

    @property
    def state(self) -> State:
        """``UNOPENED``, ``OPEN``, ``BROKEN`` (after a fault) or ``CLOSED``."""
        if self._state is State.OPEN and self._health.fault is not None:
            return State.BROKEN
        return self._state

    @property
    def closed(self) -> bool:
        """True once the session has been left (or was never entered)."""
        return self._state is not State.OPEN

    def __repr__(self) -> str:
        where = f"rank={self._rank}/{self._world_size} {self._backend or '?'} {self._device}"
        return f"<DistSession {where} {self.state.value}>"

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> DistSession:
        self._open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(raise_errors=exc is None)

    async def __aenter__(self) -> DistSession:
        # Forming the group waits for peers: keep that off the event loop.
        await anyio.to_thread.run_sync(self._open)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the current device is per thread
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Shielded: a cancellation must not leave the group half torn down.
        with anyio.CancelScope(shield=True):
            first_error = None
            for handle in self._drain():
                try:
                    await handle
                except AsyncDistError as error:
                    first_error = first_error or error
            self._teardown()
        if first_error is not None and exc is None:
            raise first_error

    def _open(self) -> None:
        if self._parent is not None and self._state is State.OPEN:
            return  # a sub-session is open from birth; `with` just scopes it
        if self._state is State.OPEN:
            raise AsyncDistError("this DistSession is already open; enter it only once")
        if self._state is State.CLOSED:
            raise SessionClosed(
                "this DistSession was closed; create a new DistSession to start again"
            )
        if dist.is_initialized():
            self._adopt()
        else:
            self._init_group()
        self._health = Health(rank=self._rank, timeout=self._timeout)
        self._start_workers()
        self._state = State.OPEN

    def _start_workers(self) -> None:
        self._completer = Completer(f"asyncdist-completer-r{self._rank}")
        self._watchdog = Watchdog(self._health, self._outstanding)

    def _adopt(self) -> None:
        group = dist.group.WORLD
        rank, world = dist.get_rank(), dist.get_world_size()
        for name, actual in (("rank", rank), ("world_size", world)):
            wanted = self._requested[name]
            if wanted is not None and wanted != actual:
                raise InitError(
                    f"the default process group is already initialised with {name}={actual}, "
                    f"but {name}={wanted} was requested"
                )
        self._rank, self._world_size = rank, world
        self._local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self._backend = str(dist.get_backend(group))
        device = self._requested_device
        if device is None:
            device = "cuda" if self._backend == "nccl" else "cpu"
        self._device = _choose_device(device, self._backend, self._local_rank)
        self._group = group
        self._owns_group = False

    def _init_group(self) -> None:
        env = detect(**self._requested)
        device = _choose_device(self._requested_device, self._requested_backend, env.local_rank)
        backend = _choose_backend(self._requested_backend, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=self._timeout)
        store = None
        self._loopback = self._init_method is None and (
            env.master_port is None or is_loopback(env.master_addr)
        )
        try:
            if self._init_method is None:
                store, self._owned_store = session_store(env, self._timeout)
            with gloo_on_loopback(self._loopback and backend == "gloo"):
                dist.init_process_group(
                    backend,
                    init_method=self._init_method,
                    store=store,
                    rank=env.rank,
                    world_size=env.world_size,
                    timeout=timeout,
                    device_id=device if backend == "nccl" else None,
                )
        except InitError:
            self._owned_store = None
            raise
        except (RuntimeError, OSError, ValueError) as exc:
            self._owned_store = None
            where = (
                self._init_method or f"{env.master_addr}:{env.master_port or '(local)'}"
            )
            raise InitError(
                f"rank {env.rank} of {env.world_size} could not form a {backend} group via "
                f"{where} within {self._timeout:g} s ({exc}). Check that all "
                f"{env.world_size} ranks started, that MASTER_ADDR/MASTER_PORT agree, and "
                "that the master is reachable."
            ) from exc
        self._env = env
        self._rank, self._world_size, self._local_rank = env.rank, env.world_size, env.local_rank
        self._backend, self._device = backend, device
        self._group = dist.group.WORLD
        self._owns_group = True

    def _drain(self) -> list[Handle[Any]]:
        """The handles still outstanding, in issue order (all, if not broken)."""
        if self._state is not State.OPEN or self._health.fault is not None:
            # Broken: outstanding work either failed already or is lost; the
            # backend timeout bounds it, and destroying the group waits for it.
            return []
        handles = list(self._outstanding)
        for child in self._children:
            handles += child._drain()
        return handles

    def _close(self, *, raise_errors: bool) -> None:
        first_error = None
        for handle in self._drain():
            try:
                handle.wait()
            except AsyncDistError as error:
                first_error = first_error or error
        self._teardown()
        if first_error is not None and raise_errors:
            raise first_error

    def _teardown(self) -> None:
        if self._state is not State.OPEN:
            return
        for child in self._children:
            child._teardown()
        self._children.clear()
        self._state = State.CLOSED
        completer, self._completer = self._completer, None
        if completer is not None:
            completer.close(timeout=self._timeout)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.close()
        self._outstanding.clear()
        if self._owns_group or self._parent is not None:
            group = None if self._parent is None else self._group
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError, KeyError) as exc:  # already gone
                logger.debug("destroy_process_group: %s", exc)
        if self._parent is not None and self in self._parent._children:
            self._parent._children.remove(self)
        self._group = None
        self._owned_store = None

    def close(self) -> None:
        """Leave the session now (as ``with`` does on exit). Closing twice is fine."""
        if self._state is State.OPEN:
            self._close(raise_errors=True)
        else:
            self._state = State.CLOSED

    # -- groups -----------------------------------------------------------------

    def split(self, group_size: int) -> DistSession:
        """A sub-session over this rank's block of ``group_size`` consecutive ranks.

        Every rank must call ``split`` with the same size, in the same order
        relative to other collectives (torch requires every rank to create
        every group). The sub-session has its own ``rank``/``world_size`` and
        the whole collective surface; it is released with this session (or
        earlier, by leaving ``with sub:``).

        Raises:
            TypeError: ``group_size`` is not an int.
            ValueError: ``group_size`` does not divide the world size.
        """
        name = "split"
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"{name}: group_size must be an int, not {type(group_size).__name__}")
        if group_size < 1 or self._world_size % group_size:
            raise ValueError(
                f"{name}: group_size={group_size} does not divide the world size "
                f"{self._world_size} into whole groups"
            )
        self._check_open(name)
        mine = self._rank // group_size
        own_group: Any = None
        base = [dist.get_global_rank(self._group, r) for r in range(self._world_size)]
        with gloo_on_loopback(self._loopback and self._backend == "gloo"):
            for block in range(self._world_size // group_size):
                ranks = base[block * group_size : (block + 1) * group_size]
                group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self._timeout))
                if block == mine:
                    own_group = group
        sub = DistSession(self._backend, timeout=self._timeout, device=self._device, debug=self._debug)
        sub._parent = self
        sub._state = State.OPEN
        sub._group = own_group
        sub._rank = self._rank % group_size
        sub._world_size = group_size
        sub._local_rank = self._local_rank
        sub._backend, sub._device = self._backend, self._device
        sub._loopback = self._loopback
        sub._health = self._health  # a fault anywhere breaks the whole job
        sub._start_workers()
        self._children.append(sub)
        return sub

    # -- launching -----------------------------------------------------------------

    def _check_open(self, op: str) -> None:
        if self._state is not State.OPEN:
            raise SessionClosed(
                f"{op}: the session is {self._state.value}; issue collectives inside "
                "`with DistSession() as s:` (or `async with`)"
            )
        fault = self._health.fault
        if fault is not None:
            raise SessionBroken(
                f"{op} on rank {self._rank}: the session is broken by an earlier failure "
                f"({type(fault).__name__}); leave it and start a new one (or let torchrun "
                "restart the job)"
            ) from fault

    def _launch(
        self,
        op: str,
        issue: Callable[[], Any],
        finish: Callable[[], T],
        *,
        futureless: str | None = None,
    ) -> Handle[T]:
        """Issue a collective now and return its handle.

        ``issue`` calls torch with ``async_op=True`` and returns the work;
        ``finish`` runs once the work completed and returns the handle's
        result.  ``futureless`` names the ordering key for works gloo gives no
        future: a completer thread waits on those.
        """
        outstanding = self._outstanding
        while outstanding and outstanding[0].done():
            outstanding.popleft()
        try:
            work = issue()
        except (RuntimeError, ValueError) as exc:
            # Refused by torch before anything reached the wire.
            raise translate(exc, op=op, rank=self._rank, timeout=self._timeout) from exc
        if futureless is not None and self._backend == "gloo":
            assert self._completer is not None
            handle: Handle[T] = Handle._create(op, self._health, finish)
            self._completer.submit(futureless, lambda: handle._settle(work.wait))
        else:
            handle = Handle._create(op, self._health, finish, work)
        outstanding.append(handle)
        return handle

    def _tensor(self, tensor: Any, op: str, what: str = "tensor") -> torch.Tensor:
        return _ops.check_tensor(
            tensor, collective=op, backend=self._backend, device=self._device, what=what
        )

    def _root(self, value: Any, op: str, what: str) -> int:
        return _ops.check_rank(value, world_size=self._world_size, collective=op, what=what)

    # -- collectives -----------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, op: _ops.ReduceOpLike = "sum") -> Handle[torch.Tensor]:
        """Reduce ``tensor`` across all ranks, in place.

        Args:
            tensor: a contiguous tensor, the same shape and dtype on every rank.
            op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"``, ``"product"``, or a
                ``torch.distributed.ReduceOp``.

        Returns:
            A handle whose result is ``tensor``, reduced.

        Raises:
            TypeError, ValueError: bad tensor or op (nothing is launched).
            SessionClosed, SessionBroken: the session is not usable.
        """
        name = "allreduce"
        self._check_open(name)
        self._tensor(tensor, name)
        reduction = _ops.reduction(op, tensor.dtype, backend=self._backend, collective=name)
        group, world = self._group, self._world_size
        options = dist.AllreduceOptions()
        options.reduceOp = reduction.wire_op
        options.asyncOp = True
        # complex travels as pairs of reals (only sum/mean reach here for complex)
        wire = torch.view_as_real(tensor) if tensor.is_complex() else tensor

        def finish() -> torch.Tensor:
            if reduction.divide:
                tensor.div_(world)
            return tensor

        # The ProcessGroup method directly: torch's dist.all_reduce wrapper
        # re-does the checks made above and costs ~10 µs a call.
        return self._launch(name, lambda: group.allreduce([wire], options), finish)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle[torch.Tensor]:
        """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank.

        Returns:
            A handle whose result is ``tensor``.

        Raises:
            TypeError, ValueError: bad tensor, or ``src`` not a rank of the group.
        """
        name = "broadcast"
        self._check_open(name)
        self._tensor(tensor, name)
        self._root(src, name, "src")
        group = self._group
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        options.asyncOp = True
        return self._launch(name, lambda: group.broadcast([tensor], options), lambda: tensor)
