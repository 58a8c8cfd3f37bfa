"""Two "hosts" on one machine: network namespaces joined by a veth pair whose
both ends are shaped with ``tc qdisc ... tbf`` (netem is not available here).

The link, not the CPU, then bounds communication, as between two machines.
Needs root, ``ip`` and ``tc``; :func:`require` says what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_shaped_worker.py"


def require() -> str | None:
    """Why shaped-link benchmarks cannot run here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2)"
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class ShapedLink:
    """``with ShapedLink("1gbit") as link: link.run(task, args)``."""

    def __init__(self, rate: str = "1gbit", burst: str = "1mb", latency: str = "200ms") -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"adA{tag}", f"adB{tag}")
        self.dev = (f"vA{tag}", f"vB{tag}")
        subnet = 16 + os.getpid() % 200
        self.addr = (f"10.213.{subnet}.1", f"10.213.{subnet}.2")
        self.rate, self.burst, self.latency = rate, burst, latency

    def __enter__(self) -> ShapedLink:
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
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

    def run(self, task: str, options: dict[str, Any], timeout: float = 600) -> list[dict[str, Any]]:
        """Run ``task`` of _shaped_worker.py as rank 0 and rank 1, one per namespace."""
        out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"asyncdist-shaped-{os.getpid()}"
        out_dir.mkdir(parents=True, exist_ok=True)
        port_file = out_dir / "port"
        port_file.unlink(missing_ok=True)
        procs = []
        try:
            for rank in (0, 1):
                env = dict(os.environ, GLOO_SOCKET_IFNAME=self.dev[rank], OMP_NUM_THREADS="1")
                cmd = [
                    "ip",
                    "netns",
                    "exec",
                    self.ns[rank],
                    sys.executable,
                    str(WORKER),
                    "--task",
                    task,
                    "--rank",
                    str(rank),
                    "--master",
                    self.addr[0],
                    "--port-file",
                    str(port_file),
                    "--out",
                    str(out_dir / f"rank{rank}.json"),
                    "--options",
                    json.dumps(options),
                ]
                procs.append(subprocess.Popen(cmd, env=env))
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.wait(max(1.0, deadline - time.monotonic()))
            if any(p.returncode for p in procs):
                raise RuntimeError(f"shaped-link worker failed: {[p.returncode for p in procs]}")
            return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
