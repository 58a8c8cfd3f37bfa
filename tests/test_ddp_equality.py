"""gradient_sync against torch's DistributedDataParallel, step for step.

Each spawned rank trains two replicas of one BatchNorm model on its own
batches: one under ``gradient_sync``, one under DDP (gloo), both over the
session's group, which is torch's default group. They start from different
weights and buffers on every rank (rank 0's win: ``broadcast_parameters`` /
DDP's constructor), accumulate under ``no_sync``, step with SGD (momentum)
or Adam, with step overlap or ``await sync; opt.step()``, and halfway
through save a checkpoint on rank 0 that every rank resumes from, into a
fresh model and optimizer.

Compared, per rank: the buffers each forward sees (DDP broadcasts rank 0's
at a forward that follows a synced one; gradient_sync hands them over when
the step finishes) and, at the end, every parameter and buffer. On 2 ranks
they are bitwise equal (DDP averages as ``g / 2`` summed, gradient_sync as
the sum halved: the same floats); on 3 ranks ``g / 3`` rounds differently,
so within float rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from asyncdist import DistSession, GradientSync, spawn

STEPS = 6
RESUME_AT = 3  # the checkpoint is saved after this many steps, and resumed from


@dataclasses.dataclass(frozen=True)
class Config:
    optimizer: str  # "sgd" (with momentum) or "adam"
    overlap: bool  # gradient_sync(optimizer=opt) rather than `await sync; opt.step()`
    accumulate: bool  # two micro-batches per step, the first under no_sync
    buffers: bool = True  # broadcast_buffers (DDP: forward_sync_buffers)


CONFIGS = [
    Config("sgd", overlap=False, accumulate=False),
    Config("sgd", overlap=True, accumulate=True),
    Config("adam", overlap=False, accumulate=True),
    Config("adam", overlap=True, accumulate=False),
]
NO_BUFFERS = Config("sgd", overlap=False, accumulate=True, buffers=False)


def _net(rank: int) -> torch.nn.Module:
    """A small MLP with BatchNorm, its weights *and* running stats different
    on every rank."""
    torch.manual_seed(100 + rank)
    # no bias before a BatchNorm, as usual: its gradient would be rounding
    # noise around zero, which Adam scales up to full steps of lr on 3 ranks
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16, bias=False),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16, bias=False),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
    )
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm1d):
            assert module.running_mean is not None
            assert module.running_var is not None
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    return net


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _batches(rank: int, step: int, config: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's own micro-batches for a step (different data on each rank)."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    count = 2 if config.accumulate else 1
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(count)
    ]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, parts: int) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y) / parts


class Pair:
    """The two replicas of one rank: ``model`` under gradient_sync, ``ddp``."""

    def __init__(self, s: DistSession, config: Config, folder: str) -> None:
        assert dist.is_initialized()
        assert s.group is dist.group.WORLD  # what DDP uses by default
        self.s, self.config, self.folder = s, config, folder
        self.seen: dict[str, list[list[torch.Tensor]]] = {"ours": [], "ddp": []}
        self._build(_net(s.rank), _net(s.rank), None)

    def _build(
        self, ours: torch.nn.Module, theirs: torch.nn.Module, saved: dict[str, Any] | None
    ) -> None:
        """Fresh optimizers, a sync and a DDP over ``ours`` / ``theirs``
        (optimizer states from ``saved``, a checkpoint, when resuming)."""
        self.model, self.opt = ours, _optimizer(self.config.optimizer, ours)
        self.ddp_opt = _optimizer(self.config.optimizer, theirs)
        if saved is not None:
            self.opt.load_state_dict(saved["ours"]["optimizer"])
            self.ddp_opt.load_state_dict(saved["ddp"]["optimizer"])
        self.sync: GradientSync = self.s.gradient_sync(
            ours,
            bucket_mb=0.0005,  # a few buckets
            first_bucket_mb=0.0002,
            optimizer=self.opt if self.config.overlap else None,
            broadcast_buffers=self.config.buffers,
        )
        # DDP's constructor broadcasts rank 0's parameters and buffers
        self.ddp = DistributedDataParallel(theirs, forward_sync_buffers=self.config.buffers)
        for name, module in (("ours", ours), ("ddp", theirs)):
            module.register_forward_pre_hook(self._recorder(name))

    def _recorder(self, name: str) -> Any:
        # DDP's buffer broadcast runs before its module's forward: a pre-hook
        # on the module sees what the forward computes with
        def record(module: torch.nn.Module, args: Any) -> None:
            self.seen[name].append([b.detach().clone() for b in module.buffers()])

        return record

    def backward(self, step: int) -> None:
        """DDP's whole step, then our backward (its sync still to finish),
        over this step's micro-batches, all but the last under no_sync."""
        batches = _batches(self.s.rank, step, self.config)
        for model, no_sync in ((self.ddp, self.ddp.no_sync), (self.model, self.sync.no_sync)):
            for i, (x, y) in enumerate(batches):
                last = i == len(batches) - 1
                with contextlib.nullcontext() if last else no_sync():
                    _loss(model, x, y, len(batches)).backward()
            if model is self.ddp:
                self.ddp_opt.step()
                self.ddp_opt.zero_grad(set_to_none=step % 2 == 0)

    def step(self, step: int) -> None:
        """Ours, after the sync finished: the plain step (unless overlapped)."""
        if not self.config.overlap:
            self.opt.step()
        self.opt.zero_grad(set_to_none=step % 2 == 0)

    def checkpoint_and_resume(self) -> None:
        """Rank 0 saves both replicas; every rank loads them into fresh models."""
        paths = {name: os.path.join(self.folder, f"{name}.pt") for name in ("ours", "ddp")}
        if self.s.is_main:
            models = {"ours": self.model, "ddp": self.ddp.module}
            opts = {"ours": self.opt, "ddp": self.ddp_opt}
            for name, path in paths.items():
                torch.save(
                    {"model": models[name].state_dict(), "optimizer": opts[name].state_dict()}, path
                )
        self.s.barrier().wait()
        saved = {name: torch.load(path) for name, path in paths.items()}
        # no "module." prefix: the model was never wrapped
        assert list(saved["ours"]["model"]) == list(saved["ddp"]["model"])
        self.sync.remove()
        fresh = {name: _net(self.s.rank) for name in paths}  # other weights, until loaded
        for name, model in fresh.items():
            model.load_state_dict(saved[name]["model"])
        self._build(fresh["ours"], fresh["ddp"], saved)

    def result(self) -> dict[str, Any]:
        """What the next forward sees, and every parameter and buffer: an
        eval-mode forward (no running-stat update) lets DDP broadcast rank 0's
        buffers as its next training forward would."""
        x = torch.ones(2, 6)
        with torch.no_grad():
            for model in (self.ddp, self.model):
                model.eval()
                model(x)
        self.sync.remove()
        return {
            "seen": self.seen,
            "ours": {k: v.clone() for k, v in self.model.state_dict().items()},
            "ddp": {k: v.clone() for k, v in self.ddp.module.state_dict().items()},
        }


