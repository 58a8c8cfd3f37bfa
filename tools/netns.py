"""Two "hosts" on one machine: network namespaces joined by a veth pair,
optionally shaped with ``tc qdisc ... tbf`` (netem is not available here).

Needs root, ``ip`` and ``tc``; :func:`missing` says what is absent. The
addresses live only inside the namespaces this process creates, and so do the
faults :class:`TwoHosts` injects (link down, black holes with ``nft``, a
reshaped link): deleting the namespaces on exit removes every one of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def missing() -> str | None:
    """Why namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2)"
    return None


def missing_firewall() -> str | None:
    """Why black holes cannot be made here (no ``nft``), or None if they can."""
    if shutil.which("nft") is None:
        return "needs the 'nft' command (apt-get install nftables)"
    return None


def _sh(*args: str, stdin: str | None = None) -> None:
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


_FAULT_TABLE = "asyncdist_fault"


class TwoHosts:
    """``with TwoHosts(rate="1gbit") as hosts: hosts.popen(0, [...])``."""

    def __init__(self, rate: str | None = None, burst: str = "1mb", latency: str = "200ms") -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"adA{tag}", f"adB{tag}")
        self.dev = (f"vA{tag}", f"vB{tag}")
        subnet = 16 + os.getpid() % 200
        self.addr = (f"10.213.{subnet}.1", f"10.213.{subnet}.2")
        self.name = (f"host0-{tag}", f"host1-{tag}")
        self.rate, self.burst, self.latency = rate, burst, latency

    def __enter__(self) -> TwoHosts:
        try:
            hosts = "".join(f"{a} {n}\n" for a, n in zip(self.addr, self.name, strict=True))
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
                # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: each
                # "host" resolves both names, as machines on one cluster do
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{hosts}")
            _sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                if self.rate is not None:
                    _sh(
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        self.rate,
                        "burst",
                        self.burst,
                        "latency",
                        self.latency,
                    )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    # -- faults: each takes effect at once; heal() undoes them all --------------------

    def link(self, up: bool) -> None:
        """Set both ends of the veth pair down (the cable is pulled: no carrier,
        routes gone, nothing sent and no reset either way) or up again."""
        for ns, dev in zip(self.ns, self.dev, strict=True):
            _sh("ip", "-n", ns, "link", "set", dev, "up" if up else "down")

    def drop(self, *, into: tuple[int, ...] = (0, 1), sparing: int | None = None) -> None:
        """Silently drop every packet arriving at the hosts in ``into`` from
        the other host: ``(0, 1)`` is a black hole, ``(0,)`` a one-way one
        (host 1 -> host 0 lost, host 0 -> host 1 still delivered).
        ``sparing``: a TCP port on host 0 whose connections still pass both
        ways (a service both hosts keep reaching, the rest cut).

        The rule sits in the receiver's input hook, as a firewall on the path
        would: the sender gets no error (a drop in its own output hook would
        fail its send with EPERM) and nobody sends a reset.
        """
        for host in into:
            spared = ""
            if sparing is not None:
                side = "dport" if host == 0 else "sport"
                spared = f'    iifname "{self.dev[host]}" tcp {side} {sparing} accept\n'
            rules = (
                f"table inet {_FAULT_TABLE} {{\n"
                "  chain input { type filter hook input priority -300; policy accept;\n"
                f"{spared}"
                f'    iifname "{self.dev[host]}" drop\n'
                "  }\n"
                "}\n"
            )
            _sh("ip", "netns", "exec", self.ns[host], "nft", "-f", "-", stdin=rules)

    def shape(self, rate: str, burst: str = "32kb", latency: str = "400ms") -> None:
        """Replace both ends' root qdisc with a ``tbf`` of ``rate`` (a crawl)."""
        for ns, dev in zip(self.ns, self.dev, strict=True):
            _sh(
                *("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root"),
                *("tbf", "rate", rate, "burst", burst, "latency", latency),
            )

    def heal(self) -> None:
        """Undo every fault: links up, black holes removed, the shaping this
        object was made with (or none) restored. Fine when nothing was injected."""
        self.link(up=True)
        for ns, dev in zip(self.ns, self.dev, strict=True):
            subprocess.run(
                ["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", _FAULT_TABLE],
                capture_output=True,
                check=False,
            )
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
                check=False,
            )
        if self.rate is not None:
            self.shape(self.rate, self.burst, self.latency)

    def env(self, host: int, **extra: str) -> dict[str, str]:
        """The environment for a process on ``host``: gloo on its veth."""
        return dict(os.environ, GLOO_SOCKET_IFNAME=self.dev[host], OMP_NUM_THREADS="1", **extra)

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` on ``host``: in its network namespace, under its own hostname."""
        rename = 'hostname "$0" && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.ns[host],
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            rename,
            self.name[host],
            *argv,
        ]

    def free_port(self, host: int) -> int:
        """A port the OS picks on ``host`` (its namespace is otherwise empty)."""
        probe = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
        out = subprocess.run(
            self.command(host, [sys.executable, "-c", probe]),
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.strip())
