"""gradient_sync: averaged gradients equal the hand-computed average of each rank's own."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncdist import DistSession, GradientSync, spawn
from asyncdist._grad import EDGE_FLOOR, buckets_of, layout

pytestmark = pytest.mark.timeout(90)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Parameter(torch.zeros(4))  # never in the graph
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))  # another dtype
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return self.frozen(y) * self.scale.float()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _local_grads(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, list[float]]:
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    for x, y in batches:
        torch.nn.functional.cross_entropy(ref(x), y).backward()
    return {n: p.grad.flatten().tolist() for n, p in ref.named_parameters() if p.grad is not None}


def _train(s: DistSession, bucket_mb: float, use_async: bool) -> dict[str, Any]:
    torch.manual_seed(s.rank)  # different initial weights on each rank...
    model = Net()
    sync = s.gradient_sync(model, bucket_mb=bucket_mb, first_bucket_mb=bucket_mb / 2)
    sync.broadcast_parameters(src=0)  # ...until rank 0's are broadcast
    out: dict[str, Any] = {
        "weights": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
    }
    out["buckets"] = len(sync.bucket_sizes)
    steps = []
    for step in range(3):
        batches = [_batch(s.rank, step)]
        if step == 2:  # gradient accumulation over two micro-batches
            batches.append(_batch(s.rank, 10 + step))
        local = _local_grads(model, batches)
        model.zero_grad(set_to_none=True)
        if len(batches) == 2:
            with sync.no_sync():
                torch.nn.functional.cross_entropy(model(batches[0][0]), batches[0][1]).backward()
                sync.wait()  # a no-op inside no_sync
        x, y = batches[-1]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if use_async:
            import anyio

            async def finish() -> None:
                await sync

            anyio.run(finish)
        else:
            sync.wait()
        synced = {
            n: p.grad.flatten().tolist() for n, p in model.named_parameters() if p.grad is not None
        }
        steps.append({"local": local, "synced": synced})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
    out["steps"] = steps
    sync.remove()
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(_batch(0, 0)[0]), _batch(0, 0)[1]).backward()
    out["after_remove_launched"] = any(b.handle is not None for b in buckets_of(sync))
    return out


@pytest.mark.parametrize(("world", "bucket_mb", "use_async"), [(2, 25.0, False), (3, 0.0005, True)])
def test_synced_gradients_are_the_average_of_local_ones(
    world: int, bucket_mb: float, use_async: bool
) -> None:
    results = spawn(_train, world, args=(bucket_mb, use_async), timeout=30)
    assert all(r["weights"] == results[0]["weights"] for r in results), "broadcast_parameters"
    if bucket_mb < 0.01:
        assert results[0]["buckets"] > 3, "tiny buckets should split the model"
    for step in range(3):
        names = results[0]["steps"][step]["synced"].keys()
        assert "frozen.weight" not in names, "frozen parameters are left alone"
        for name in names:
            per_rank = [r["steps"][step]["local"].get(name) for r in results]
            per_rank = [
                v if v is not None else [0.0] * len(results[0]["steps"][step]["synced"][name])
                for v in per_rank
            ]
            expected = [sum(vals) / world for vals in zip(*per_rank, strict=True)]
            for r in results:
                assert r["steps"][step]["synced"][name] == pytest.approx(
                    expected, rel=1e-5, abs=1e-6
                ), (step, name)
        # the never-used parameter keeps no gradient, as DDP (find_unused_parameters) leaves it
        assert all("unused" not in r["steps"][step]["synced"] for r in results)
    assert not any(r["after_remove_launched"] for r in results)


class Branchy(torch.nn.Module):
    """A trunk, a branch only some ranks use in a step, and a head no rank uses
    on odd steps (an expert routed nowhere, a head for another task)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 4)
        self.branch = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, rank: int, step: int) -> torch.Tensor:
        y = self.trunk(x)
        if rank == 0:
            y = y + self.branch(x)
        if step % 2 == 0:
            y = y + self.head(x)
        return y


