"""One rank of a shaped-link benchmark, started by _netns.ShapedLink.run inside its namespace.

Rank 0 hosts the rendezvous store on a port the OS picks (it plays the part
of torchrun's agent) and publishes the port in a file; both ranks then open a
DistSession from torchrun-style variables.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncdist import DistSession

MIB = 1 << 20


def _rendezvous(rank: int, master: str, port_file: Path) -> Any:
    store = None
    if rank == 0:
        store = dist.TCPStore(
            master,
            0,
            2,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=120),
        )
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.rename(port_file)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never published its store port")
        time.sleep(0.05)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        MASTER_ADDR=master,
        MASTER_PORT=port_file.read_text(),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    return store


def overlap(s: DistSession, options: dict[str, Any]) -> dict[str, Any]:
    """A 4 MiB allreduce overlapped with GIL-free "device compute" of equal length."""
    import anyio

    tensor = torch.zeros(int(options.get("mib", 4)) * MIB // 4)
    reps = int(options.get("reps", 15))
    for _ in range(3):
        s.allreduce(tensor).wait()
    comm = []
    for _ in range(reps):
        s.barrier().wait()
        t0 = time.perf_counter()
        s.allreduce(tensor).wait()
        comm.append(time.perf_counter() - t0)
    comm_s = statistics.median(comm)
    compute_s = comm_s * float(options.get("compute_ratio", 1.0))

    async def run() -> dict[str, Any]:
        times: dict[str, list[float]] = {"sequential": [], "overlapped": []}
        timeline: dict[str, float] = {}
        for r in range(reps):
            for mode in ("sequential", "overlapped") if r % 2 else ("overlapped", "sequential"):
                await s.barrier()
                t0 = time.perf_counter()
                if mode == "sequential":
                    await s.allreduce(tensor)
                    time.sleep(compute_s)  # noqa: ASYNC251 - GIL-free "device compute"
                else:
                    h = s.allreduce(tensor)
                    c0 = time.perf_counter()
                    time.sleep(compute_s)  # noqa: ASYNC251 - the host idles, as during a kernel
                    c1 = time.perf_counter()
                    await h
                    if r == reps - 1:
                        timeline = {
                            "launch": 0.0,
                            "compute_start": c0 - t0,
                            "compute_end": c1 - t0,
                            "comm_done": time.perf_counter() - t0,
                        }
                times[mode].append(time.perf_counter() - t0)
        return {"times": times, "timeline": timeline}

    result = anyio.run(run)
    seq = statistics.median(result["times"]["sequential"])
    ovl = statistics.median(result["times"]["overlapped"])
    bound = max(comm_s, compute_s)
    return {
        "comm_s": comm_s,
        "compute_s": compute_s,
        "sequential_s": seq,
        "overlapped_s": ovl,
        "efficiency": (seq - ovl) / (seq - bound) if seq > bound else 0.0,
        "timeline": result["timeline"],
        "samples": result["times"],
    }


def bandwidth(s: DistSession, options: dict[str, Any]) -> dict[str, Any]:
    """A 64 MiB allreduce against the line-rate bound 2(n-1)/n * size / rate."""
    size = int(options.get("mib", 64)) * MIB
    tensor = torch.zeros(size // 4)
    s.allreduce(tensor).wait()
    times = []
    for _ in range(int(options.get("reps", 5))):
        s.barrier().wait()
        t0 = time.perf_counter()
        s.allreduce(tensor).wait()
        times.append(time.perf_counter() - t0)
    n = s.world_size
    rate_bits = float(options["rate_bits"])
    bound = 2 * (n - 1) / n * size * 8 / rate_bits
    median = statistics.median(times)
    return {
        "bytes": size,
        "median_s": median,
        "bound_s": bound,
        "efficiency": bound / median,
        "samples": times,
    }


class _Mlp(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _Timed:
    """Wall time spent inside ``optimizer.step()`` (every call: gradient_sync's
    per-bucket updates count too), from the optimizer's own step hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.total = 0.0
        self._start = 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._start

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


