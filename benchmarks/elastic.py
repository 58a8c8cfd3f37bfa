"""Elastic: from a rank's death to the next completed step, asyncdist vs torchrun restarts.

The same job in both arms: 3 local gloo ranks train a small MLP with
``gradient_sync`` (Adam), each step padded to about ``--step-ms`` of compute;
rank 2 SIGKILLs itself at the start of step ``--kill-at`` (the first
attempt only), having written the time first.

* **asyncdist elastic**: ``spawn(..., elastic=True)``, ``state.commit()``
  after every step (a copy in memory). The survivors re-form as 2 ranks and
  go on in the same processes.
* **torchrun restart**: ``torchrun --nproc-per-node 3 --max-restarts 1``
  (static rendezvous), a plain ``DistSession``; rank 0 saves a checkpoint
  (``torch.save``) every ``--every`` steps. The death makes the others fail
  with ``PeerFailure``; torchrun then stops and restarts all 3 workers, which
  import torch again, form the group again and load the checkpoint.
* **torchft** (when ``torchft`` is installed: ``pip install torchft``): its
  fault-tolerant DDP, each rank a replica group of one, with a lighthouse
  in this process (``min_replicas=2``) and torchft's own gloo group. A
  failed step is not committed; the next quorum drops the dead replica.

Per round: **time to the next step**, from the victim's kill to the first
step any rank completes after it, and **steps lost**, the step the job was
at minus the step it resumed from. Rounds alternate the arms; medians.
Goal (issue 26): asyncdist at most 0.25x torchrun's time to the next step,
and at most the step in flight lost.

    python benchmarks/elastic.py [--rounds 3] [--kill-at 12] [--every 10] [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

WORLD = 3
VICTIM = 2
GOAL = 0.25
TIMEOUT = 30.0  # every arm's collective timeout


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))


def _step(model: Any, opt: Any, step: int, rank: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _pad(started: float, step_ms: float) -> None:
    """Compute stand-in: the step takes ``step_ms`` in all."""
    left = started + step_ms / 1000 - time.monotonic()
    if left > 0:
        time.sleep(left)


def _die(out: str) -> None:
    Path(out, "killed").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


# -- asyncdist elastic ---------------------------------------------------------------------


async def _elastic_rank(s: Any, steps: int, kill_at: int, step_ms: float, out: str) -> Any:
    import torch

    launch_rank = s.rank
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = s.elastic_state(model=model, optimizer=opt, step=0)
    sync = s.gradient_sync(model)
    done: list[tuple[int, float, int]] = []  # (step, time, world)
    resumed = []
    async for world in s.elastic(state):
        resumed.append(state.step)
        async with world:
            while state.step < steps:
                if launch_rank == VICTIM and world.generation == 0 and state.step == kill_at:
                    _die(out)
                started = time.monotonic()
                _step(model, opt, state.step, world.rank)
                await sync
                opt.step()
                _pad(started, step_ms)
                state.step += 1
                state.commit()
                done.append((state.step, time.time(), world.generation))
    return {"done": done, "resumed": resumed}


def _elastic_round(steps: int, kill_at: int, step_ms: float) -> dict[str, float]:
    import asyncdist

    out = tempfile.mkdtemp(prefix="asyncdist-elastic-")
    try:
        results = asyncdist.spawn(
            _elastic_rank,
            WORLD,
            args=(steps, kill_at, step_ms, out),
            elastic=True,
            min_world_size=2,
            timeout=TIMEOUT,
            join_timeout=300,
        )
        killed = float(Path(out, "killed").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    alive = [r for r in results if not isinstance(r, BaseException)]
    after = min(t for r in alive for _, t, world in r["done"] if world > 0)
    resumed = alive[0]["resumed"][-1]
    step_s = _step_time([r["done"] for r in alive], killed)
    return {"next_step_s": after - killed, "lost": kill_at - resumed, "step_s": step_s}


# -- torchrun restarts -----------------------------------------------------------------------


WORKER = """
import os, sys, time, torch
sys.path.insert(0, {bench!r})
import elastic as bench
from asyncdist import DistSession

