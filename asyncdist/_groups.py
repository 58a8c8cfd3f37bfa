"""Groups: every process group asyncdist forms, adopts and destroys.

A session tree's groups, and who forms them:

* the world: the default group, formed by ``form_world`` on a session's
  entry (or adopted, ``adopt_world``, when someone initialised it already);
* a split's blocks (``form_blocks``) and a channel's group (``form_channel``);
* side groups of a lane (``SideGroup``): one for object traffic, and in debug
  mode one for fingerprints. Both gloo, over the lane's ranks, formed with
  the lane.

Every lane records how it holds its group (``Ownership``) and gives its
groups back through ``destroy``.

Naming. torch names a group formed with ``use_local_synchronization=True``
by a hash of its ranks and ``len(_world.pg_names)``, the number of groups
alive in the process: ranks that form groups in different orders give them
different names and never meet. So every torch group is formed eagerly, in
program order, on every member (a session's entry, ``split``, the first
``channel(name)``). Other groups, and the default group, are named by a
per-process counter that only ``destroy_process_group()`` resets
(``name_groups_afresh``).

A name is also where a group's keys live in the default group's store, and
that store can outlive the group (an adopted default group's, across the
sessions that adopt it). The hashed name repeats once an earlier group over
the same ranks is destroyed, and the new group would then read the dead
one's addresses. So a channel over the whole world is formed without local
synchronization (every rank is a member anyway) and takes the counter's
name, which never repeats while the world lives. A sub-session's channel
must use the hash; re-forming one over the same block after its sub-session
closed, on a store that outlives it, is the case left open.

Side groups are not torch groups, so torch's naming does not reach them: a
``SideGroup`` is a ``ProcessGroupGloo`` built directly on the default
group's store, under a prefix every member derives alike from its lane's
torch group name (agreed, since that group formed in program order) and the
session's ``side_namespace``, with one worker thread (its exchanges run one
at a time). It is formed with its lane, not at its first use: its open
connections are how a peer's death fails an object collective at once,
where forming it then would wait for a dead peer until the timeout. It is
used only through its methods, blocking, on one completer thread
(``_wire``'s exchanges).

Loopback. gloo binds the address the host name resolves to (often a public
one) unless ``GLOO_SOCKET_IFNAME`` names an interface, and it reads the
variable when a group is formed. torch 2.13 offers no per-group way to
choose it: ``init_process_group(pg_options=...)`` and
``new_group(pg_options=...)`` drop the options of a gloo backend, and a
``ProcessGroupGloo`` built with its own devices is not a
``torch.distributed`` group. A local world (no master given, or a loopback
master) therefore forms its torch gloo groups inside ``gloo_on_loopback``,
which sets the variable for the forming only; it is asyncdist's one write to
``os.environ``. A side group, not being a torch group, takes its lane's
gloo devices, or names its own (the loopback interface, or the interfaces
the variable named when its lane was made) where the lane has no gloo
backend.

Teardown order. gloo runs a future's callbacks on its worker thread while
that thread still holds the work; if a waiter wakes and the group is
destroyed at once, the last reference to the group can be dropped on that
worker thread, gloo then joins itself and the process aborts ("terminate
called ... Resource deadlock avoided"). So a lane closes in this order, on
the closing thread: its sub-lanes; its completer threads and (for the root)
the tree's watchdog, joined; its outstanding handles forgotten; then
``destroy``: side groups, sub-groups and the group; and only then the
handles let go of their works (a work keeps its group's transport alive).
A side group's works carry no callbacks (its exchanges wait on them), so
what holds it last is its lane or a completer thread, never gloo's own.

What waits. Destroying is bookkeeping; what blocks is letting go of the
last reference to a group (its lane's, and its works'): gloo's destructor
waits for every collective it still runs, and one queued behind a failed
collective ends only at its own timeout. An elastic world's end defers that
part (``Lane.close(defer=True)``) until the next world is agreed on and
formed, and before anything of it is restored.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import logging
import os
import socket
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

# Imported now, before any default group exists: its functions take
# ``group=group.WORLD`` as a default *value*, evaluated at import. torch
# imports it lazily (torch._dynamo does, at a first ``optimizer.zero_grad()``
# or ``step()``), and imported while a session's group lives, it would hold
# that group, with its gloo threads, for the life of the process (measured:
# an elastic world that ended kept its default group this way).
import torch.distributed.nn.functional
from torch.distributed import distributed_c10d

from ._env import (
    MIXED,
    LaunchEnv,
    backends_by_device,
    choose_backend,
    choose_device,
    detect,
    is_loopback,
    launcher_local_rank,
)
from ._store import forget, session_store
from .errors import InitError

logger = logging.getLogger("asyncdist")
T = TypeVar("T")

# How a lane holds its group: "world" (it initialised the default group and
# destroys it, side groups included), "group" (a sub-group it destroys with
# its side groups), "adopted" (someone else's default group: only the side
# groups are destroyed).
Ownership = Literal["world", "group", "adopted"]


# -- loopback ------------------------------------------------------------------------------


@functools.cache
def _loopback_interface() -> str | None:
    """The loopback interface's name (looked up once: a syscall per session
    entry otherwise, and the loopback interface does not come and go)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


