"""Lane: one ordered stream of collectives over one process group.

Collectives pair up across ranks by issue order *per lane*. A session's
root lane, each channel's and each split's are lanes, and "lane" means that
and nothing else in asyncdist. A ``Lane`` holds what the stream needs: its
group and side groups (object traffic, debug fingerprints; formed in
``_groups``), its routes by device type, the issuer guard
(two tasks issuing at once on one lane are refused before launch), its
outstanding operations (``_op.Op``), its lazy completer threads, its
sub-lanes, its leave notices, and the session tree's shared record
(``_progress.Tree``: health, the one watchdog, the tracer, timeout, debug).
``Lane.check`` decides whether the lane is usable (closed, or broken by a
fault anywhere in the tree).

Collectives reach it as a ``_wire.Spec``: a small declarative description of
what to issue (which call, which tensors, reduce op, root) and how to finish
(the step that turns the completed work into the handle's result). One
``Lane.launch`` issues every spec the same way, through ``_wire`` (the only
module that calls torch collectives), so tracing and debug verification
cover every op alike. The one exception is the hot path of small
collectives: ``Lane.launch_allreduce`` issues an allreduce without a spec,
and hands it to ``launch`` as one whenever a tracer or debug mode is on.

``Lane.leave`` tells the peers this rank leaves on purpose; ``Lane.close``
tears the lane down in the order gloo needs, which the ``_groups`` module
docstring explains: sub-lanes, then the completer and (for the root) the
tree's watchdog, joined, then the groups, on the closing thread, and only
then the outstanding operations let go of their works.
"""

from __future__ import annotations

import collections
import logging
import threading
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import _groups, _ops, _wire
from ._debug import Fingerprint, Verifier
from ._groups import Ownership
from ._handle import Handle, handle_of
from ._op import Op
from ._progress import Completer, Recorder, Tree
from ._store import LeaveNotices
from ._wakeup import IssuerKey, current_issuer, in_async_context, one_after_another, who_issues
from ._wire import Route, Spec, device_type
from .errors import (
    AsyncDistError,
    CollectiveMismatch,
    CollectiveTimeout,
    Leaving,
    SessionBroken,
    SessionClosed,
)

logger = logging.getLogger("asyncdist")

# Outstanding operations a lane keeps before a launch asks the oldest whether
# they finished, and settles them (``Lane._retire``). Below it, the waiters
# and the watchdog's once-a-second look settle them, off the issuing path: a
# burst of 10,000 collectives costs no more to issue than raw torch's. Above
# it (a program issuing far more than it waits on), a launch pays for the
# settling, so what a lane holds stays bounded.
BACKLOG = 16384

T = TypeVar("T")


