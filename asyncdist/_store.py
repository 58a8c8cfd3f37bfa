"""The rendezvous store under each session.

* The local default and [asyncdist.spawn][asyncdist.spawn] host a ``TCPStore`` on a
  socket asyncdist binds itself to 127.0.0.1 with a port from the OS, so the
  store never listens beyond loopback and no port can be raced for.
* Stores on a fixed ``MASTER_PORT`` (torchrun, SLURM, explicit) are kept for
  the life of the process: re-creating one on the same port right after
  closing it fails with EADDRINUSE, so sessions opened one after another share
  it, each under its own ``PrefixStore``.
* A launcher agent's store (torchrun's, ``spawn``'s) outlives the workers, so
  after a torchrun restart it still holds the dead attempt's keys. Before the
  first session on it, the ranks agree on a fresh *generation* (see
  ``agree_generation``) and key everything under it. torchrun's
  ``TORCHELASTIC_RESTART_COUNT`` cannot serve: it counts the restarts each
  node *caused*, so nodes disagree on it after one of them fails.
* A rank that leaves a session on purpose leaves a notice in the session's
  store first (``LeaveNotices``), so a peer whose collective then fails
  on the closed connection can say "rank N left" rather than "a peer died".
"""

from __future__ import annotations

import datetime
import itertools
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection
from typing import TypeVar, get_args

import torch.distributed as dist

from ._env import LOOPBACK, LaunchEnv, bind_loopback, is_loopback
from .errors import Departure, InitError, Leaving

logger = logging.getLogger("asyncdist")
T = TypeVar("T")

_lock = threading.Lock()
# (addr, port) -> (store, generation, session numbers on it): sessions are
# numbered per store, so a rank that used another store before still agrees
# with a fresh peer on this one. Process-wide state, as the port it holds is:
# a store outlives the session that made it, so that the next one, in any
# part of the program, reuses it instead of failing with EADDRINUSE.
_kept: dict[tuple[str, int], tuple[dist.Store, str, itertools.count[int]]] = {}

GENERATION_KEY = "asyncdist/generation"
_POLL_FIRST, _POLL_MAX = 0.002, 0.1  # seconds between checks, doubling


def host_loopback_store(
    world_size: int, timeout: float, host: str = LOOPBACK, port: int = 0
) -> dist.TCPStore:
    """A master ``TCPStore`` listening on loopback only (on ``host``, by
    default 127.0.0.1), on ``port`` or, for 0, a port the OS picks."""
    sock = bind_loopback(host, port)
    host, port = sock.getsockname()[:2]
    try:
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it itself
    return store


