"""Backward's main-thread CPU: autograd alone, DDP, gradient_sync, and where the last's goes.

Two local gloo ranks on loopback train three copies of the sweep's deep MLP
(24 x 256 + head, 50 parameters: the shape with the most hooks per
millisecond of backward), one step each in rotating order: no hooks at all,
torch DDP, and ``gradient_sync`` (the sweep's bucket caps, SGD with
momentum). Per step the main thread's CPU time (``time.thread_time``, so
waiting for a core the gloo threads hold does not count) is taken over the
forward and over the backward up to autograd's end (a callback queued from
the first gradient's hook runs then, the same for every arm); medians over
the steps, the worse of the two ranks. A second pass, after the timed one,
wraps gradient_sync's parts (the copies into buckets, the launches, the
step's start, the hook calls as a whole) to time each; the wrapping adds
about a microsecond per wrapped call, so the parts sum to a little more than
the first pass's excess. A third pass launches each bucket with torch's own
``all_reduce(async_op=True)`` in place of the session's ``allreduce`` and
times those calls the same way: the launches' row less this one is what the
session's issue path (checks, handle, bookkeeping) costs inside a backward.

This is the probe behind the backward-phase rows of docs/benchmarks.md; it
is not part of ``asyncdist bench`` (``benchmarks/ddp.py`` judges the goal).

    python benchmarks/backward_cpu.py [--steps 120] [--batch 16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

ARMS = ("none", "ddp", "sync")
WARMUP = 10
PARTS = ("hooks", "copies", "launches", "start")


class _RawLaunch:
    """A bucket launched with torch's own call: what ``GradientSync`` waits on."""

    def __init__(self, work: Any, tensor: Any) -> None:
        self._work, self._tensor = work, tensor

    def wait(self) -> Any:
        self._work.wait()
        return self._tensor


