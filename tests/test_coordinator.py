"""`asyncdist coordinator`: hosts an elastic session's store, and exits by
itself once the session is over (every member left, or all went silent)."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from _ports import free_port

from asyncdist import _coordinator
from asyncdist._coordinator import ROOT, serve

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.5  # the session timeout the coordinator is told: silent for 1 s ends it


class Serving:
    """``serve`` on a thread; ``why`` once it returned."""

    def __init__(self, port: int) -> None:
        self.why: str | None = None
        self.thread = threading.Thread(target=self._run, args=(port,), daemon=True)
        self.thread.start()

    def _run(self, port: int) -> None:
        self.why = serve("127.0.0.1", port, TIMEOUT, poll=0.05)


@pytest.fixture
def serving(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Serving, Any]]:
    """A coordinator on a free port (no start-up grace) and a member's client
    of it, keys under the elastic root as members write them."""
    monkeypatch.setattr(_coordinator, "START_GRACE", 0.0)
    port = free_port()
    served = Serving(port)
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    yield served, dist.PrefixStore(ROOT, client)
    served.thread.join(10)


def _beat_for(store: Any, member: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        store.add(f"hb/{member}", 1)
        time.sleep(0.05)


def test_it_serves_while_members_beat_and_ends_once_every_member_left(
    serving: tuple[Serving, Any],
) -> None:
    served, store = serving
    _beat_for(store, "a:1", 0.1)
    _beat_for(store, "b:2", 0.1)
    store.set("dead/a:1", "normally")
    _beat_for(store, "b:2", 2 * 2 * TIMEOUT)  # past the idle limit: b keeps it alive
    assert served.thread.is_alive(), served.why
    store.set("dead/b:2", "normally")
    served.thread.join(5)
    assert served.why == "every member left"


def test_it_ends_once_no_heartbeat_moved_for_twice_the_timeout(
    serving: tuple[Serving, Any],
) -> None:
    served, store = serving
    _beat_for(store, "a:1", 0.2)
    started = time.monotonic()
    served.thread.join(10)
    assert served.why == "no member's heartbeat moved for 1 s"
    assert 2 * TIMEOUT - 0.2 <= time.monotonic() - started < 2 * TIMEOUT + 2


def test_it_ends_when_nobody_registered(serving: tuple[Serving, Any]) -> None:
    served, _ = serving
    served.thread.join(10)
    assert served.why == "no member registered within 1 s"


def test_the_command_says_where_it_listens_and_why_it_ended() -> None:
    port = free_port()
    argv = ["coordinator", "--port", str(port), "--host", "127.0.0.1", "--timeout", "30"]
    command = subprocess.Popen(
        [sys.executable, "-m", "asyncdist", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )
        store = dist.PrefixStore(ROOT, client)
        _beat_for(store, "a:1", 0.2)
        store.set("dead/a:1", "normally")
        out, err = command.communicate(timeout=30)
    finally:
        command.kill()
        command.wait()
    assert command.returncode == 0, err
    assert out.splitlines() == [
        f"asyncdist coordinator on 127.0.0.1:{port}",
        f"asyncdist coordinator on 127.0.0.1:{port}: done (every member left)",
    ]


def test_the_command_refuses_a_port_in_use() -> None:
    port = free_port()
    holder = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "asyncdist", "coordinator", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        del holder
    assert done.returncode == 1
    assert f"cannot listen on *:{port}" in done.stderr