steps, kill_at, step_ms, every, out = {steps}, {kill_at}, {step_ms}, {every}, {out!r}
ckpt = os.path.join(out, "ckpt.pt")
torch.set_num_threads(1)
with DistSession() as s:
    model = bench._model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"]); opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
    with open(os.path.join(out, f"resumed.{{s.rank}}"), "a") as f:
        f.write(f"{{step}}\\n")
    sync = s.gradient_sync(model)
    sync.broadcast_parameters()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    first = attempt == 0
    log = open(os.path.join(out, f"done.{{s.rank}}"), "a")
    while step < steps:
        if first and s.rank == bench.VICTIM and step == kill_at:
            bench._die(out)
        started = time.monotonic()
        bench._step(model, opt, step, s.rank)
        sync.wait()
        opt.step()
        bench._pad(started, step_ms)
        step += 1
        if s.rank == 0 and step % every == 0:
            tmp = ckpt + ".tmp"
            saved = {{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}}
            torch.save(saved, tmp)
            os.replace(tmp, ckpt)
        log.write(f"{{step}} {{time.time()!r}} {{attempt}}\\n"); log.flush()
"""


def _torchrun_round(steps: int, kill_at: int, step_ms: float, every: int) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix="asyncdist-torchrun-")
    try:
        script = _worker(WORKER, out, steps=steps, kill_at=kill_at, step_ms=step_ms, every=every)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(WORLD),
            "--max-restarts",
            "1",
            "--master-port",
            str(_free_port()),
            str(script),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            env.pop(name, None)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-3000:]}")
        killed = float(Path(out, "killed").read_text())
        logs = _logs(out)
        resumed = int(Path(out, "resumed.0").read_text().split()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    after = min(t for log in logs for _, t, attempt in log if attempt > 0)
    return {
        "next_step_s": after - killed,
        "lost": kill_at - resumed,
        "step_s": _step_time(logs, killed),
    }


TORCHFT_WORKER = """
import os, sys, time
from datetime import timedelta
import torch
sys.path.insert(0, {bench!r})
import elastic as bench
from torch.distributed import TCPStore
from torchft.ddp import DistributedDataParallel
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

replica, lighthouse = int(sys.argv[1]), sys.argv[2]
steps, kill_at, step_ms, out = {steps}, {kill_at}, {step_ms}, {out!r}
torch.set_num_threads(1)
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # its group's
model = bench._model()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

def load_state_dict(saved):
    model.load_state_dict(saved["model"]); opt.load_state_dict(saved["optim"])

def state_dict():
    return {{"model": model.state_dict(), "optim": opt.state_dict()}}

timeout = timedelta(seconds=bench.TIMEOUT)
manager = Manager(
    pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
    state_dict=state_dict, min_replica_size=2, rank=0, world_size=1,
    store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
    replica_id=f"r{{replica}}", timeout=timeout,
)
ddp = DistributedDataParallel(manager, model)
wrapped = OptimizerWrapper(manager, opt)
log = open(os.path.join(out, f"done.{{replica}}"), "a")
while manager.current_step() < steps:
    step = manager.current_step()
    if replica == bench.VICTIM and step == kill_at:
        bench._die(out)
    started = time.monotonic()
    g = torch.Generator().manual_seed(1000 * step + replica)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)
    wrapped.zero_grad()  # starts the quorum
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    wrapped.step()  # only if every replica's allreduce succeeded
    bench._pad(started, step_ms)
    log.write(f"{{manager.current_step()}} {{time.time()!r}} {{manager.num_participants()}}\\n")
    log.flush()
manager.shutdown(wait=False)
os._exit(0)  # torchft's threads would hold the process
"""


def has_torchft() -> bool:
    """Whether the torchft arm can run (``pip install torchft``)."""
    os.environ.setdefault("RUST_LOG", "error")  # read at import: else it logs every quorum
    try:
        import torchft._torchft  # noqa: F401
    except ImportError:
        return False
    return True


def _torchft_round(steps: int, kill_at: int, step_ms: float) -> dict[str, float]:
    from torchft._torchft import LighthouseServer

    out = tempfile.mkdtemp(prefix="asyncdist-torchft-")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        script = _worker(TORCHFT_WORKER, out, steps=steps, kill_at=kill_at, step_ms=step_ms)
        env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
        with open(Path(out, "log"), "wb") as log:
            for replica in range(WORLD):
                command = [sys.executable, str(script), str(replica), lighthouse.address()]
                procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
            for proc in procs:
                proc.wait(timeout=300)
        codes = [proc.returncode for proc in procs]
        if codes != [0] * VICTIM + [-signal.SIGKILL] + [0] * (WORLD - VICTIM - 1):
            tail = Path(out, "log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"torchft workers exited {codes}:\n{tail}")
        killed = float(Path(out, "killed").read_text())
        logs = _logs(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        lighthouse.shutdown()
        shutil.rmtree(out, ignore_errors=True)
    survivors = [log for replica, log in enumerate(logs) if replica != VICTIM]
    # the first step of the quorum without the victim (fewer participants)
    after = min((t, n) for log in survivors for n, t, size in log if size < WORLD and t > killed)
    return {
        "next_step_s": after[0] - killed,
        "lost": max(kill_at - (after[1] - 1), 0),
        "step_s": _step_time(survivors, killed),
    }


def _worker(template: str, out: str, **fields: object) -> Path:
    """A worker script in ``out``: ``template`` filled with ``fields``, the
    folder, and this folder's path (the script imports this module)."""
    script = Path(out, "worker.py")
    bench = str(Path(__file__).resolve().parent)
    script.write_text(template.format(bench=bench, out=out, **fields))
    return script


