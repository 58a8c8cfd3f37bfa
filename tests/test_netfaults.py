"""Network faults between two namespace "hosts": the link pulled for good or for
2 s, black holes both ways and one way (``nft`` drops, no reset ever sent), a
partition during session entry and during teardown, and a link shaped to a
crawl under a 64 MiB allreduce.

Each test runs ranks of tests/netfault_worker.py on the two hosts of
:class:`tools.netns.TwoHosts` (one per host, or two per host), lets them stream
collectives, injects the fault and checks what every rank saw: a
``CollectiveTimeout`` or ``PeerFailure`` (``InitError`` on entry) within the
session timeout plus the documented grace, a clean exit from the session, no
asyncdist thread left, and, once the network is healed, a new session in the
same process with exact results. Every process is reaped and the namespaces
(with every rule in them) are deleted, whatever happens. The measured times
are in docs/failures.md; ``pytest -rP`` prints them.

Needs root, iproute2 and nftables; skips naming what is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from asyncdist._store import NOTICE_TIMEOUT  # noqa: E402
from tools.netns import TwoHosts, missing, missing_firewall  # noqa: E402

WORKER = Path(__file__).resolve().parent / "netfault_worker.py"
TIMEOUT = 3.0  # the session timeout of every case but the flap
# The documented bound (docs/failures.md): the session timeout plus 5 s, the
# watchdog's grace and time to be scheduled on a busy 2-core machine.
GRACE = 5.0
MIB_FLOATS = 1 << 18  # float32 elements in 1 MiB

_why = missing() or missing_firewall()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(150),
    pytest.mark.skipif(_why is not None, reason=f"network-fault tests {_why}"),
]

Inject = Callable[[TwoHosts], None]


class Job:
    """The ranks of one scenario, their files, and the fault's time."""

    def __init__(self, hosts: TwoHosts, out: Path, modes: tuple[str, ...], per_host: int) -> None:
        self.hosts, self.out, self.modes, self.per_host = hosts, out, modes, per_host
        self.procs: list[subprocess.Popen[bytes]] = []
        self.t_fault = 0.0

    def start(self, case: str, timeout: float, big: int) -> None:
        port = self.hosts.free_port(0)
        for rank, mode in enumerate(self.modes):
            host = rank // self.per_host
            cfg = {
                "rank": rank,
                "world": len(self.modes),
                "master": self.hosts.addr[0],
                "port": port,
                "timeout": timeout,
                "mode": mode,
                "case": case,
                "dir": str(self.out),
                "big": big,
            }
            env = self.hosts.env(host, ASYNCDIST_NETFAULT=json.dumps(cfg), PYTHONPATH=str(ROOT))
            with (self.out / f"log.{rank}").open("wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        self.hosts.command(host, [sys.executable, str(WORKER)]),
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )

    def logs(self) -> str:
        return "\n".join(
            f"--- rank {r}:\n{(self.out / f'log.{r}').read_text(errors='replace')[-2500:]}"
            for r in range(len(self.procs))
        )

    def wait_files(self, names: list[str], limit: float, what: str) -> None:
        deadline = time.monotonic() + limit
        while not all((self.out / name).exists() for name in names):
            dead = [p.returncode for p in self.procs if p.poll() is not None]
            if dead and any(dead):
                pytest.fail(f"a rank exited ({dead}) before {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                absent = [n for n in names if not (self.out / n).exists()]
                pytest.fail(f"{what}: no {absent} within {limit:g} s (a hang?)\n{self.logs()}")
            time.sleep(0.01)

    def mark(self, name: str, value: float) -> None:
        tmp = self.out / f".{name}.tmp"
        tmp.write_text(json.dumps(value))
        tmp.rename(self.out / name)

    def reports(self, kind: str) -> list[dict[str, Any]]:
        return [
            json.loads((self.out / f"{kind}.{r}.json").read_text()) for r in range(len(self.procs))
        ]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


def _left_in(hosts: TwoHosts) -> list[str]:
    """Processes still running in either namespace."""
    pids = []
    for ns in hosts.ns:
        done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids += done.stdout.split()
    return pids


def _scenario(
    tmp_path: Path,
    *,
    inject: Inject,
    modes: tuple[str, ...],
    case: str = "stream",
    per_host: int = 1,
    timeout: float = TIMEOUT,
    big: int = MIB_FLOATS,
    flap: float | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Run the ranks, inject the fault once they are where ``case`` wants it,
    heal once every rank reported (or, for a ``flap``, after that many
    seconds), and return ``(first reports, final reports, fault time)``."""
    world = len(modes)
    with TwoHosts() as hosts:
        job = Job(hosts, tmp_path, modes, per_host)
        try:
            job.start(case, timeout, big)
            armed = {
                "stream": [f"ready.{r}" for r in range(world)],
                "entry": ["entering.0"],
                "teardown": ["leaving.0", *(f"ready.{r}" for r in range(1, world))],
            }[case]
            job.wait_files(armed, 90, "the ranks got ready")
            if case == "entry":
                time.sleep(0.5)  # rank 0 is waiting for the others in the store
            inject(hosts)
            job.t_fault = time.monotonic()
            job.mark("fault", job.t_fault)
            if flap is not None:
                time.sleep(max(0.0, job.t_fault + flap - time.monotonic()))
                hosts.heal()
                job.mark("healed", time.monotonic())
            firsts = [f"first.{r}.json" for r in range(world)]
            # past the bound, the test fails: a hang
            job.wait_files(firsts, timeout + GRACE + 10, "every rank reported the fault")
            if flap is None:
                hosts.heal()
                job.mark("healed", time.monotonic())
            job.wait_files([f"final.{r}.json" for r in range(world)], 60, "the healed session")
            deadline = time.monotonic() + 30
            for proc in job.procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pytest.fail(f"a rank did not exit after its last session\n{job.logs()}")
            codes = [p.returncode for p in job.procs]
            assert codes == [0] * world, f"exit codes {codes}\n{job.logs()}"
            assert not _left_in(hosts), "processes left in the namespaces"
        finally:
            job.stop()
        return job.reports("first"), job.reports("final"), job.t_fault


def _left_threads(threads: dict[str, list[str]], *, cut_off: bool = False) -> list[str]:
    """asyncdist's Python threads and gloo's OS threads still running once every
    session was left (a kept rendezvous store's thread may stay, by design).

    ``cut_off``: the rank could not reach the store host when it left. Reading
    a leave notice there is abandoned after ``NOTICE_TIMEOUT`` (the error is
    not held up), but its thread stays blocked in torch's TCPStore client,
    which has no receive timeout (``set_timeout`` does not bound it), until
    the network heals; the final check, after the heal, requires it gone.
    """
    python = [n for n in threads["python"] if n.startswith("asyncdist")]
    if cut_off:
        python = [n for n in python if n != "asyncdist-notice"]
    return python + [n for n in threads["os"] if "gloo" in n]


def _check(
    first: list[dict[str, Any]],
    final: list[dict[str, Any]],
    t_fault: float,
    *,
    errors: tuple[str, ...],
    timeout: float = TIMEOUT,
    what: str,
) -> None:
    """Every rank: an allowed error within the bound, left cleanly, no asyncdist
    thread left, and the healed session worked."""
    measured = []
    for report in first:
        rank = report["rank"]
        assert report["error"] in errors, f"rank {rank}: {report.get('traceback', report)}"
        elapsed = report["t_error"] - t_fault
        measured.append(
            f"rank {rank} ({report['mode']}) {report['error']} after {elapsed:.2f} s, "
            f"left {report['t_left'] - report['t_error']:.2f} s later"
        )
        assert elapsed <= timeout + GRACE, f"rank {rank}: {elapsed:.2f} s after the fault"
        # leaving waits for nothing but the backend: where a peer's exit (not
        # the timeout) ended the first collective, one still queued behind it
        # (gloo runs two at a time) ends at its own timeout, and destroying
        # the group waits for that
        assert report["t_left"] - report["t_error"] < timeout + 1.0, report
        assert not report["initialized_after"], f"rank {rank} left the group initialised"
        # a rank cut off from the store may leave a notice read blocked until the heal
        cut_off = report["t_left"] - report["t_error"] >= NOTICE_TIMEOUT
        left = _left_threads(report["threads"], cut_off=cut_off)
        assert not left, f"rank {rank}: {report['threads']}"
    for report in final:
        assert report["ok"]
        assert report["state"] == "closed"
        assert not report["initialized"]
        assert not _left_threads(report["threads"]), report["threads"]
    print(f"netfault {what}: " + "; ".join(measured))


# -- 1, 2: the link pulled -------------------------------------------------------------


def test_link_down_for_good(tmp_path: Path) -> None:
    """Both veth ends down mid-stream (4 MiB allreduces in flight): no reset,
    no carrier; only the timeout can tell."""
    first, final, t = _scenario(
        tmp_path, inject=lambda h: h.link(up=False), modes=("sync", "asyncio")
    )
    _check(first, final, t, errors=("CollectiveTimeout", "PeerFailure"), what="link down")


def test_link_flap_shorter_than_timeout(tmp_path: Path) -> None:
    """Down for 2 s, then up, under a 5 s session timeout: TCP retransmits once
    the link is back (its backoff reaches 3 s at most), nothing was reset, so
    the stream goes on with exact results and ends normally."""
    first, final, t = _scenario(
        tmp_path,
        inject=lambda h: h.link(up=False),
        modes=("trio", "sync"),
        timeout=5.0,
        flap=2.0,
    )
    for report in first:
        assert report["error"] is None, report.get("traceback")
        assert report["steps"] > 2 * 5  # it streamed on after the flap (checked exactly)
        assert report["t_left"] - t > 2.0
    for report in final:
        assert report["ok"]
    print(f"netfault flap: {[r['steps'] for r in first]} steps, all exact, no error")


# -- 3, 4: black holes -----------------------------------------------------------------


def test_black_hole_four_ranks(tmp_path: Path) -> None:
    """Every packet between the hosts dropped (2 ranks per host; ranks on one
    host still reach each other)."""
    first, final, t = _scenario(
        tmp_path,
        inject=lambda h: h.drop(into=(0, 1)),
        modes=("sync", "asyncio", "trio", "sync"),
        per_host=2,
    )
    _check(first, final, t, errors=("CollectiveTimeout", "PeerFailure"), what="black hole")


def test_one_way_black_hole(tmp_path: Path) -> None:
    """Host 1 -> host 0 dropped; host 0 -> host 1 still delivered."""
    first, final, t = _scenario(
        tmp_path, inject=lambda h: h.drop(into=(0,)), modes=("asyncio", "trio")
    )
    _check(first, final, t, errors=("CollectiveTimeout", "PeerFailure"), what="one-way")


# -- 5: partitions at entry and at exit --------------------------------------------------


def test_partition_during_entry(tmp_path: Path) -> None:
    """Rank 0 hosts the store and waits in rendezvous; the partition comes,
    then rank 1 tries to join. The group never forms: InitError on both."""
    first, final, t = _scenario(
        tmp_path, inject=lambda h: h.drop(into=(0, 1)), modes=("trio", "sync"), case="entry"
    )
    _check(first, final, t, errors=("InitError",), what="partition at entry")


def test_partition_during_teardown(tmp_path: Path) -> None:
    """Each rank leaves its session with a 4 MiB allreduce outstanding; the
    partition comes while rank 0's exit is waiting on it. Leaving raises the
    unobserved error (docs/failures.md) and still releases everything."""
    first, final, t = _scenario(
        tmp_path, inject=lambda h: h.drop(into=(0, 1)), modes=("sync", "asyncio"), case="teardown"
    )
    _check(first, final, t, errors=("CollectiveTimeout", "PeerFailure"), what="partition at exit")


# -- 6: a crawl --------------------------------------------------------------------------


def test_link_shaped_to_a_crawl(tmp_path: Path) -> None:
    """tbf at 1 Mbit/s while 64 MiB allreduces stream (one needs ~9 min at that
    rate), session timeout 3 s."""
    first, final, t = _scenario(
        tmp_path,
        inject=lambda h: h.shape("1mbit"),
        modes=("asyncio", "sync"),
        big=64 * MIB_FLOATS,
    )
    _check(first, final, t, errors=("CollectiveTimeout", "PeerFailure"), what="crawl")