def _branchy(s: DistSession, how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    options: dict[str, Any] = {
        "plain": {},
        "overlap": {"optimizer": opt},
        "bf16": {"compression": "bf16"},
    }[how]
    # tiny buckets: the branch and the head share no bucket with the trunk
    sync = s.gradient_sync(model, bucket_mb=0.0001, first_bucket_mb=0.0001, **options)
    out: dict[str, Any] = {"steps": []}
    for step in range(4):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + s.rank))
        head = model.head.weight.detach().clone()
        model(x, s.rank, step).sum().backward()
        sync.wait()
        out["steps"].append(
            {
                "grads": {n: p.grad is not None for n, p in model.named_parameters()},
                "branch": s.all_gather(model.branch.weight.grad).wait(),
            }
        )
        if how != "overlap":
            opt.step()
        out["steps"][-1]["head_moved"] = not torch.equal(head, model.head.weight)
        opt.zero_grad(set_to_none=True)
    out["agree"] = all(torch.equal(*s.all_gather(p.detach()).wait()) for p in model.parameters())
    return out


@pytest.mark.parametrize("how", ["plain", "overlap", "bf16"])
def test_a_parameter_no_rank_used_keeps_no_gradient_as_with_ddp(how: str) -> None:
    """A parameter some ranks used gets the average (zeros where unused); one
    no rank used keeps ``.grad`` None, so the optimizer leaves it alone
    (momentum and weight decay included), as DDP with
    ``find_unused_parameters=True`` and local autograd do."""
    for rank, r in enumerate(spawn(_branchy, 2, args=(how,), timeout=60)):
        for step, st in enumerate(r["steps"]):
            assert st["grads"]["trunk.weight"], (rank, step)
            assert st["grads"]["branch.weight"], (rank, step)
            used = step % 2 == 0
            assert st["grads"]["head.weight"] is used, (rank, step, st["grads"])
            # an optimizer skips a parameter without a gradient: no momentum, no decay
            assert st["head_moved"] is used, (rank, step)
            mine, other = st["branch"]
            assert torch.equal(mine, other), (rank, step)  # rank 0's half, on both
        assert r["agree"], rank


def test_bad_arguments() -> None:
    with DistSession() as s:
        with pytest.raises(TypeError, match="Module"):
            s.gradient_sync(torch.ones(1))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="bucket_mb"):
            s.gradient_sync(Net(), bucket_mb=0)
        with pytest.raises(ValueError, match="op"):
            s.gradient_sync(Net(), op="max")
        with pytest.raises(ValueError, match="op"):
            s.gradient_sync(Net(), op=dist.ReduceOp.MAX)
        with s.gradient_sync(Net()) as sync:
            assert isinstance(sync, GradientSync)
            assert sync.bucket_sizes[0] <= 1 << 20, "a small first bucket"


def _summed(s: DistSession, op: object) -> list[float]:
    model = torch.nn.Linear(2, 1, bias=False)
    with s.gradient_sync(model, op=op) as sync:  # type: ignore[arg-type]
        model(torch.full((1, 2), float(s.rank + 1))).sum().backward()
        sync.wait()
    assert model.weight.grad is not None
    return [float(v) for v in model.weight.grad.flatten()]


