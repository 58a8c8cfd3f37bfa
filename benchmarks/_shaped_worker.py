"""One rank of a shaped-link benchmark, started by _netns.ShapedLink.run inside its namespace.

Rank 0 hosts the rendezvous store on a port the OS picks (it plays the part
of torchrun's agent) and publishes the port in a file; both ranks then open a
DistSession from torchrun-style variables.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
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


class _ConvNet(torch.nn.Module):
    """Three conv + BatchNorm + ReLU + pool stages on 3 x 32 x 32 images and a
    linear head: compute bound, few parameters, and buffers to keep in step."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        channels = (3, 32, 64, 128)
        for cin, cout in itertools.pairwise(channels):
            layers += [
                torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                torch.nn.BatchNorm2d(cout),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),
            ]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(128 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


# the sweep's model shapes: (the model, one input row's shape)
SHAPES: dict[str, tuple[Any, tuple[int, ...]]] = {
    "wide": (lambda: _Mlp(1024, 4), (1024,)),  # wide and shallow: 4.2 M parameters in 10 tensors
    "deep": (lambda: _Mlp(256, 24), (256,)),  # deep and narrow: 1.6 M in 50 small tensors
    # the shape of issue 25's independent instrument: 1.1 M in 10 tensors
    "mid": (lambda: _Mlp(512, 4), (512,)),
    "conv": (_ConvNet, (3, 32, 32)),  # conv + BatchNorm: 0.1 M parameters, compute bound
}


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
SWEEP_ARMS = ARMS[:-1]  # the seed's way runs on the headline configuration only


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def ddp(s: DistSession, options: dict[str, Any]) -> dict[str, Any]:
    """Every configuration of ``options["configs"]`` in turn (one session)."""
    configs = options["configs"]
    if options.get("smoke"):  # one configuration per shape
        configs = list({c["shape"]: c for c in reversed(configs)}.values())[::-1]
    reps = int(options.get("reps", 10))
    buckets = {
        "bucket_mb": float(options.get("bucket_mb", 4.0)),
        "first_bucket_mb": float(options.get("first_bucket_mb", 1.0)),
    }
    results = []
    for config in configs:
        arms = ARMS if config.get("seed") else SWEEP_ARMS
        result = _ddp_config(s, config, arms, reps, buckets)
        results.append({"config": config, **result})
        print(f"rank {s.rank}: {_config_name(config)} done", file=sys.stderr, flush=True)
    return {"configs": results}


def _config_name(config: dict[str, Any]) -> str:
    return f"{config['shape']} b{config['batch']} {config['optimizer']}"


def _ddp_config(
    s: DistSession,
    config: dict[str, Any],
    arms: tuple[str, ...],
    reps: int,
    buckets: dict[str, float],
) -> dict[str, Any]:
    """Step time (forward, backward, gradient averaging, optimizer) of every
    arm on one configuration, interleaved step by step.

    Each arm trains its own copy of one model on the same batch. Per step the
    main thread's time splits into backward (forward and backward up to the
    end of autograd's last hook, measured the same way for every arm: DDP's
    and gradient_sync's copies into buckets and launches included, DDP's
    blocking wait at the end of its backward not), exposed communication
    (waiting for buckets) and optimizer (inside ``optimizer.step()``,
    gradient_sync's per-bucket updates included).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    make, row = SHAPES[config["shape"]]
    batch = int(config["batch"])
    torch.manual_seed(0)
    base = make()
    models = {arm: copy.deepcopy(base) for arm in arms}
    opts = {arm: _optimizer(config["optimizer"], models[arm].parameters()) for arm in arms}
    timers = {arm: _Timed(opts[arm]) for arm in arms}
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
    # the backward phase ends when autograd has run every hook, before DDP's
    # own end-of-backward callback waits for its buckets: a callback queued
    # from the first gradient's hook runs just then (ahead of DDP's, queued
    # at its last bucket), the same for every arm
    # and the main thread's CPU time until then: what the hooks and launches
    # cost, apart from waiting for a core the ranks' gloo threads hold
    computed = {"at": 0.0, "cpu": 0.0}

    def mark() -> None:
        computed["at"] = time.perf_counter()
        computed["cpu"] = time.thread_time()

    def queue_mark(_: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(mark)  # type: ignore[attr-defined]

    for arm in arms:
        list(models[arm].parameters())[-1].register_post_accumulate_grad_hook(queue_mark)
    g = torch.Generator().manual_seed(s.rank)
    x = torch.randn(batch, *row, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    world = s.world_size

    def step(arm: str) -> dict[str, float]:
        model = ddps.get(arm, models[arm])
        t0, cpu0 = time.perf_counter(), time.thread_time()
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
        marked = t0 < computed["at"] <= t1
        backward = computed["at"] - t0 if marked else t1 - t0
        return {
            "step": t2 - t0,
            "backward": backward,
            "backward_cpu": computed["cpu"] - cpu0 if marked else backward,
            "optimizer": timers[arm].take(),
        }

    for arm in arms:  # warm-up (and gradient_sync's bucket rebuild)
        step(arm)
        step(arm)
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for r in range(reps * int(config.get("weight", 1))):  # short steps: more rounds
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            s.barrier().wait()
            samples[arm].append(step(arm))
    # compute alone (forward, and forward with backward; no communication) and
    # communication alone (one allreduce of every gradient, float32 and bfloat16)
    forward, compute = [], []
    for _ in range(9):
        t0 = time.perf_counter()
        with syncs["sync"].no_sync():
            loss = torch.nn.functional.cross_entropy(models["sync"](x), y)
            t1 = time.perf_counter()
            loss.backward()
        models["sync"].zero_grad(set_to_none=True)
        forward.append(t1 - t0)
        compute.append(time.perf_counter() - t0)
    for sync in syncs.values():
        sync.remove()
    params = sum(p.numel() for p in base.parameters())
    comm, least = {}, {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        flat = torch.zeros(params, dtype=dtype)
        times = []
        for _ in range(3):
            s.barrier().wait()
            t0 = time.perf_counter()
            s.allreduce(flat, op="sum").wait()
            times.append(time.perf_counter() - t0)
        comm[name] = statistics.median(times)
        least[name] = min(times)
    # the least any step waits after its last gradient: one element's round trip
    tiny, times = torch.zeros(1), []
    for _ in range(9):
        s.barrier().wait()
        t0 = time.perf_counter()
        s.allreduce(tiny, op="sum").wait()
        times.append(time.perf_counter() - t0)
    comm["one_element"], least["one_element"] = statistics.median(times), min(times)
    # the same float32 allreduce while this rank's main thread runs the
    # optimizer, as step overlap does: on a machine whose cores the ranks'
    # compute and their gloo threads share, communication slows down
    busy, optimizer = [], opts["sync"]
    for param in models["sync"].parameters():
        param.grad = torch.zeros_like(param)
    flat = torch.zeros(params)
    for _ in range(3):
        s.barrier().wait()
        t0 = time.perf_counter()
        handle = s.allreduce(flat, op="sum")
        while not handle.done():
            optimizer.step()
        handle.wait()
        busy.append(time.perf_counter() - t0)
    comm["float32_busy"] = statistics.median(busy)
    compute_s, forward_s = statistics.median(compute), statistics.median(forward)
    med = {arm: statistics.median(x["step"] for x in samples[arm]) for arm in arms}
    breakdown = {}
    for arm in arms:
        part = {k: statistics.median(x[k] for x in samples[arm]) for k in samples[arm][0]}
        breakdown[arm] = {
            "backward": part["backward"],
            "backward_cpu": part["backward_cpu"],
            "optimizer": part["optimizer"],
            "exposed_comm": max(med[arm] - part["backward"] - part["optimizer"], 0.0),
            "communication": comm["bfloat16" if arm.endswith(("bf16", "both")) else "float32"],
        }
    # no exact arm's step can be shorter: the first gradient needs the forward,
    # the last average every gradient's allreduce, and the update the averages;
    # nor (where compute bounds the step) than forward and backward and then
    # the round trip of the last gradient's allreduce, at least one element's.
    # Each part is its least sample: a bound must not rise with the noise (the
    # median of 5 compute samples once came out above DDP's whole step)
    floor = (
        max(min(compute) + least["one_element"], min(forward) + least["float32"])
        + breakdown["sync"]["optimizer"]
    )
    steps = {arm: [x["step"] for x in samples[arm]] for arm in arms}

    def paired(arm: str, base: str) -> float:
        """The median over rounds of arm ÷ base, each pair from one round."""
        return statistics.median(a / b for a, b in zip(steps[arm], steps[base], strict=True))

    saving = statistics.median(
        a - b for a, b in zip(steps["sync"], steps["sync_step"], strict=True)
    )
    sizes = syncs["sync"].bucket_sizes
    return {
        "params": params,
        "grad_bytes": params * 4,
        "median_s": med,
        "compute_s": compute_s,
        "forward_s": forward_s,
        "comm_s": comm,
        "floor_s": floor,
        "breakdown": breakdown,
        "buckets": sizes,
        "ratio_vs_ddp": {arm: paired(arm, "ddp") for arm in arms},
        "backward_vs_ddp": breakdown["sync"]["backward"] / breakdown["ddp"]["backward"],
        "backward_cpu_vs_ddp": (
            breakdown["sync"]["backward_cpu"] / breakdown["ddp"]["backward_cpu"]
        ),
        "bf16_vs_ddp_bf16": paired("sync_bf16", "ddp_bf16"),
        "floor_vs_ddp": floor / med["ddp"],
        # step overlap judged by what it can hide: the step time it saves over
        # plain gradient_sync, as a share of the optimizer's time; the update
        # of the last bucket to land cannot be hidden (nothing is left on the
        # wire behind it), which bounds the share by the other buckets' part
        "overlap_hides": saving / breakdown["sync"]["optimizer"],
        "overlap_can_hide": 1 - sizes[-1] / sum(sizes),
        "samples": steps,
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
