"""Ports for multi-rank tests, always from the OS, never a fixed number.

Tests import it as ``from _ports import free_port`` (and ``listening``): ``tests/`` has no
``__init__.py``, so pytest's default ``prepend`` import mode puts this
directory on ``sys.path``.
"""

from __future__ import annotations

import socket

import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS just handed out and is free again.

    The socket is bound to port 0 (the OS picks) and closed before returning;
    it never listened, so the port is free at once, though not reserved: use
    it for something that must not be listening (a master nobody hosts), or
    where a rare clash only retries.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening() -> set[tuple[str, int]]:
    """(ip, port) of this process's listening TCP sockets (a store's,
    gloo's). By address alone, one left on loopback by an earlier test would
    hide a new one."""
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
