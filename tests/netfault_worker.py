"""One rank of tests/test_netfaults.py, run on a namespace "host" (tools/netns.py).

Configured by ``$ASYNCDIST_NETFAULT`` (JSON: rank, world, master, port,
timeout, mode, case, dir, big). The test and the ranks talk through files in
``dir``; times are ``time.monotonic()``, one clock for every namespace:

* ``ready.<rank>``: this rank has run its warm-up steps (``entering.<rank>``
  for the entry case: it is about to enter the session);
* ``fault``: written by the test once the fault is in place (its time);
* ``first.<rank>.json``: how the faulted session ended here (error type, its
  time, whether leaving was clean);
* ``healed``: written by the test once the network is whole again;
* ``final.<rank>.json``: the new session after the heal, and the threads left.

``mode`` is how this rank waits: ``sync`` (``Handle.wait()``), ``asyncio`` or
``trio`` (``await``, through ``async with DistSession``). ``case``:

* ``stream``: collectives (a small and a large allreduce and a broadcast per
  step, every result checked exactly) until an error, or, once ``healed``
  exists and every rank agreed to stop, a normal end (the flap);
* ``entry``: rank 0 enters at once, the others only once the fault is in place;
* ``teardown``: after the warm-up, each rank launches a large allreduce and
  leaves the session without waiting on it: rank 0 first, the others once the
  fault is in place, so every rank's exit waits through the fault.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist

from asyncdist import DistSession, Handle

WARM = 5  # steps before the rank says it is ready for the fault
GIVE_UP = 60.0  # seconds of streaming after which a rank stops on its own (the test fails)

cfg: dict[str, Any] = json.loads(os.environ["ASYNCDIST_NETFAULT"])
RANK, WORLD, MODE, CASE = int(cfg["rank"]), int(cfg["world"]), str(cfg["mode"]), str(cfg["case"])
DIR = Path(cfg["dir"])


def _write(name: str, data: object) -> None:
    tmp = DIR / f".{name}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(DIR / name)  # readers never see half a file


def _wait_file(name: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not (DIR / name).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {RANK}: {name} never came")
        time.sleep(0.01)


def _session() -> DistSession:
    return DistSession(
        "gloo",
        rank=RANK,
        world_size=WORLD,
        master_addr=str(cfg["master"]),
        master_port=int(cfg["port"]),
        timeout=float(cfg["timeout"]),
        device="cpu",
    )


class Step:
    """One step's collectives, launched at once (they overlap), then checked."""

    def __init__(self, s: DistSession, step: int, stop: bool, big: int) -> None:
        self.step, self.world = step, s.world_size
        self.small = torch.tensor([float(s.rank + step), float(stop)], dtype=torch.float64)
        self.big = torch.full((big,), float(s.rank + 1))
        src = step % s.world_size
        self.bcast = torch.full((256,), float(step) if s.rank == src else -1.0)
        self.handles: list[Handle[Any]] = [
            s.allreduce(self.small),
            s.allreduce(self.big),
            s.broadcast(self.bcast, src=src),
        ]

    def check(self) -> bool:
        """Raise unless every result is exact; whether the ranks agreed to stop."""
        w = self.world
        assert self.small[0].item() == w * self.step + w * (w - 1) / 2, self.small
        assert bool((self.big == w * (w + 1) / 2).all()), "large allreduce inexact"
        assert bool((self.bcast == self.step).all()), "broadcast inexact"
        return self.small[1].item() > 0