class Lane:
    """One lane over one process group: launches specs, tracks their
    operations, and tears everything down in the order gloo needs.

    ``owns``: how the lane holds its group (``_groups.Ownership``).
    Made by ``Lane.root`` (a new session tree) or by ``split``/``channel``.
    """

    def __init__(
        self,
        group: Any,
        tree: Tree,
        *,
        rank: int,
        world_size: int,
        owns: Ownership,
        label: str = "the session",
        parent: Lane | None = None,
        notices: LeaveNotices | None = None,
        namespace: str = "",
    ) -> None:
        self.group = group
        self.tree = tree
        self.label = label
        self.rank = rank
        self.world_size = world_size
        self.backend = tree.backend  # the device's backend (its route's)
        self.device = device = tree.device
        # by device type; the session's device first. ``cpu_route``: a CUDA
        # lane whose group also carries CPU tensors on gloo
        self.routes: dict[str, Route] = {device.type: Route(group, tree.backend, device)}
        if tree.cpu_route and device.type != "cpu":
            self.routes["cpu"] = Route(group, "gloo", torch.device("cpu"))
        self.route_key: Callable[[torch.Tensor], str] = (
            device_type if parent is None else parent.route_key
        )
        self.timeout = tree.timeout
        self.debug = tree.debug
        self.loopback = tree.loopback
        self.health = tree.health
        self._owns = owns
        self._parent = parent
        self._children: list[Lane] = []
        if parent is not None:
            namespace = parent.namespace
        self.namespace: str = namespace  # the store prefix of its side groups
        self._side = {
            kind: _groups.SideGroup(
                group,
                kind,
                rank,
                world_size,
                namespace=namespace,
                timeout=self.timeout,
                loopback=self.loopback,
            )
            for kind in (("objects", "debug") if self.debug else ("objects",))
        }
        self._outstanding: collections.deque[Op] = collections.deque()
        self._ended: BaseException | None = None  # ``interrupt``'s error
        self._verifier = Verifier(rank) if tree.debug else None
        self._closed = False
        self._issuer: IssuerKey | None = None  # who issued last
        self._issuer_name = ""
        self._completer = Completer(f"asyncdist-completer-r{rank}")  # its threads start lazily
        tree.watchdog.watch(self._outstanding)  # the tree's one watchdog thread
        self._notices = notices  # how peers learn that this rank left on purpose
        self._issued = 0  # collectives launched on this lane
        self._splits = 0  # sub-lanes formed by split

    @classmethod
    def root(cls, world: _groups.World, *, timeout: float, debug: bool = False) -> Lane:
        """The root lane of a new session tree over the default group, with
        the tree's shared record (and its watchdog thread)."""
        tree = Tree.start(
            rank=world.rank,
            timeout=timeout,
            debug=debug,
            loopback=world.loopback,
            backend=world.backend,
            device=world.device,
            cpu_route=world.cpu_route,
        )
        if world.owns == "world":
            tree.notices = LeaveNotices.for_world(world.world_size, "the session")
        return cls(
            _groups.world_group(),
            tree,
            rank=world.rank,
            world_size=world.world_size,
            owns=world.owns,
            notices=tree.notices,
            namespace=_groups.side_namespace(world.owns),
        )

    # -- groups -------------------------------------------------------------------

    @property
    def global_ranks(self) -> list[int]:
        """The default group's ranks of this lane's members, by lane rank."""
        return _groups.global_ranks(self.group, self.world_size)

    def form_side_groups(self) -> None:
        """Form the side groups now, while waiting for peers is expected (the
        session's entry, ``split`` and ``channel`` run off the event loop in
        async code), not inside the first object collective: their open
        connections are how a peer's death fails an object collective at
        once, where forming them then would wait for a dead peer until the
        timeout.

        Every lane, each channel included, keeps its own objects group:
        object collectives are two steps (sizes, then payload) run on a
        completer thread, which on the lane's own group would interleave with
        the collectives issued meanwhile.

        Raises:
            RuntimeError: a peer did not join in time.
            StoreSilent: the store did not answer (``_groups.rendezvous``).
            InitError: a rendezvous given up on still runs in this process.
        """
        for side in self._side.values():
            side.form()

    def split(self, group_size: int) -> Lane:
        """A lane over this rank's block of ``group_size`` consecutive ranks,
        sharing this lane's health (a fault anywhere breaks the whole job).

        Every rank forms every block's group, as torch requires. The caller
        checked ``group_size``.

        Raises:
            CollectiveError: a peer did not join in time (the session breaks).
        """
        ranks, mine = self.global_ranks, self.rank // group_size
        try:
            own = _groups.form_blocks(
                ranks,
                group_size,
                mine,
                timeout=self.timeout,
                loopback=self.loopback and self.uses_gloo,
            )
        except (RuntimeError, TimeoutError) as exc:  # (a silent store: ``rendezvous``)
            raise self._forming_failed(exc, op="split") from exc
        first = ranks[mine * group_size]
        label = f"the sub-session of ranks {first}..{first + group_size - 1}"
        notices = None
        if self._notices is not None:
            members = ranks[mine * group_size : (mine + 1) * group_size]
            notices = self._notices.child(f"split{self._splits}", members, label)
        self._splits += 1
        try:
            return self._child(own, self.rank % group_size, group_size, "split", label, notices)
        finally:
            del own  # (see ``_child``)

    def channel(self, name: str) -> Lane:
        """A lane over the same ranks with groups of its own (its collectives
        never pair with this lane's), sharing this lane's health.

        Only this lane's members take part (a sub-session's channel is formed
        by its block alone).

        Raises:
            CollectiveError: a peer did not join in time (the session breaks).
        """
        try:
            group = _groups.form_channel(
                self.global_ranks,
                timeout=self.timeout,
                loopback=self.loopback and self.uses_gloo,
            )
        except (RuntimeError, TimeoutError) as exc:  # (a silent store: ``rendezvous``)
            raise self._forming_failed(exc, op="channel") from exc
        label = f"channel {name!r}"
        notices = None
        if self._notices is not None:
            notices = self._notices.child(f"channel:{name}", self.global_ranks, label)
        try:
            return self._child(group, self.rank, self.world_size, "channel", label, notices)
        finally:
            del group  # (see ``_child``)

    def _child(
        self,
        group: Any,
        rank: int,
        world_size: int,
        op: str,
        label: str,
        notices: LeaveNotices | None = None,
    ) -> Lane:
        child = Lane(
            group,
            self.tree,
            rank=rank,
            world_size=world_size,
            owns="group",
            parent=self,
            label=label,
            notices=notices,
        )
        self._children.append(child)
        try:
            child.form_side_groups()
        except (RuntimeError, TimeoutError) as exc:
            child.close()
            # the error's traceback holds this frame and the caller's, and the
            # session it breaks keeps the error: they must not keep the
            # destroyed group, whose gloo threads and sockets live as long as it
            del group, child
            raise self._forming_failed(exc, op=op) from exc
        return child

    def _forming_failed(self, exc: BaseException, *, op: str) -> AsyncDistError:
        """The error that breaks the session when a group of ``op`` did not
        form: a silent store is named as such (a peer that never joined is
        the usual timeout's "alive but silent")."""
        # its frames (finished: the forming's) hold what the forming made, a
        # gloo device's listening socket among them, which the error, kept by
        # the session it breaks, would keep until the cyclic GC
        traceback.clear_frames(exc.__traceback__)
        if isinstance(exc, _groups.StoreSilent):
            exc = CollectiveTimeout(
                f"{op} on rank {self.rank} did not complete: {exc}. Check that the host of "
                "the session's store (MASTER_ADDR:MASTER_PORT under a launcher) is running "
                "and reachable",
                op=op,
                rank=self.rank,
            )
        return self.health.fail(exc, op=op)

    # -- routing -------------------------------------------------------------------

    @property
    def uses_gloo(self) -> bool:
        return any(route.backend == "gloo" for route in self.routes.values())

    def serves(self) -> str:
        """The devices this lane serves, for messages: ``cuda:0 (nccl) and cpu (gloo)``."""
        return " and ".join(str(route) for route in self.routes.values())

    def route(self, tensor: Any, *, collective: str, what: str = "tensor") -> Route:
        """The route of ``tensor`` (a non-tensor gets the session's device's
        route; the argument checks then refuse it).

        Raises:
            ValueError: a tensor on a device this lane does not serve (a meta
                tensor, another GPU than the session's).
        """
        if not isinstance(tensor, torch.Tensor):
            return next(iter(self.routes.values()))
        if tensor.is_cpu and self.route_key is device_type:  # the common case, cheaply
            route = self.routes.get("cpu")
            if route is not None:
                return route
        primary = next(iter(self.routes.values()))
        route = self.routes.get(self.route_key(tensor))
        if route is None and primary.backend == "gloo" and tensor.device.type == "cuda":
            return primary  # a gloo-only lane stages CUDA tensors through the host
        if route is None or (route.device.type == "cuda" and tensor.device != route.device):
            raise ValueError(
                f"{collective}: {what} is on {tensor.device}, but this session serves "
                f"{self.serves()}; move it with .to({str(primary.device)!r})"
            )
        return route

    def _route_of(self, spec: Spec[Any]) -> Route:
        """The one route of every tensor of ``spec`` (no tensor: the device's).

        Raises:
            ValueError: the call mixes tensors of two routes.
        """
        if len(self.routes) == 1:  # the argument checks refused other devices already
            return next(iter(self.routes.values()))
        tensors = [*spec.inputs, *(spec.outputs or ())]
        if not tensors:
            return next(iter(self.routes.values()))
        routes = {
            id(route): route for route in (self.route(t, collective=spec.op) for t in tensors)
        }
        if len(routes) > 1:
            raise ValueError(
                f"{spec.op}: one call takes tensors of one device, got "
                f"{', '.join(sorted({str(t.device) for t in tensors}))}"
            )
        return next(iter(routes.values()))

    # -- tracing -------------------------------------------------------------------

    @property
    def tracer(self) -> Recorder | None:
        """The tracer recording the collectives of this lane's tree."""
        return self.tree.tracer

    @tracer.setter
    def tracer(self, tracer: Recorder | None) -> None:
        self.tree.tracer = tracer

    # -- launching -----------------------------------------------------------------

    def busy(self) -> bool:
        """Whether a collective of this lane is still outstanding."""
        return any(not handle.done() for handle in self._outstanding)

    def launch(self, spec: Spec[T], route: Route | None = None) -> Handle[T]:
        """Issue ``spec`` now (in debug mode: once every rank agreed on it) and
        return its handle. ``route``: the route of every tensor of ``spec``,
        where the caller resolved it already (default: resolved here).

        Raises:
            CollectiveError: torch refused the call before anything was sent.
            CollectiveMismatch: (debug mode, sync callers) ranks disagree.
        """
        exchange = _wire.is_exchange(spec)
        if route is None and not exchange:
            route = self._route_of(spec)
        received: list[Any] | None = None
        finish: Callable[..., Any] = spec.finish
        if exchange:
            received, finish = _receiving(spec)
        op = self._new_op(spec.op, finish)
        if self._verifier is None:
            self._issue(op, spec, received, route)
        else:
            self._issue_verified(op, spec, received, route)
        tracer = self.tree.tracer
        if tracer is not None:
            described = spec.inputs if spec.described is None else spec.described
            tracer.record(op, _ops.nbytes(described) + len(spec.payload))
        return self._launched(op)

    def launch_allreduce(
        self,
        name: str,
        tensor: torch.Tensor,
        reduction: _ops.Reduction,
        route: Route,
        finish: Callable[[], T],
    ) -> Handle[T]:
        """``launch`` of the allreduce of ``tensor`` in place (checked, on
        ``route``), the collective programs issue most, in bursts of small
        ones: without a ``Spec`` unless a tracer or debug mode needs one
        (building it, and dispatching on it, cost about a tenth of a small
        allreduce's issuing; ``benchmarks/scaling.py``).

        Raises:
            as ``launch``.
        """
        wire = _ops.wire(tensor)
        if self._verifier is not None or self.tree.tracer is not None:
            spec = Spec(
                name, "allreduce", finish, inputs=(wire,), reduce=reduction, described=(tensor,)
            )
            return self.launch(spec, route)
        op = self._new_op(name, finish)
        try:
            work = _wire.allreduce(route.group, wire, reduction)
        except (RuntimeError, ValueError) as exc:
            # refused by torch before anything reached the wire
            raise self.health.translate(exc, op=name, left=op.departure_reader()) from exc
        op.attach(work, streamed=route.backend == "nccl")
        return self._launched(op)

    def _new_op(self, name: str, finish: Callable[..., Any]) -> Op:
        """The record of the next collective of this lane, once the issuer
        may issue it.

        Raises:
            CollectiveMismatch: another task issues while this one's are outstanding.
        """
        self._retire()
        issuer, named = who_issues()
        if issuer != self._issuer:
            self._switch_issuer(issuer, name)
        elif named is not None:  # a helper of a family that shares its key
            self._issuer_name = named
        self._issued += 1
        return Op(name, self.health, finish, self._notices, self._issued)

    def _launched(self, op: Op) -> Handle[Any]:
        """Queue ``op``, issued, as outstanding; its handle."""
        self._outstanding.append(op)
        if self._ended is not None:  # ended while this launched: see ``interrupt``
            op.interrupt(self._ended)
        return handle_of(op)

    def _retire(self) -> None:
        """Let go of the oldest operations once settled (waited on, or seen
        done by the watchdog), at the cost of a flag each: a launch does not
        settle the work of earlier ones, which their waiter does anyway.
        Past ``BACKLOG`` outstanding (a program that issues far more than it
        waits on), the oldest are asked whether they finished, and settled,
        so the queue stays as long as what is really in flight."""
        outstanding = self._outstanding
        while outstanding:
            head = outstanding[0]
            if head.streamed or len(outstanding) > BACKLOG:
                if not head.done():  # NCCL: stays until the device finished it
                    return
            elif not head.has_outcome():
                return
            outstanding.popleft()
            if not head.streamed:  # no stream to order: the result needs no work
                head.release(None)  # (close() releases the others)

    def _switch_issuer(self, issuer: IssuerKey, op: str) -> None:
        """Another task or thread issues on this lane: fine once the lane is
        idle, or when the two cannot run at once; while a collective of the
        last issuer is outstanding, two concurrent issuers interleave in an
        order that can differ between ranks, so refuse (at no communication
        cost: this rank alone decides)."""
        name = current_issuer()
        last = self._issuer
        if last is not None and not one_after_another(last, issuer) and self.busy():
            raise CollectiveMismatch(
                f"{op} on rank {self.rank}: two tasks at once issue on {self.label} "
                f"({self._issuer_name} still has a collective outstanding, and {name} "
                "issues another). Collectives pair up across ranks by issue order, which "
                "two tasks cannot keep alike on every rank. Give each task its own lane: "
                "ch = session.channel('name') (formed by every rank), or await the first "
                "task's collectives before the second issues. Nothing was launched."
            )
        self._issuer, self._issuer_name = issuer, name

    def _issue(
        self,
        op: Op,
        spec: Spec[Any],
        received: list[Any] | None,
        route: Route | None,
        *,
        deferred: bool = False,
    ) -> None:
        # (no closure here: this is the hot path, and a closure would make
        # its variables cells on every call)
        if received is not None:
            self._exchange(op, spec, received)
            return
        assert route is not None
        try:
            work = _wire.issue(route.group, spec)
        except (RuntimeError, ValueError) as exc:
            # refused by torch before anything reached the wire
            raise self.health.translate(exc, op=spec.op, left=op.departure_reader()) from exc
        key = _wire.futureless(spec) if route.backend == "gloo" else None
        if key is not None:
            self._completer.submit(f"{route.device.type}:{key}", _settling(op, work))
        else:
            op.attach(work, streamed=route.backend == "nccl", hook=deferred)

    def _exchange(self, op: Op, spec: Spec[Any], received: list[Any]) -> None:
        """Run the exchange ``spec`` on the objects side group: two steps, in
        program order on one thread (issued from a callback, the second step
        would race with what the program issues meanwhile; see ``_wire``)."""
        side = self._side["objects"]
        world, rank = self.world_size, self.rank

        def run() -> None:
            received.append(_wire.exchange(side.group(), spec, world, rank))

        self._completer.submit("objects", lambda: op.settle(run))

    def _issue_verified(
        self,
        op: Op,
        spec: Spec[Any],
        received: list[Any] | None,
        route: Route | None,
    ) -> None:
        """Debug mode: agree with every rank on the call, then issue it.

        The exchange waits for peers, so it runs on the lane's debug thread,
        in program order, never on an event loop: async callers get the
        handle at once (a mismatch arrives with it); sync callers wait for
        the agreement and get the mismatch raised at the call.
        """
        assert self._verifier is not None
        fingerprint = None
        if spec.call not in _wire.POINT_TO_POINT:  # two ranks only: nothing to compare
            fingerprint = self._verifier.fingerprint(
                spec.op,
                spec.inputs if spec.described is None else spec.described,
                reduce="" if spec.reduce is None else spec.reduce.name,
                root=spec.root,
                pairwise=spec.pairwise,
            )
        refused: list[BaseException] = []
        agreed = threading.Event()

        def agree_then_issue() -> None:
            try:
                if fingerprint is not None:
                    self._agree(spec.op, fingerprint, op)
                # on the debug thread, in the caller's grad/inference mode
                op.as_caller(lambda: self._issue(op, spec, received, route, deferred=True))
            except BaseException as exc:  # noqa: BLE001 - it reaches the caller or the handle
                refused.append(exc)
                op.fail(exc)
            finally:
                agreed.set()

        self._completer.submit("debug", agree_then_issue)
        if not in_async_context():
            agreed.wait()
            if refused:
                op.observed = True
                raise refused[0]

    def _agree(self, name: str, fingerprint: Fingerprint, op: Op) -> None:
        assert self._verifier is not None
        try:
            exchanged = _wire.exchange_fingerprints(
                self._side["debug"].group(), fingerprint.encode(), self.world_size
            )
        except RuntimeError as exc:
            raise self.health.fail(exc, op=name, left=op.departure_reader()) from exc
        prints = [Fingerprint.decode(data) for data in exchanged]
        self._verifier.check(name, prints)

    # -- leaving -------------------------------------------------------------------

    def drain(self) -> list[Op]:
        """The ops still outstanding here and in sub-lanes, in issue order
        (none once broken: outstanding work failed already or is lost; the
        backend timeout bounds it, and destroying the group waits for it)."""
        if self.health.fault is not None:
            return []
        handles = list(self._outstanding)
        for child in self._children:
            handles += child.drain()
        return handles

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def sublanes(self) -> tuple[Lane, ...]:
        """The lanes formed inside this one (channels, splits) and still open."""
        return tuple(self._children)

    def check(self, op: str) -> Lane:
        """This lane, if ``op`` may be issued on it now.

        Raises:
            SessionClosed: the lane was closed (its session was left).
            SessionBroken: a fault broke the session tree; marks it seen.
        """
        if self._closed:
            raise SessionClosed(
                f"{op} on rank {self.rank}: the session is closed; issue collectives inside "
                "`with DistSession() as s:` (or `async with`)"
            )
        fault = self.health.fault
        if fault is not None:
            self.health.fault_seen = True
            raise SessionBroken(
                f"{op} on rank {self.rank}: the session is broken by an earlier failure "
                f"({type(fault).__name__}); leave it and start a new one (or let torchrun "
                "restart the job)"
            ) from fault
        return self

    def interrupt(self, error: BaseException) -> None:
        """Break the tree with ``error`` and fail every outstanding op of this
        lane and the lanes inside it with it (an elastic world ended: nobody
        waits on a group that lost a member). The works stay where they are
        until ``close``.

        It runs on the watcher's thread, maybe while the program launches: a
        launch releases the GIL inside torch, which is when a waiting thread
        takes it. An op appended after the loop below copied the queue finds
        ``_ended`` set and fails itself (``launch``); one appended before is
        in the copy. Either way nothing waits on the ended world."""
        self._ended = error
        self.health.record_fault(error)
        for op in list(self._outstanding):
            op.interrupt(error)
        for child in self._children:
            child.interrupt(error)

    def leave(self, how: Leaving) -> None:
        """Tell the peers that this rank leaves this lane (and the lanes inside
        it) on purpose, before any group is destroyed: a peer still waiting in
        a collective then learns why its connection closed. ``how``: how the
        block ended (normally, by an exception, an interrupt, a cancellation).
        Skipped once broken by a dead peer (the fault explains it, and the
        store may have died with it); after a timeout, told (the silent
        peer may wake, and must not blame a crash). Bounded by
        ``NOTICE_TIMEOUT``; one store request."""
        fault = self.health.fault
        if self._notices is None or self._closed:
            return
        if fault is None:
            self._notices.post(self.health.rank, how)
        elif isinstance(fault, CollectiveTimeout):
            self._notices.post(self.health.rank, "timed_out")

    def close(self, *, defer: bool = False) -> Callable[[], None]:
        """Release everything, in the order that keeps gloo from aborting
        (the ``_groups`` module docstring says why). Closing twice is fine.

        Letting go of the works waits for them: gloo has no abort, and a
        collective it still runs (one queued behind a failed one, say) ends
        only at its own timeout. With ``defer`` (an elastic world's end) that
        part is left to the callable returned, so the lane's groups are
        gone at once and the next world can be agreed on and formed
        meanwhile; the caller runs it before the new world uses anything an
        old collective could still write. Without, it is done here and the
        callable does nothing.
        """
        if self._closed:
            return _nothing
        self._closed = True
        children = [child.close(defer=defer) for child in list(self._children)]
        if not defer:
            self._completer.close(timeout=self.timeout)
        if self._parent is None:
            self.tree.close()  # the tree's watchdog: the root closes last
        else:
            self.tree.watchdog.unwatch(self._outstanding)
        handles = list(self._outstanding)
        self._outstanding.clear()
        side, self._side = list(self._side.values()), {}
        _groups.destroy(self._owns, self.group, side)
        completer, health, timeout = self._completer, self.health, self.timeout
        # the group itself: its last reference going waits for its works
        kept: list[Any] = [self.group, self.routes]

        def release() -> None:
            for finish in children:
                finish()
            if defer:
                completer.close(timeout=timeout)
            # Once the groups are gone, handles the program (or a fault's
            # traceback) still holds let go of their works, which keep gloo's
            # transport alive.
            for op in handles:
                op.release(health.fault)
            kept.clear()

        if not defer:
            release()
        if self._parent is not None and self in self._parent._children:
            self._parent._children.remove(self)
        if self._parent is None and self._notices is not None:
            self._notices.release()  # no handle keeps the store (or its port) alive
        self.group = None
        self.routes = {}  # nor a route its group
        return release if defer else _nothing


def _nothing() -> None:
    """What is left of a close that deferred nothing."""


def _receiving(spec: Spec[T]) -> tuple[list[Any], Callable[[], T]]:
    """An exchange's box for what it receives, and its finishing step over it."""
    box: list[Any] = []

    def finish() -> T:
        return spec.finish(box[0])

    return box, finish


def _settling(op: Op, work: Any) -> Callable[[], None]:
    """A completer's job: wait for a futureless ``work``, then settle ``op``."""
    return lambda: op.settle(work.wait)
