"""spawn: run a function on N local ranks, each inside its own DistSession.

The parent plays torchrun's agent: it hosts the rendezvous store on a
loopback socket with a port from the OS, starts the ranks with the ``spawn``
start method (forking a process that holds torch threads is unsafe), gives
each the torchrun environment, collects results over pipes, and kills and
reaps every child before it returns, whatever happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ._debug import debug_from_env
from ._membership import COORDINATOR_ENV, JOIN_ENV, check_world_sizes, dead_key
from ._store import host_loopback_store
from .errors import (
    AsyncDistError,
    CollectiveError,
    MembershipLost,
    PeerFailure,
    SessionBroken,
    mismatch_hint,
)

# Once a rank's own error (or its death) is known, the other ranks get this
# long to finish or fail on their own (they usually see PeerFailure at once,
# and their reports and logs are worth having) before they are killed.
FAILURE_GRACE = 3.0
# The exit status of a rank that found the call to spawn running again while
# it started (a script without the main guard); the parent names the fix.
UNGUARDED_EXIT = 87
UNGUARDED_HINT = (
    "the script calls spawn when it is imported: each rank is a fresh process that "
    "imports the main script, so there the call to spawn ran again. Put the call to "
    'spawn (and whatever only the parent should run) under `if __name__ == "__main__":`.'
)

# When the first error to arrive is a consequence (a rank saw its peer leave),
# the rank that failed first is usually still leaving its session: this long
# to report its own error, which then wins.
CAUSE_GRACE = 2.0


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this child if the parent dies (no orphans)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    session_options: dict[str, Any],
    async_backend: str,
    conn: multiprocessing.connection.Connection,
) -> None:
    _die_with_parent()
    # The environment torchrun gives its workers; this process is ours alone.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    if session_options.get("elastic"):
        os.environ[COORDINATOR_ENV] = f"127.0.0.1:{port}"
    if session_options.pop("joining", False):
        os.environ[JOIN_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import anyio
    import torch

    from ._session import DistSession

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # A launcher's signal: SIGTERM unwinds the rank (leaving its session, so
    # the group is released) instead of killing it on the spot.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if inspect.iscoroutinefunction(fn):

            async def main() -> Any:
                async with DistSession(**session_options) as session:
                    return await fn(session, *args)

            result = anyio.run(main, backend=async_backend)
        else:
            with DistSession(**session_options) as session:
                result = fn(session, *args)
        message: tuple[Any, ...] = ("ok", result)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == 0:
            message = ("ok", None)
        else:
            error = AsyncDistError(f"rank {rank} exited with code {code}")
            message = ("error", error, traceback.format_exc())
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        message = ("error", exc, traceback.format_exc())
    data = _dump_message(message, rank)
    # A parent that is gone cannot be told; it reports this rank itself.
    with contextlib.suppress(BrokenPipeError):
        conn.send_bytes(data)
    conn.close()


def _dumps(obj: Any) -> bytes:
    """Pickle ``obj`` by value, tensors included, with plain ``pickle``.

    ``Connection.send`` uses multiprocessing's ``ForkingPickler``, where torch
    registers reductions that share a tensor's memory through a file
    descriptor the *sender* must keep serving; a rank has exited by the time
    the parent reads its result, so those cannot be used here.  A tensor that
    views a small part of a bigger storage is compacted first, so only its
    own elements travel.
    """
    buffer = io.BytesIO()
    _ValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


class _ValuePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or type(obj) is not torch.Tensor:
            return NotImplemented
        if obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
            return NotImplemented
        needed = obj.numel() * obj.element_size()
        if obj.untyped_storage().nbytes() <= needed:
            return NotImplemented
        compact = obj.detach().clone(memory_format=torch.contiguous_format)
        compact.requires_grad_(obj.requires_grad)
        return compact.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _dump_message(message: tuple[Any, ...], rank: int) -> bytes:
    """The rank's message as bytes; if it cannot be pickled, an error saying so."""
    try:
        return _dumps(message)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises
        problem = f"{type(exc).__name__}: {exc}"
        pickling_traceback = traceback.format_exc()
    if message[0] == "ok":
        what = f"rank {rank} returned a {type(message[1]).__name__} that cannot be pickled"
        details = pickling_traceback
        hint = "spawn sends results to the parent by pickle; return picklable values"
    else:
        original = message[1]
        what = f"rank {rank} raised {type(original).__name__}: {original}"
        what += ", and the exception cannot be pickled"
        details = message[2]
        hint = "make the exception picklable to get it back as itself"
    error = AsyncDistError(f"{what} ({problem}); {hint}")
    return _dumps(("error", error, details))


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _kill_and_reap(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()
        proc.close()


def spawn(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    backend: str | None = "gloo",
    timeout: float | None = 60.0,
    device: str | None = None,
    debug: bool = False,
    channels: Sequence[str] = (),
    async_backend: str = "asyncio",
    join_timeout: float | None = None,
    elastic: bool = False,
    min_world_size: int = 1,
    max_world_size: int | None = None,
    max_restarts: int = 0,
) -> list[Any]:
    """Run ``fn(session, *args)`` on ``world_size`` local ranks and return their results.

    Each rank is a fresh process with its own [DistSession][asyncdist.DistSession]
    (on gloo by default). ``fn`` may be ``async def``; it then runs under
    ``async_backend`` (``"asyncio"`` or ``"trio"``). ``fn``, ``args`` and the
    results must be picklable; ``fn`` must be importable (module level),
    which is checked before any process starts. Results come back by value,
    tensors included (a view of a bigger tensor brings only its own elements).

    When a rank fails, the call raises as soon as the cause is known: after a
    rank's own exception, or its death, the other ranks get at most 3 s to
    finish or fail on their own (they usually see ``PeerFailure`` at once),
    then they are killed and reaped, and the exception is raised. When the
    first error to arrive is one a rank saw *because* a peer left
    (``PeerFailure``, ``CollectiveTimeout``...), the others get up to 2 s to
    report the cause, which then wins.

    Args:
        backend: each rank's ``DistSession`` backend (default gloo).
        timeout: the sessions' timeout (seconds).
        device: each session's device.
        debug: verify collectives across ranks (``DistSession(debug=True)``).
        channels: channels each session forms on entry.
        join_timeout: wall-clock bound for the whole run; ``None``: none.
        elastic: each session is ``DistSession(elastic=True, min_world_size=...)``
            and this process is their coordinator: a rank's death is told to
            the others (who re-form without it) instead of ending the run.
        min_world_size: (elastic) the fewest ranks a world may have (at most
            ``world_size``).
        max_world_size: (elastic) the most ranks a world may have (at least
            ``world_size``; ``None``: no cap).
        max_restarts: (elastic) how many dead ranks, in all, are replaced by a
            fresh process that joins the running session at its next commit
            (the replacement's result takes the dead rank's slot).

    Returns:
        The ranks' return values, indexed by launch rank. With ``elastic``,
        a rank that died holds its ``PeerFailure`` (saying how it exited)
        instead, as ``asyncio.gather(..., return_exceptions=True)`` does; with
        ``max_restarts``, its replacement's result, or still the
        ``PeerFailure`` (with a note) if the replacement came after the
        others had finished.

    Raises:
        TypeError: ``fn`` cannot be pickled (a lambda or nested function), or
            ``elastic`` is not a bool (as ``DistSession`` refuses it).
        ValueError: a bad ``world_size``, ``max_restarts``, ``min_world_size``
            or ``max_world_size`` (nothing is started).
        RuntimeError: the ranks could not start because the main script calls
            spawn when it is imported (no ``if __name__ == "__main__":`` guard);
            raised as soon as the first rank exits.
        Exception: the first failing rank's own exception, with a note naming
            the rank and its traceback.
        PeerFailure: a rank died without reporting (killed by SIGABRT: most
            likely gloo aborting on mismatched collectives; the message says
            how to find the difference).
        AsyncDistError: a rank's result or exception could not be pickled
            (or unpickled here); the message names the rank.
        TimeoutError: ``join_timeout`` passed.

    No child outlives the call.
    """
    _refuse_while_bootstrapping()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    _check_importable(fn)
    options = {
        "backend": backend,
        "timeout": timeout,
        "device": device,
        "debug": debug,
        "channels": tuple(channels),
    }
    if not isinstance(elastic, bool):
        raise TypeError(f"elastic must be True or False, not {elastic!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative int, got {max_restarts!r}")
    if max_restarts and not elastic:
        raise ValueError("max_restarts replaces dead ranks of an elastic run: pass elastic=True")
    check_world_sizes(elastic, min_world_size, max_world_size)
    if max_world_size is not None and world_size > max_world_size:
        raise ValueError(f"world_size={world_size} is above max_world_size={max_world_size}")
    if elastic and world_size < min_world_size:
        raise ValueError(f"world_size={world_size} is below min_world_size={min_world_size}")
    if elastic:
        options |= {
            "elastic": True,
            "min_world_size": min_world_size,
            "max_world_size": max_world_size,
        }
    store = host_loopback_store(world_size, timeout or 300.0)
    port = store.port
    ctx = multiprocessing.get_context("spawn")
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: dict[int, multiprocessing.connection.Connection] = {}
    dead: list[multiprocessing.process.BaseProcess] = []

    def start(rank: int, joining: bool = False) -> None:
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child,
            args=(
                fn,
                tuple(args),
                rank,
                world_size,
                port,
                options | {"joining": True} if joining else options,
                async_backend,
                sender,
            ),
            name=f"asyncdist-rank{rank}",
            daemon=True,
        )
        proc.start()
        sender.close()
        if rank < len(procs):  # a replacement: the dead one was reaped already
            dead.append(procs[rank])
            procs[rank] = proc
            conns[rank].close()
        else:
            procs.append(proc)
        conns[rank] = receiver

    restarts = [max_restarts]

    def replace(rank: int) -> bool:
        if restarts[0] <= 0:
            return False
        restarts[0] -= 1
        start(rank, joining=True)
        return True

    try:
        for rank in range(world_size):
            start(rank)
        debugging = debug or debug_from_env()
        return _collect(procs, conns, join_timeout, debugging, store if elastic else None, replace)
    finally:
        _kill_and_reap(procs)
        for proc in dead:
            proc.close()
        for conn in conns.values():
            conn.close()
        del store