# Held for the whole forming of a group by gloo_on_loopback, whether it writes
# GLOO_SOCKET_IFNAME or not: a group formed elsewhere in asyncdist meanwhile
# (say, a multi-node session in another thread) would otherwise read the
# loopback value and bind only to loopback. Reentrant: a forming may nest.
_GLOO_ENV_LOCK = threading.RLock()

_GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


@contextlib.contextmanager
def gloo_on_loopback(active: bool) -> Iterator[None]:
    """Form gloo groups in this block; while active, they listen on loopback
    only (see the module docstring for why this is an environment write).

    Scope of the write: when ``active``, a loopback interface exists and the
    user has not set ``GLOO_SOCKET_IFNAME`` themselves, the variable is set in
    ``os.environ`` on entering the block and removed on leaving it (normally or
    by exception), unless someone else changed it meanwhile. During the
    block, every thread of the process sees it. A module-level lock is held
    for the whole block, active or not, so every asyncdist group forming
    (which all go through this function) waits until the variable is gone,
    and never reads another forming's value. Code outside asyncdist that
    forms gloo groups or reads the variable concurrently is not covered.
    Keep the block to the forming only: it holds the lock while waiting for
    peers.
    """
    with _GLOO_ENV_LOCK:
        name = _loopback_interface() if active and _GLOO_IFNAME not in os.environ else None
        if name is None:
            yield
            return
        os.environ[_GLOO_IFNAME] = name
        try:
            yield
        finally:
            if os.environ.get(_GLOO_IFNAME) == name:
                del os.environ[_GLOO_IFNAME]


# -- rendezvous, bounded ------------------------------------------------------------------

# Seconds a rendezvous may run past the longest its forming may take (its
# ``timeout``: the sum of its phases' timeouts) before its caller stops
# waiting: torch's own timeouts fire within it whenever the store answers.
RENDEZVOUS_GRACE = 5.0
# What each rendezvous given up on was forming, while it still runs: no group
# forms in this process meanwhile (``refuse_while_held``).
_held: dict[int, str] = {}
_tickets = itertools.count()


class StoreSilent(TimeoutError):
    """Raised by ``rendezvous`` when the store did not answer within its
    bound: the store's host, not a peer, is the one to look at."""


