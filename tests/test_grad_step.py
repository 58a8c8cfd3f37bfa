"""gradient_sync's step overlap and wire compression.

Step overlap must update the parameters bitwise as ``await sync;
opt.step()`` does; compression must agree with DDP's compress hooks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from asyncdist import AsyncDistError, DistSession, spawn
from asyncdist._collectives import lane_of
from asyncdist._grad import buckets_of

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    """Several buckets at a small cap; a frozen layer, a parameter no step
    uses, and a float64 parameter (a bucket of its own dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Parameter(torch.ones(4))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return self.frozen(y) * self.scale.float()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


Make = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Make] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1),
}


class Replica:
    """A model, an extra parameter outside it (a loss temperature, stepped by
    the same optimizer), two parameter groups and a scheduler."""

    def __init__(self, base: Net, make: Make) -> None:
        self.model = copy.deepcopy(base)
        self.temperature = torch.nn.Parameter(torch.ones(()))
        m = self.model
        groups = [
            {"params": [*m.a.parameters(), *m.b.parameters(), *m.frozen.parameters()]},
            {
                "params": [*m.c.parameters(), m.scale, m.unused, self.temperature],
                "lr": 0.05,
            },
        ]
        self.opt = make(groups)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        logits = self.model(x) / self.temperature
        torch.nn.functional.cross_entropy(logits, y).backward()

    def state(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in [*self.model.parameters(), self.temperature]]


async def _same_as_sequential(
    s: DistSession, names: list[str], clip: float | None
) -> dict[str, list[bool]]:
    """Per optimizer and step: are the overlapped parameters bitwise those of
    ``await sync; [clip]; opt.step()``? Step 2 accumulates over two
    micro-batches under no_sync; sync steps alternate with async awaits."""
    torch.manual_seed(0)
    base = Net()
    out: dict[str, list[bool]] = {}
    for name in names:
        overlapped, sequential = Replica(base, OPTIMIZERS[name]), Replica(base, OPTIMIZERS[name])
        tiny = {"bucket_mb": 0.0005, "first_bucket_mb": 0.0002}
        ours = s.gradient_sync(
            overlapped.model, **tiny, optimizer=overlapped.opt, clip_grad_norm=clip
        )
        plain = s.gradient_sync(sequential.model, **tiny)
        same = []
        for step in range(5):
            for replica, sync in ((overlapped, ours), (sequential, plain)):
                if step == 2:
                    with sync.no_sync():
                        replica.backward(*_batch(s.rank, 100 + step))
                        await sync  # no communication, and no step
                replica.backward(*_batch(s.rank, step))
                if step % 2:
                    await sync
                else:
                    sync.wait()
                if replica is sequential:
                    if clip is not None:
                        torch.nn.utils.clip_grad_norm_(replica.model.parameters(), clip)
                    replica.opt.step()
                replica.opt.zero_grad(set_to_none=step % 2 == 0)
                replica.scheduler.step()
            same.append(
                all(
                    torch.equal(a, b)
                    for a, b in zip(overlapped.state(), sequential.state(), strict=True)
                )
            )
            # and the step did move the parameters
            assert not torch.equal(overlapped.state()[0], base.a.weight)
        out[name] = same
        assert len(ours.bucket_sizes) >= 3, ours.bucket_sizes
        ours.remove()
        plain.remove()
    return out


@pytest.mark.parametrize(("world", "clip"), [(2, None), (3, None), (2, 0.05)])
def test_step_overlap_is_bitwise_the_sequential_step(world: int, clip: float | None) -> None:
    names = list(OPTIMIZERS) if clip is None else ["adam"]
    results = spawn(
        _same_as_sequential, world, args=(names, clip), timeout=60, channels=["gradients"]
    )
    for rank, result in enumerate(results):
        assert result == {name: [True] * 5 for name in names}, rank


def _manual_step_after_overlap(s: DistSession) -> str:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with s.gradient_sync(model, optimizer=opt) as sync:
        model(torch.ones(1, 2)).sum().backward()
        sync.wait()
        try:
            opt.step()
        except AsyncDistError as exc:
            message = str(exc)
        else:
            message = ""
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        sync.wait()  # the guard re-arms per step: the next step is taken normally
        sync.remove()
        # a new sync over the same optimizer steps it without tripping the
        # first one's guard (that one had just stepped)
        again = s.gradient_sync(model, optimizer=opt)
        model(torch.ones(1, 2)).sum().backward()
        again.wait()
        again.remove()
    return message


