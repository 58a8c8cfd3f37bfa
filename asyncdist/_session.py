"""DistSession: the process group's lifecycle, and every collective.

This is the one module that issues collectives on ``torch.distributed``.
Each collective method checks its arguments on the calling rank, issues the
op with ``async_op=True`` at once, and returns a :class:`Handle` that only
observes completion.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import enum
import logging
import math
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio
import torch
import torch.distributed as dist

from . import _ops, _pickle, _trace, _wakeup
from ._debug import Fingerprint, describe, mismatch
from ._env import LaunchEnv, detect, gloo_on_loopback, is_loopback
from ._grad import GradientSync
from ._handle import Completer, Handle, Health, Watchdog, combined
from ._store import forget, session_store
from ._trace import Tracer, rank_path
from .errors import (
    AsyncDistError,
    CollectiveMismatch,
    InitError,
    SessionBroken,
    SessionClosed,
    translate,
)

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
        if str(chosen) == "cuda":  # no index: this process's LOCAL_RANK
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
        rank: this process's rank; overrides the launch environment
            (torchrun, then SLURM, then a 1-process world).
        world_size: the number of processes; overrides the environment.
        master_addr: the rendezvous host; overrides ``MASTER_ADDR``.
        master_port: the rendezvous port; overrides ``MASTER_PORT``.
        timeout: seconds (or a ``timedelta``) that bound forming the group and
            every collective; default 1800, as in torch.
        device: the device collectives run on; default CUDA ``LOCAL_RANK`` when
            CUDA is available, else CPU.
        debug: check before each collective that all ranks issue the same op
            (also ``ASYNCDIST_DEBUG=1``).
        trace: record every collective's launch and completion and write a
            Chrome trace per rank when the session ends (``True``:
            ``asyncdist-trace.rank<r>.json``; a path ``p``: ``p`` with
            ``.rank<r>`` before its suffix). See also :meth:`trace`.
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
        trace: bool | str | os.PathLike[str] = False,
    ) -> None:
        self._requested_backend = backend
        self._init_method = init_method
        self._requested_rank, self._requested_world = rank, world_size
        self._requested_master = (master_addr, master_port)
        self._timeout = _seconds(timeout)
        self._requested_device = device
        self._debug = debug or os.environ.get("ASYNCDIST_DEBUG", "") not in ("", "0")
        self._trace_path: str | os.PathLike[str] | None = (
            None if trace is False else "asyncdist-trace.json" if trace is True else trace
        )
        self._tracer: Tracer | None = None
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
        self._aux: dict[str, Any] = {}  # side groups: "debug" fingerprints, "objects"
        self._seq = 0  # collectives issued, for debug fingerprints
        self._last_issuer = ""

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
        try:
            await anyio.to_thread.run_sync(self._open)
        except BaseException:
            # Cancelled once the group had formed: there is no __aexit__ to release it.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._teardown)
            raise
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
            unseen = [await handle._join_async() for handle in self._drain()]
            # joining worker threads and destroying the group can block: not on the loop
            await anyio.to_thread.run_sync(self._teardown)
        self._report(unseen, raise_errors=exc is None)

    def _open(self) -> None:
        if self._parent is not None and self._state is State.OPEN:
            return  # a sub-session is open from birth; `with` just scopes it
        if self._state is State.OPEN:
            raise AsyncDistError(
                f"the DistSession of rank {self._rank} is already open; enter it only once"
            )
        if self._state is State.CLOSED:
            raise SessionClosed(
                f"the DistSession of rank {self._rank} was closed; create a new DistSession "
                "to start again"
            )
        if dist.is_initialized():
            self._adopt()
        else:
            self._init_group()
        self._health = Health(rank=self._rank, timeout=self._timeout)
        self._start_workers()
        if self._trace_path is not None:
            self._tracer = Tracer(self._rank)
        self._state = State.OPEN
        try:
            self._form_side_groups()
        except (RuntimeError, OSError) as exc:
            self._teardown()
            raise InitError(
                f"rank {self._rank} of {self._world_size}: the group formed, but its side "
                f"group did not within {self._timeout:g} s ({exc}). Check that every rank "
                "is still running."
            ) from exc

    def _form_side_groups(self) -> None:
        """Form the side groups now, while waiting for peers is expected (entry
        runs off the event loop), not inside the first object collective."""
        self._side_group("objects")
        if self._debug:
            self._side_group("debug")

    def _start_workers(self) -> None:
        self._completer = Completer(f"asyncdist-completer-r{self._rank}")
        self._watchdog = Watchdog(self._health, self._outstanding)

    def _adopt(self) -> None:
        group = dist.group.WORLD
        rank, world = dist.get_rank(), dist.get_world_size()
        for name, actual, wanted in (
            ("rank", rank, self._requested_rank),
            ("world_size", world, self._requested_world),
        ):
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
        env = detect(
            rank=self._requested_rank,
            world_size=self._requested_world,
            master_addr=self._requested_master[0],
            master_port=self._requested_master[1],
        )
        device = _choose_device(self._requested_device, self._requested_backend, env.local_rank)
        backend = _choose_backend(self._requested_backend, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=self._timeout)
        store, fresh = None, False
        self._loopback = self._init_method is None and (
            env.master_port is None or is_loopback(env.master_addr)
        )
        try:
            if self._init_method is None:
                store, self._owned_store, fresh = session_store(env, self._timeout)
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
            if fresh:
                store = None
                forget(env)  # release the port this failed session bound...
                traceback.clear_frames(exc.__traceback__)  # ...which torch's frames hold
            where = self._init_method or f"{env.master_addr}:{env.master_port or '(local)'}"
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
        unseen = [handle._join() for handle in self._drain()]
        self._teardown()
        self._report(unseen, raise_errors=raise_errors)

    def _report(self, unseen: Iterable[BaseException | None], *, raise_errors: bool) -> None:
        """Surface failures of outstanding handles nobody waited on: nothing is lost.

        A fault is raised when the block exited normally; otherwise (or for
        local errors, like a refused unpickle) it is logged. So is the fault
        that broke the session, if no error of it ever reached the user (the
        watchdog found it on a handle nobody waited on).
        """
        faults = [error for error in unseen if error is not None]
        health = self._health
        if health.fault is not None and not health.fault_seen and health.fault not in faults:
            faults.insert(0, health.fault)
        for error in faults:
            logger.warning("rank %d: unobserved failure at session exit: %s", self._rank, error)
        fault = next((e for e in faults if isinstance(e, AsyncDistError)), None)
        if fault is not None and raise_errors:
            health.fault_seen = True  # once, not again at a parent session's exit
            raise fault

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
        aux, self._aux = list(self._aux.values()), {}
        if not self._owns_group:  # an owned default group takes its side groups with it
            for group in aux:
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError, KeyError) as exc:
                    logger.debug("destroy_process_group(side group): %s", exc)
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
        if self._tracer is not None and self._trace_path is not None and self._parent is None:
            _trace.write(rank_path(self._trace_path, self._rank), self._tracer_events())

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
        sub = DistSession(
            self._backend, timeout=self._timeout, device=self._device, debug=self._debug
        )
        sub._parent = self
        sub._state = State.OPEN
        sub._group = own_group
        sub._rank = self._rank % group_size
        sub._world_size = group_size
        sub._local_rank = self._local_rank
        sub._backend, sub._device = self._backend, self._device
        sub._loopback = self._loopback
        sub._health = self._health  # a fault anywhere breaks the whole job
        sub._tracer = self._tracer
        sub._start_workers()
        self._children.append(sub)
        try:
            sub._form_side_groups()
        except RuntimeError as exc:
            sub._teardown()
            error = translate(exc, op=name, rank=self._rank, timeout=self._timeout)
            self._health.break_(error)
            self._health.saw(error)
            raise error from exc
        return sub

    # -- launching -----------------------------------------------------------------

    def _check_open(self, op: str) -> None:
        if self._state is not State.OPEN:
            where = f" on rank {self._rank}" if self._state is State.CLOSED else ""
            raise SessionClosed(
                f"{op}{where}: the session is {self._state.value}; issue collectives inside "
                "`with DistSession() as s:` (or `async with`)"
            )
        fault = self._health.fault
        if fault is not None:
            self._health.fault_seen = True
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
        nbytes: int = 0,
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
            streamed = self._backend == "nccl"
            handle = Handle._create(op, self._health, finish, work, streamed=streamed)
        outstanding.append(handle)
        if self._tracer is not None:
            self._tracer.record(handle, nbytes)
        return handle

    def _tensor(self, tensor: Any, op: str, what: str = "tensor") -> torch.Tensor:
        return _ops.check_tensor(
            tensor, collective=op, backend=self._backend, device=self._device, what=what
        )

    def _root(self, value: Any, op: str, what: str) -> int:
        return _ops.check_rank(value, world_size=self._world_size, collective=op, what=what)

    # -- training ---------------------------------------------------------------------

    def gradient_sync(
        self,
        module: torch.nn.Module,
        bucket_mb: float = 25.0,
        op: _ops.ReduceOpLike = "mean",
        *,
        first_bucket_mb: float = 1.0,
    ) -> GradientSync:
        """Average ``module``'s gradients across ranks, overlapped with backward.

        Returns a :class:`GradientSync`; ``await`` it (or ``.wait()``) after
        ``loss.backward()``. See the "Overlap in training loops" guide.
        ``op``: ``"mean"`` (average) or ``"sum"``, or ``ReduceOp.AVG``/``SUM``.

        Raises:
            TypeError, ValueError: not a module, or a bad bucket size or op.
        """
        self._check_open("gradient_sync")
        return GradientSync(
            self, module, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, op=op
        )

    # -- tracing ------------------------------------------------------------------------

    def _tracer_events(self) -> list[list[dict[str, Any]]]:
        assert self._tracer is not None
        events = self._tracer.snapshot()
        return [events if r == self._rank else [] for r in range(self._world_size)]

    @contextlib.contextmanager
    def trace(self, path: str | os.PathLike[str]) -> Iterator[None]:
        """Trace every collective issued inside the block into one Chrome trace.

        Every rank must enter the block. On a normal exit, rank 0 writes
        ``path`` with all ranks' events (one process per rank); if the block
        raises, each rank writes its own ``path`` with ``.rank<r>`` inserted.
        """
        self._check_open("trace")
        started = self._tracer is None
        if started:
            self._tracer = Tracer(self._rank)
        tracer = self._tracer
        assert tracer is not None
        try:
            yield
        except BaseException:
            _trace.write(rank_path(path, self._rank), self._tracer_events())
            raise
        finally:
            if started:
                self._tracer = None
        events = self.all_gather_object(tracer.snapshot(), allowed=[]).wait()
        if self._rank == 0:
            _trace.write(path, events)

    def span(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Mark a block of compute (forward, backward...) in the trace, if tracing."""
        tracer = self._tracer
        return contextlib.nullcontext() if tracer is None else tracer.span(name)

    # -- debug mode ----------------------------------------------------------------

    def _side_group(self, kind: str) -> Any:
        """A gloo group over this session's ranks for side traffic (formed when
        the session opens, see :meth:`_form_side_groups`)."""
        group = self._aux.get(kind)
        if group is None:
            ranks = [dist.get_global_rank(self._group, r) for r in range(self._world_size)]
            with gloo_on_loopback(self._loopback):
                group = dist.new_group(
                    ranks,
                    timeout=datetime.timedelta(seconds=self._timeout),
                    backend="gloo",
                    use_local_synchronization=True,
                )
            self._aux[kind] = group
        return group

    def _verify(
        self,
        op: str,
        tensors: Iterable[torch.Tensor] = (),
        *,
        reduce: str = "",
        root: int | None = None,
        pairwise: bool = False,
    ) -> None:
        """In debug mode, compare this call with every other rank's before launch.

        ``pairwise``: ``tensors[j]`` is what this rank exchanges with rank
        ``j``; it must match rank ``j``'s ``tensors[rank]``, not this list.

        Raises:
            CollectiveMismatch: on every rank, if any rank issues something else.
        """
        if not self._debug:
            return
        issuer = _wakeup.current_issuer()
        conflict = ""
        switched = self._last_issuer and issuer != self._last_issuer
        if switched and any(not handle.done() for handle in self._outstanding):
            conflict = f"{self._last_issuer} and {issuer}"
        self._last_issuer = issuer
        self._seq += 1
        mine = Fingerprint(
            self._seq,
            op,
            tuple(describe(t) for t in tensors),
            reduce,
            root,
            conflict,
            {"pairwise": True} if pairwise else {},
        )
        raw = torch.frombuffer(bytearray(mine.encode()), dtype=torch.uint8)
        everyone = torch.empty(self._world_size * raw.numel(), dtype=torch.uint8)
        try:
            dist.all_gather_single(everyone, raw, group=self._side_group("debug"))
        except RuntimeError as exc:
            error = translate(exc, op=op, rank=self._rank, timeout=self._timeout)
            self._health.break_(error)
            self._health.saw(error)  # raised to the caller right here
            raise error from exc
        size = raw.numel()
        prints = [
            Fingerprint.decode(_tensor_bytes(everyone[r * size : (r + 1) * size]))
            for r in range(self._world_size)
        ]
        problem = mismatch(prints)
        if problem is not None:
            raise CollectiveMismatch(f"{op} on rank {self._rank}: {problem}")

    # -- collectives -----------------------------------------------------------------

    def allreduce(
        self, tensor: torch.Tensor, op: _ops.ReduceOpLike = "sum"
    ) -> Handle[torch.Tensor]:
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
        self._verify(name, (tensor,), reduce=reduction.name)
        return self._allreduce(name, tensor, reduction, lambda: tensor)

    def _allreduce(
        self, name: str, tensor: torch.Tensor, reduction: _ops.Reduction, done: Callable[[], T]
    ) -> Handle[T]:
        group, world = self._group, self._world_size
        options = dist.AllreduceOptions()
        options.reduceOp = reduction.wire_op
        options.asyncOp = True
        # complex travels as pairs of reals (only sum/mean reach here for complex)
        wire = torch.view_as_real(tensor) if tensor.is_complex() else tensor

        def finish() -> T:
            if reduction.divide:
                tensor.div_(world)
            return done()

        # The ProcessGroup method directly: torch's dist.all_reduce wrapper
        # re-does the checks made above and costs ~10 µs a call.
        nbytes = tensor.numel() * tensor.element_size()
        return self._launch(name, lambda: group.allreduce([wire], options), finish, nbytes=nbytes)

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
        self._verify(name, (tensor,), root=src)
        group = self._group
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        options.asyncOp = True
        nbytes = tensor.numel() * tensor.element_size()
        return self._launch(
            name, lambda: group.broadcast([tensor], options), lambda: tensor, nbytes=nbytes
        )

    def all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        """Gather ``tensor`` from every rank.

        Returns:
            A handle whose result is a list with one tensor per rank (element
            ``j`` came from rank ``j``); they are views of one buffer.

        Raises:
            TypeError, ValueError: bad tensor (it must have the same shape and
                dtype on every rank).
        """
        name = "all_gather"
        self._check_open(name)
        self._tensor(tensor, name)
        self._verify(name, (tensor,))
        group = self._group
        world, shape = self._world_size, tensor.shape
        # gloo takes the concatenated (flat) form only
        out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        flat = tensor.reshape(-1)
        return self._launch(
            name,
            lambda: dist.all_gather_single(out, flat, group=group, async_op=True),
            lambda: list(out.view(world, *shape).unbind(0)),
        )

    def reduce_scatter(
        self, tensor: torch.Tensor, op: _ops.ReduceOpLike = "sum"
    ) -> Handle[torch.Tensor]:
        """Reduce ``tensor`` across ranks and give each rank its block of the result.

        ``tensor.numel()`` must be divisible by the world size. Rank ``r`` gets
        block ``r``: rows ``r*n/W .. (r+1)*n/W`` when the first dimension ``n``
        divides, else the same slice of the flattened tensor.

        Returns:
            A handle whose result is this rank's block (a new tensor).

        Raises:
            TypeError, ValueError: bad tensor or op, or a size that does not divide.
        """
        name = "reduce_scatter"
        self._check_open(name)
        self._tensor(tensor, name)
        world = self._world_size
        if tensor.numel() % world:
            raise ValueError(
                f"{name}: tensor of {tensor.numel()} elements does not split into "
                f"{world} equal blocks"
            )
        reduction = _ops.reduction(op, tensor.dtype, backend=self._backend, collective=name)
        self._verify(name, (tensor,), reduce=reduction.name)
        if tensor.dim() > 0 and tensor.shape[0] % world == 0:
            shape = (tensor.shape[0] // world, *tensor.shape[1:])
        else:
            shape = (tensor.numel() // world,)
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        wire_in = (torch.view_as_real(tensor) if tensor.is_complex() else tensor).reshape(-1)
        wire_out = (torch.view_as_real(out) if out.is_complex() else out).reshape(-1)
        group = self._group

        def finish() -> torch.Tensor:
            if reduction.divide:
                out.div_(world)
            return out

        return self._launch(
            name,
            lambda: dist.reduce_scatter_single(
                wire_out, wire_in, op=reduction.wire_op, group=group, async_op=True
            ),
            finish,
            futureless="collectives",
        )

    def all_to_all(self, inputs: Sequence[torch.Tensor]) -> Handle[list[torch.Tensor]]:
        """Send ``inputs[j]`` to rank ``j``; receive one tensor from every rank.

        Element ``j`` of the result came from rank ``j`` and has the shape and
        dtype of ``inputs[j]`` (every rank sends rank ``j`` a tensor shaped like
        the one it receives from it). NCCL allows the shapes to differ pair by
        pair; gloo needs one shape and dtype for every tensor.

        Raises:
            TypeError, ValueError: not a list of one tensor per rank, or (gloo)
                tensors of different shapes or dtypes.
        """
        name = "all_to_all"
        self._check_open(name)
        chunks = self._tensor_list(inputs, name, "inputs", self._world_size)
        if self._backend == "gloo":
            kinds = {describe(t) for t in chunks}
            if len(kinds) > 1:
                raise ValueError(
                    f"{name} on rank {self._rank}: gloo needs every tensor in inputs to "
                    f"have one shape and dtype, got {', '.join(sorted(kinds))}"
                )
        self._verify(name, chunks, pairwise=True)
        outputs = [torch.empty_like(t) for t in chunks]
        group = self._group
        return self._launch(
            name,
            lambda: dist.all_to_all(outputs, chunks, group=group, async_op=True),
            lambda: outputs,
        )

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: _ops.ReduceOpLike = "sum"
    ) -> Handle[torch.Tensor]:
        """Reduce ``tensor`` across ranks into ``tensor`` on rank ``dst``.

        Returns:
            A handle whose result is ``tensor`` (meaningful on ``dst`` only;
            other ranks' tensors may have been used as scratch).
        """
        name = "reduce"
        self._check_open(name)
        self._tensor(tensor, name)
        self._root(dst, name, "dst")
        reduction = _ops.reduction(op, tensor.dtype, backend=self._backend, collective=name)
        self._verify(name, (tensor,), reduce=reduction.name, root=dst)
        group, world, mine = self._group, self._world_size, self._rank == dst
        wire = torch.view_as_real(tensor) if tensor.is_complex() else tensor

        def finish() -> torch.Tensor:
            if reduction.divide and mine:
                tensor.div_(world)
            return tensor

        return self._launch(
            name,
            lambda: dist.reduce(
                wire, op=reduction.wire_op, group=group, group_dst=dst, async_op=True
            ),
            finish,
        )

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> Handle[list[torch.Tensor] | None]:
        """Collect every rank's ``tensor`` on rank ``dst``.

        Returns:
            A handle whose result is the list of tensors by rank on ``dst``,
            ``None`` on every other rank.
        """
        name = "gather"
        self._check_open(name)
        self._tensor(tensor, name)
        self._root(dst, name, "dst")
        self._verify(name, (tensor,), root=dst)
        group = self._group
        gathered = (
            [torch.empty_like(tensor) for _ in range(self._world_size)]
            if self._rank == dst
            else None
        )
        return self._launch(
            name,
            lambda: dist.gather(tensor, gathered, group=group, group_dst=dst, async_op=True),
            lambda: gathered,
        )

    def scatter(
        self,
        out: torch.Tensor,
        chunks: Sequence[torch.Tensor] | None = None,
        src: int = 0,
    ) -> Handle[torch.Tensor]:
        """Fill ``out`` on every rank with its chunk of ``chunks`` from rank ``src``.

        Args:
            out: receives this rank's chunk.
            chunks: on ``src``, one tensor per rank, each shaped like ``out``;
                ignored elsewhere.

        Returns:
            A handle whose result is ``out``.
        """
        name = "scatter"
        self._check_open(name)
        self._tensor(out, name, "out")
        self._root(src, name, "src")
        pieces: list[torch.Tensor] | None = None
        if self._rank == src:
            if chunks is None:
                raise ValueError(f"{name}: rank {src} is the source and must pass chunks")
            pieces = self._tensor_list(chunks, name, "chunks", self._world_size)
            for piece in pieces:
                if piece.shape != out.shape or piece.dtype != out.dtype:
                    raise ValueError(
                        f"{name}: every chunk must be shaped like out ({describe(out)}), "
                        f"got {describe(piece)}"
                    )
        self._verify(name, (out,), root=src)
        group = self._group
        return self._launch(
            name,
            lambda: dist.scatter(out, pieces, group=group, group_src=src, async_op=True),
            lambda: out,
        )

    def send(self, tensor: torch.Tensor, dst: int) -> Handle[None]:
        """Send ``tensor`` to rank ``dst`` (which must ``recv`` it).

        Point-to-point ops involve two ranks only, so debug mode does not
        fingerprint them.

        Returns:
            A handle whose result is ``None`` once the tensor was sent.
        """
        name = "send"
        self._check_open(name)
        self._tensor(tensor, name)
        self._peer(dst, name, "dst")
        group = self._group
        return self._launch(
            name,
            lambda: dist.isend(tensor, group=group, group_dst=dst),
            lambda: None,
            futureless=f"send->{dst}",
        )

    def recv(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        """Receive into ``tensor`` what rank ``src`` sends.

        Returns:
            A handle whose result is ``tensor``, filled.
        """
        name = "recv"
        self._check_open(name)
        self._tensor(tensor, name)
        self._peer(src, name, "src")
        group = self._group
        return self._launch(
            name,
            lambda: dist.irecv(tensor, group=group, group_src=src),
            lambda: tensor,
            futureless=f"recv<-{src}",
        )

    def barrier(self) -> Handle[None]:
        """Complete once every rank has reached this barrier.

        Returns:
            A handle whose result is ``None``.
        """
        name = "barrier"
        self._check_open(name)
        self._verify(name)
        group = self._group
        return self._launch(name, lambda: dist.barrier(group=group, async_op=True), lambda: None)

    def allreduce_coalesced(
        self, tensors: Sequence[torch.Tensor], op: _ops.ReduceOpLike = "sum"
    ) -> Handle[list[torch.Tensor]]:
        """Reduce many tensors in place with one collective per dtype.

        The tensors of each dtype are packed into one flat buffer, reduced
        together, and copied back: for many small tensors this costs a
        fraction of one allreduce each.

        Returns:
            A handle whose result is ``tensors`` (the same list), reduced.
        """
        name = "allreduce_coalesced"
        self._check_open(name)
        items = self._tensor_list(tensors, name, "tensors")
        op_name = _ops.reduction_name(op, collective=name)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in items:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        reductions = {
            dtype: _ops.reduction(op, dtype, backend=self._backend, collective=name)
            for dtype in by_dtype
        }
        self._verify(name, items, reduce=op_name)
        parts = []
        for dtype, bucket in by_dtype.items():
            flat = torch.cat([t.reshape(-1) for t in bucket])

            def unpack(flat: torch.Tensor = flat, bucket: list[torch.Tensor] = bucket) -> None:
                offset = 0
                for tensor in bucket:
                    count = tensor.numel()
                    tensor.copy_(flat[offset : offset + count].view_as(tensor))
                    offset += count

            parts.append(self._allreduce(name, flat, reductions[dtype], unpack))
        result = tensors if isinstance(tensors, list) else items
        return combined(name, parts, lambda _: result)

    # -- object collectives ------------------------------------------------------------

    def broadcast_object(
        self, obj: Any, src: int = 0, *, allowed: Iterable[Any] | None = None
    ) -> Handle[Any]:
        """Send a picklable object from rank ``src`` to every rank.

        Object traffic runs on a side group, in program order, on one thread
        per session; the call itself only pickles (on ``src``) and queues.

        Args:
            allowed: restrict what receivers may unpickle to plain data plus
                these classes/functions (or ``"module.Name"`` strings); ``None``
                trusts every peer. See the security page.

        Returns:
            A handle whose result is the object (unpickled on every rank but ``src``).

        Raises:
            TypeError: ``obj`` cannot be pickled (on ``src``).
            pickle.UnpicklingError: (from the handle) a refused global.
        """
        name = "broadcast_object"
        self._check_open(name)
        self._root(src, name, "src")
        allow = _pickle.allow_list(allowed)
        mine = self._rank == src
        payload = _pickle.dumps(obj, op=name) if mine else b""
        self._verify(name, root=src)
        group = self._side_group("objects")
        received: list[bytes] = []

        def exchange() -> None:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            dist.broadcast(size, group=group, group_src=src)
            if mine:
                buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            else:
                buffer = torch.empty(int(size.item()), dtype=torch.uint8)
            if buffer.numel():
                dist.broadcast(buffer, group=group, group_src=src)
            received.append(_tensor_bytes(buffer))

        def finish() -> Any:
            return obj if mine else _pickle.loads(received[0], allow)

        return self._launch_steps(name, exchange, finish)

    def all_gather_object(
        self, obj: Any, *, allowed: Iterable[Any] | None = None
    ) -> Handle[list[Any]]:
        """Gather a picklable object from every rank.

        Returns:
            A handle whose result is the list of every rank's object, by rank
            (this rank's own entry is ``obj`` itself).

        Raises:
            TypeError: ``obj`` cannot be pickled.
            pickle.UnpicklingError: (from the handle) a refused global.
        """
        name = "all_gather_object"
        self._check_open(name)
        allow = _pickle.allow_list(allowed)
        payload = _pickle.dumps(obj, op=name)
        self._verify(name)
        group, world, me = self._side_group("objects"), self._world_size, self._rank
        received: list[bytes] = []

        def exchange() -> None:
            sizes = torch.empty(world, dtype=torch.int64)
            dist.all_gather_single(
                sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group
            )
            longest = int(sizes.max().item())
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            everyone = torch.empty(world * longest, dtype=torch.uint8)
            dist.all_gather_single(everyone, mine, group=group)
            for rank in range(world):
                start = rank * longest
                received.append(_tensor_bytes(everyone[start : start + int(sizes[rank])]))

        def finish() -> list[Any]:
            return [
                obj if rank == me else _pickle.loads(data, allow)
                for rank, data in enumerate(received)
            ]

        return self._launch_steps(name, exchange, finish)

    def _launch_steps(
        self, name: str, exchange: Callable[[], None], finish: Callable[[], T]
    ) -> Handle[T]:
        """Queue a multi-step exchange on the session's object thread."""
        assert self._completer is not None
        handle: Handle[T] = Handle._create(name, self._health, finish)
        self._completer.submit("objects", lambda: handle._settle(exchange))
        self._outstanding.append(handle)
        if self._tracer is not None:
            self._tracer.record(handle, 0)
        return handle

    # -- argument checks ----------------------------------------------------------------

    def _tensor_list(
        self, tensors: Any, op: str, what: str, length: int | None = None
    ) -> list[torch.Tensor]:
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(f"{op}: {what} must be a list of tensors, not {type(tensors).__name__}")
        if length is not None and len(tensors) != length:
            raise ValueError(
                f"{op}: {what} must hold {length} tensors (one per rank), not {len(tensors)}"
            )
        return [self._tensor(t, op, f"{what}[{i}]") for i, t in enumerate(tensors)]

    def _peer(self, value: Any, op: str, what: str) -> int:
        peer = self._root(value, op, what)
        if peer == self._rank:
            raise ValueError(f"{op}: {what}={peer} is this rank; a rank cannot {op} to itself")
        return peer


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU uint8 tensor (no numpy needed)."""
    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel()) if tensor.numel() else b""