def rendezvous(
    call: Callable[[], T],
    what: str,
    timeout: float,
    *,
    late: Callable[[T], object] | None = None,
) -> T:
    """``call()`` (``what``: a group's forming, which waits on the rendezvous
    store), made on a daemon thread of its own and waited for ``timeout``
    plus ``RENDEZVOUS_GRACE`` seconds.

    torch's store client never gives up on a server that stopped answering
    while connected (a stopped process, a frozen host, a link cut after
    connecting): a wait that times out then waits, with no bound, to cancel
    itself, so torch's timeout does not end the forming (measured: still
    waiting at 40 s with a 3 s timeout). Here the thread held is this one,
    never the caller's. Until it returns, no group forms in this process:
    it would do so beside torch state that the held forming may yet write.
    If it does return, what it formed is handed to ``late`` (which destroys
    it) and the process may form groups again.

    Raises:
        StoreSilent: no answer within the bound.
        InitError: a rendezvous given up on still runs (``refuse_while_held``).
        BaseException: what ``call()`` raised.
    """
    # (again here: a caller that checked before waiting for the gloo lock may
    # have waited behind a forming that was given up on meanwhile)
    refuse_while_held()
    limit = timeout + RENDEZVOUS_GRACE
    lock, done = threading.Lock(), threading.Event()
    outcome: list[tuple[bool, Any]] = []
    gave_up: list[int] = []  # the caller's ticket in ``_held``, once it stopped waiting

    def run() -> None:
        made = _attempt(call)
        try:
            with lock:
                if not gave_up:
                    outcome.append(made)
                    done.set()
                    return
            if not made[0]:  # nobody raises it: let go of torch's frames (the store, its port)
                traceback.clear_frames(made[1].__traceback__)
            try:
                if made[0] and late is not None:
                    late(made[1])
            except Exception as exc:  # noqa: BLE001 - nobody is waiting for it any more
                logger.debug("%s, formed after its caller gave up: %s", what, exc)
            finally:
                _held.pop(gave_up[0], None)
                logger.info("asyncdist: %s ended, after its caller gave up on it", what)
        finally:
            # an error's traceback holds this frame (through ``_attempt``'s):
            # the frame must not hold the error, or the two wait for the cyclic GC
            del made

    threading.Thread(target=run, name="asyncdist-rendezvous", daemon=True).start()
    try:
        done.wait(limit)
    finally:  # at the bound, or interrupted (KeyboardInterrupt)
        with lock:
            if not outcome:
                ticket = next(_tickets)
                _held[ticket] = what
                gave_up.append(ticket)
    if gave_up:
        raise StoreSilent(
            f"{what}: the rendezvous store did not answer within {limit:g} s; its host is "
            "stopped or frozen, or cut off from this process"
        )
    answered, value = outcome.pop()
    if not answered:
        try:
            raise value
        finally:
            value = None  # (as concurrent.futures does: no cycle through this frame)
    return value  # type: ignore[no-any-return]


def _attempt(call: Callable[[], T]) -> tuple[bool, Any]:
    """``(True, call())``, or ``(False, what it raised)``. Caught here, not in
    ``rendezvous``'s thread: the error's traceback then holds no frame that
    holds the error, so nothing of the forming (its store, gloo's listening
    socket) waits for the cyclic GC once the error is dropped."""
    try:
        return (True, call())
    except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
        return (False, exc)


def refuse_while_held() -> None:
    """Refuse to form a group while a rendezvous given up on still runs.

    Raises:
        InitError: one does.
    """
    held = list(_held.values())  # (one call: a held one may end meanwhile)
    if held:
        what = held[0]
        raise InitError(
            f"this process gave up on {what}: its rendezvous store stopped answering, and "
            "torch still waits on it. No group can form beside it until that store "
            "answers again or closes; start a fresh process"
        )


def _drop_late_world(_: object) -> None:
    """Destroy a default group whose forming was given up on (``rendezvous``'s
    ``late``): nothing else formed meanwhile (``refuse_while_held``)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _drop_late_group(group: Any) -> None:
    """Destroy a sub-group whose forming was given up on: torch registered it,
    even if the default group it was formed over is gone by now, and a group
    left registered would shift the names of the next session's groups."""
    dist.destroy_process_group(group)


# -- the world -----------------------------------------------------------------------------


def name_groups_afresh() -> None:
    """Let the next default group be named as on every other rank: "0".

    torch names the default group by a per-process counter that only
    ``destroy_process_group()`` resets, and a failed ``init_process_group``
    leaves it advanced. After a fault at entry that failed inside init on one
    rank and before it on another (reaching the store), the ranks' next groups
    would differ in name, wait for each other's keys under different prefixes,
    and no later session of those processes could form. Called only while no
    default group exists, so no group carries a counter-given name. (torch
    has no public way to do this: it writes ``_world.group_count``.)
    """
    distributed_c10d._world.group_count = 0