def test_a_manual_step_after_the_overlapped_one_is_refused() -> None:
    for message in spawn(_manual_step_after_overlap, 2, timeout=30):
        assert "already stepped" in message
        assert "remove the optimizer.step()" in message


def test_bad_arguments_raise_before_anything_is_launched() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    partial = torch.optim.SGD(model.a.parameters(), lr=0.1)
    cases: list[tuple[type[Exception], str, dict[str, Any], Any]] = [
        (ValueError, "compression must be", {"compression": "int8"}, model),
        (TypeError, "torch.nn.Module", {}, 3),
        (ValueError, "does not own .*b.weight", {"optimizer": partial}, model),
        (TypeError, "torch.optim.Optimizer", {"optimizer": object()}, model),
        (TypeError, "LBFGS", {"optimizer": torch.optim.LBFGS(model.parameters())}, model),
        (ValueError, "clip_grad_norm needs optimizer", {"clip_grad_norm": 1.0}, model),
        (ValueError, "clip_grad_norm must be", {"optimizer": opt, "clip_grad_norm": -1}, model),
    ]
    with DistSession() as s:
        for error, match, kwargs, module in cases:
            with pytest.raises(error, match=match):
                s.gradient_sync(module, **kwargs)
        lane = lane_of(s)
        assert lane is not None
        assert list(lane.sublanes) == [], "a channel was formed"


