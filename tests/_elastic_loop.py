"""The training loop of the elastic launch jobs (elastic_torchrun_job.py,
elastic_slurm_job.py), run as scripts: this folder is their ``sys.path[0]``.

A ``Linear(6, 1)`` trained with SGD and ``gradient_sync``; step ``k`` of
world rank ``r`` uses the batch seeded ``1000 * k + r``, so a one-process
replay can recompute every step. Every step commits.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import Any

import anyio
import torch

from asyncdist import DistSession, World


async def train(
    *,
    session_timeout: float,
    min_world_size: int,
    until: Callable[[World, int], bool],
    dies_at: int | None,
    pause: float = 0.0,
    last_look: Callable[[], Any] = lambda: None,
    entered: Callable[[World], None] = lambda world: None,
) -> dict[str, Any]:
    """Train until ``until(world, step)``; SIGKILL this process before step
    ``dies_at`` (None: never); ``entered(world)`` as each world begins. The
    worlds seen (generation, rank, world size, step at its start), the
    parameters, and ``last_look()`` taken inside the session once training
    ended."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worlds = []
    async with DistSession(
        elastic=True, min_world_size=min_world_size, timeout=session_timeout
    ) as s:
        state = s.elastic_state(model=model, optimizer=opt, step=0)
        sync = s.gradient_sync(model)
        async for world in s.elastic(state):
            worlds.append([world.generation, world.rank, world.world_size, state.step])
            entered(world)
            async with world:
                while not until(world, state.step):
                    if state.step == dies_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    g = torch.Generator().manual_seed(1000 * state.step + world.rank)
                    opt.zero_grad()
                    model(torch.randn(4, 6, generator=g)).sum().backward()
                    await sync
                    opt.step()
                    state.step += 1
                    state.commit()
                    if pause:
                        await anyio.sleep(pause)
        looked = last_look()
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    return {"worlds": worlds, "params": params, "last_look": looked}


def write(path: str, data: object) -> None:
    with open(path, "w") as file:
        json.dump(data, file)
