"""The job tests/test_elastic.py runs under torchrun on two namespace "hosts",
one worker per node, static rendezvous (node 0's agent hosts the store).

Node 1's worker SIGKILLs itself at step 5 of its first attempt; its agent
restarts it (``--max-restarts 1``) and the new worker joins the running
session. Each worker writes ``done.<node>.<attempt>.json`` to
``$ASYNCDIST_OUT``: the worlds it saw and its parameters.
"""

from __future__ import annotations

import json
import os
import signal

import anyio
import torch

from asyncdist import DistSession


async def main() -> None:
    out = os.environ["ASYNCDIST_OUT"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node = int(os.environ["GROUP_RANK"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worlds = []
    async with DistSession(elastic=True, timeout=4) as s:
        state = s.elastic_state(model=model, optimizer=opt, step=0)
        sync = s.gradient_sync(model)
        async for world in s.elastic(state):
            worlds.append([world.generation, world.rank, world.world_size, state.step])
            async with world:
                while state.step < 40 or world.world_size < 2:
                    if node == 1 and attempt == 0 and state.step == 5:
                        os.kill(os.getpid(), signal.SIGKILL)
                    g = torch.Generator().manual_seed(1000 * state.step + world.rank)
                    opt.zero_grad()
                    model(torch.randn(4, 6, generator=g)).sum().backward()
                    await sync
                    opt.step()
                    state.step += 1
                    state.commit()
                    await anyio.sleep(0.05)
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    _write(os.path.join(out, f"done.{node}.{attempt}.json"), {"worlds": worlds, "params": params})


def _write(path: str, data: object) -> None:
    with open(path, "w") as file:
        json.dump(data, file)


if __name__ == "__main__":
    anyio.run(main)