def _logs(out: str) -> list[list[tuple[int, float, int]]]:
    """Each rank's ``done.<rank>`` log: (step, time, attempt or participants)."""
    logs = []
    for rank in range(WORLD):
        lines = [line.split() for line in Path(out, f"done.{rank}").read_text().splitlines()]
        logs.append([(int(a), float(b), int(c)) for a, b, c in lines])
    return logs


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _step_time(logs: list[list[tuple[int, float, int]]], killed: float) -> float:
    """Median time between two steps of rank 0's log before the fault."""
    times = [t for _, t, _ in logs[0] if t < killed]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return _common.median(gaps) if gaps else float("nan")


# -- the table -------------------------------------------------------------------------------


def summarize(
    rounds: dict[str, list[dict[str, float]]], every: int, smoke: bool = False
) -> tuple[str, list[str], list[list[str]], dict[str, Any]]:
    def med(arm: str, key: str) -> float:
        return _common.median([r[key] for r in rounds[arm]])

    ratio = med("elastic", "next_step_s") / med("torchrun", "next_step_s")
    lost = max(r["lost"] for r in rounds["elastic"])
    rows = [
        [
            "asyncdist elastic",
            f"{med('elastic', 'next_step_s'):.2f} s",
            f"{max(r['lost'] for r in rounds['elastic']):g}",
            f"{med('elastic', 'step_s') * 1e3:.1f} ms",
        ],
        [
            "torchrun restart",
            f"{med('torchrun', 'next_step_s'):.2f} s",
            f"{max(r['lost'] for r in rounds['torchrun']):g}",
            f"{med('torchrun', 'step_s') * 1e3:.1f} ms",
        ],
    ]
    if rounds.get("torchft"):
        rows.append(
            [
                "torchft FT-DDP",
                f"{med('torchft', 'next_step_s'):.2f} s",
                f"{max(r['lost'] for r in rounds['torchft']):g}",
                f"{med('torchft', 'step_s') * 1e3:.1f} ms",
            ]
        )
    rows.append(
        [
            "elastic ÷ torchrun",
            f"{ratio:.3f}×",
            _common.verdict("≤ 1 step", lost <= 1, smoke),
            _common.verdict(f"≤ {GOAL}×", ratio <= GOAL, smoke),
        ]
    )
    if rounds.get("torchft"):
        vs_torchft = med("elastic", "next_step_s") / med("torchft", "next_step_s")
        rows.append(["elastic ÷ torchft", f"{vs_torchft:.3f}×", "", ""])
    title = (
        f"A rank of {WORLD} dies: commit every step vs checkpoint every {every} "
        f"({len(rounds['elastic'])} rounds)"
    )
    columns = ["arm", "to next step", "steps lost", "step"]
    payload = {"rounds": rounds, "ratio": ratio, "goal": GOAL, "every": every}
    return title, columns, rows, payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--every", type=int, default=10, help="torchrun's checkpoint period")
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--smoke", action="store_true", help="a quick run; goals not judged")
    args = parser.parse_args(argv)
    rounds: dict[str, list[dict[str, float]]] = {"elastic": [], "torchrun": []}
    if has_torchft():
        rounds["torchft"] = []
    else:
        print("torchft is not installed (pip install torchft): its arm is left out")
    for _ in range(args.rounds):
        rounds["elastic"].append(_elastic_round(args.steps, args.kill_at, args.step_ms))
        rounds["torchrun"].append(
            _torchrun_round(args.steps, args.kill_at, args.step_ms, args.every)
        )
        if "torchft" in rounds:
            rounds["torchft"].append(_torchft_round(args.steps, args.kill_at, args.step_ms))
    title, columns, rows, payload = summarize(rounds, args.every, args.smoke)
    return _common.publish("elastic", title, columns, rows, payload, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
