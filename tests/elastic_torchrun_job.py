"""The job tests/test_elastic.py runs under torchrun, static rendezvous (node
0's agent hosts the store): on two namespace "hosts", one worker per node,
or on one node with two.

The worker named by ``$ASYNCDIST_VICTIM`` (``node:local rank``, default
``1:0``) SIGKILLs itself at step 5 of its first attempt; its agent restarts
its node's workers (``--max-restarts 1``), which join the running session.
Each worker writes ``done.<node>.<attempt>.json`` to ``$ASYNCDIST_OUT``: the
worlds it saw and its parameters; or, if its session ended with
``MembershipLost``, ``lost.<node>.<local rank>.<attempt>.json``: its ``why``,
message and how long after start.
"""

from __future__ import annotations

import json
import os
import signal
import time

import anyio
import torch

from asyncdist import DistSession, MembershipLost


async def main() -> None:
    out = os.environ["ASYNCDIST_OUT"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    victim = os.environ.get("ASYNCDIST_VICTIM", "1:0") == f"{node}:{local}"
    started = time.monotonic()
    try:
        await train(out, node, attempt, victim)
    except MembershipLost as exc:
        elapsed = time.monotonic() - started
        record = {"why": exc.why, "message": str(exc), "elapsed": elapsed}
        _write(os.path.join(out, f"lost.{node}.{local}.{attempt}.json"), record)
        raise


async def train(out: str, node: int, attempt: int, victim: bool) -> None:
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
                    if victim and attempt == 0 and state.step == 5:
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