def _compare(s: DistSession, configs: list[Config], folder: str) -> list[dict[str, Any]]:
    """Sync loops: ``sync.wait()`` after backward."""
    out = []
    for n, config in enumerate(configs):
        pair = Pair(s, config, os.path.join(folder, str(n)))
        pair.sync.broadcast_parameters()
        for step in range(STEPS):
            if step == RESUME_AT:
                pair.checkpoint_and_resume()
            pair.backward(step)
            pair.sync.wait()
            pair.step(step)
        out.append(pair.result())
    return out


async def _compare_async(
    s: DistSession, configs: list[Config], folder: str
) -> list[dict[str, Any]]:
    """The same, awaited: ``await sync`` after backward."""
    out = []
    for n, config in enumerate(configs):
        pair = Pair(s, config, os.path.join(folder, str(n)))
        await pair.sync.broadcast_parameters_async()
        for step in range(STEPS):
            if step == RESUME_AT:
                pair.checkpoint_and_resume()
            pair.backward(step)
            await pair.sync
            pair.step(step)
        out.append(pair.result())
    return out


def _folders(tmp_path: Path, configs: list[Config]) -> str:
    for n in range(len(configs)):
        (tmp_path / str(n)).mkdir()
    return str(tmp_path)


def _pairs(result: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, ours, DDP's) for every buffer at every forward, then every
    parameter and buffer at the end."""
    seen_ours, seen_ddp = result["seen"]["ours"], result["seen"]["ddp"]
    assert len(seen_ours) == len(seen_ddp), (len(seen_ours), len(seen_ddp))
    for forward, (ours, theirs) in enumerate(zip(seen_ours, seen_ddp, strict=True)):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            yield f"buffer {i} at forward {forward}", a, b
    assert list(result["ours"]) == list(result["ddp"])
    for key, a in result["ours"].items():
        yield f"final {key}", a, result["ddp"][key]


def _check(results: list[list[dict[str, Any]]], configs: list[Config], *, exact: bool) -> None:
    for rank, per_config in enumerate(results):
        for config, result in zip(configs, per_config, strict=True):
            for what, ours, theirs in _pairs(result):
                where = f"rank {rank}, {config}: {what}"
                if exact or not ours.is_floating_point():
                    assert torch.equal(ours, theirs), where
                else:
                    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=where)


@pytest.mark.timeout(150)
def test_bitwise_ddp_on_two_ranks(tmp_path: Path) -> None:
    configs = [*CONFIGS, NO_BUFFERS]
    results = spawn(_compare, 2, args=(configs, _folders(tmp_path, configs)), timeout=60)
    _check(results, configs, exact=True)
    # the buffers really travelled: every rank's third forward saw rank 0's stats
    third = [r[0]["seen"]["ours"][2][0] for r in results]
    assert torch.equal(third[0], third[1])
    # and with broadcast_buffers=False they did not (after the initial broadcast)
    last = [r[-1]["ours"]["1.running_mean"] for r in results]
    assert not torch.equal(last[0], last[1])


@pytest.mark.timeout(150)
def test_ddp_to_float_rounding_on_three_ranks(tmp_path: Path) -> None:
    results = spawn(_compare, 3, args=(CONFIGS, _folders(tmp_path, CONFIGS)), timeout=60)
    _check(results, CONFIGS, exact=False)


ASYNC_CONFIGS = [CONFIGS[1], CONFIGS[2]]  # overlap + SGD; no overlap + Adam; both accumulate


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_backend", ["asyncio", "trio"])
def test_awaited_bitwise_ddp(async_backend: str, tmp_path: Path) -> None:
    results = spawn(
        _compare_async,
        2,
        args=(ASYNC_CONFIGS, _folders(tmp_path, ASYNC_CONFIGS)),
        timeout=60,
        async_backend=async_backend,
        channels=["gradients"],
    )
    _check(results, ASYNC_CONFIGS, exact=True)


# -- a GAN: two models, two syncs, one backward through both ---------------------------------


def _gan(rank: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A generator with BatchNorm and a discriminator, different on every rank."""
    torch.manual_seed(200 + rank)
    gen = torch.nn.Sequential(
        torch.nn.Linear(4, 16, bias=False),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 6),
    )
    disc = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1)
    )
    bn = gen[1]
    assert bn.running_mean is not None
    bn.running_mean.normal_()
    return gen, disc


