"""A peer rank in a child process, so an in-process async test can be rank 0.

::

    async with late_peer(_peer_allreduce, LATE) as peer:
        async with DistSession(timeout=20) as s:   # rank 0 of a 2-rank gloo world
            ...

The test process plays the launcher agent, as :func:`asyncdist.spawn` does:
it hosts the rendezvous store on loopback (port from the OS), gives the
child the torchrun environment and takes the same environment itself (through
``monkeypatch.setenv``, undone when the block ends), so ``DistSession()`` here
is rank 0. The child runs ``peer_fn(session, *args)`` inside its own sync
``DistSession``; ``peer_fn`` must be a module-level function (the child is
started with ``spawn``). ``join_late`` delays the child's session entry.

On exit the block waits for the child without blocking the event loop (it
polls), kills and reaps it whatever happens, drops this process's kept store
connection for the port, and fails the test if the child raised (its
exception comes back pickled, with its traceback) or did not finish.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

import asyncdist._store

WORLD_SIZE = 2
JOIN_TIMEOUT = 30.0  # seconds the child gets to finish once the test's body is done
BODY_FAILED_GRACE = 1.0  # seconds it gets to report when the body failed


class PeerFailed(AssertionError):
    """The peer rank raised, died, or did not finish."""


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan if the test dies


def _torchrun_env(rank: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(WORLD_SIZE),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _child(
    peer_fn: Callable[..., Any],
    args: tuple[Any, ...],
    port: int,
    join_late: float,
    options: dict[str, Any],
    conn: multiprocessing.connection.Connection,
) -> None:
    _die_with_parent()
    os.environ.update(_torchrun_env(1, port))
    os.environ.pop("ASYNCDIST_DEBUG", None)
    try:
        import torch

        from asyncdist import DistSession

        torch.set_num_threads(1)
        time.sleep(join_late)
        with DistSession(**options) as session:
            result = peer_fn(session, *args)
        message: tuple[str, Any, str] = ("ok", result, "")
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the test
        try:
            blob = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an unpicklable exception
            blob = pickle.dumps(RuntimeError(repr(exc)))
        message = ("error", blob, traceback.format_exc())
    with contextlib.suppress(Exception):
        conn.send(message)
    conn.close()


class Peer:
    """The running peer: ``result`` (what ``peer_fn`` returned) once joined."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, port: int) -> None:
        self.proc = proc
        self.port = port
        self.result: Any = None


@contextlib.asynccontextmanager
async def late_peer(
    peer_fn: Callable[..., Any],
    *args: Any,
    join_late: float = 0.0,
    session_timeout: float = 20.0,
    join_within: float = JOIN_TIMEOUT,
    **session_options: Any,
) -> AsyncIterator[Peer]:
    """Make this process rank 0 of a 2-rank gloo world whose rank 1 runs
    ``peer_fn(session, *args)`` in a child process.

    ``session_timeout``: the child's session's (and the store's) timeout;
    ``join_within``: seconds the child gets to finish after the body;
    ``session_options`` go to the child's ``DistSession`` (e.g. ``debug=True``).
    """
    options = {"backend": "gloo", "timeout": session_timeout, **session_options}
    store = asyncdist._store.host_loopback_store(WORLD_SIZE, session_timeout)
    port = store.port
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_child,
        args=(peer_fn, args, port, join_late, options, sender),
        name="test-peer-rank1",
        daemon=True,
    )
    peer = Peer(proc, port)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in _torchrun_env(0, port).items():
                mp.setenv(name, value)
            proc.start()
            sender.close()
            try:
                yield peer
            except BaseException as exc:
                # The peer may wait for a collective rank 0 never issues: give
                # it a moment to report (its error may be the cause), then kill.
                peer_error = await _join(peer, receiver, BODY_FAILED_GRACE)
                if peer_error is not None and peer_error.__cause__ is not None:
                    exc.add_note(f"meanwhile the peer rank raised {peer_error.__cause__!r}")
                raise
            peer_error = await _join(peer, receiver, join_within)
            if peer_error is not None:
                raise peer_error
    finally:
        if proc.is_alive():
            proc.kill()
        if proc.pid is not None:  # started
            proc.join()  # reaping a killed process: milliseconds
        proc.close()
        receiver.close()
        # this process's client connection, kept per (addr, port) by asyncdist
        asyncdist._store.forget_address("127.0.0.1", port)
        del store


async def _join(
    peer: Peer, conn: multiprocessing.connection.Connection, within: float
) -> PeerFailed | None:
    """Wait for the child's message and exit by polling (the loop keeps
    running); kill it after ``within`` seconds. Returns what went wrong, if anything."""
    deadline = time.monotonic() + within
    message: tuple[str, Any, str] | None = None
    received = False
    while True:
        alive = peer.proc.is_alive()
        if not received and conn.poll():
            with contextlib.suppress(EOFError):
                message = conn.recv()
            received = True
        if not alive:
            break
        if time.monotonic() >= deadline:
            peer.proc.kill()
            if message is None:
                return PeerFailed(f"the peer rank did not finish within {within:g} s")
            break
        await anyio.sleep(0.01)
    if message is None:
        peer.proc.join()
        return PeerFailed(f"the peer rank exited with code {peer.proc.exitcode} without reporting")
    status, payload, text = message
    if status == "error":
        error = pickle.loads(payload)
        failure = PeerFailed(f"the peer rank raised {error!r}; its traceback:\n{text}")
        failure.__cause__ = error
        return failure
    peer.result = payload
    return None