def form_world(
    env: LaunchEnv,
    backend: str,
    device: torch.device,
    *,
    init_method: str | None,
    timeout: float,
    loopback: bool,
) -> dist.Store | None:
    """Initialise the default group; the rendezvous store this session then
    owns (None with an ``init_method``).

    Raises:
        InitError: the group did not form (the ranks, the master, the timeout,
            a silent store: ``rendezvous``), or a forming given up on still runs.
    """
    refuse_while_held()
    name_groups_afresh()
    fresh: list[bool] = []  # whether the forming created the kept store (see ``forget``)

    def form() -> dist.Store | None:
        store: dist.Store | None = None
        owned: dist.Store | None = None
        if init_method is None:
            store, owned, created = session_store(env, timeout)
            fresh.append(created)
        if device.type == "cuda":  # the current device is the calling thread's
            torch.cuda.set_device(device)
        try:
            dist.init_process_group(
                backend,
                init_method=init_method,
                store=store,
                rank=env.rank,
                world_size=env.world_size,
                timeout=datetime.timedelta(seconds=timeout),
                device_id=device if "nccl" in backend else None,
            )
        except BaseException:
            if fresh and fresh[0]:
                store = owned = None
                forget(env)  # release the port this failed session bound
            raise
        return owned

    def late(owned: dist.Store | None) -> None:  # formed after its caller gave up
        _drop_late_world(owned)
        if fresh and fresh[0]:
            forget(env)

    what = f"rank {env.rank}'s forming of the default group"
    # each phase waits up to the timeout on its own: reaching the master,
    # agreeing a generation on an agent's store, init_process_group
    phases = 1 if init_method is not None else (3 if env.agent_store else 2)
    try:
        with gloo_on_loopback(loopback and "gloo" in backend):
            return rendezvous(form, what, phases * timeout, late=late)
    except InitError:
        raise
    except (RuntimeError, OSError, ValueError) as exc:
        traceback.clear_frames(exc.__traceback__)  # torch's frames hold the store's port
        where = init_method or f"{env.master_addr}:{env.master_port or '(local)'}"
        raise InitError(
            f"rank {env.rank} of {env.world_size} could not form a {backend} group via "
            f"{where} within {timeout:g} s ({exc}). Check that all "
            f"{env.world_size} ranks started, that MASTER_ADDR/MASTER_PORT agree, and "
            "that the master is reachable."
        ) from exc


