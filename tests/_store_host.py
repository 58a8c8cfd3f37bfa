"""A rendezvous store hosted by a child process that a test can stop:
``with store_host() as host: ... host.stop() ...``.

A stopped process (``SIGSTOP``) keeps its listening socket: the kernel still
accepts connections and takes in what is sent, and nothing ever answers,
which is what a frozen host or a link cut after connecting looks like to
torch's store client (it then waits forever). The block's exit kills and
reaps the child, stopped or not.

Tests import it as ``from _store_host import store_host`` (see ``_ports``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

_HOST = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                      wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()  # until the test closes it (or kills this process)
"""


class StoreHost:
    """The child hosting the store, and its port on 127.0.0.1."""

    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        self.process, self.port = process, port

    def stop(self) -> None:
        """Freeze the host: connected clients get no answer any more."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """End the host: its clients' connections close."""
        self.process.kill()
        self.process.wait(10)


@contextmanager
def store_host() -> Iterator[StoreHost]:
    """A store on a port from the OS, in a child process; killed and reaped
    on leaving the block."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.strip().isdigit(), f"the store host did not start: {line!r}"
        yield StoreHost(process, int(line))
    finally:
        process.kill()
        process.wait(10)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


def until_no_forming_is_held(limit: float = 10.0) -> None:
    """Wait until no forming given up on still runs (``_groups.rendezvous``)."""
    from asyncdist import _groups

    deadline = time.monotonic() + limit
    while _groups._held and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _groups._held, _groups._held


def one_rank_on(host: StoreHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set the environment of a world of one whose store is ``host``'s, as a
    launcher agent's store is (``TORCHELASTIC_USE_AGENT_STORE``): a
    ``DistSession()`` entered next connects to it as a client, so stopping
    the host freezes every later forming of that session."""
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(host.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }.items():
        monkeypatch.setenv(name, value)
