"""DistSession: the process group's lifecycle.

A session forms (or adopts) the default group on entry, hands its
collectives to its root ``Lane``, and on exit drains,
reports and tears down, however the block ends. The collective surface comes
from ``Collectives``; sub-sessions from
[DistSession.split][asyncdist.DistSession.split] are sessions over a sub-lane.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import functools
import logging
import os
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Literal

import anyio
import torch
import torch.distributed as dist

from . import _groups, _ops
from ._channel import Channel, Channels, check_channel_name
from ._collectives import Collectives
from ._debug import debug_from_env
from ._elastic import ElasticState, World, Worlds, guard, unguard
from ._env import (
    timeout_seconds,
)
from ._grad import GradientSync, Options, detach, module_of, optimizer_of, regenerate
from ._lane import Lane
from ._membership import Decision, check_world_sizes
from ._membership import Membership as _Membership
from ._op import Op
from ._progress import leaving_how, quiet_interrupt
from ._trace import TraceBlock, Tracer, rank_events, rank_path, write
from .errors import (
    AsyncDistError,
    CollectiveTimeout,
    InitError,
    Leaving,
    MembershipChanged,
    MembershipLost,
    PeerFailure,
    SessionBroken,
    SessionClosed,
)

logger = logging.getLogger("asyncdist")


class State(enum.Enum):
    """Where a session is in its life."""

    UNOPENED = "unopened"
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


GRADIENTS = "gradients"  # the channel gradient_sync uses by default
# what an elastic session allows before its loop over worlds: setting up
_BEFORE_THE_LOOP = frozenset({"channel", "gradient_sync", "elastic", "elastic_state", "trace"})


class DistSession(Collectives):
    """A process group's whole life, and the collectives on it.

    Entering (``with`` or ``async with``) forms the group from the launch
    environment, or adopts a default group that is already initialised (and
    then leaves it initialised). Leaving, however it happens, waits for
    outstanding collectives (bounded by ``timeout``) and destroys the group it
    created, without any barrier a dead peer could hang.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` for every tensor; by default a CUDA
            session serves CUDA tensors on NCCL and CPU tensors on gloo (as
            torch's default group does, per call by the tensor's device), and
            a CPU session is gloo.
        init_method: a torch init URL (``"tcp://host:port"``, ``"file://..."``);
            default: asyncdist's own rendezvous from the environment.
        rank: this process's rank; overrides the launch environment
            (torchrun, then SLURM, then a 1-process world).
        world_size: the number of processes; overrides the environment.
        master_addr: the rendezvous host; overrides ``MASTER_ADDR``.
        master_port: the rendezvous port; overrides ``MASTER_PORT``.
        timeout: seconds (or a ``timedelta``) that bound forming the group and
            every collective; default 1800, as in torch. Entering waits up to
            it at each step (reaching the master, forming the group). A
            rendezvous store that stops answering is given up on 5 s after
            those steps' timeouts.
        device: the device collectives run on; default CUDA ``LOCAL_RANK`` when
            CUDA is available, else CPU.
        debug: check before each collective that all ranks issue the same op
            (also ``ASYNCDIST_DEBUG=1``).
        trace: record every collective's launch and completion and write a
            Chrome trace per rank when the session ends (``True``:
            ``asyncdist-trace.rank<r>.json``; a path ``p``: ``p`` with
            ``.rank<r>`` before its suffix). See also [trace][asyncdist.DistSession.trace].
        channels: names of [channels][asyncdist.DistSession.channel] to form on
            entry (off the event loop with ``async with``), so that
            ``s.channel(name)`` never waits later.
        elastic: keep training when a rank dies: the survivors form a new
            world and go on from the last committed state (see
            [elastic][asyncdist.DistSession.elastic] and the "Elastic
            sessions" guide). Needs a coordinator that outlives the ranks
            (``spawn(..., elastic=True)``); gloo on CPU.
        min_world_size: (elastic) the fewest ranks a world may have; below it
            the session ends with ``MembershipLost``. A launch of fewer
            ranks raises ``ValueError`` at entry.
        max_world_size: (elastic) the most ranks a world may have (``None``:
            no cap). Joiners beyond it wait as spares, and are taken in when
            a member dies; a launch of more ranks raises ``ValueError`` at
            entry.
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
        channels: Iterable[str] = (),
        elastic: bool = False,
        min_world_size: int = 1,
        max_world_size: int | None = None,
    ) -> None:
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be True or False, not {elastic!r}")
        check_world_sizes(elastic, min_world_size, max_world_size)
        on_cpu = device is None or (
            not isinstance(device, int) and torch.device(device).type == "cpu"
        )
        if elastic and (init_method is not None or not on_cpu):
            raise ValueError(
                "an elastic session forms its groups on its coordinator, on CPU with gloo: "
                "init_method= and a device other than the CPU are not supported with elastic=True"
            )
        if elastic and backend not in (None, "gloo"):
            raise ValueError(f"an elastic session runs on gloo, not {backend!r}")
        self._membership: _Membership | None = (
            _Membership(min_world_size, max_world_size) if elastic else None
        )
        self._looping = False  # elastic: the loop over worlds has begun
        # elastic: the current world's members and the commits it started
        # from, and how many re-forms in a row changed neither (see _stalls)
        self._began: tuple[frozenset[str], int] | None = None
        self._fruitless = 0
        self._requested_channels = tuple(channels)
        for name in self._requested_channels:
            check_channel_name(name)
        self._timeout = timeout_seconds(timeout)
        self._wanted = _groups.Wanted(
            self._timeout, backend, init_method, rank, world_size, master_addr, master_port, device
        )
        self._debug = debug or debug_from_env()
        self._trace_path: str | os.PathLike[str] | None = (
            None if trace is False else "asyncdist-trace.json" if trace is True else trace
        )
        self._state = State.UNOPENED
        self._lane: Lane | None = None  # kept after closing: rank etc. stay readable
        self._local_rank = 0
        self._owned_store: dist.Store | None = None
        self._parent: DistSession | None = None
        self._children: list[DistSession] = []
        self._channels = Channels()
        # the GradientSyncs made here: their hooks come off when the session ends
        self._syncs: weakref.WeakSet[GradientSync] = weakref.WeakSet()
        self._states: weakref.WeakSet[ElasticState] = weakref.WeakSet()

    @classmethod
    def _sub_session(cls, parent: DistSession, lane: Lane) -> DistSession:
        """A sub-session over ``lane`` (a sub-lane of ``parent``'s), open from birth."""
        sub = cls(lane.backend, timeout=lane.timeout, device=lane.device, debug=lane.debug)
        sub._lane, sub._parent, sub._state = lane, parent, State.OPEN
        sub._local_rank = parent._local_rank
        parent._children.append(sub)
        return sub

    # -- properties ------------------------------------------------------------

    @property
    def local_rank(self) -> int:
        """This process's index on its machine (``LOCAL_RANK``)."""
        return self._local_rank

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    @property
    def timeout(self) -> float:
        """Seconds that bound each collective."""
        return self._timeout

    @property
    def debug(self) -> bool:
        """Whether collectives are verified across ranks before launch."""
        return self._debug

    @property
    def state(self) -> State:
        """The session's [State][asyncdist.State]: ``UNOPENED``, ``OPEN``,
        ``BROKEN`` (after a fault) or ``CLOSED``."""
        comm = self._lane
        if self._state is State.OPEN and comm is not None and comm.health.fault is not None:
            return State.BROKEN
        return self._state

    @property
    def closed(self) -> bool:
        """True once the session has been left (or was never entered)."""
        return self._state is not State.OPEN

    def __repr__(self) -> str:
        where = f"rank={self.rank}/{self.world_size} {self.backend or '?'} {self.device}"
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
        quiet_interrupt(exc)
        self._close(leaving_how(exc))

    async def __aenter__(self) -> DistSession:
        # Forming the group waits for peers: keep that off the event loop.
        try:
            await anyio.to_thread.run_sync(self._open)
        except BaseException:
            # Cancelled once the group had formed: there is no __aexit__ to release it.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._teardown)
            raise
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        quiet_interrupt(exc)
        how = leaving_how(exc, anyio.get_cancelled_exc_class())
        # Shielded: a cancellation must not leave the group half torn down.
        with anyio.CancelScope(shield=True):
            unseen = [await op.join_async() for op in self._drain()]
            # joining worker threads and destroying the group can block: not on the loop
            await anyio.to_thread.run_sync(functools.partial(self._teardown, left=how))
        self._report(unseen, raise_errors=exc is None)

    def _open(self) -> None:
        if self._parent is not None and self._state is State.OPEN:
            return  # a sub-session is open from birth; `with` just scopes it
        if self._state is State.OPEN:
            raise AsyncDistError(
                f"the DistSession of rank {self.rank} is already open; enter it only once"
            )
        if self._state is State.CLOSED:
            raise SessionClosed(
                f"the DistSession of rank {self.rank} was closed; create a new DistSession "
                "to start again"
            )
        if self._membership is not None:
            world = self._membership.enter(self._wanted, self._on_world_end)
        else:
            world = _groups.enter_world(self._wanted)
        self._local_rank, self._owned_store = world.local_rank, world.store
        comm = self._lane = Lane.root(world, timeout=self._timeout, debug=self._debug)
        if self._trace_path is not None:
            comm.tracer = Tracer(comm.rank)
        self._state = State.OPEN
        joined = None if self._membership is None else self._membership.joined
        try:
            comm.form_side_groups()
            if joined is not None:  # a joiner: the channels its world has, in its order
                self._channels.reform(joined.channels, comm.channel)
            for name in self._requested_channels:
                self.channel(name)
        except (RuntimeError, OSError) as exc:
            self._teardown()
            raise InitError(
                f"rank {comm.rank} of {comm.world_size}: the group formed, but its side "
                f"groups or channels did not within {self._timeout:g} s ({exc}). Check that "
                "every rank is still running and declares the same channels."
            ) from exc

    def _drain(self) -> list[Op]:
        """The collectives still outstanding, in issue order (none if not open)."""
        if self._state is not State.OPEN or self._lane is None:
            return []
        return self._lane.drain()

    def _close(self, how: Leaving) -> None:
        unseen = [op.join() for op in self._drain()]
        self._teardown(left=how)
        self._report(unseen, raise_errors=how == "finished")

    def _report(self, unseen: Iterable[BaseException | None], *, raise_errors: bool) -> None:
        """Surface failures of outstanding handles nobody waited on: nothing is lost.

        A fault is raised when the block exited normally; otherwise (or for
        local errors, like a refused unpickle or a FinishError) it is logged. So is the fault
        that broke the session, if no error of it ever reached the user (the
        watchdog found it on a handle nobody waited on).
        """
        if self._lane is not None:
            self._lane.health.report(unseen, raise_errors=raise_errors)

    def _teardown(self, *, left: Leaving | None = None) -> None:
        """Release everything. ``left``: how the block ended (normally, by an
        exception, an interrupt, a cancellation), so first tell the peers this
        rank left on purpose, once for the lanes inside this one too."""
        if self._state is not State.OPEN:
            return
        detach(self._syncs, rank=self.rank, warn=left == "finished")
        unguard(self._states)
        if left is not None and self._lane is not None:
            self._lane.leave(left)
        if self._membership is not None:
            self._membership.leave(left or "raised")
        for child in list(self._children):
            child._teardown()
        self._state = State.CLOSED
        self._channels.clear()
        comm = self._lane
        if comm is None:
            return
        tracer = comm.tracer if self._parent is None else None
        comm.close()
        self._owned_store = None
        if self._parent is not None and self in self._parent._children:
            self._parent._children.remove(self)
        if tracer is not None and self._trace_path is not None:
            events = rank_events(comm.rank, comm.world_size, tracer.snapshot())
            write(rank_path(self._trace_path, comm.rank), events)

    def close(self) -> None:
        """Leave the session now (as ``with`` does on exit). Closing twice is fine."""
        if self._state is State.OPEN:
            self._close("finished")
        else:
            self._state = State.CLOSED

    async def aclose(self) -> None:
        """[close][asyncdist.DistSession.close] for async code (as ``async with``
        does on exit): outstanding handles are awaited on the loop, the group is
        torn down on a worker thread."""
        if self._state is State.OPEN:
            await self.__aexit__(None, None, None)
        else:
            self._state = State.CLOSED

    def _usable(self, op: str) -> Lane:
        if self._membership is not None and not self._looping and op not in _BEFORE_THE_LOOP:
            raise AsyncDistError(
                f"{op}: in an elastic session, collectives run inside the elastic loop "
                "(`async for world in s.elastic(state): async with world: ...`), where every "
                "rank of the world, a joiner too, issues them alike; the loop itself gives "
                "every rank rank 0's state first"
            )
        if self._state is not State.OPEN or self._lane is None:
            where = f" on rank {self.rank}" if self._state is State.CLOSED else ""
            raise SessionClosed(
                f"{op}{where}: the session is {self._state.value}; issue collectives inside "
                "`with DistSession() as s:` (or `async with`)"
            )
        return self._lane.check(op)

    # -- groups -----------------------------------------------------------------

    def _split_lane(self, group_size: int) -> Lane:
        name = "split"
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"{name}: group_size must be an int, not {type(group_size).__name__}")
        if group_size < 1 or self.world_size % group_size:
            raise ValueError(
                f"{name}: group_size={group_size} does not divide the world size "
                f"{self.world_size} into whole groups"
            )
        return self._usable(name)

    def split(self, group_size: int) -> DistSession:
        """A sub-session over this rank's block of ``group_size`` consecutive ranks.

        Every rank must call ``split`` with the same size, in the same order
        relative to other collectives (torch requires every rank to create
        every group). The sub-session has its own ``rank``/``world_size`` and
        the whole collective surface; it is released with this session (or
        earlier, by leaving ``with sub:``). Forming the groups waits for every
        rank: in async code use [split_async][asyncdist.DistSession.split_async].

        Raises:
            TypeError: ``group_size`` is not an int.
            ValueError: ``group_size`` does not divide the world size.
            CollectiveError: a peer did not join in time.
        """
        comm = self._split_lane(group_size)
        return DistSession._sub_session(self, comm.split(group_size))

    async def split_async(self, group_size: int) -> DistSession:
        """[split][asyncdist.DistSession.split] for async code: the groups form
        on a worker thread while the event loop goes on.

        Arguments are checked before anything waits. Cancelling the awaiting
        task lets the forming finish (every rank takes part in it); the
        sub-session is then released with this session.
        """
        self._split_lane(group_size)
        return await anyio.to_thread.run_sync(self.split, group_size)

    def channel(self, name: str) -> Channel:
        """The channel ``name``: an independent, ordered lane over this
        session's ranks, with the whole collective surface.

        Collectives on different lanes (the session itself, each channel)
        never pair with each other, so tasks that issue concurrently each
        take their own. The first call with a name forms the channel's
        groups: every rank of the session must make it, in the same program
        order (it waits for them; in async code use
        [channel_async][asyncdist.DistSession.channel_async], or declare it with
        ``DistSession(channels=[...])``). Later calls return the same channel
        at once. The channel shares the session's health and closes with it.

        Raises:
            TypeError, ValueError: ``name`` is not a non-empty string.
            SessionClosed, SessionBroken: the session is not usable.
            CollectiveError: a peer did not join in time.
        """
        check_channel_name(name)
        self._usable("channel")
        return self._channels.form(name, lambda: self._usable("channel"))

    async def channel_async(self, name: str) -> Channel:
        """[channel][asyncdist.DistSession.channel] for async code: a new
        channel's groups form on a worker thread while the loop goes on.

        Tasks that ask for the same new name at once get the one channel:
        the first forms it, the others await that forming.
        """
        check_channel_name(name)
        return await self._channels.form_async(name, lambda: self._usable("channel"), self.channel)

    # -- training ---------------------------------------------------------------------

    def gradient_sync(
        self,
        module: torch.nn.Module,
        bucket_mb: float = 25.0,
        op: _ops.ReduceOpLike = "mean",
        *,
        first_bucket_mb: float = 1.0,
        channel: Channel | DistSession | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        compression: Literal["bf16", "fp16"] | None = None,
        clip_grad_norm: float | None = None,
        broadcast_buffers: bool = True,
    ) -> GradientSync:
        """Average ``module``'s gradients across ranks, overlapped with backward.

        Returns a [GradientSync][asyncdist.GradientSync]; ``await`` it (or
        ``.wait()``) after ``loss.backward()``. See the "Overlap in training
        loops" guide. ``op``: ``"mean"`` (average) or ``"sum"``, or
        ``ReduceOp.AVG``/``SUM``.

        The buckets travel on ``channel``, by default the session's channel
        named ``"gradients"``, so collectives other tasks issue on the session
        (metrics, say) neither pair with a bucket nor queue behind one. Its
        first use forms it (every rank, same order): in async code declare it
        at entry with ``DistSession(channels=["gradients"])`` so nothing waits
        on the loop. The syncs one task (or thread) makes share the channel,
        as two DDP modules share a process group: a generator and its
        discriminator may launch in one backward, and any task may finish a
        step. Refused on the issuing rank, while another's collectives on
        the channel are outstanding: two tasks finishing such syncs at once
        (``asyncio.gather(sync_g, sync_d)``), syncs that two tasks made, and
        a sync with step overlap (``optimizer=``) beside another, since its
        buckets launch as the one before lands, at times that differ between
        ranks. Give those a channel each.

        ``optimizer``: step overlap. Awaiting the sync also runs this
        optimizer's update, one bucket's parameters at a time as each bucket
        lands, while later buckets are still on the wire; the result is
        bitwise the same as ``await sync; optimizer.step()``. The optimizer's
        update must be per parameter (SGD, Adam, AdamW, RMSprop, ...); it must
        own every parameter of ``module`` that requires grad. Do not call
        ``optimizer.step()`` yourself (a second call in the same step raises).
        ``clip_grad_norm``: clip by the global norm (as
        ``torch.nn.utils.clip_grad_norm_(module.parameters(), clip_grad_norm)``)
        before the update; the update then waits for the last bucket.

        Buckets: each closes once it holds ``bucket_mb``; the first and the
        last are small (``first_bucket_mb``, or a quarter of the model's
        gradients if that is smaller, never under 64 KiB), so communication
        starts early in backward and little is left once backward ends. For
        ``"mean"``, each gradient is multiplied by ``1 / world_size`` as it is
        copied into its bucket and the bucket is summed, as DDP does.

        ``broadcast_buffers``: as DDP's (and on by default): the module's
        buffers (BatchNorm running statistics, any ``register_buffer``) are
        rank 0's on every rank once each synced step is finished, so every
        forward sees the same buffers on every rank. The broadcast is launched
        with the step's first bucket and waited for with it.

        The sync is safe as DDP: the next backward before the step finished
        raises, as does a manual ``optimizer.step()`` with ``optimizer=``; a
        second live sync over the same parameters or optimizer is refused; and
        when this session ends, the sync's hooks come off the module.

        ``compression``: ``"bf16"`` or ``"fp16"`` sends float32/float64
        buckets in that type, pre-divided by the world size, and copies the
        average back in full precision (the numerics of DDP's
        ``bf16_compress_hook``/``fp16_compress_hook``). Off by default.

        Raises:
            TypeError, ValueError: not a module, a parameter off the
                session's device, a sparse embedding (``sparse=True``: sparse
                gradients are not averaged), a bad bucket size, op,
                compression or clip, or an optimizer that is not a
                per-parameter ``torch.optim.Optimizer`` over the module's
                parameters. Raised before anything is launched.
            AsyncDistError: a live GradientSync already covers one of the
                module's parameters, or the optimizer.
        """
        self._usable("gradient_sync")
        options = Options.checked(
            module,
            device=self.device,
            bucket_mb=bucket_mb,
            first_bucket_mb=first_bucket_mb,
            op=op,
            optimizer=optimizer,
            compression=compression,
            clip_grad_norm=clip_grad_norm,
            broadcast_buffers=broadcast_buffers,
        )
        lane = self.channel(GRADIENTS) if channel is None else channel
        sync = GradientSync(lane, module, options)
        self._syncs.add(sync)
        return sync

    # -- elastic ------------------------------------------------------------------------

    def elastic_state(self, **items: object) -> ElasticState:
        """The training state an elastic session restores after a re-form.

        Each item is either an object with ``state_dict()`` and
        ``load_state_dict()`` (a module, an optimizer, a scheduler, a
        ``GradScaler``), restored in place, or a plain value (a number, a
        string, a list...), read and written as an attribute
        (``state.step += 1``). Call ``state.commit()`` between steps, every
        N steps: after a re-form every rank goes on from the latest commit
        any survivor holds. See [elastic][asyncdist.DistSession.elastic].

        The optimizer of the state's model belongs in it too, and so does
        its scheduler: while the session is open, a step of an optimizer
        that updates the state's parameters but is not in it raises (a
        scheduler left out is warned about on the ``asyncdist`` logger).

        Raises:
            AsyncDistError: the session is not elastic; (at its first
                ``step()``) an optimizer of the state's parameters that the
                state does not hold: after a re-form its state would differ
                between ranks, and a joiner's would start empty.
            TypeError: an item is neither, or is a class, or a value that
                holds tensors (``model.state_dict()``: pass ``model`` itself).
        """
        membership = self._elastic_membership("elastic_state")

        def ends_at(commits: int) -> str | None:
            if membership.at_commit(self.rank, commits):
                return "a rank joins"
            return None

        state = ElasticState(items, self._busy_sync, ends_at, lambda: self.rank)
        guard(state)  # an optimizer of its model left out of it is refused at its step
        self._states.add(state)
        return state

    def elastic(self, state: ElasticState) -> Worlds:
        """The worlds of an elastic session: ``async for world in
        s.elastic(state):`` (``for`` in sync code), the body inside ``async
        with world:`` (``with world:``).

        Each loop starts from ``state`` as it finds it: every rank commits
        it, and the first world that forms sends its rank 0's to every rank
        (launch rank 0's, or the survivor's that is rank 0 once it died).
        When a rank dies, goes silent past the timeout or
        leaves, the block ends with the failure, the survivors agree on a new
        world on the coordinator (a strict majority of the last world, at
        least ``min_world_size``), re-form the session's groups and channels
        in the same processes, restore the latest commit any of them holds
        (from the new rank 0, by broadcast: every rank's state is bitwise the
        same), and the loop yields the new world: the step in flight and any
        step after the commit are redone. Gradient syncs go on, rebuilt for
        the new world size. When the block ends normally the loop stops.

        Raises:
            AsyncDistError: the session is not elastic, the body did not
                run inside ``with world:``, or a gradient sync's module or
                optimizer (``optimizer=``) is not in ``state``.
            MembershipLost: (from the loop) no next world for this rank, or
                (``why="no_progress"``) the worlds keep failing at the same
                step with every rank present (a program error: see the guide).
        """
        membership = self._elastic_membership("elastic")
        if not isinstance(state, ElasticState):
            raise TypeError(
                f"elastic: state must come from s.elastic_state(...), not {type(state).__name__}"
            )
        return Worlds(
            functools.partial(self._first_world, membership, state),
            functools.partial(self._next_world, membership, state),
        )

    def _elastic_membership(self, op: str) -> _Membership:
        self._usable(op)
        if self._membership is None:
            raise AsyncDistError(
                f"{op}: this session is not elastic; use DistSession(elastic=True) (launched "
                "by spawn(..., elastic=True))"
            )
        return self._membership

    def _busy_sync(self, call: str) -> str | None:
        """A gradient sync of this session with a step in flight, by name:
        what an elastic state's ``call`` (a commit) must wait for.

        Raises:
            SessionClosed: the session is closed: a commit has no world left
                to end and no coordinator to ask.
        """
        if self._state is State.CLOSED:
            raise SessionClosed(
                f"{call} on rank {self.rank}: the session is closed; commit while it is open, "
                "inside the elastic loop"
            )
        return next((repr(sync) for sync in self._syncs if sync.pending), None)

    def _ends_world(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised in a world's block, is the end of that
        world (a peer failed, went silent, or the world was declared over),
        rather than the program's own error."""
        if isinstance(exc, MembershipLost):
            return False
        if isinstance(exc, (MembershipChanged, PeerFailure, CollectiveTimeout)):
            return True
        lane = self._lane
        return isinstance(exc, SessionBroken) and lane is not None and lane.health.fault is not None

    def _on_world_end(self, generation: int, reason: str) -> None:
        """The watcher heard that world ``generation`` is over: fail what is
        outstanding in it, so nobody waits on a group that lost a member."""
        membership, lane = self._membership, self._lane
        if membership is None or lane is None or membership.generation != generation:
            return
        lane.interrupt(self._world_over(generation, reason, lane.rank))

    @staticmethod
    def _world_over(generation: int, reason: str, rank: int) -> MembershipChanged:
        return MembershipChanged(
            f"world {generation} of the elastic session is over on rank {rank} ({reason}); "
            "inside `with world:` the elastic loop re-forms",
            op="elastic",
            rank=rank,
            generation=generation,
            reason=reason,
        )

    def _world(self, membership: _Membership, restored: int, reason: str) -> World:
        return World(
            self.rank,
            self.world_size,
            membership.generation,
            restored,
            reason,
            _ends=self._ends_world,
        )

    def _share_state(self, state: ElasticState) -> int:
        """Every rank takes rank 0's last commit; its count."""
        comm = self._usable("elastic")
        committed = state.committed() if comm.rank == 0 else None
        commits, snapshot = self.broadcast_object(committed, src=0).wait()
        if snapshot is not None:
            state.restore(commits, snapshot)
        return int(commits)

    def _check_state(self, state: ElasticState) -> None:
        """Refuse a gradient sync whose module, or whose optimizer (``optimizer=``),
        the state does not restore: parameters or optimizer state would differ
        between ranks after a re-form (a joiner's optimizer would start empty),
        silently."""
        for sync in self._syncs:
            if not state.holds(module_of(sync)):
                raise AsyncDistError(
                    f"{sync!r} averages a module the elastic state does not hold: after a "
                    "re-form its parameters would differ between ranks. Pass the model to "
                    "s.elastic_state(model=...)"
                )
            optimizer = optimizer_of(sync)
            if optimizer is not None and not state.holds_object(optimizer):
                raise AsyncDistError(
                    f"{sync!r} steps an optimizer (optimizer=) the elastic state does not "
                    "hold: after a re-form its state (Adam's moments, the step count) would "
                    "differ between ranks, and a joiner's would start empty. Pass it to "
                    "s.elastic_state(optimizer=...)"
                )

    def _first_world(self, membership: _Membership, state: ElasticState) -> World:
        # a joiner's first loop starts from the state of the world it joins
        joined = membership.joined if not self._looping else None
        self._looping = True
        self._check_state(state)
        if joined is None:
            # The state as this loop found it, taken on every member: whichever
            # rank is rank 0 of the first world that forms (rank 0 may die
            # before it shares) has one to share, so every rank goes on from
            # one state. A later loop starts from its own state too, never
            # from an older commit. The counts agree (every member commits
            # at the same steps), as a re-form's choice of rank 0 needs.
            state.take()
        self._began = (
            (frozenset(membership.members), state.commits)
            if joined is None
            else (frozenset(joined.members), joined.commits)
        )
        self._fruitless = 0
        try:
            restored = self._share_state(state)
        except AsyncDistError as exc:
            if not self._ends_world(exc):
                raise
            failed = self._world(membership, 0, "")
            failed.error = exc  # a member failed before the first step: re-form at once
            return self._next_world(membership, state, failed)
        reason = "" if joined is None else f"joined: {joined.reason}"
        return self._world(membership, restored, reason)

    def _next_world(self, membership: _Membership, state: ElasticState, ended: World) -> World:
        """Re-form after ``ended``'s block failed: agree, form, restore; again
        if a member fails while the new world forms (each round is bounded,
        and each leaves the one that failed out).

        Raises:
            MembershipLost: no next world for this rank (the session is
                broken with it).
            AsyncDistError: a gradient sync over a module the state lacks.
        """
        self._check_state(state)
        error: BaseException | None = ended.error
        while True:
            reason = (
                error.reason
                if isinstance(error, MembershipChanged)
                else f"{type(error).__name__} on rank {self.rank}: {error}"
            )
            decision, world = self._agree(membership, state, reason, error)
            lane = Lane.root(world, timeout=self._timeout, debug=self._debug)
            old, self._lane = self._lane, lane
            lane.tracer = None if old is None else old.tracer
            try:
                lane.form_side_groups()
                self._channels.reform(decision.channels, lane.channel)
                regenerate(self._syncs)
                restored = self._share_state(state)
            except (RuntimeError, TimeoutError) as exc:
                # a member failed while this world formed (a raw backend error
                # from forming its side groups, the coordinator silent there,
                # or a translated one): once more
                if isinstance(exc, AsyncDistError) and not self._ends_world(exc):
                    raise
                error = exc
                continue
            return self._world(membership, restored, decision.reason)

    def _agree(
        self,
        membership: _Membership,
        state: ElasticState,
        reason: str,
        error: BaseException | None,
    ) -> tuple[Decision, _groups.World]:
        """Leave the current world (which ``error`` ended) and agree on, and
        form, the next one's default group: its decision and the group.

        Raises:
            MembershipLost: no next world for this rank, or the worlds keep
                failing without progress (``_stalls``).
        """
        old = self._lane
        assert old is not None
        membership.end(reason)
        old.health.record_fault(self._world_over(membership.generation, reason, old.rank))
        for child in list(self._children):
            child._teardown()
        names = self._channels.names()
        # The old world's groups go now; their collectives may still run (gloo
        # has no abort: one queued behind a failed one ends at its own
        # timeout). This rank reports and the next world forms meanwhile, so
        # a late end here does not make this rank's report late; the works
        # are let go of before returning, before anything of the new world is
        # restored, since a collective that still completes (with a resumed
        # peer of a world of two) writes into the tensors it was given.
        release = old.close(defer=True)
        try:
            # refused before this rank is counted in the next world, which
            # its peers would then wait for until their timeout
            _groups.refuse_while_held()
            decision = membership.reform(reason, old.rank, state.commits, names)
            self._stalls(decision, error)
            rank = decision.members.index(membership.me)
            return decision, membership.form(decision.generation, rank, len(decision.members))
        except (MembershipLost, InitError) as exc:
            lost = (
                exc if isinstance(exc, MembershipLost) else MembershipLost(str(exc), why="timeout")
            )
            old.health.record_fault(lost)
            old.health.mark_seen(lost)
            raise lost from (exc.__cause__ if lost is exc else exc)
        finally:
            release()

    def _stalls(self, decision: Decision, error: BaseException | None) -> None:
        """Refuse a second re-form in a row into the same world at the same
        commit: every member was still there, nobody joined, and nobody
        committed since the world began, twice. No peer is lost then; the
        world keeps failing at the same step, which is the program's doing
        (ranks issuing different collectives, one rank waiting on something
        the others never send), and re-forming would redo it forever. One
        such re-form is allowed (a transient fault). Every member decides
        alike: it reads only the agreed decisions.

        Raises:
            MembershipLost: (``why="no_progress"``) the second such re-form,
                chained to the error that ended the world.
        """
        began = (frozenset(decision.members), decision.commits)
        self._fruitless = self._fruitless + 1 if began == self._began else 0
        self._began = began
        if self._fruitless < 2:
            return
        cause = "" if error is None else f"; the last ended with {type(error).__name__}: {error}"
        lost = MembershipLost(
            f"rank {self.rank}: the elastic session's worlds keep failing at the same step "
            f"without progress: every rank is alive and present, yet world "
            f"{decision.generation - 2} and world {decision.generation - 1} both ended before "
            f"any commit past commit {decision.commits}, with the same "
            f"{len(decision.members)} ranks. No peer is lost, so this looks like a program "
            "error (ranks issuing different collectives, or one rank waiting on a collective "
            f"the others never issue), not a failure re-forming can mend{cause}",
            why="no_progress",
        )
        raise lost from error

    # -- tracing ------------------------------------------------------------------------

    def trace(self, path: str | os.PathLike[str]) -> TraceBlock:
        """Trace every collective issued inside the block into one Chrome trace.

        Use ``with s.trace(path):`` in sync code and ``async with
        s.trace(path):`` in async code (leaving the block gathers every rank's
        events, which waits for the slowest rank). Every rank must enter the
        block. On a normal exit, rank 0 writes ``path`` with all ranks' events
        (one process per rank); if the block raises, each rank writes its own
        ``path`` with ``.rank<r>`` inserted.
        """
        comm = self._usable("trace")
        return TraceBlock(path, comm, lambda events: self.all_gather_object(events, allowed=[]))

    def span(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Mark a block of compute (forward, backward...) in the trace, if tracing."""
        tracer = None if self._lane is None else self._lane.tracer
        return contextlib.nullcontext() if tracer is None else tracer.span(name)