def form_generation(
    store: dist.Store,
    generation: int,
    rank: int,
    world_size: int,
    *,
    timeout: float,
    loopback: bool,
) -> World:
    """Initialise the default group of an elastic session's world
    ``generation`` (gloo, CPU), its keys under ``pg/{generation}/`` of the
    coordinator ``store``: a world never meets the groups of one before it.

    Raises:
        RuntimeError: a member did not join in time.
        StoreSilent: the store did not answer (``rendezvous``).
        InitError: a forming given up on still runs in this process.
    """
    refuse_while_held()
    name_groups_afresh()
    form = functools.partial(
        dist.init_process_group,
        "gloo",
        store=dist.PrefixStore(f"pg/{generation}", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    what = f"rank {rank}'s forming of world {generation}"
    with gloo_on_loopback(loopback):
        rendezvous(form, what, timeout, late=_drop_late_world)
    return World(rank, world_size, 0, "gloo", torch.device("cpu"), "world", loopback=loopback)


def adopt_world(rank: int | None, world_size: int | None) -> tuple[int, int, dict[str, str]]:
    """The initialised default group's (rank, world size, backend by device type).

    Raises:
        InitError: it disagrees with the ``rank`` or ``world_size`` asked for.
    """
    actual_rank, actual_world = dist.get_rank(), dist.get_world_size()
    for name, actual, wanted in (
        ("rank", actual_rank, rank),
        ("world_size", actual_world, world_size),
    ):
        if wanted is not None and wanted != actual:
            raise InitError(
                f"the default process group is already initialised with {name}={actual}, "
                f"but {name}={wanted} was requested"
            )
    return actual_rank, actual_world, backends_by_device(str(dist.get_backend()))


def world_group() -> Any:
    """The default group."""
    return dist.group.WORLD


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a session asks of the world: its constructor's arguments."""

    timeout: float
    backend: str | None = None
    init_method: str | None = None
    rank: int | None = None
    world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    device: Any = None


@dataclass(frozen=True, slots=True)
class World:
    """The default group as a session's root lane holds it."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # the device's backend
    device: torch.device
    owns: Ownership  # "world": formed here (and destroyed on exit); "adopted"
    cpu_route: bool = False  # a CUDA world whose group also carries CPU tensors on gloo
    loopback: bool = False  # its gloo groups form inside gloo_on_loopback
    store: dist.Store | None = None  # the rendezvous store this process formed


def enter_world(wanted: Wanted) -> World:
    """Adopt the default group if someone initialised it, else form it.

    Raises:
        InitError: the group did not form, or the one there disagrees with
            what was asked for, or a forming given up on still runs in this
            process.
    """
    # before adopting, too: a default group there may be one that a forming
    # given up on registered late, about to be destroyed
    refuse_while_held()
    if dist.is_initialized():
        rank, world, backends = adopt_world(wanted.rank, wanted.world_size)
        local_rank = launcher_local_rank()
        local_rank = rank if local_rank is None else local_rank
        device = choose_device(wanted.device, backends.get("cuda", "gloo"), local_rank)
        if device.type not in backends:
            device = torch.device("cpu")
        return World(
            rank,
            world,
            local_rank,
            backends[device.type],
            device,
            "adopted",
            cpu_route=device.type == "cuda" and backends.get("cpu") == "gloo",
        )
    env = detect(
        rank=wanted.rank,
        world_size=wanted.world_size,
        master_addr=wanted.master_addr,
        master_port=wanted.master_port,
    )
    device = choose_device(wanted.device, wanted.backend, env.local_rank)
    backend = choose_backend(wanted.backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    loopback = wanted.init_method is None and (
        env.master_port is None or is_loopback(env.master_addr)
    )
    # like torch's default group: CUDA tensors on NCCL, CPU tensors on gloo,
    # unless a backend was asked for
    mixed = wanted.backend is None and device.type == "cuda"
    store = form_world(
        env,
        MIXED if mixed else backend,
        device,
        init_method=wanted.init_method,
        timeout=wanted.timeout,
        loopback=loopback,
    )
    return World(
        env.rank,
        env.world_size,
        env.local_rank,
        backend,
        device,
        "world",
        cpu_route=mixed,
        loopback=loopback,
        store=store,
    )


def global_ranks(group: Any, world_size: int) -> list[int]:
    """The default group's ranks of ``group``'s members, by group rank."""
    if group is dist.group.WORLD:
        return list(range(world_size))
    return [dist.get_global_rank(group, r) for r in range(world_size)]


# -- a lane's groups -----------------------------------------------------------------------


class SideGroup:
    """A gloo group over a lane's members for one kind of side traffic
    (``kind``: "objects" or "debug"), formed by ``form()`` when its lane is
    made, in program order (see the module docstring for how it is named).

    ``form()`` runs on the thread making the lane; ``group()`` then on one
    completer thread; ``close()`` on the lane's closing thread, after that
    thread was joined (or given up on: it then finds the group closed).
    """

    def __init__(
        self,
        lane_group: Any,
        kind: str,
        rank: int,
        world_size: int,
        *,
        namespace: str,
        timeout: float,
        loopback: bool,
    ) -> None:
        self.kind = kind
        self._prefix = f"{namespace}/{lane_group.group_name}/{kind}"
        self._rank, self._world_size, self._timeout = rank, world_size, timeout
        # the lane's own gloo devices (its TCP loop, its interface), where it
        # has a gloo backend; else devices of its own, named as below
        self._devices = _gloo_devices(lane_group)
        self._interfaces = [] if self._devices else _side_interfaces(loopback)
        self._group: Any = None
        self._closed = False

    def form(self) -> None:
        """Form the ``ProcessGroupGloo`` now, blocking until every member
        formed it (up to the timeout).

        Raises:
            RuntimeError: a member did not join in time.
            StoreSilent: the store did not answer (``rendezvous``).
            InitError: a forming given up on still runs in this process.
        """
        gloo = dist.ProcessGroupGloo
        devices = self._devices
        if not devices and self._interfaces:
            devices = [gloo.create_device(interface=name) for name in self._interfaces]
        elif not devices:
            devices = [gloo.create_default_device()]
        # torch's options type and fields are private; the public constructor
        # would choose the devices from the environment (see the docstring)
        options = gloo._Options()  # type: ignore[attr-defined]
        options._devices = devices
        options._threads = 1  # its exchanges run one at a time, on one thread
        options._timeout = datetime.timedelta(seconds=self._timeout)
        store = dist.PrefixStore(self._prefix, distributed_c10d._get_default_store())
        refuse_while_held()
        form = functools.partial(gloo, store, self._rank, self._world_size, options)
        # (one formed late is dropped: nothing holds it)
        self._group = rendezvous(form, f"the {self.kind} side group's forming", self._timeout)

    def group(self) -> Any:
        """The formed ``ProcessGroupGloo``.

        Raises:
            RuntimeError: it is closed (its lane was left), or never formed.
        """
        group = self._group
        if group is None:
            state = "closed" if self._closed else "not formed"
            raise RuntimeError(f"the {self.kind} side group is {state}")
        return group

    def close(self) -> None:
        """Let go of the group; ``group()`` raises from now on."""
        self._closed = True
        self._group = None


def _gloo_devices(group: Any) -> list[Any]:
    """The network devices of ``group``'s gloo backend (none without one)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return []
    if not isinstance(backend, dist.ProcessGroupGloo):
        return []
    options = backend.options
    return list(options._devices)  # type: ignore[attr-defined]


def _side_interfaces(loopback: bool) -> list[str]:
    """The interfaces a side group binds: the loopback one for a local world;
    else those the user's ``GLOO_SOCKET_IFNAME`` names (read now, on the
    thread making the lane, under the lock of ``gloo_on_loopback``), or none:
    gloo's default device, as torch's own groups get."""
    if loopback:
        name = _loopback_interface()
        if name is not None:
            return [name]
    with _GLOO_ENV_LOCK:
        names = os.environ.get(_GLOO_IFNAME, "")
    return [name for name in names.split(",") if name]


_ADOPTIONS = itertools.count()


def side_namespace(owns: Ownership) -> str:
    """The store prefix of a session's side groups, alike on every member.

    A world this process formed has a store of its own (a fresh one, or a
    kept one under a prefix per session; an elastic world's under its
    generation), so its lanes' group names suffice. An adopted default group
    keeps its store across the sessions that adopt it, and names its root
    lane alike in each: those sessions are numbered, in the order this
    process opens them, as every rank does.
    """
    if owns == "adopted":
        return f"asyncdist/side/adopted{next(_ADOPTIONS)}"
    return "asyncdist/side"


def form_blocks(
    ranks: Sequence[int], group_size: int, mine: int, *, timeout: float, loopback: bool
) -> Any:
    """Form a group for every block of ``group_size`` consecutive ``ranks``
    (torch requires every rank to form every group); block ``mine``'s.

    Raises:
        RuntimeError: a peer did not join in time.
        StoreSilent: the store did not answer (``rendezvous``).
        InitError: a forming given up on still runs in this process.
    """
    own: Any = None
    refuse_while_held()
    with gloo_on_loopback(loopback):
        try:
            for block in range(len(ranks) // group_size):
                form = functools.partial(
                    dist.new_group,
                    list(ranks[block * group_size : (block + 1) * group_size]),
                    timeout=datetime.timedelta(seconds=timeout),
                )
                what = f"the forming of the group of block {block} of {group_size} ranks"
                group = rendezvous(form, what, timeout, late=_drop_late_group)
                if block == mine:
                    own = group
        except BaseException:
            if own is not None:  # a later block failed: this rank's own is nobody's
                with contextlib.suppress(RuntimeError, ValueError):
                    _drop_late_group(own)
            raise
    return own


def form_channel(ranks: Sequence[int], *, timeout: float, loopback: bool) -> Any:
    """A group over ``ranks`` (the default group's backends), formed by them alone.

    Over the whole world it is named by torch's group counter, which never
    repeats while the default group lives; over part of it (a sub-session's
    block), by a hash of the ranks and the number of live groups, as torch
    names a group the other ranks do not form (see the module docstring).

    Raises:
        RuntimeError: a peer did not join in time.
        StoreSilent: the store did not answer (``rendezvous``).
        InitError: a forming given up on still runs in this process.
    """
    refuse_while_held()
    form = functools.partial(
        dist.new_group,
        list(ranks),
        timeout=datetime.timedelta(seconds=timeout),
        use_local_synchronization=len(ranks) != dist.get_world_size(),
    )
    with gloo_on_loopback(loopback):
        return rendezvous(form, "a channel's forming", timeout, late=_drop_late_group)


def destroy(owns: Ownership, group: Any, side: Iterable[SideGroup]) -> None:
    """Destroy a closing lane's groups, on the closing thread (see the module
    docstring for what must happen before). A group already gone is skipped."""
    for each in side:
        each.close()
    if owns == "adopted":
        return
    try:
        dist.destroy_process_group(None if owns == "world" else group)
    except (RuntimeError, ValueError, KeyError) as exc:  # already gone
        logger.debug("destroy_process_group: %s", exc)


def destroy_world() -> None:
    """Destroy the default group (and every group formed over it) that no
    session holds: DI-engine's ``dist_finalize`` after someone else's
    ``init_process_group``. Nothing to do if there is none."""
    if dist.is_initialized():
        destroy("world", None, ())
