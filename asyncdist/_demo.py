"""``asyncdist demo``: train a small model on local ranks, with and without overlap.

Each rank trains the same MLP on its own shard of a synthetic task (labels
from a fixed random "teacher"), steps alternating between two ways of
averaging gradients:

* overlapped: ``gradient_sync`` launches each bucket's allreduce during
  backward, and ``await sync`` waits for what is left;
* sequential: backward first, then the same buckets reduced afterwards.

Medians of the two step times, the time communication alone takes, and how
much of it the overlap hid are reported by rank 0.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ._session import GRADIENTS, DistSession

FEATURES, HIDDEN, CLASSES, BATCH = 256, 768, 10, 64


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def _data(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    teacher = torch.nn.Linear(FEATURES, CLASSES)
    torch.nn.init.normal_(teacher.weight, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1 + rank)
    batches = []
    for _ in range(steps):
        x = torch.randn(BATCH, FEATURES, generator=g)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        batches.append((x, y))
    return batches


async def train(session: DistSession, steps: int, bucket_mb: float) -> dict[str, Any]:
    """One rank of the demo; rank 0 shows progress and returns the summary."""
    torch.manual_seed(session.rank)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync = session.gradient_sync(model, bucket_mb=bucket_mb, channel=session.channel(GRADIENTS))
    await sync.broadcast_parameters_async(src=0)
    grads = [p for p in model.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in grads)
    batches = _data(session.rank, steps)
    times: dict[str, list[float]] = {"overlapped": [], "sequential": [], "comm": [], "compute": []}
    losses: list[float] = []

    progress = None
    if session.is_main:
        progress, task = progress_bar(steps)
        progress.start()

    flat = [torch.zeros_like(p) for p in grads]
    try:
        for step, (x, y) in enumerate(batches):
            mode = "overlapped" if step % 2 == 0 else "sequential"
            await session.barrier()  # start each step together
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if mode == "overlapped":
                loss.backward()
                await sync
            else:
                with sync.no_sync():
                    loss.backward()
                await session.allreduce_coalesced(
                    [p.grad for p in grads if p.grad is not None], op="mean"
                )
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step > 1:  # the first steps warm up and rebuild buckets
                times[mode].append(time.perf_counter() - t0)
            # the two parts alone, for reference
            if step > 1 and step % 4 == 1:
                await session.barrier()
                t1 = time.perf_counter()
                await session.allreduce_coalesced(flat, op="mean")
                times["comm"].append(time.perf_counter() - t1)
                t2 = time.perf_counter()
                probe = torch.nn.functional.cross_entropy(model(x), y)
                with sync.no_sync():  # compute alone: no bucket launched, none to await
                    probe.backward()
                opt.zero_grad(set_to_none=True)
                times["compute"].append(time.perf_counter() - t2)
            losses.append(loss.item())
            if progress is not None:
                progress.update(task, advance=1, loss=f"loss {losses[-1]:.3f}")
    finally:
        if progress is not None:
            progress.stop()
        sync.remove()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    hidden = (med["sequential"] - med["overlapped"]) / med["comm"] if med.get("comm") else 0.0
    return {
        "rank": session.rank,
        "world_size": session.world_size,
        "backend": session.backend,
        "params": sum(p.numel() for p in grads),
        "bytes_per_step": nbytes,
        "buckets": len(sync.bucket_sizes),
        "median_s": med,
        "hidden": hidden,
        "loss_first": losses[0],
        "loss_last": statistics.mean(losses[-4:]),
    }


def progress_bar(steps: int, console: Any = None) -> tuple[Any, Any]:
    """Rank 0's progress display and its task; the loss shows once a step has one."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]training[/] step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
    )
    return progress, progress.add_task("train", total=steps, loss="")


def starting(world_size: int, backend: str) -> None:
    """The status line shown while the ranks start (processes, group, channel)."""
    from rich.console import Console

    Console().print(
        f"[bold]asyncdist demo[/]: starting {world_size} ranks on {backend} (processes, "
        "process group, gradient channel), a few seconds..."
    )


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    med = result["median_s"]
    table = Table(title=f"asyncdist demo: {result['world_size']} ranks on {result['backend']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("parameters", f"{result['params']:,}")
    table.add_row("bytes reduced per step", f"{result['bytes_per_step'] / 2**20:.1f} MiB")
    table.add_row("gradient buckets", str(result["buckets"]))
    table.add_row("step, backward then allreduce", f"{med['sequential'] * 1e3:.1f} ms")
    table.add_row("step, allreduce during backward", f"{med['overlapped'] * 1e3:.1f} ms")
    table.add_row("communication alone", f"{med['comm'] * 1e3:.1f} ms")
    table.add_row("forward + backward alone", f"{med['compute'] * 1e3:.1f} ms")
    table.add_row("communication hidden by overlap", f"{100 * result['hidden']:.0f} %")
    table.add_row(
        "loss, first step -> last steps", f"{result['loss_first']:.3f} -> {result['loss_last']:.3f}"
    )
    Console().print(table)
