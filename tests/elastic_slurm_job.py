"""The job tests/test_slurm.py runs with srun, one task per node, elastic.

It gets nothing from the test but SLURM's environment and the output folder
(its working directory): task 0 hosts the coordinator in a sidecar by
itself. The task named by the first argument SIGKILLs itself at step 5; the
other goes on alone (``min_world_size=1``) and writes ``done.<task>.json``:
the worlds it saw, its parameters, and whether the coordinator sidecar still
ran when it finished (``sidecar``).
"""

from __future__ import annotations

import os
import sys

import anyio
from _elastic_loop import train, write


def _coordinator_running() -> bool:
    """Whether a process runs ``asyncdist coordinator`` (in this test's
    cluster the nodes are network namespaces of one machine: one /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                argv = file.read().split(b"\0")
        except OSError:
            continue
        if b"asyncdist" in argv and b"coordinator" in argv:
            return True
    return False


async def main(victim: int) -> None:
    task = int(os.environ["SLURM_PROCID"])
    report = await train(
        session_timeout=5,
        min_world_size=1,
        until=lambda world, step: step >= 20,
        dies_at=5 if task == victim else None,
        # before leaving: the sidecar ends once every member left
        last_look=_coordinator_running,
    )
    report["sidecar"] = report.pop("last_look")
    write(f"done.{task}.json", report)


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]))