class Run:
    def __init__(self) -> None:
        self.steps = 0
        self.t_error: float | None = None
        self.healed_seen: float | None = None
        self.started = time.monotonic()

    def want_stop(self) -> bool:
        if time.monotonic() - self.started > GIVE_UP:
            return True
        if self.healed_seen is None and (DIR / "healed").exists():
            self.healed_seen = time.monotonic()
        # stream on for a while after the heal: the flap must be behind us
        return self.healed_seen is not None and time.monotonic() - self.healed_seen > 1.0

    def before(self, s: DistSession) -> None:
        """Between steps: say ready after the warm-up; in the teardown case, launch
        the collective the exit will wait on (rank 0 before the fault, others after)."""
        if self.steps == WARM:
            _write(f"ready.{RANK}", time.monotonic())

    def teardown_launch(self, s: DistSession) -> None:
        if RANK != 0:
            _wait_file("fault")
        s.allreduce(torch.full((int(cfg["big"]),), 1.0))  # not waited on: the exit drains it
        _write(f"leaving.{RANK}", time.monotonic())


def _sync(run: Run) -> None:
    big = int(cfg["big"])
    if CASE == "entry" and RANK != 0:
        _wait_file("fault")
    elif CASE == "entry":
        _write(f"entering.{RANK}", time.monotonic())
    with _session() as s:
        while True:
            stop = run.want_stop() if CASE == "stream" else False
            step = Step(s, run.steps, stop, big)
            try:
                for handle in step.handles:
                    handle.wait()
            except BaseException:
                run.t_error = time.monotonic()
                raise
            run.steps += 1
            run.before(s)
            if step.check():
                break
            if CASE == "teardown" and run.steps == WARM:
                run.teardown_launch(s)
                break
            if CASE == "entry":
                break


async def _async(run: Run) -> None:
    big = int(cfg["big"])
    if CASE == "entry" and RANK != 0:
        await anyio.to_thread.run_sync(_wait_file, "fault")
    elif CASE == "entry":
        _write(f"entering.{RANK}", time.monotonic())
    async with _session() as s:
        while True:
            stop = run.want_stop() if CASE == "stream" else False
            step = Step(s, run.steps, stop, big)
            try:
                for handle in step.handles:
                    await handle
            except BaseException:
                run.t_error = time.monotonic()
                raise
            run.steps += 1
            run.before(s)
            if step.check():
                break
            if CASE == "teardown" and run.steps == WARM:
                await anyio.to_thread.run_sync(run.teardown_launch, s)
                break
            if CASE == "entry":
                break


def _threads() -> dict[str, Any]:
    """Python threads by name, and the OS threads' names (gloo's are
    ``gloo_tcp_loop``/``pt_gloo_runloop``; a kept store's ``pt_tcpstore_uv``)."""
    tasks = Path("/proc/self/task")
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return {"python": sorted(t.name for t in threading.enumerate()), "os": sorted(names)}


def _healed_session() -> dict[str, Any]:
    """A new session on the healed network: exact results, like any job's first."""
    with _session() as s:
        step = Step(s, 7, False, int(cfg["big"]))
        for handle in step.handles:
            handle.wait()
        step.check()
        gathered = s.all_gather_object(s.rank).wait()
        assert gathered == list(range(WORLD)), gathered
    return {"ok": True, "state": s.state.value}


def main() -> None:
    torch.set_num_threads(1)
    before = _threads()
    run = Run()
    first: dict[str, Any] = {"rank": RANK, "mode": MODE}
    try:
        if MODE == "sync":
            _sync(run)
        else:
            anyio.run(_async, run, backend=MODE)
        first["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported, judged by the test
        chain = []
        cause: BaseException | None = exc
        while cause is not None and len(chain) < 4:
            chain.append(f"{type(cause).__module__}.{type(cause).__name__}: {cause}"[:600])
            cause = cause.__cause__
        first["error"] = type(exc).__name__
        first["chain"] = chain
        first["traceback"] = traceback.format_exc()[-3000:]
    t_left = time.monotonic()
    first.update(
        steps=run.steps,
        t_error=run.t_error if run.t_error is not None else t_left,
        t_left=t_left,
        initialized_after=dist.is_initialized(),
        threads=_threads(),
    )
    _write(f"first.{RANK}.json", first)
    _wait_file("healed")
    final = _healed_session()
    final.update(threads_before=before, threads=_threads(), initialized=dist.is_initialized())
    _write(f"final.{RANK}.json", final)


if __name__ == "__main__":
    main()