def _rank(s: Any, steps: int, batch: int) -> dict[str, Any]:
    import torch
    from _shaped_worker import SHAPES

    import asyncdist._grad as grad_module

    torch.set_num_threads(1)
    make, row = SHAPES["deep"]
    g = torch.Generator().manual_seed(s.rank)
    x = torch.randn(batch, *row, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def timed(parts: dict[str, float] | None) -> dict[str, dict[str, float]]:
        torch.manual_seed(0)
        base = make()
        models = {arm: copy.deepcopy(base) for arm in ARMS}
        opts = {
            arm: torch.optim.SGD(models[arm].parameters(), lr=0.01, momentum=0.9) for arm in ARMS
        }
        ddp = torch.nn.parallel.DistributedDataParallel(models["ddp"], bucket_cap_mb=4)
        sync = s.gradient_sync(models["sync"], bucket_mb=4, first_bucket_mb=1)
        forward = {"none": models["none"], "ddp": ddp, "sync": models["sync"]}
        ended = {"cpu": 0.0}

        def mark() -> None:
            ended["cpu"] = time.thread_time()

        def queue_mark(_: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(mark)  # type: ignore[attr-defined]

        for arm in ARMS:  # the last parameter (the head's bias) has the first gradient
            list(models[arm].parameters())[-1].register_post_accumulate_grad_hook(queue_mark)
        samples: dict[str, dict[str, list[float]]] = {a: {"fwd": [], "bwd": []} for a in ARMS}
        for r in range(steps + WARMUP):
            if parts is not None and r == WARMUP:  # the warm-up's tally is dropped
                parts.update(dict.fromkeys(PARTS, 0.0))
            for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
                c0 = time.thread_time()
                loss = torch.nn.functional.cross_entropy(forward[arm](x), y)
                c1 = time.thread_time()
                loss.backward()
                if arm == "sync":
                    sync.wait()
                opts[arm].step()
                opts[arm].zero_grad(set_to_none=True)
                if r >= WARMUP:
                    samples[arm]["fwd"].append((c1 - c0) * 1e3)
                    samples[arm]["bwd"].append((ended["cpu"] - c1) * 1e3)
        sync.remove()
        return {
            arm: {k: statistics.median(v) for k, v in phases.items()}
            for arm, phases in samples.items()
        }

    result: dict[str, Any] = {"arms": timed(None)}
    parts: dict[str, float] = {}

    patched = [
        (grad_module.GradientSync, "_on_grad", "hooks"),
        (grad_module._Bucket, "fill", "copies"),
        (grad_module.GradientSync, "_launch", "launches"),
        (grad_module.GradientSync, "_begin", "start"),
    ]
    originals = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in patched]
    for cls, attr, name in patched:
        setattr(cls, attr, _common.timed_calls(parts, name, getattr(cls, attr), time.thread_time))
    try:
        timed(parts)
    finally:
        for cls, attr, fn in originals:
            setattr(cls, attr, fn)
    result["parts_ms"] = {name: parts[name] * 1e3 / steps for name in PARTS}

    # the same launches as torch's own calls (a mean's gradients are scaled
    # as they are copied in, so the bucket is summed: torch's default op)
    import torch.distributed as dist

    def raw_launch(sync: Any, bucket: Any) -> _RawLaunch:
        return _RawLaunch(dist.all_reduce(bucket.buffer, async_op=True), bucket.buffer)

    launch = grad_module.GradientSync._launch
    raw: dict[str, float] = {}
    grad_module.GradientSync._launch = _common.timed_calls(  # type: ignore[method-assign]
        raw, "launches", raw_launch, time.thread_time
    )
    try:
        timed(raw)  # its warm-up's tally is dropped, as above
    finally:
        grad_module.GradientSync._launch = launch  # type: ignore[method-assign]
    result["parts_ms"]["raw_launches"] = raw["launches"] * 1e3 / steps
    return result


def summarize(
    ranks: list[dict[str, Any]],
) -> tuple[str, list[str], list[list[str]], dict[str, Any]]:
    """Per-rank results -> the table's title, columns and rows, and the JSON payload
    (every figure the worse, i.e. larger, of the ranks)."""

    def worst(arm: str, phase: str) -> float:
        return max(float(r["arms"][arm][phase]) for r in ranks)

    def worst_part(name: str) -> float:
        return max(float(r["parts_ms"][name]) for r in ranks)

    rows = []
    none_bwd, ddp_bwd = worst("none", "bwd"), worst("ddp", "bwd")
    for arm, label in (("none", "autograd, no hooks"), ("ddp", "DDP"), ("sync", "gradient_sync")):
        fwd, bwd = worst(arm, "fwd"), worst(arm, "bwd")
        rows.append(
            [label, f"{fwd:.2f}", f"{bwd:.2f}", f"{bwd - none_bwd:+.2f}", f"{bwd / ddp_bwd:.2f}"]
        )
    parts = {name: worst_part(name) for name in PARTS}
    hooks_rest = parts["hooks"] - parts["copies"] - parts["launches"] - parts["start"]
    for name, value in (
        ("of it: copies", parts["copies"]),
        ("of it: launches", parts["launches"]),
        ("of it: step start", parts["start"]),
        ("of it: rest of hooks", hooks_rest),
    ):
        rows.append([name, "", f"{value:.2f}", "", ""])
    payload = {"ranks": ranks, "parts_ms": parts, "hooks_rest_ms": hooks_rest}
    if all("raw_launches" in r["parts_ms"] for r in ranks):
        raw = worst_part("raw_launches")
        rows.append(["launches, torch's own call", "", f"{raw:.2f}", "", ""])
        payload["raw_launches_ms"] = raw
        payload["issue_path_ms"] = parts["launches"] - raw
    title = "backward CPU, main thread (deep MLP, 2 gloo ranks), ms"
    return title, ["arm", "fwd", "bwd", "bwd +", "÷ DDP"], rows, payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    import asyncdist

    ranks = asyncdist.spawn(_rank, 2, args=(args.steps, args.batch), timeout=600)
    title, columns, rows, payload = summarize(ranks)
    return _common.publish("backward_cpu", title, columns, rows, payload)


if __name__ == "__main__":
    sys.exit(main())