def _refuse_while_bootstrapping() -> None:
    """Stop a rank that runs spawn while it starts: its main script has no guard.

    A process of the ``spawn`` start method imports the parent's main script
    before it runs anything (multiprocessing then refuses to start processes
    with "An attempt has been made to start a new process before the current
    process has finished its bootstrapping phase"). This rank exits with
    ``UNGUARDED_EXIT`` at once, so that the parent names the fix and fails
    fast instead of reporting a rank that exited with code 1.
    """
    # multiprocessing's own test for this (multiprocessing.spawn._check_not_importing_main)
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"asyncdist.spawn: {UNGUARDED_HINT}", file=sys.stderr, flush=True)
        raise SystemExit(UNGUARDED_EXIT)


def _check_importable(fn: Callable[..., Any]) -> None:
    """Refuse, before any process starts, an ``fn`` the ranks could not unpickle.

    Raises:
        TypeError: ``fn`` cannot be pickled (a lambda, a nested function...).
    """
    try:
        pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # whatever pickling raises
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise TypeError(
            f"spawn: fn ({name}) cannot be sent to the ranks ({type(exc).__name__}: {exc}). "
            "Each rank is a fresh process that imports fn by name: define fn at module "
            "level (not a lambda or a function nested in another), in a module the ranks "
            "can import (under `if __name__ == '__main__':` in a script, only the call to "
            "spawn goes)."
        ) from exc


