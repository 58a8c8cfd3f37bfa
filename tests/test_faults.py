"""Fault injection: every scenario of the reliability table, with its bound.

Each scenario runs under pytest-timeout (which dumps every thread's stack and
fails at its bound) and, for multi-process ones, spawn's own join timeout,
which kills and reaps every child. Ranks report what they saw into JSON files,
since a faulty run makes spawn raise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import torch
import torch.distributed as dist
from _ports import free_port
from _store_host import store_host, until_no_forming_is_held

from asyncdist import (
    AsyncDistError,
    CollectiveTimeout,
    DistSession,
    InitError,
    PeerFailure,
    SessionBroken,
    _groups,
    spawn,
)
from asyncdist._env import bind_loopback

MIB = 1 << 20


def _save(path: str, **data: Any) -> None:
    Path(path).write_text(json.dumps(data))


def _load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


# -- 1, 2: a rank dies -----------------------------------------------------------------


def _dies(s: DistSession, how: str, out: str) -> None:
    t = torch.ones(4 * MIB)  # 16 MiB
    if s.rank == 1:
        if how == "sigkill":
            s.allreduce(t)  # in flight when the rank is killed
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "exit0":
            sys.exit(0)
        elif how == "exit1":
            sys.exit(1)
        elif how == "abort":
            os.abort()
        time.sleep(30)
    t0 = time.monotonic()
    try:
        s.allreduce(t).wait()
        outcome = "completed"
    except PeerFailure:
        outcome = "PeerFailure"
    elapsed = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        s.barrier()
        broken = False
    except SessionBroken:
        broken = True
    _save(out, outcome=outcome, elapsed=elapsed, broken=broken, refused_in=time.monotonic() - t1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["sigkill", "exit0", "exit1", "abort"])
def test_dead_rank(how: str, tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    t0 = time.monotonic()
    if how == "exit0":  # a clean exit is a rank's own business: no result, no error
        assert spawn(_dies, 2, args=(how, str(out)), timeout=30, join_timeout=40) == [None, None]
    else:
        with pytest.raises(AsyncDistError, match="rank 1"):
            spawn(_dies, 2, args=(how, str(out)), timeout=30, join_timeout=40)
    report = _load(out)
    print(f"measured: dead rank ({how}) -> PeerFailure after {report['elapsed']:.2f} s")
    assert report["outcome"] == "PeerFailure"
    assert report["elapsed"] < 5.0
    assert report["broken"]
    assert report["refused_in"] < 0.1
    assert time.monotonic() - t0 < 30


# -- 3: a silent rank ------------------------------------------------------------------


def _silent(s: DistSession, how: str, out: str) -> None:
    if s.rank == 1:
        s.barrier().wait()
        if how == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(30)
        return
    s.barrier().wait()
    t0 = time.monotonic()
    try:
        s.allreduce(torch.ones(1024)).wait()
        outcome = "completed"
    except CollectiveTimeout:
        outcome = "CollectiveTimeout"
    _save(out, outcome=outcome, elapsed=time.monotonic() - t0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["sleep", "sigstop"])
def test_silent_rank_times_out(how: str, tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, AsyncDistError)):
        spawn(_silent, 2, args=(how, str(out)), timeout=3, join_timeout=15)
    report = _load(out)
    print(f"measured: silent rank ({how}) -> CollectiveTimeout after {report['elapsed']:.2f} s")
    assert report["outcome"] == "CollectiveTimeout"
    assert 3.0 <= report["elapsed"] <= 8.0
    assert time.monotonic() - t0 < 25, "finalize or the kill of the silent rank hung"


def _wakes_late(s: DistSession) -> str:
    """Rank 1 sleeps past the timeout; rank 0 times out, and its block goes
    on and ends normally. What rank 1 is told once awake."""
    if s.rank == 0:
        try:
            s.allreduce(torch.ones(4)).wait()
        except CollectiveTimeout as exc:
            return type(exc).__name__
        return "completed"
    time.sleep(4.0)
    try:
        s.allreduce(torch.ones(4)).wait()
    except PeerFailure as exc:
        return str(exc)
    return "completed"


@pytest.mark.timeout(60)
def test_a_rank_that_wakes_after_the_others_timed_out_is_not_told_of_a_crash() -> None:
    """It used to read "a peer died or closed its connection without leaving
    the session", with gloo's abort hint: the peer had left, after its
    timeout, because this rank was late."""
    timed_out, woke = spawn(_wakes_late, 2, timeout=2, join_timeout=30)
    assert timed_out == "CollectiveTimeout"
    assert "rank 0 gave up waiting for the others" in woke, woke
    assert "DistSession(timeout=...)" in woke
    assert "died" not in woke


# -- 4: SIGTERM mid-step ---------------------------------------------------------------


def _sigterm(s: DistSession, out: str) -> None:
    if s.rank == 1:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        s.allreduce(torch.ones(1024)).wait()  # rank 0 is late: waiting when SIGTERM lands
        return
    time.sleep(2.0)
    # rank 1's exit waits for the allreduce it had launched (nothing is lost)...
    s.allreduce(torch.ones(1024)).wait()
    t0 = time.monotonic()
    try:  # ...and then releases its group: the next collective fails at once
        s.allreduce(torch.ones(1024)).wait()
        outcome = "completed"
    except PeerFailure:
        outcome = "PeerFailure"
    _save(out, outcome=outcome, elapsed=time.monotonic() - t0)


@pytest.mark.timeout(60)
def test_sigterm_leaves_the_session_and_peers_see_peer_failure(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    t0 = time.monotonic()
    with pytest.raises(AsyncDistError, match="rank 1 exited with code 143"):
        spawn(_sigterm, 2, args=(str(out),), timeout=30, join_timeout=40)
    print(f"measured: SIGTERM run over after {time.monotonic() - t0:.2f} s")
    assert time.monotonic() - t0 < 15
    report = _load(out)
    assert report["outcome"] == "PeerFailure", "rank 1 released its group on SIGTERM"
    assert report["elapsed"] < 5.0


# -- 5, 6, 7: forming the group --------------------------------------------------------


def test_missing_rank_is_an_init_error_and_the_port_is_released() -> None:
    port = free_port()
    t0 = time.monotonic()
    session = DistSession(rank=0, world_size=3, master_port=port, timeout=3)
    with pytest.raises(InitError, match="could not form"):
        session.__enter__()
    print(f"measured: missing rank -> InitError after {time.monotonic() - t0:.2f} s")
    assert time.monotonic() - t0 < 3 + 5
    assert not dist.is_initialized()
    gc.collect()
    sock = bind_loopback(port=port)  # would raise EADDRINUSE if still held
    sock.close()


def test_unreachable_master_is_an_init_error_naming_it() -> None:
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    session = DistSession(rank=1, world_size=2, master_port=port, timeout=3)
    with pytest.raises(InitError, match=f"127.0.0.1:{port}"):
        session.__enter__()
    print(f"measured: unreachable master -> InitError after {time.monotonic() - t0:.2f} s")
    assert time.monotonic() - t0 < 3 + 5


def test_master_port_already_taken() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        session = DistSession(rank=0, world_size=2, master_port=port, timeout=3)
        with pytest.raises(InitError, match=f"127.0.0.1:{port}"):
            session.__enter__()
    finally:
        taken.close()


@pytest.mark.timeout(60)
def test_a_master_frozen_at_entry_is_an_init_error_and_holds_no_later_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The master's host freezes (SIGSTOP: it still accepts connections, and
    answers nothing): torch's store client then waits forever, whatever its
    timeout. Entry gives up at the timeout plus the grace, and while that
    forming is still held, no other session of this process forms beside
    it; once the store closes, the held forming ends and sessions form again."""
    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.5)
    with store_host() as host:
        host.stop()
        t0 = time.monotonic()
        session = DistSession(rank=1, world_size=2, master_port=host.port, timeout=1)
        with pytest.raises(InitError) as told:
            session.__enter__()
        elapsed = time.monotonic() - t0
        print(f"measured: frozen master -> InitError after {elapsed:.2f} s")
        assert 2.5 <= elapsed < 2.5 + 2.0  # two phases (the master, the group) and the grace
        assert str(told.value).startswith(
            f"rank 1 of 2 could not form a gloo group via 127.0.0.1:{host.port} within 1 s "
            "(rank 1's forming of the default group: the rendezvous store did not answer "
            "within 2.5 s; its host is stopped or frozen, or cut off from this process)"
        ), told.value
        assert not dist.is_initialized()
        with pytest.raises(InitError, match="this process gave up on rank 1's forming of the"):
            DistSession(rank=0, world_size=1, timeout=1).__enter__()
        host.kill()
    until_no_forming_is_held()
    with DistSession(rank=0, world_size=1, timeout=5) as s:
        assert s.allreduce(torch.ones(1)).wait().item() == 1.0


