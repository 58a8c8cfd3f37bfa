"""The job tests/test_slurm.py runs under a real ``srun`` (directly, or from the
batch script of docs/guides/launching.md, where it is ``train.py``).

It reads nothing but what SLURM gives every task: no MASTER_ADDR, RANK or
output path is set for it. Each task opens a DistSession, checks an
allreduce and a gradient_sync step, and writes what it saw to
``rank<r>.json`` in the working directory (srun's, which every node sees).

``python slurm_job.py die``: after the group formed, the last rank exits
with status 3; the others record the error their next allreduce raises and
how long it took.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from asyncdist import AsyncDistError, DistSession
from asyncdist._env import detect

TIMEOUT = 20.0


def main() -> None:
    torch.set_num_threads(1)
    die = sys.argv[1:] == ["die"]
    launch = detect()
    report: dict[str, object] = {
        "launcher": launch.launcher,
        "master_addr": launch.master_addr,
        "master_ip": socket.gethostbyname(launch.master_addr),
        "master_port": launch.master_port,
        "host": socket.gethostname(),
        "job_id": int(os.environ["SLURM_JOB_ID"]),
        "procid": int(os.environ["SLURM_PROCID"]),
        "localid": int(os.environ["SLURM_LOCALID"]),
        "preset": sorted(
            k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k in os.environ
        ),
    }
    with DistSession(timeout=TIMEOUT, device="cpu") as s:
        report.update(rank=s.rank, world=s.world_size, local_rank=s.local_rank)
        if die:
            s.barrier().wait()  # the group is formed on every rank
            if s.rank == s.world_size - 1:
                os._exit(3)
            start = time.monotonic()
            try:
                s.allreduce(torch.ones(1)).wait()
                report["error"] = None
            except AsyncDistError as exc:
                report["error"] = type(exc).__name__
                report["message"] = str(exc)
            report["elapsed"] = time.monotonic() - start
        else:
            t = torch.tensor([float(s.rank)])
            s.allreduce(t).wait()
            report["sum"] = t.item()
            torch.manual_seed(s.rank)
            model = torch.nn.Linear(8, 2)
            sync = s.gradient_sync(model)
            sync.broadcast_parameters(src=0)
            model(torch.full((4, 8), float(s.rank + 1))).sum().backward()
            sync.wait()
            assert model.weight.grad is not None
            grads = s.all_gather_object(model.weight.grad.tolist()).wait()
            report["grads_equal"] = all(g == grads[0] for g in grads)
            report["grad00"] = model.weight.grad[0, 0].item()
    (Path.cwd() / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
