"""The rendezvous store under each session.

* The local default and :func:`asyncdist.spawn` host a ``TCPStore`` on a
  socket asyncdist binds itself to 127.0.0.1 with a port from the OS, so the
  store never listens beyond loopback and no port can be raced for.
* Stores on a fixed ``MASTER_PORT`` (torchrun, SLURM, explicit) are kept for
  the life of the process: re-creating one on the same port right after
  closing it fails with EADDRINUSE, so sessions opened one after another share
  it, each under its own :class:`~torch.distributed.PrefixStore`.
* A launcher agent's store (torchrun's, ``spawn``'s) outlives the workers, so
  after a torchrun restart it still holds the dead attempt's keys. Before the
  first session on it, the ranks agree on a fresh *generation* (see
  :func:`agree_generation`) and key everything under it. torchrun's
  ``TORCHELASTIC_RESTART_COUNT`` cannot serve: it counts the restarts each
  node *caused*, so nodes disagree on it after one of them fails.
"""

from __future__ import annotations

import datetime
import itertools
import socket
import threading
import time
import uuid

import torch.distributed as dist

from ._env import LOOPBACK, LaunchEnv, bind_loopback, is_loopback
from .errors import InitError

_lock = threading.Lock()
# (addr, port) -> (store, generation, session numbers on it): sessions are
# numbered per store, so a rank that used another store before still agrees
# with a fresh peer on this one
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

    Rank 0 picks a random name, publishes it under :data:`GENERATION_KEY` and
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
    deadline = time.monotonic() + timeout
    where = f"{env.master_addr}:{env.master_port}"
    if env.rank == 0:
        generation = uuid.uuid4().hex
        store.set(GENERATION_KEY, generation)
        hello = [f"asyncdist/{generation}/hello/{r}" for r in range(1, env.world_size)]
        waiting = set(range(1, env.world_size))
        delay, seen = _POLL_FIRST, 0
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
                delay = _POLL_FIRST
                continue
            if time.monotonic() >= deadline:
                missing = sorted(waiting)
                raise InitError(
                    f"rank 0 waited {timeout:g} s for rank(s) {_short(missing)} of "
                    f"{env.world_size} to join through the launcher's store at {where}. "
                    "Check that every node's launcher started and can reach it."
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)
        return generation

    token = uuid.uuid4().hex
    announced = ""  # the generation this rank has said hello under
    delay = _POLL_FIRST
    while True:
        if store.check([GENERATION_KEY]):
            generation = store.get(GENERATION_KEY).decode()
            if generation != announced:
                store.set(f"asyncdist/{generation}/hello/{env.rank}", token)
                store.add(f"asyncdist/{generation}/arrivals", 1)
                announced, delay = generation, _POLL_FIRST
            welcome = f"asyncdist/{generation}/welcome/{env.rank}"
            if store.check([welcome]) and store.get(welcome).decode() == token:
                return generation
        if time.monotonic() >= deadline:
            raise InitError(
                f"rank {env.rank} found no live rank 0 in the launcher's store at {where} "
                f"within {timeout:g} s. Check that rank 0's node is up and its worker "
                "started."
            )
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX)


def _short(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def forget(env: LaunchEnv) -> None:
    """Drop the kept store for ``env``'s master (its group never formed), so
    its port is released; the next session connects or hosts afresh."""
    with _lock:
        _kept.pop((env.master_addr, env.master_port or 0), None)


def session_store(env: LaunchEnv, timeout: float) -> tuple[dist.Store, dist.Store | None, bool]:
    """Return ``(store for this session, store the session owns or None, fresh)``;
    ``fresh``: this call created the kept store (see :func:`forget`).

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