def _gan_steps(s: DistSession, arm: str) -> dict[str, Any]:
    """The DCGAN tutorial's loop: the discriminator's step on real and
    detached fake data, then the generator's through the discriminator.
    ``arm``: both models under DDP, or each under its own gradient_sync.
    There the generator's backward runs inside the discriminator's
    ``no_sync()`` (its gradients there serve the generator only), or, as
    DDP does, averages them too (both syncs launch in that one backward),
    and the next ``zero_grad`` drops them either way."""
    gen, disc = _gan(s.rank)
    seen: list[torch.Tensor] = []
    gen[1].register_forward_pre_hook(lambda m, args: seen.append(m.running_mean.clone()))
    if arm == "ddp":
        run_gen, run_disc = DistributedDataParallel(gen), DistributedDataParallel(disc)
        syncs: tuple[GradientSync, GradientSync] | None = None
    else:
        run_gen, run_disc = gen, disc
        tiny = {"bucket_mb": 0.0005, "first_bucket_mb": 0.0002}  # a few buckets each
        syncs = (s.gradient_sync(gen, **tiny), s.gradient_sync(disc, **tiny))
        for sync in syncs:
            sync.broadcast_parameters()
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.01, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.01, betas=(0.5, 0.999))
    bce = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(10_000 * s.rank)
    for _ in range(STEPS):
        real, noise = torch.randn(8, 6, generator=g) + 1, torch.randn(8, 4, generator=g)
        fake = run_gen(noise)
        opt_d.zero_grad()
        real_loss = bce(run_disc(real), torch.ones(8, 1))
        fake_loss = bce(run_disc(fake.detach()), torch.zeros(8, 1))
        (real_loss + fake_loss).backward()
        if syncs is not None:
            syncs[1].wait()
        opt_d.step()
        opt_g.zero_grad()
        local = syncs is not None and arm == "ours, no_sync"
        with syncs[1].no_sync() if syncs is not None and local else contextlib.nullcontext():
            bce(run_disc(fake), torch.ones(8, 1)).backward()
        if syncs is not None:
            syncs[0].wait()
            syncs[1].wait()  # nothing to wait for under no_sync
        opt_g.step()
    if syncs is not None:
        assert len(syncs[0].bucket_sizes) >= 2
        assert len(syncs[1].bucket_sizes) >= 2
    state = {f"gen.{k}": v for k, v in gen.named_parameters()}
    state |= {f"disc.{k}": v for k, v in disc.named_parameters()}
    return {"seen": seen, "state": {k: v.detach().clone() for k, v in state.items()}}