@pytest.mark.parametrize("op", ["sum", dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_op_takes_names_and_reduce_ops(op: object) -> None:
    """d(w . x)/dw = x = rank + 1: summed over 2 ranks 3, averaged 1.5."""
    expected = 1.5 if op == dist.ReduceOp.AVG else 3.0
    assert spawn(_summed, 2, args=(op,)) == [[expected, expected]] * 2


async def _training_beside_metrics(s: DistSession) -> dict[str, Any]:
    """gradient_sync's buckets travel on their own channel: a metrics task
    issuing on the session meanwhile neither pairs with a bucket nor is refused."""
    import anyio

    torch.manual_seed(s.rank)
    model = Net()
    sync = s.gradient_sync(model, bucket_mb=0.0005, first_bucket_mb=0.0002)
    await sync.broadcast_parameters_async()
    metrics: list[float] = []

    async def train() -> None:
        for step in range(5):
            x, y = _batch(s.rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            await anyio.sleep(0.002 * s.rank)  # the ranks interleave differently
            await sync
            model.zero_grad(set_to_none=True)

    async def report() -> None:
        for step in range(20):
            t = torch.tensor([float(step + s.rank)])
            metrics.append(float(await s.allreduce(t)))
            await anyio.sleep(0.001 * (1 - s.rank))

    async with anyio.create_task_group() as tg:
        tg.start_soon(train)
        tg.start_soon(report)
    return {"metrics": metrics, "buckets": len(sync.bucket_sizes)}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_gradient_sync_and_a_metrics_task_run_side_by_side(backend: str) -> None:
    results = spawn(
        _training_beside_metrics, 2, timeout=30, async_backend=backend, channels=["gradients"]
    )
    for r in results:
        assert r["metrics"] == [float(2 * step + 1) for step in range(20)]
        assert r["buckets"] > 1


def _check_layout(sizes: list[int], dtypes: list[torch.dtype], cap: int, edge_cap: int) -> None:
    buckets = layout(sizes, dtypes, cap=cap, edge_cap=edge_cap)
    assert [i for b in buckets for i in b] == list(range(len(sizes))), "each once, in order"
    assert all(len({dtypes[i] for i in b}) == 1 for b in buckets), "one dtype per bucket"
    if not sizes:
        assert buckets == []
        return
    edge = min(edge_cap, cap, max(sum(sizes) // 4, EDGE_FLOOR))
    size = [sum(sizes[i] for i in b) for b in buckets]
    last = buckets[-1]
    # the last bucket is small: within edge, or a single gradient larger than it
    assert size[-1] <= edge or len(last) == 1, (size, edge)
    # and as long as it can be: one more gradient of its dtype would not fit
    if last[0] > 0 and dtypes[last[0] - 1] == dtypes[last[0]]:
        assert size[-1] + sizes[last[0] - 1] > edge, (size, edge)
    if len(buckets) > 1:
        first = buckets[0]
        # the first closes once it reaches edge (or at a change of dtype, or the tail)
        assert sum(sizes[i] for i in first[:-1]) < edge, (size, edge)
        for b, after in itertools.pairwise(buckets[1:]):
            # a middle bucket closes once it reaches cap (a small remainder
            # rides with the bucket before it), or where the dtype changes
            assert sum(sizes[i] for i in b[:-1]) < cap + edge, (size, cap)
            if after is not last and dtypes[after[0]] == dtypes[b[-1]]:
                assert sum(sizes[i] for i in b) >= cap, (size, cap)


def test_bucket_layout_keeps_the_first_and_the_last_bucket_small() -> None:
    """Buckets partition the gradients in order, one dtype each; the first
    closes at the edge size and the last holds at most that, so a model's
    communication starts early and little of it is left after backward."""
    rng = torch.Generator().manual_seed(0)
    f32, f16 = torch.float32, torch.float16
    for trial in range(300):
        n = int(torch.randint(0, 40, (1,), generator=rng))
        sizes = [int(s) for s in torch.randint(1, 400_000, (n,), generator=rng)]
        mixed = trial % 3 == 0
        dtypes = [f16 if mixed and i % 7 < 2 else f32 for i in range(n)]
        _check_layout(sizes, dtypes, cap=int(1.5 * (1 << 20)), edge_cap=1 << 19)
    # a model too small to split stays one bucket
    assert layout([1000] * 10, [f32] * 10, cap=25 << 20, edge_cap=1 << 20) == [list(range(10))]


def test_a_small_model_is_split_so_little_is_left_after_backward() -> None:
    """Four 66 KB layers under the default caps: DDP's 1 MiB first bucket
    would hold them all and launch once backward ends; here the first and
    the last bucket are a quarter of the model each."""
    model = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(4)))
    layer = 128 * 128 * 4 + 128 * 4
    with DistSession() as s, s.gradient_sync(model) as sync:
        assert sync.bucket_sizes == [layer, 2 * layer, layer]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 7])
def test_the_mean_factor_scales_as_a_float_would(dtype: torch.dtype, world: int) -> None:
    """A bucket scales each gradient by 1/world with a 0-dim tensor (the
    cheaper call): the result is, to the bit, what multiplying by the float
    gives, copied in or accumulated in place in its slot."""
    from asyncdist._grad import _Bucket

    g = torch.Generator().manual_seed(world)
    params = [torch.nn.Parameter(torch.randn(257, generator=g).to(dtype)) for _ in range(2)]
    bucket = _Bucket(params, torch.device("cpu"), None, world)
    grad = torch.randn(257, generator=g).to(dtype) * 1000
    bucket.fill(0, grad)  # copied in
    assert torch.equal(bucket.slots[0], torch.mul(grad, 1.0 / world))
    bucket.slots[1].copy_(grad)
    bucket.fill(1, bucket.slots[1])  # accumulated in place in its slot
    assert torch.equal(bucket.slots[1], grad.mul(1.0 / world))
