"""The job tests/test_slurm.py runs with srun, one task per node, elastic.

It gets nothing from the test but SLURM's environment and the output folder
(its working directory): task 0 hosts the coordinator in a sidecar by
itself. With a task number as its argument, that task SIGKILLs itself at
step 5 and the other goes on alone (``min_world_size=1``) to step 20. With
``regrow``, task 1 dies at step 5, and the survivor trains on until a
replacement (this job run with ``join``, in a step of its own) has joined
and the world of two has taken 5 steps. Each writes ``done.<task>.json``
(the replacement ``done.join.json``): the worlds it saw, its parameters, and
whether the coordinator sidecar still ran when it finished (``sidecar``);
and ``world.<task>.<generation>`` as each world begins.
"""

from __future__ import annotations

import logging
import os
import sys

import anyio
from _elastic_loop import train, write

from asyncdist import World


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


async def main(mode: str) -> None:
    task = int(os.environ["SLURM_PROCID"])
    starts: dict[int, int] = {}

    def until(world: World, step: int) -> bool:
        first = starts.setdefault(world.generation, step)
        if mode in ("regrow", "join"):  # on until the replacement took 5 steps with us
            return world.world_size == 2 and world.generation >= 2 and step >= first + 5
        return step >= 20

    def entered(world: World) -> None:
        if mode != "join":
            with open(f"world.{task}.{world.generation}", "w"):
                pass

    if mode != "join" and task == 0:
        logging.basicConfig(level=logging.INFO)  # the coordinator's address, for a replacement
    victim = 1 if mode == "regrow" else -1 if mode == "join" else int(mode)
    report = await train(
        session_timeout=5,
        min_world_size=1,
        until=until,
        dies_at=5 if task == victim else None,
        pause=0.1 if mode in ("regrow", "join") else 0.0,
        # before leaving: the sidecar ends once every member left
        last_look=_coordinator_running,
        entered=entered,
    )
    report["sidecar"] = report.pop("last_look")
    write("done.join.json" if mode == "join" else f"done.{task}.json", report)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
