"""The job tests/test_multinode.py runs under torchrun on two namespace "hosts".

Every rank checks allreduce, broadcast and gradient_sync across the 4 ranks
and writes what it saw to $ASYNCDIST_OUT/rank<r>.json. With
ASYNCDIST_FAIL_ONCE=1, global rank 3 dies in the first attempt (torchrun
--max-restarts restarts the job).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from asyncdist import DistSession


def main() -> None:
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with DistSession(timeout=60, device="cpu") as s:
        if os.environ.get("ASYNCDIST_FAIL_ONCE") == "1" and attempt == 0 and s.rank == 3:
            os._exit(1)
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
    out = Path(os.environ["ASYNCDIST_OUT"]) / f"rank{report['rank']}.json"
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