ARMS = ("ddp", "ddp_bf16", "sync", "sync_step", "sync_bf16", "sync_both", "seed")


def ddp(s: DistSession, options: dict[str, Any]) -> dict[str, Any]:
    """Step time (backward + gradient averaging + Adam) of every arm, interleaved.

    Each arm trains its own copy of one model on the same batch. Per step the
    main thread's time splits into backward (forward and backward; for DDP,
    the compute alone, its blocking finish counted as exposed communication),
    exposed communication (waiting for buckets) and optimizer (inside
    ``optimizer.step()``, gradient_sync's per-bucket updates included).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    width, depth = int(options.get("width", 1024)), int(options.get("depth", 4))
    batch = int(options.get("batch", 64))
    buckets = {
        "bucket_mb": float(options.get("bucket_mb", 4.0)),
        "first_bucket_mb": float(options.get("first_bucket_mb", 1.0)),
    }
    torch.manual_seed(0)
    base = _Mlp(width, depth)
    models = {arm: copy.deepcopy(base) for arm in ARMS}
    opts = {arm: torch.optim.Adam(models[arm].parameters(), lr=1e-4) for arm in ARMS}
    timers = {arm: _Timed(opts[arm]) for arm in ARMS}
    ddps = {
        arm: torch.nn.parallel.DistributedDataParallel(
            models[arm], bucket_cap_mb=buckets["bucket_mb"]
        )
        for arm in ("ddp", "ddp_bf16")
    }
    # the body of DDP's bf16_compress_hook: DDP refuses to register that hook
    # by name without CUDA and NCCL, the same function under another name it takes
    ddps["ddp_bf16"].register_comm_hook(
        None, lambda state, bucket: default_hooks._compress_hook(torch.bfloat16, state, bucket)
    )
    syncs = {
        "sync": s.gradient_sync(models["sync"], **buckets),
        "sync_step": s.gradient_sync(models["sync_step"], **buckets, optimizer=opts["sync_step"]),
        "sync_bf16": s.gradient_sync(models["sync_bf16"], **buckets, compression="bf16"),
        "sync_both": s.gradient_sync(
            models["sync_both"], **buckets, optimizer=opts["sync_both"], compression="bf16"
        ),
    }
    g = torch.Generator().manual_seed(s.rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    world = s.world_size

    def step(arm: str) -> dict[str, float]:
        model = ddps.get(arm, models[arm])
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        if arm in syncs:
            syncs[arm].wait()  # the step-overlap arms update inside it
        elif arm == "seed":  # the seed helper: a blocking allreduce per gradient
            for p in models[arm].parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        if arm not in ("sync_step", "sync_both"):
            opts[arm].step()
        t2 = time.perf_counter()
        opts[arm].zero_grad(set_to_none=True)
        return {"step": t2 - t0, "backward": t1 - t0, "optimizer": timers[arm].take()}

    for arm in ARMS:  # warm-up (and gradient_sync's bucket rebuild)
        step(arm)
        step(arm)
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for r in range(int(options.get("reps", 10))):
        for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
            s.barrier().wait()
            samples[arm].append(step(arm))
    # compute alone (forward and backward, no communication) and communication
    # alone (one allreduce of every gradient, in float32 and in bfloat16)
    compute = []
    for _ in range(5):
        t0 = time.perf_counter()
        with syncs["sync"].no_sync():
            torch.nn.functional.cross_entropy(models["sync"](x), y).backward()
        models["sync"].zero_grad(set_to_none=True)
        compute.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in base.parameters())
    comm = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        flat = torch.zeros(params, dtype=dtype)
        times = []
        for _ in range(3):
            s.barrier().wait()
            t0 = time.perf_counter()
            s.allreduce(flat, op="sum").wait()
            times.append(time.perf_counter() - t0)
        comm[name] = statistics.median(times)
    compute_s = statistics.median(compute)
    med = {arm: statistics.median(x["step"] for x in samples[arm]) for arm in ARMS}
    breakdown = {}
    for arm in ARMS:
        part = {k: statistics.median(x[k] for x in samples[arm]) for k in samples[arm][0]}
        backward = min(part["backward"], compute_s) if arm.startswith("ddp") else part["backward"]
        optimizer = part["optimizer"]
        breakdown[arm] = {
            "backward": backward,
            "optimizer": optimizer,
            "exposed_comm": max(med[arm] - backward - optimizer, 0.0),
            "communication": comm["bfloat16" if arm.endswith(("bf16", "both")) else "float32"],
        }
    return {
        "params": params,
        "grad_bytes": params * 4,
        "median_s": med,
        "compute_s": compute_s,
        "comm_s": comm,
        "breakdown": breakdown,
        "buckets": syncs["sync"].bucket_sizes,
        "ratio_vs_ddp": {arm: med[arm] / med["ddp"] for arm in ARMS},
        "samples": {arm: [x["step"] for x in samples[arm]] for arm in ARMS},
    }


def concurrency(s: DistSession, options: dict[str, Any]) -> dict[str, Any]:
    """A 4 B allreduce issued while a bulk allreduce is in flight: on the same
    lane, or on a channel of its own; and the bulk's throughput with a stream
    of small ops on the channel alongside. Interleaved repetitions, medians."""
    bulk = torch.zeros(int(options.get("mib", 64)) * MIB // 4)
    tiny = torch.zeros(1)
    small = s.channel("small")
    reps, alongside = int(options.get("reps", 10)), int(options.get("alongside", 20))

    def idle() -> float:
        t0 = time.perf_counter()
        s.allreduce(tiny).wait()
        return time.perf_counter() - t0

    def during(lane: Any) -> float:
        h = s.allreduce(bulk)
        t0 = time.perf_counter()
        lane.allreduce(tiny).wait()
        latency = time.perf_counter() - t0
        h.wait()
        return latency

    def bulk_alone() -> float:
        t0 = time.perf_counter()
        s.allreduce(bulk).wait()
        return time.perf_counter() - t0

    def bulk_with_small() -> float:
        t0 = time.perf_counter()
        h = s.allreduce(bulk)
        for _ in range(alongside):  # the same count on every rank
            small.allreduce(tiny).wait()
        h.wait()
        return time.perf_counter() - t0

    modes = {
        "idle": idle,
        "same_lane": lambda: during(s),
        "own_channel": lambda: during(small),
        "bulk_alone": bulk_alone,
        "bulk_with_small": bulk_with_small,
    }
    for fn in modes.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in modes}
    names = list(modes)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            s.barrier().wait()
            times[name].append(modes[name]())
    med = {name: statistics.median(v) for name, v in times.items()}
    nbytes = bulk.numel() * bulk.element_size()
    return {
        "median_s": med,
        "same_lane_x_idle": med["same_lane"] / med["idle"],
        "own_channel_x_idle": med["own_channel"] / med["idle"],
        "bulk_gbit_s": {
            "alone": nbytes * 8 / med["bulk_alone"] / 1e9,
            "with_small": nbytes * 8 / med["bulk_with_small"] / 1e9,
        },
        "bulk_throughput_kept": med["bulk_alone"] / med["bulk_with_small"],
        "samples": times,
    }


TASKS = {"overlap": overlap, "bandwidth": bandwidth, "ddp": ddp, "concurrency": concurrency}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = _rendezvous(args.rank, args.master, args.port_file)
    with DistSession(timeout=300, device="cpu") as s:
        result = TASKS[args.task](s, json.loads(args.options))
    args.out.write_text(json.dumps(result))
    del store


if __name__ == "__main__":
    main()
