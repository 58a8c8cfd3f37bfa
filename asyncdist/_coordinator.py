"""Hosting an elastic session's coordinator outside the ranks.

``spawn`` hosts the coordinator in its own process and torchrun in node 0's
agent. A SLURM step has neither, so its task 0 starts a sidecar process
(``start_sidecar``) that hosts it: ``asyncdist coordinator``, the same
command a user runs to host one by hand. It is detached from task 0 (a
session of its own), so task 0's death leaves it serving the survivors.

The sidecar exits by itself (``serve``) when the session is over: once every
member it has seen left (``dead/{member}``, written by a leaving member), or
once no member's heartbeat has moved for twice the session timeout (they
all died, or the step was cancelled), or if nobody registered at all within
that time plus a minute for start-up. So it outlives no job.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import torch.distributed as dist

ROOT = "asyncdist/elastic"  # the elastic keys' prefix (a PrefixStore puts "/" after it)
_POLL = 0.25  # seconds between the sidecar's looks at the heartbeats
START_GRACE = 60.0  # seconds on top of the idle limit for the members to start


def serve(host: str, port: int, timeout: float, *, poll: float = _POLL) -> str:
    """Host a coordinator ``TCPStore`` on ``host:port`` (every interface for
    ``""``) until the session that uses it is over; why it ended.

    Raises:
        RuntimeError: the port could not be bound.
    """
    store = dist.TCPStore(
        host or "0.0.0.0",
        port,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    beats, dead = f"{ROOT}/hb/", f"{ROOT}/dead/"
    idle_limit = 2 * timeout
    started = moved = time.monotonic()
    seen: dict[str, int] = {}
    while True:
        time.sleep(poll)
        now = time.monotonic()
        keys = store.list_keys()
        members = [key[len(beats) :] for key in keys if key.startswith(beats)]
        for member in members:
            count = int(store.add(f"{beats}{member}", 0))
            if seen.get(member) != count:
                seen[member], moved = count, now
        if members and all(f"{dead}{member}" in keys for member in members):
            return "every member left"
        if seen and now - moved >= idle_limit:
            return f"no member's heartbeat moved for {idle_limit:g} s"
        if not seen and now - started >= idle_limit + START_GRACE:
            return f"no member registered within {idle_limit + START_GRACE:g} s"


def start_sidecar(port: int, timeout: float) -> subprocess.Popen[bytes]:
    """Start ``asyncdist coordinator`` on ``port`` of this host, detached (a
    session of its own: this process's death does not stop it). Its errors go
    to this process's stderr (the job's log)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncdist",
            "coordinator",
            "--port",
            str(port),
            "--timeout",
            f"{timeout:g}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