def _died(rank: int, exitcode: int | None, debug: bool) -> PeerFailure | RuntimeError:
    """The error for a rank that exited without sending a result."""
    if exitcode == UNGUARDED_EXIT:
        return RuntimeError(f"spawn: rank {rank} could not start: {UNGUARDED_HINT}")
    message = f"rank {rank} exited with code {exitcode} without returning a result"
    if exitcode == -signal.SIGABRT:
        message += f" (killed by SIGABRT). {mismatch_hint(debug=debug)}"
    return PeerFailure(message, op="spawn", rank=rank)


def _is_consequence(error: BaseException) -> bool:
    """Errors a rank sees *because* another rank failed first (a rank's own
    death, reported by spawn itself, is a cause)."""
    own_death = isinstance(error, CollectiveError) and error.op == "spawn"
    return isinstance(error, (CollectiveError, SessionBroken)) and not own_death


def _load_message(data: bytes, rank: int) -> tuple[Any, ...]:
    try:
        message = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raises
        error = AsyncDistError(
            f"rank {rank}'s message could not be unpickled in the parent "
            f"({type(exc).__name__}: {exc}); check that its result or exception "
            "can be rebuilt from its pickle"
        )
        return ("error", error, traceback.format_exc())
    return tuple(message)


def _collect(
    procs: Sequence[multiprocessing.process.BaseProcess],
    conns: dict[int, multiprocessing.connection.Connection],
    join_timeout: float | None,
    debug: bool = False,
    coordinator: Any = None,
    replace: Callable[[int], bool] = lambda rank: False,
) -> list[Any]:
    """Gather every rank's message; on failure, the root cause.

    Once a rank's own error (or its death) is known, the others get
    ``FAILURE_GRACE`` seconds to report before spawn kills them. The rank
    that fails first is not always the first to *report*, though: its peers
    see ``PeerFailure`` as soon as it leaves its session. So when the first
    error is such a consequence, the others get ``CAUSE_GRACE`` seconds, and
    the earliest error that is not a consequence wins.

    ``coordinator``: the store of an elastic run. A rank that dies there is
    written down as dead (so the others re-form without waiting for it)
    and its slot of the results holds its error; the run goes on, and
    ``replace(rank)`` may start a joiner in its place (``procs`` and
    ``conns`` then hold the new process). A replacement that arrives after
    the others finished (``MembershipLost(why="finished")``) is no failure:
    its slot keeps the dead rank's error.
    """
    results: dict[int, Any] = {}
    replaced: set[int] = set()
    errors: list[BaseException] = []
    pending = dict(conns)
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    while pending:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            if errors:
                break
            raise TimeoutError(
                f"spawn: ranks {sorted(pending)} did not finish within {join_timeout:g} s"
            )
        wait_for: list[Any] = list(pending.values())
        wait_for += [procs[rank].sentinel for rank in pending]
        ready = multiprocessing.connection.wait(
            wait_for, None if deadline is None else deadline - now
        )
        for rank, conn in list(pending.items()):
            sentinel_ready = procs[rank].sentinel in ready
            if conn not in ready and not sentinel_ready:
                continue
            data = None
            if conn.poll():
                # EOFError: nothing was sent; OSError: the rank died mid-message.
                with contextlib.suppress(EOFError, OSError):
                    data = conn.recv_bytes()
            elif not sentinel_ready:
                continue
            del pending[rank]
            message = None if data is None else _load_message(data, rank)
            if message is None:
                procs[rank].join()
                error: BaseException = _died(rank, procs[rank].exitcode, debug)
                if procs[rank].exitcode == UNGUARDED_EXIT:
                    raise error  # every rank fails so: no grace is worth waiting
                if coordinator is not None:
                    member = f"{socket.gethostname()}:{procs[rank].pid}"
                    coordinator.set(dead_key(member), f"exit {procs[rank].exitcode}")
                    results[rank] = error
                    if replace(rank):
                        replaced.add(rank)
                        pending[rank] = conns[rank]
                    continue
            elif message[0] == "ok":
                results[rank] = message[1]
                continue
            elif (
                rank in replaced
                and isinstance(message[1], MembershipLost)
                and message[1].why == "finished"
            ):
                results[rank].add_note(
                    f"its replacement came after the others had finished: {message[1]}"
                )
                continue
            else:
                error = message[1]
                error.add_note(f"raised on rank {rank} of {len(procs)}; its traceback:")
                error.add_note(message[2].rstrip())
            if not _is_consequence(error) or not errors:
                grace = time.monotonic() + (
                    CAUSE_GRACE if _is_consequence(error) else FAILURE_GRACE
                )
                deadline = grace if deadline is None else min(deadline, grace)
            errors.append(error)
    if errors:
        raise next((e for e in errors if not _is_consequence(e)), errors[0])
    return [results[rank] for rank in range(len(procs))]
