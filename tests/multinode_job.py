"""The job tests/test_multinode.py runs under torchrun on two namespace "hosts".

Every rank checks allreduce, broadcast and gradient_sync across the 4 ranks
and writes what it saw to $ASYNCDIST_OUT/rank<r>.json. With
ASYNCDIST_FAIL_ONCE=1, global rank $ASYNCDIST_FAIL_RANK (default 3) dies
once, after the group formed, and leaves $ASYNCDIST_OUT/died while the others
wait; torchrun --max-restarts restarts the job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from asyncdist import DistSession


def main() -> None:
    torch.set_num_threads(1)
    out = Path(os.environ["ASYNCDIST_OUT"])
    # torchrun's restart count is per node: the node that did not fail keeps 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with DistSession(timeout=60, device="cpu") as s:
        died = out / "died"
        if os.environ.get("ASYNCDIST_FAIL_ONCE") == "1" and not died.exists():
            s.barrier().wait()  # every rank got this far in the first attempt
            if s.rank == int(os.environ.get("ASYNCDIST_FAIL_RANK", "3")):
                died.write_text(f"rank {s.rank} died once\n")
                os._exit(1)
            # The others stay healthy until torchrun stops them, so the node
            # that did not fail restarts without counting it (the hard case).
            time.sleep(120)
        t = torch.tensor([float(s.rank)])
        s.allreduce(t).wait()
        b = torch.tensor([float(s.rank)])
        s.broadcast(b, src=3).wait()
        torch.manual_seed(s.rank)
        model = torch.nn.Linear(8, 2)
        sync = s.gradient_sync(model)
        sync.broadcast_parameters(src=0)
        x = torch.full((4, 8), float(s.rank + 1))
        model(x).sum().backward()
        sync.wait()
        grads = s.all_gather_object(model.weight.grad.tolist()).wait()
        report = {
            "rank": s.rank,
            "world": s.world_size,
            "local_rank": s.local_rank,
            "sum": t.item(),
            "bcast": b.item(),
            "grads_equal": all(g == grads[0] for g in grads),
            "grad00": model.weight.grad[0, 0].item(),
            "attempt": attempt,
        }
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
