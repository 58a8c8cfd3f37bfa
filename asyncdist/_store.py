"""The rendezvous store under each session.

* The local default and :func:`asyncdist.spawn` host a ``TCPStore`` on a
  socket asyncdist binds itself to 127.0.0.1 with a port from the OS, so the
  store never listens beyond loopback and no port can be raced for.
* Stores on a fixed ``MASTER_PORT`` (torchrun, SLURM, explicit) are kept for
  the life of the process: re-creating one on the same port right after
  closing it fails with EADDRINUSE, so sessions opened one after another share
  it, each under its own :class:`~torch.distributed.PrefixStore`.
"""

from __future__ import annotations

import datetime
import itertools
import socket
import threading
import time

import torch.distributed as dist

from ._env import LaunchEnv, bind_loopback, is_loopback
from .errors import InitError

_lock = threading.Lock()
_kept: dict[tuple[str, int], dist.Store] = {}
_session_ids = itertools.count()


def host_loopback_store(world_size: int, timeout: float) -> dist.TCPStore:
    """A master ``TCPStore`` listening on 127.0.0.1 only, on a port the OS picks."""
    sock = bind_loopback()
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
        sock = bind_loopback(env.master_addr, env.master_port)
        try:
            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=True,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
                master_listen_fd=sock.fileno(),
            )
        except BaseException:
            sock.close()
            raise
        sock.detach()
        return store
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


def forget(env: LaunchEnv) -> None:
    """Drop the kept store for ``env``'s master (its group never formed), so
    its port is released; the next session connects or hosts afresh."""
    with _lock:
        _kept.pop((env.master_addr, env.master_port or 0), None)


def session_store(env: LaunchEnv, timeout: float) -> tuple[dist.Store, dist.Store | None, bool]:
    """Return ``(store for this session, store the session owns or None, fresh)``;
    ``fresh``: this call created the kept store (see :func:`forget`).

    Raises:
        InitError: the master could not be reached or its port could not be bound.
    """
    if env.master_port is None:
        if env.world_size != 1:
            raise InitError("a multi-process world needs a master port")
        owned = host_loopback_store(1, timeout)
        return owned, owned, False
    key = (env.master_addr, env.master_port)
    with _lock:
        store = _kept.get(key)
        fresh = store is None
        if store is None:
            try:
                store = _connect(env, timeout)
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
            _kept[key] = store
    prefix = f"asyncdist/attempt{env.attempt}/session{next(_session_ids)}"
    return dist.PrefixStore(prefix, store), None, fresh