def _compressed_vs_ddp(s: DistSession, compression: str) -> dict[str, Any]:
    """The same gradients averaged by gradient_sync with compression, by DDP
    with the matching compress hook, and by gradient_sync in full precision."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ours, full = copy.deepcopy(base), copy.deepcopy(base)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    narrow = {"bf16": torch.bfloat16, "fp16": torch.float16}[compression]
    # the body of DDP's bf16_compress_hook / fp16_compress_hook (DDP refuses to
    # register the bf16 one by its name without CUDA and NCCL; an unannotated
    # lambda passes its signature check)
    ddp.register_comm_hook(
        None, lambda state, bucket: default_hooks._compress_hook(narrow, state, bucket)
    )
    sync = s.gradient_sync(ours, compression=compression, first_bucket_mb=0.001)
    sync_full = s.gradient_sync(full, channel=s.channel("full"))
    g = torch.Generator().manual_seed(s.rank)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
    for model in (ours, full, ddp):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    sync.wait()
    sync_full.wait()
    grads = {
        name: [p.grad for p in model.parameters()]  # type: ignore[misc]
        for name, model in (("ours", ours), ("full", full), ("ddp", ddp.module))
    }

    def gap(other: str) -> float:
        pairs = zip(grads["ours"], grads[other], strict=True)
        return max(float((a - b).abs().max()) for a, b in pairs)

    return {
        "dtypes": [b.buffer.dtype for b in buckets_of(sync)],
        "wire": [None if b.wire is None else b.wire.dtype for b in buckets_of(sync)],
        "vs_ddp": gap("ddp"),
        "vs_full": gap("full"),
        "scale": max(float(g.abs().max()) for g in grads["full"]),
    }


@pytest.mark.parametrize(("world", "compression"), [(2, "bf16"), (3, "bf16"), (2, "fp16")])
def test_compression_matches_ddps_hook(world: int, compression: str) -> None:
    narrow = {"bf16": torch.bfloat16, "fp16": torch.float16}[compression]
    eps = torch.finfo(narrow).eps
    for r in spawn(_compressed_vs_ddp, world, args=(compression,), timeout=60):
        assert r["dtypes"] == [torch.float32] * len(r["dtypes"])
        assert r["wire"] == [narrow] * len(r["wire"]), "every bucket narrowed on the wire"
        # DDP's buckets differ from ours, so sums may round in another order:
        # within a couple of roundings in the narrow type
        assert r["vs_ddp"] <= 2 * eps * r["scale"], r
        assert 0 < r["vs_full"] <= 2 * eps * r["scale"], r


def _accumulated_in_place(s: DistSession, compression: str | None) -> bool:
    """Two replicas averaged the same way over three steps of two
    micro-batches each (the first under ``no_sync()``): one zeroes its
    gradients with ``set_to_none=True`` (the hooks copy fresh gradients into
    the buckets), the other with ``set_to_none=False`` (each ``.grad`` is a
    view of its bucket, and backward accumulates into it in place)."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    fresh, in_place = copy.deepcopy(base), copy.deepcopy(base)
    kw: dict[str, Any] = {"compression": compression, "first_bucket_mb": 0.0001}
    syncs = {
        id(fresh): s.gradient_sync(fresh, **kw),
        id(in_place): s.gradient_sync(in_place, channel=s.channel("in_place"), **kw),
    }
    same = True
    for step in range(3):
        for model, none in ((fresh, True), (in_place, False)):
            model.zero_grad(set_to_none=none)
            sync = syncs[id(model)]
            with sync.no_sync():
                x, y = _batch(s.rank, 2 * step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
            x, y = _batch(s.rank, 2 * step + 1)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            sync.wait()
        pairs = zip(fresh.parameters(), in_place.parameters(), strict=True)
        same &= all(torch.equal(a.grad, b.grad) for a, b in pairs)  # type: ignore[arg-type]
        with torch.no_grad():  # a step, so that the next gradients differ
            for a, b in zip(fresh.parameters(), in_place.parameters(), strict=True):
                a -= 0.1 * a.grad  # type: ignore[operator]
                b -= 0.1 * b.grad  # type: ignore[operator]
    return same


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_gradients_accumulated_in_their_buckets_are_averaged_alike(
    compression: str | None,
) -> None:
    assert spawn(_accumulated_in_place, 2, args=(compression,), timeout=60) == [True, True]


def _fp16_large(s: DistSession) -> list[float]:
    """Gradients of 60000 on each rank: the sum (120000) overflows fp16, the
    pre-divided halves (30000 each) do not."""
    model = torch.nn.Linear(1, 1, bias=False)
    with s.gradient_sync(model, compression="fp16") as sync:
        model(torch.full((1, 1), 60000.0)).sum().backward()
        sync.wait()
    assert model.weight.grad is not None
    return model.weight.grad.flatten().tolist()


def test_fp16_predivides_so_the_sum_cannot_overflow() -> None:
    assert spawn(_fp16_large, 2, timeout=30) == [[60000.0], [60000.0]]


def _on_the_wire_after_backward(s: DistSession, overlap: bool) -> list[list[bool]]:
    """Per step, on rank 0: which buckets were launched once backward ended,
    while rank 1 holds its first bucket back (it starts its backward late)."""
    import time

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = s.gradient_sync(
        model,
        bucket_mb=0.0005,
        first_bucket_mb=0.0002,
        optimizer=opt if overlap else None,
    )
    launched = []
    for step in range(3):
        x, y = _batch(s.rank, step)
        s.barrier().wait()
        if s.rank == 1:
            time.sleep(0.3)  # rank 0's first bucket cannot complete meanwhile
        torch.nn.functional.cross_entropy(model(x), y).backward()
        launched.append([b.handle is not None for b in buckets_of(sync)])
        sync.wait()
        if not overlap:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return launched if s.rank == 0 else []


@pytest.mark.parametrize("overlap", [True, False])
def test_with_step_overlap_one_bucket_is_on_the_wire_at_a_time(overlap: bool) -> None:
    """Step overlap sends buckets one after another, so each lands as early
    as the link allows and its update runs while the next one travels (gloo
    would run two at once, and both would land late); a plain sync launches
    every complete bucket during backward, as DDP does."""
    launched = spawn(_on_the_wire_after_backward, 2, args=(overlap,), timeout=60)[0]
    for step in launched:
        assert len(step) > 2, step
        if overlap:
            assert step == [True] + [False] * (len(step) - 1), launched
        else:  # every complete bucket (the one with the unused parameter waits for the end)
            assert step[:-1] == [True] * (len(step) - 1), launched
