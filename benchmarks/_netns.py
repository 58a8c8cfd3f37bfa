"""A shaped link between two namespace "hosts" (tools/netns.py) and a runner
for _shaped_worker.py on both ends: the link, not the CPU, then bounds
communication, as between two machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_shaped_worker.py"
sys.path.insert(0, str(HERE.parent))


from tools.netns import TwoHosts, missing  # noqa: E402

require = missing


class ShapedLink(TwoHosts):
    """``with ShapedLink("1gbit") as link: link.run(task, options)``."""

    def __init__(self, rate: str = "1gbit") -> None:
        super().__init__(rate=rate)

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