def _connect(env: LaunchEnv, timeout: float) -> dist.Store:
    assert env.master_port is not None
    hosting = env.rank == 0 and not env.agent_store
    if hosting and is_loopback(env.master_addr):
        return host_loopback_store(env.world_size, timeout, env.master_addr, env.master_port)
    if not hosting:
        timeout = _wait_for_master(env.master_addr, env.master_port, timeout)
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=hosting,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def _wait_for_master(host: str, port: int, timeout: float) -> float:
    """Wait until the master accepts connections; return the time left.

    torch's client retries with back-off in steps of the whole timeout, so an
    absent master would be reported only after about three timeouts; probing
    with plain sockets keeps the bound at the timeout itself.
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(remaining, 2.0))).close()
            return max(remaining, 1.0)
        except OSError as exc:
            if time.monotonic() + 0.2 >= deadline:
                raise InitError(
                    f"no rendezvous store answered at {host}:{port} within {timeout:g} s "
                    f"({exc}). Check MASTER_ADDR/MASTER_PORT and that rank 0 (or the "
                    "launcher) is up."
                ) from exc
            time.sleep(0.2)


def agree_generation(store: dist.Store, env: LaunchEnv, timeout: float) -> str:
    """Agree with the other ranks on a generation name no earlier attempt used.

    Rank 0 picks a random name, publishes it under ``GENERATION_KEY`` and
    welcomes every other rank by echoing the random token that rank wrote
    under the name. A rank that read a stale name (rank 0 of a dead attempt
    wrote it) gets no echo of its own token and says hello again as soon as
    the key changes.
    This relies on what torchrun guarantees on a restart: every worker of the
    old attempt is stopped before any worker of the new one starts, so only
    the live rank 0 can answer.

    Raises:
        InitError: rank 0 did not see every rank within ``timeout``, or a rank
            found no live rank 0.
    """
    poll = _Poll(timeout)
    where = f"{env.master_addr}:{env.master_port}"
    if env.rank == 0:
        generation = uuid.uuid4().hex
        store.set(GENERATION_KEY, generation)
        hello = [f"asyncdist/{generation}/hello/{r}" for r in range(1, env.world_size)]
        waiting = set(range(1, env.world_size))
        seen = 0
        while waiting:
            # one request per poll; the per-rank keys are read only after arrivals
            count = store.add(f"asyncdist/{generation}/arrivals", 0)
            arrived = [r for r in waiting if store.check([hello[r - 1]])] if count != seen else []
            seen = count
            if arrived:
                for r in arrived:
                    token = store.get(hello[r - 1]).decode()
                    store.set(f"asyncdist/{generation}/welcome/{r}", token)
                waiting.difference_update(arrived)
                poll.progressed()
                continue
            poll.sleep(
                lambda: InitError(
                    f"rank 0 waited {timeout:g} s for rank(s) {_short(sorted(waiting))} of "
                    f"{env.world_size} to join through the launcher's store at {where}. "
                    "Check that every node's launcher started and can reach it."
                )
            )
        return generation

    token = uuid.uuid4().hex
    announced = ""  # the generation this rank has said hello under
    while True:
        if store.check([GENERATION_KEY]):
            generation = store.get(GENERATION_KEY).decode()
            if generation != announced:
                store.set(f"asyncdist/{generation}/hello/{env.rank}", token)
                store.add(f"asyncdist/{generation}/arrivals", 1)
                announced = generation
                poll.progressed()
            welcome = f"asyncdist/{generation}/welcome/{env.rank}"
            if store.check([welcome]) and store.get(welcome).decode() == token:
                return generation
        poll.sleep(
            lambda: InitError(
                f"rank {env.rank} found no live rank 0 in the launcher's store at {where} "
                f"within {timeout:g} s. Check that rank 0's node is up and its worker "
                "started."
            )
        )


class _Poll:
    """The pauses between polls of the store, until a deadline: from
    ``_POLL_FIRST`` s, doubling up to ``_POLL_MAX`` s, and short again after
    progress."""

    __slots__ = ("_deadline", "_delay")

    def __init__(self, timeout: float) -> None:
        self._deadline = time.monotonic() + timeout
        self._delay = _POLL_FIRST

    def progressed(self) -> None:
        """The last poll found something: poll again soon."""
        self._delay = _POLL_FIRST

    def sleep(self, expired: Callable[[], InitError]) -> None:
        """Pause before the next poll.

        Raises:
            InitError: ``expired()``, once the deadline has passed.
        """
        if time.monotonic() >= self._deadline:
            raise expired()
        time.sleep(self._delay)
        self._delay = min(self._delay * 2, _POLL_MAX)


def _short(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def forget(env: LaunchEnv) -> None:
    """Drop the kept store for ``env``'s master (its group never formed), so
    its port is released; the next session connects or hosts afresh."""
    forget_address(env.master_addr, env.master_port or 0)


def forget_address(addr: str, port: int) -> None:
    """Drop the store kept for the master at ``addr:port``, if any.

    For tests and tools that host a master themselves: the sessions that
    used it are over, and this process's connection to it goes now.
    """
    with _lock:
        _kept.pop((addr, port), None)


def kept_addresses() -> frozenset[tuple[str, int]]:
    """The ``(addr, port)`` of every master whose store this process keeps.

    For tests and tools: a store stays kept from its first session to the
    end of the process, unless forgotten (``forget``, ``forget_address``).
    """
    with _lock:
        return frozenset(_kept)


def session_store(env: LaunchEnv, timeout: float) -> tuple[dist.Store, dist.Store | None, bool]:
    """Return ``(store for this session, store the session owns or None, fresh)``;
    ``fresh``: this call created the kept store (see ``forget``).

    Raises:
        InitError: the master could not be reached or its port could not be
            bound, or (on a launcher agent's store) the ranks did not agree on
            a generation in time.
    """
    if env.master_port is None:
        if env.world_size != 1:
            raise InitError("a multi-process world needs a master port")
        owned = host_loopback_store(1, timeout)
        return owned, owned, False
    key = (env.master_addr, env.master_port)
    with _lock:
        kept = _kept.get(key)
        fresh = kept is None
        if kept is None:
            try:
                store = _connect(env, timeout)
                # a store rank 0 hosts lives and dies with the job: no stale keys
                generation = agree_generation(store, env, timeout) if env.agent_store else "job"
            except InitError:
                raise
            except (OSError, RuntimeError) as exc:
                role = "host" if env.rank == 0 and not env.agent_store else "reach"
                raise InitError(
                    f"rank {env.rank} could not {role} the rendezvous store at "
                    f"{env.master_addr}:{env.master_port} ({exc}). Check MASTER_ADDR/"
                    "MASTER_PORT, that the master is up, and that the port is free and "
                    "reachable."
                ) from exc
            kept = _kept[key] = (store, generation, itertools.count())
    store, generation, numbers = kept
    prefix = f"asyncdist/{generation}/session{next(numbers)}"
    return dist.PrefixStore(prefix, store), None, fresh


# -- leave notices ---------------------------------------------------------------------

# Seconds a notice may take to post or read. Both run on a helper thread that
# is abandoned past this bound, so a dead or unreachable store can neither slow
# a session's exit nor hold up an error by more than this.
NOTICE_TIMEOUT = 2.0
_LEAVINGS: dict[str, Leaving] = {how: how for how in get_args(Leaving)}
# Sessions over a group this process formed, numbered in opening order (every
# rank opens them in the same order), so each one's notices have keys of their
# own even on a store that outlives it. Process-wide, as that store is: a
# count per session would restart at 0 and reuse an earlier session's keys.
_world_sessions = itertools.count()


def _bounded(call: Callable[[], T], timeout: float = NOTICE_TIMEOUT) -> T | None:
    """``call()``'s result, or ``None`` if it raised or took over ``timeout`` s."""
    box: list[T] = []

    def run() -> None:
        try:
            box.append(call())
        except Exception as exc:  # noqa: BLE001 - a notice is best effort
            logger.debug("leave notice: %s", exc)

    thread = threading.Thread(target=run, name="asyncdist-notice", daemon=True)
    thread.start()
    thread.join(timeout)
    return box[0] if box else None


class LeaveNotices:
    """The notices by which the ranks of one lane (a session, a sub-session,
    a channel) tell each other that they left it on purpose.

    A rank leaving a session appends ``"<rank>:<how>,"`` (``finished``,
    ``raised``, ``interrupted`` or ``cancelled``: how its block ended)
    under the lane's key *before* it destroys any group, so a peer whose
    collective fails on the closed connection finds the notice: it reads its
    own lane's key and every enclosing lane's (leaving a session leaves its
    channels and sub-sessions too). Keys live under the session's store and
    its number; a lane's key extends its parent's. The store is dropped when
    the session closes (``release``), so no handle keeps it, or its port,
    alive.
    """

    __slots__ = ("_key", "_parent", "_store", "label", "members")

    def __init__(
        self,
        store: dist.Store | None,
        key: str,
        members: Collection[int],
        label: str,
        parent: LeaveNotices | None = None,
    ) -> None:
        self._store = store
        self._key = key
        self._parent = parent
        self.members = frozenset(members)
        self.label = label

    @classmethod
    def for_world(cls, world_size: int, label: str) -> LeaveNotices | None:
        """Notices for a session over the default group it just formed, on the
        group's store; ``None`` where there is none (or no peer to tell)."""
        if world_size < 2:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, KeyError, AttributeError):
            return None
        return cls(store, f"asyncdist/left/{next(_world_sessions)}", range(world_size), label)

    def child(self, name: str, members: Collection[int], label: str) -> LeaveNotices:
        """The notices of a lane inside this one (``name``: its key, unique here)."""
        return LeaveNotices(None, f"{self._key}/{name}", members, label, self)

    def _root_store(self) -> dist.Store | None:
        notices: LeaveNotices | None = self
        while notices is not None and notices._parent is not None:
            notices = notices._parent
        return None if notices is None else notices._store

    def post(self, rank: int, how: Leaving) -> None:
        """Tell this lane's peers that ``rank`` leaves it now, and how its
        block ended (bounded)."""
        store = self._root_store()
        if store is None:
            return
        entry = f"{rank}:{how},"
        # Store.append is missing from torch's stubs, not from torch
        _bounded(lambda: store.append(self._key, entry))  # type: ignore[attr-defined]

    def departure(self, rank: int, number: int) -> Departure | None:
        """The first peer of this lane that left it (or an enclosing lane) on
        purpose, as seen by ``rank`` waiting in the lane's ``number``-th
        collective; ``None`` if none did, or the store cannot tell in time."""
        store = self._root_store()
        if store is None:
            return None
        lanes: list[LeaveNotices] = []
        notices: LeaveNotices | None = self
        while notices is not None:
            lanes.append(notices)
            notices = notices._parent

        def read() -> Departure | None:
            for lane in lanes:
                if not store.check([lane._key]):
                    continue
                for entry in store.get(lane._key).decode().split(","):
                    peer, _, how = entry.partition(":")
                    if peer.isdigit() and int(peer) != rank and int(peer) in self.members:
                        said = _LEAVINGS.get(how, "raised")
                        return Departure(int(peer), said, lane.label, self.label, number)
            return None

        return _bounded(read)

    def release(self) -> None:
        """Forget the store (the session closed)."""
        self._store = None
