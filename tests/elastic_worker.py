"""One rank of tests/test_elastic.py's partition scenario, run on a namespace
"host" (tools/netns.py) with the job's coordinator on host 0.

Usage: ``python elastic_worker.py <dir>``; the launch environment (``RANK``,
``WORLD_SIZE``, ``ASYNCDIST_COORDINATOR``) places it. It trains a small
model in an elastic session with a 3 s timeout and talks to the test through
files in ``dir``: ``ready.<rank>`` once world 0 has taken 3 steps, then
``done.<rank>.json``: the worlds it saw, its parameters, or the
``MembershipLost`` that ended it, and when (``time.time()``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anyio
import torch

from asyncdist import DistSession, MembershipLost

TIMEOUT = 3.0
STEPS = 80


def _write(folder: str, name: str, data: Any) -> None:
    """Whole or not at all: the test polls for the name, then reads it."""
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as file:
        json.dump(data, file)
    os.replace(path + ".tmp", path)


async def main(folder: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worlds = []
    async with DistSession(elastic=True, min_world_size=2, timeout=TIMEOUT) as s:
        state = s.elastic_state(model=model, optimizer=opt, step=0)
        sync = s.gradient_sync(model)
        try:
            async for world in s.elastic(state):
                worlds.append([world.generation, world.world_size])
                async with world:
                    while state.step < STEPS:
                        g = torch.Generator().manual_seed(1000 * state.step + world.rank)
                        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
                        opt.zero_grad()
                        torch.nn.functional.mse_loss(model(x), y).backward()
                        await sync
                        opt.step()
                        state.step += 1
                        state.commit()
                        if state.step == 3 and world.generation == 0:
                            _write(folder, f"ready.{rank}", time.time())
                        await anyio.sleep(0.05)
        except MembershipLost as exc:
            _write(
                folder, f"done.{rank}.json", {"worlds": worlds, "lost": exc.why, "t": time.time()}
            )
            return
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    _write(folder, f"done.{rank}.json", {"worlds": worlds, "params": params, "t": time.time()})


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
