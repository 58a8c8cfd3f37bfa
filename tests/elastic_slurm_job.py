"""The job tests/test_slurm.py runs with srun, one task per node, elastic.

It gets nothing from the test but SLURM's environment and the output folder
(its working directory): task 0 hosts the coordinator in a sidecar by
itself. The task named by the first argument SIGKILLs itself at step 5; the
other goes on alone (``min_world_size=1``) and writes ``done.<task>.json``:
the worlds it saw, its parameters, and whether the coordinator sidecar still
ran when it finished.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import anyio
import torch

from asyncdist import DistSession


async def main(victim: int) -> None:
    task = int(os.environ["SLURM_PROCID"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worlds = []
    async with DistSession(elastic=True, min_world_size=1, timeout=5) as s:
        state = s.elastic_state(model=model, optimizer=opt, step=0)
        sync = s.gradient_sync(model)
        async for world in s.elastic(state):
            worlds.append([world.generation, world.rank, world.world_size, state.step])
            async with world:
                while state.step < 20:
                    if task == victim and state.step == 5:
                        os.kill(os.getpid(), signal.SIGKILL)
                    g = torch.Generator().manual_seed(1000 * state.step + world.rank)
                    opt.zero_grad()
                    model(torch.randn(4, 6, generator=g)).sum().backward()
                    await sync
                    opt.step()
                    state.step += 1
                    state.commit()
        sidecar = _coordinator_running()  # before leaving: it ends once every member left
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    _write(f"done.{task}.json", {"worlds": worlds, "params": params, "sidecar": sidecar})


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


def _write(path: str, data: object) -> None:
    with open(path, "w") as file:
        json.dump(data, file)


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]))