GAN_ARMS = ("ours, no_sync", "ours, as DDP", "ddp")


def _gan_compare(s: DistSession) -> dict[str, dict[str, Any]]:
    return {arm: _gan_steps(s, arm) for arm in GAN_ARMS}


@pytest.mark.timeout(120)
def test_a_gan_trains_bitwise_as_with_two_ddp_modules() -> None:
    """Two syncs made by one task share the channel "gradients" (in the
    generator's backward through the discriminator both launch), and the
    generator's buffers are handed over as DDP broadcasts them: every
    parameter, and the running statistics each forward saw, are DDP's, bit
    for bit, on both ranks."""
    results = spawn(_gan_compare, 2, timeout=60)
    for rank, result in enumerate(results):
        theirs = result["ddp"]
        for arm in GAN_ARMS[:2]:
            ours = result[arm]
            assert len(ours["seen"]) == len(theirs["seen"]) == STEPS
            for step, (a, b) in enumerate(zip(ours["seen"], theirs["seen"], strict=True)):
                assert torch.equal(a, b), f"rank {rank}, {arm}: buffers at forward {step}"
            assert list(ours["state"]) == list(theirs["state"])
            for key, value in ours["state"].items():
                where = f"rank {rank}, {arm}: {key} differs from DDP's"
                assert torch.equal(value, theirs["state"][key]), where
    # the ranks started apart, and rank 0's weights won
    first, second = (r["ours, as DDP"]["state"]["disc.0.weight"] for r in results)
    assert torch.equal(first, second)
