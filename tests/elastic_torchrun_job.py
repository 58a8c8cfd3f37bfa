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

import os
import time

import anyio
from _elastic_loop import train, write

from asyncdist import MembershipLost


async def main() -> None:
    out = os.environ["ASYNCDIST_OUT"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    victim = os.environ.get("ASYNCDIST_VICTIM", "1:0") == f"{node}:{local}"
    started = time.monotonic()
    try:
        report = await train(
            session_timeout=4,
            min_world_size=1,
            until=lambda world, step: step >= 40 and world.world_size >= 2,
            dies_at=5 if victim and attempt == 0 else None,
            pause=0.05,
        )
    except MembershipLost as exc:
        elapsed = time.monotonic() - started
        record = {"why": exc.why, "message": str(exc), "elapsed": elapsed}
        write(os.path.join(out, f"lost.{node}.{local}.{attempt}.json"), record)
        raise
    del report["last_look"]
    write(os.path.join(out, f"done.{node}.{attempt}.json"), report)


if __name__ == "__main__":
    anyio.run(main)