def _rank_sum(s: DistSession) -> float:
    t = torch.tensor([float(s.rank)])
    return s.allreduce(t).wait().item()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_spawn_back_to_back_and_in_parallel_never_hits_address_in_use() -> None:
    for _ in range(50):
        assert spawn(_rank_sum, 2) == [1.0, 1.0]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(spawn, _rank_sum, 2) for _ in range(4)]
        assert [r.result(timeout=120) for r in runs] == [[1.0, 1.0]] * 4


# -- 9, 10: cancellation ---------------------------------------------------------------


async def _cancel_late(s: DistSession) -> list[float]:
    if s.rank == 1:
        await anyio.sleep(2.0)
    t = torch.full((1000,), float(s.rank + 1))
    h = s.allreduce(t)
    del t  # only the handle keeps the tensor alive now
    gc.collect()
    with anyio.move_on_after(0.3):
        await h
    result = await h
    return result[:3].tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancel_while_a_peer_is_late_then_await_again(backend: str) -> None:
    assert spawn(_cancel_late, 2, async_backend=backend) == [[3.0] * 3] * 2


async def _cancel_in_exit(s: DistSession) -> dict[str, Any]:
    s.close()
    t0 = time.monotonic()
    if s.rank == 0:
        with anyio.move_on_after(0.3):
            async with DistSession(timeout=20) as inner:
                h = inner.allreduce(torch.ones(100))
            # the cancel landed while the exit waited for h: it still finished
    else:
        async with DistSession(timeout=20) as inner:
            await anyio.sleep(1.5)
            h = inner.allreduce(torch.ones(100))
    return {
        "released": not dist.is_initialized(),
        "elapsed": time.monotonic() - t0,
        "result": h.wait(timeout=0).tolist()[:2],
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancellation_during_exit_still_finalizes(backend: str) -> None:
    for report in spawn(_cancel_in_exit, 2, async_backend=backend):
        print(f"measured: exit cancelled ({backend}) finalized after {report['elapsed']:.2f} s")
        assert report["released"]
        assert 1.5 <= report["elapsed"] < 10
        assert report["result"] == [2.0, 2.0]


# -- 11: an exception on one rank only -------------------------------------------------


def _one_raises(s: DistSession, out: str) -> None:
    if s.rank == 0:
        raise ValueError("only here")
    t0 = time.monotonic()
    try:
        s.allreduce(torch.ones(10)).wait()
    except PeerFailure:
        _save(out, elapsed=time.monotonic() - t0)


@pytest.mark.timeout(60)
def test_exception_on_one_rank_does_not_deadlock_teardown(tmp_path: Path) -> None:
    out = tmp_path / "rank1.json"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="only here"):
        spawn(_one_raises, 2, args=(str(out),), timeout=10)
    print(f"measured: one rank raises -> peer PeerFailure after {_load(out)['elapsed']:.2f} s")
    assert _load(out)["elapsed"] < 10 + 5
    assert time.monotonic() - t0 < 30


