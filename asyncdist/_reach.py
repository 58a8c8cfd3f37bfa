"""Reachability: which members of an elastic world can open a connection to
which others, so that a re-form picks members that can form a world.

When the ranks are cut from each other but not from the coordinator, every
survivor reaches the store and reports, yet a world of all of them would
never form. So each member listens on a probe port (``Probe``), published
in the coordinator; a re-forming member tries every other member's port at
once, bounded by ``PROBE_TIMEOUT``, and reports whom it reached. The
proposer keeps the members that all reach each other (``connected``), and
the strict-majority rule then applies to those.

A listening socket costs no thread: the kernel completes a TCP handshake
without an ``accept``. The member's watcher thread closes what queued up
(``Probe.drain``) at each heartbeat, so the queue never fills.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import time
from collections.abc import Mapping, Sequence

PROBE_TIMEOUT = 1.5  # seconds a re-forming member tries to reach the others
_BACKLOG = 128


def _local_address(toward: tuple[str, int]) -> tuple[int, str]:
    """The address family and address this host sends from toward ``toward``
    (the coordinator): the interface its peers reach it on. No packet is
    sent (a UDP ``connect`` only picks the route)."""
    host, port = toward
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as udp:
        udp.connect(sockaddr)
        return family, str(udp.getsockname()[0])


class Probe:
    """A member's probe port: a listening socket on the interface that faces
    the coordinator, and the probing of the other members' ports."""

    def __init__(self, toward: tuple[str, int]) -> None:
        family, host = _local_address(toward)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(_BACKLOG)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self.address = f"{host}:{self._sock.getsockname()[1]}"

    def drain(self) -> None:
        """Close the connections probes opened since the last call."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed meanwhile
                return
            conn.close()

    def close(self) -> None:
        self._sock.close()


def reachable(addresses: Mapping[str, str], timeout: float = PROBE_TIMEOUT) -> frozenset[str]:
    """The members whose probe port (``"host:port"``, by member) accepted a
    connection within ``timeout`` seconds, all tried at once."""
    reached: set[str] = set()
    with selectors.DefaultSelector() as selector:
        for member, address in addresses.items():
            host, _, port = address.rpartition(":")
            try:
                family, kind, proto, _, sockaddr = socket.getaddrinfo(
                    host, int(port), type=socket.SOCK_STREAM
                )[0]
                sock = socket.socket(family, kind, proto)
            except (OSError, ValueError):
                continue
            sock.setblocking(False)
            code = sock.connect_ex(sockaddr)
            if code == 0:
                reached.add(member)
                sock.close()
            elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                selector.register(sock, selectors.EVENT_WRITE, member)
            else:
                sock.close()
        deadline = time.monotonic() + timeout
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                done = key.fileobj
                assert isinstance(done, socket.socket)
                if done.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    reached.add(key.data)
                selector.unregister(done)
                done.close()
        for key in list(selector.get_map().values()):  # not answered in time
            late = key.fileobj
            assert isinstance(late, socket.socket)
            with contextlib.suppress(OSError):
                late.close()
    return frozenset(reached)


def connected(members: Sequence[str], reach: Mapping[str, frozenset[str] | None]) -> list[str]:
    """The members (in their order) that all reach each other, both ways: the
    largest such set a greedy pick finds, taking members with the most
    links first (then in order). Pure, so every proposer picks alike. A
    member whose row is ``None`` (it did not probe) reaches everyone."""

    def linked(a: str, b: str) -> bool:
        ra, rb = reach.get(a), reach.get(b)
        return (ra is None or b in ra) and (rb is None or a in rb)

    links = {m: sum(linked(m, other) for other in members if other != m) for m in members}
    chosen: list[str] = []
    for member in sorted(members, key=lambda m: (-links[m], members.index(m))):
        if all(linked(member, other) for other in chosen):
            chosen.append(member)
    return [m for m in members if m in chosen]