# -- a fault nobody waited on is raised at exit -------------------------------------------


def _unwaited_fault(s: DistSession, out: str) -> None:
    s.barrier().wait()
    if s.rank == 1:
        os._exit(1)
    s.allreduce(torch.ones(1 << 16))  # launched, never waited on
    deadline = time.monotonic() + 10
    while s.state.value != "broken" and time.monotonic() < deadline:
        time.sleep(0.05)  # the watchdog settles the handle and breaks the session
    state = s.state.value
    try:
        s.close()
        outcome = "clean exit"
    except PeerFailure:
        outcome = "PeerFailure"
    # a broken session still releases everything: the group and its threads
    threads = [t.name for t in threading.enumerate() if t.name.startswith("asyncdist")]
    _save(out, state=state, outcome=outcome, group=dist.is_initialized(), threads=threads)


@pytest.mark.timeout(60)
def test_a_fault_nobody_waited_on_is_raised_when_the_session_is_left(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    with pytest.raises(AsyncDistError):
        spawn(_unwaited_fault, 2, args=(str(out),), timeout=10, join_timeout=30)
    assert _load(out) == {
        "state": "broken",
        "outcome": "PeerFailure",
        "group": False,
        "threads": [],
    }


# -- 12: exit without finalize -----------------------------------------------------------

NO_FINALIZE = """
import sys, torch
from asyncdist import DistSession
s = DistSession(rank=int(sys.argv[1]), world_size=2, master_port=int(sys.argv[2]), timeout=20)
s.__enter__()
handles = [s.allreduce(torch.ones(1000)) for _ in range(50)]
handles[-1].wait()
s.allreduce(torch.ones(1 << 16))  # still outstanding at exit
print("exiting without finalize", flush=True)
"""


@pytest.mark.timeout(90)
def test_exit_without_finalize_does_not_abort(tmp_path: Path) -> None:
    script = tmp_path / "no_finalize.py"
    script.write_text(NO_FINALIZE)
    for _ in range(3):
        port = free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank), str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        try:
            outputs = [p.communicate(timeout=60) for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait()
        for proc, (stdout, stderr) in zip(procs, outputs, strict=True):
            assert "exiting without finalize" in stdout
            assert "terminate called" not in stderr
            assert proc.returncode == 0, stderr


# -- 13, 14: resources over time ---------------------------------------------------------


def _resources() -> tuple[int, int, int]:
    me = psutil.Process()
    return threading.active_count(), me.num_fds(), me.memory_info().rss


def _settled_resources() -> tuple[int, int, int]:
    gc.collect()
    time.sleep(0.3)  # let peers' closing sockets and finished threads go away
    return _resources()


def _cycles(s: DistSession, count: int) -> dict[str, Any]:
    s.close()
    samples = {}
    for cycle in range(1, count + 1):
        with DistSession(timeout=20) as t:
            wait = [t.allreduce(torch.ones(1000)) for _ in range(5)]
            wait[-1].wait()
            t.broadcast_object({"k": 1}).wait()
        if cycle in (10, count):  # after first-time allocations, and at the end
            samples[cycle] = _settled_resources()
    return {"before": samples[10], "after": samples[count]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_open_close_cycles_leak_nothing() -> None:
    for report in spawn(_cycles, 2, args=(50,), timeout=30):
        (t0, f0, r0), (t1, f1, r1) = report["before"], report["after"]
        print(f"measured: 40 cycles: threads {t0}->{t1}, fds {f0}->{f1}, rss x{r1 / r0:.3f}")
        assert t1 <= t0, "threads grew"
        assert f1 <= f0 + 2, f"file descriptors grew from {f0} to {f1} over 40 cycles"
        assert r1 <= r0 * 1.05, f"RSS grew {r1 / r0:.3f}x"


async def _soak(s: DistSession, total: int, window: int) -> dict[str, Any]:
    pending: list[tuple[int, Any]] = []
    gc.collect()
    threads0, _, rss0 = _resources()
    for i in range(total):
        pending.append((i, s.allreduce(torch.full((64,), float(i)))))
        if len(pending) >= window:
            j, h = pending.pop(0)
            assert (await h)[0].item() == 2.0 * j
        if i == total // 10:
            gc.collect()
            threads0, _, rss0 = _resources()
    for j, h in pending:
        assert (await h)[0].item() == 2.0 * j
    gc.collect()
    threads1, _, rss1 = _resources()
    return {"threads": (threads0, threads1), "rss": (rss0, rss1)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_soak_10000_ops_with_300_outstanding(backend: str) -> None:
    t0 = time.monotonic()
    reports = spawn(_soak, 2, args=(10_000, 300), async_backend=backend, timeout=30)
    print(f"measured: soak ({backend}) {time.monotonic() - t0:.1f} s, {reports}")
    for report in reports:
        assert report["threads"][1] <= report["threads"][0]
        assert report["rss"][1] <= report["rss"][0] * 1.05


# -- 15: chaos -----------------------------------------------------------------------------


def _chaos(s: DistSession, seed: int, out_dir: str) -> None:
    rng = random.Random(seed)
    victim, fault_step = rng.randrange(s.world_size), rng.randrange(20, 200)
    fault = rng.choice(["kill", "stop", "exit"])
    last_ok = time.monotonic()
    outcome = "finished"
    try:
        for step in range(200):
            if s.rank == victim and step == fault_step:
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    os._exit(3)
            t = torch.full((256,), float(s.rank))
            s.allreduce(t).wait()
            assert t[0].item() == sum(range(s.world_size)), "wrong result"
            last_ok = time.monotonic()
    except AsyncDistError as exc:
        outcome = type(exc).__name__
    Path(out_dir, f"rank{s.rank}.json").write_text(
        json.dumps(
            {
                "outcome": outcome,
                "after_last_ok": time.monotonic() - last_ok,
                "victim": victim,
                "fault": fault,
            }
        )
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2, 3, 5, 6, 7])  # kill, kill, exit, exit, stop, stop
def test_chaos(seed: int, tmp_path: Path) -> None:
    timeout = 3.0
    with pytest.raises((AsyncDistError, TimeoutError)):
        spawn(_chaos, 4, args=(seed, str(tmp_path)), timeout=timeout, join_timeout=25)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(reports) == 3, "every survivor reports"
    worst = max(r["after_last_ok"] for r in reports)
    fault = reports[0]["fault"]
    print(f"measured: chaos seed {seed} ({fault}) error {worst:.2f} s after last success")
    for report in reports:
        assert report["outcome"] in ("PeerFailure", "CollectiveTimeout", "CollectiveError")
        assert report["after_last_ok"] <= timeout + 5


# -- mismatched collectives without debug mode -------------------------------------------


def _mismatched_sizes(s: DistSession, out: str) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank gloo aborts leaves no core
    size = 4 if s.rank == 0 else 8  # gloo aborts one rank from C++ (EnforceNotMet)
    t0 = time.monotonic()
    try:
        s.allreduce(torch.ones(size)).wait()
    except PeerFailure as exc:
        _save(f"{out}.rank{s.rank}", message=str(exc), elapsed=time.monotonic() - t0)


@pytest.mark.timeout(60)
def test_mismatched_collectives_without_debug_the_surviving_rank_is_told(tmp_path: Path) -> None:
    # Under torchrun nobody reads the dead rank's exit status: the survivor's own
    # PeerFailure is what the user sees, so it carries spawn's hint too.
    out = tmp_path / "seen"
    with pytest.raises(PeerFailure, match="killed by SIGABRT") as info:
        spawn(_mismatched_sizes, 2, args=(str(out),), timeout=20, join_timeout=40)
    assert "how gloo reports mismatched collectives" in str(info.value)
    reports = [_load(path) for path in sorted(tmp_path.glob("seen.rank*"))]
    assert len(reports) == 1, "one rank aborts, the other sees it vanish"
    message = reports[0]["message"]
    print(f"measured: mismatch -> PeerFailure on the survivor after {reports[0]['elapsed']:.2f} s")
    assert message.startswith("allreduce on rank "), message
    assert "gloo::EnforceNotMet" in message
    assert "how gloo reports mismatched collectives" in message
    assert "Run with debug=True (or ASYNCDIST_DEBUG=1)" in message
    assert "CollectiveMismatch" in message
    assert reports[0]["elapsed"] < 5.0


# -- Ctrl-C under torchrun ---------------------------------------------------------------

INTERRUPTED = {
    "sync": """
import os, time, torch
from asyncdist import DistSession

with DistSession(timeout=30) as s:
    t = torch.ones(1 << 16)
    s.allreduce(t).wait()
    print(f"rank {s.rank} ready pid {os.getpid()}", flush=True)
    while True:
        if s.rank == 0:
            time.sleep(0.3)  # mostly here when Ctrl-C lands; rank 1 waits in the allreduce
        s.allreduce(t).wait()
""",
    "async": """
import os, sys, anyio, torch
from asyncdist import DistSession

async def main():
    async with DistSession(timeout=30) as s:
        t = torch.ones(1 << 16)
        await s.allreduce(t)
        print(f"rank {s.rank} ready pid {os.getpid()}", flush=True)
        while True:
            if s.rank == 0:
                await anyio.sleep(0.3)
            await s.allreduce(t)

anyio.run(main, backend=sys.argv[1])
""",
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["sync", "trio", "asyncio"])
def test_ctrl_c_under_torchrun_is_reported_as_an_interrupt(how: str, tmp_path: Path) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED["sync" if how == "sync" else "async"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.Popen(
        [*torchrun, "--nproc-per-node=2", str(script), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job
        cwd=tmp_path,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    workers: list[int] = []  # torchrun starts each worker in a session of its own
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
            # (two ranks' lines may interleave: count the words, not the lines)
            workers = [int(pid) for pid in re.findall(r"ready pid (\d+)", "".join(lines))]
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        t0 = time.monotonic()
        proc.wait(timeout=20)
        elapsed = time.monotonic() - t0
    finally:  # nothing outlives the test: torchrun, then its workers
        left: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            left = psutil.Process(proc.pid).children(recursive=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in workers:  # (orphans once torchrun is gone; checked before a kill)
            with contextlib.suppress(psutil.Error):
                worker = psutil.Process(pid)
                if str(script) in worker.cmdline():
                    left.append(worker)
        for worker in left:
            with contextlib.suppress(psutil.Error):
                worker.kill()
        psutil.wait_procs(left, timeout=10)
        reader.join(10)  # the pipe closes once every worker is gone
    output = "".join(lines)
    assert not reader.is_alive(), f"a worker kept torchrun's output open: {output}"
    if proc.stdout is not None:
        proc.stdout.close()
    print(f"measured: every rank gone {elapsed:.2f} s after Ctrl-C")
    assert elapsed < 10, output
    assert "Connection closed by peer" not in output, output
    assert "left the session by an exception" not in output, output
    if how == "asyncio":  # asyncio turns Ctrl-C into the main task's cancellation
        assert "rank 0 left the session because its task was cancelled" in output, output
    else:
        assert "rank 0 was interrupted (KeyboardInterrupt" in output, output


# -- 16: a CPU hog ---------------------------------------------------------------------------


def _busy(s: DistSession) -> int:
    done = 0
    for _ in range(100):
        t = torch.ones(64 * 1024)
        s.allreduce(t).wait()
        assert t[0].item() == s.world_size
        done += 1
    return done


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_false_timeouts_under_a_cpu_hog() -> None:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert spawn(_busy, 4, timeout=10) == [100] * 4
    finally:
        hog.kill()
        hog.wait()


# -- 17: bad input that only this file covers --------------------------------------------------


def test_meta_tensor_is_refused_before_launch() -> None:
    with DistSession() as s:
        with pytest.raises(ValueError, match=r"is on meta, but this session serves cpu \(gloo\)"):
            s.allreduce(torch.ones(2, device="meta"))
        assert s.allreduce(torch.ones(2)).wait().tolist() == [1.0, 1.0]


_STAGGERED = """
import sys, time
import torch
torch.set_num_threads(1)
from asyncdist import DistSession, _groups
_groups.RENDEZVOUS_GRACE = 0.5
rank, port, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
time.sleep(delay)
with DistSession(rank=rank, world_size=3, master_port=port, timeout=4) as s:
    assert s.allreduce(torch.ones(1)).wait().item() == 3.0
print("entered", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_staggered_start_within_each_phases_timeout_enters() -> None:
    """Entry waits up to the timeout for the master, then up to the timeout
    in init_process_group: rank 1 first, the master 3 s later, rank 2 3 s
    after that (timeout 4) all enter. The rendezvous bound once covered a
    single timeout, and rank 1 gave up at 4.5 s blaming a frozen store."""
    from _ports import free_port

    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _STAGGERED, str(rank), str(port), str(delay)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, delay in ((1, 0.0), (0, 3.0), (2, 6.0))
    ]
    try:
        outputs = [rank.communicate(timeout=45) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait(10)
    for process, (out, err) in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, err[-2000:]
        assert out.strip() == "entered", err[-2000:]
