"""gradient_sync is as safe as DDP: no step a user can forget silently.

Each trap raises on the rank that falls into it, before anything of the
offending backward is launched; buffers agree with rank 0's after every
synced step; and a sync's hooks end with its session.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import anyio
import pytest
import torch
import torch.nn.modules.module as _module
import torch.optim.optimizer as _optimizer

from asyncdist import AsyncDistError, DistSession, SessionClosed, spawn

pytestmark = pytest.mark.timeout(120)


class BNNet(torch.nn.Module):
    """An MLP with BatchNorm (running statistics are buffers) and a buffer
    of another dtype (``num_batches_tracked`` is int64)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.c = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.bn(self.a(x))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    # each rank's inputs have their own scale and shift: local BatchNorm
    # statistics differ from rank to rank
    x = torch.randn(8, 6, generator=g) * (1 + rank) + rank
    return x, torch.randint(0, 3, (8,), generator=g)


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def _local_grads(model: torch.nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    _loss(ref, rank, step).backward()
    return [p.grad.clone() for p in ref.parameters() if p.grad is not None]


def _same_everywhere(s: DistSession, tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    gathered = s.all_gather(flat).wait()
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


async def _wait(sync: Any, how: str) -> None:
    if how == "sync":
        sync.wait()
    else:
        await sync


def _spawn(fn: Any, world: int, how: str, backend: str, *more: Any) -> list[Any]:
    return spawn(
        fn, world, args=(how, *more), timeout=60, async_backend=backend, channels=["gradients"]
    )


# -- a forgotten `await sync` ------------------------------------------------------------


async def _forgotten_await(s: DistSession, how: str) -> dict[str, Any]:
    torch.manual_seed(s.rank)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = s.gradient_sync(model, bucket_mb=0.0005, first_bucket_mb=0.0002)
    await sync.broadcast_parameters_async()
    out: dict[str, Any] = {}
    expected = _local_grads(model, s.rank, 0)
    _loss(model, s.rank, 0).backward()
    opt.zero_grad()  # the user forgot `await sync` here
    try:
        _loss(model, s.rank, 1).backward()
    except AsyncDistError as exc:
        out["error"] = str(exc)
    # the error left step 0 intact: finishing it now gives step 0's average
    await _wait(sync, how)
    everyone = [s.all_gather(g).wait() for g in expected]
    out["step0_is_the_average"] = all(
        torch.allclose(p.grad, sum(per_rank) / s.world_size, atol=1e-6)
        for p, per_rank in zip(
            [p for p in model.parameters() if p.grad is not None], everyone, strict=True
        )
    )
    # ... and training goes on normally
    for step in range(2, 5):
        opt.zero_grad(set_to_none=step % 2 == 0)
        _loss(model, s.rank, step).backward()
        await _wait(sync, how)
        opt.step()
    out["replicas_agree"] = _same_everywhere(s, list(model.parameters()))
    # a second backward in one step, without no_sync, is the same mistake
    _loss(model, s.rank, 5).backward()
    try:
        _loss(model, s.rank, 6).backward()
    except AsyncDistError as exc:
        out["double_backward"] = str(exc)
    # and so is a no_sync backward while the step's buckets may be on the wire
    with sync.no_sync():
        try:
            _loss(model, s.rank, 7).backward()
        except AsyncDistError as exc:
            out["no_sync_in_flight"] = str(exc)
    await _wait(sync, how)
    # accumulation done right still works: no_sync first, then the synced backward
    opt.zero_grad()
    with sync.no_sync():
        _loss(model, s.rank, 8).backward()
    _loss(model, s.rank, 9).backward()
    await _wait(sync, how)
    out["accumulated_agree"] = _same_everywhere(s, [p.grad for p in model.parameters()])
    sync.remove()
    return out


@pytest.mark.parametrize(
    ("world", "how", "backend"),
    [(2, "sync", "asyncio"), (3, "sync", "asyncio"), (2, "await", "asyncio"), (3, "await", "trio")],
)
def test_a_forgotten_await_raises_at_the_next_backward(world: int, how: str, backend: str) -> None:
    results = _spawn(_forgotten_await, world, how, backend)
    for rank, r in enumerate(results):
        for key in ("error", "double_backward", "no_sync_in_flight"):
            assert "before its previous step finished" in r.get(key, ""), (rank, key, r)
            assert "`await sync`" in r[key]
            assert f"on rank {rank}" in r[key]
        assert r["step0_is_the_average"], rank
        assert r["replicas_agree"], rank
        assert r["accumulated_agree"], rank


async def _stepped_before_the_await(s: DistSession, how: str) -> dict[str, Any]:
    """``opt.step()`` right after backward, the `await sync` forgotten."""
    torch.manual_seed(0)
    model, probe = BNNet(), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1, momentum=0.9)
    sync = s.gradient_sync(model)
    out: dict[str, Any] = {}
    _loss(model, s.rank, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except AsyncDistError as exc:
        out["error"] = str(exc)
    out["nothing_ran"] = (
        all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        and not opt.state
    )
    probe(torch.ones(1, 2)).sum().backward()
    probe_opt.step()  # not the sync's parameters: it steps while the sync's step is in flight
    out["probe_stepped"] = bool(probe_opt.state)  # momentum buffers: it stepped
    await _wait(sync, how)  # the step goes on as if nothing happened
    opt.step()
    for step in range(1, 3):
        opt.zero_grad()
        _loss(model, s.rank, step).backward()
        await _wait(sync, how)
        opt.step()
    out["replicas_agree"] = _same_everywhere(s, list(model.parameters()))
    hooks = len(_optimizer._global_optimizer_pre_hooks)
    sync.remove()
    out["hook_off"] = len(_optimizer._global_optimizer_pre_hooks) == hooks - 1
    return out


@pytest.mark.parametrize(("how", "backend"), [("sync", "asyncio"), ("await", "trio")])
def test_an_optimizer_step_before_the_await_is_refused_and_nothing_runs(
    how: str, backend: str
) -> None:
    for rank, r in enumerate(_spawn(_stepped_before_the_await, 2, how, backend)):
        assert f"SGD.step() on rank {rank} came before the gradient_sync" in r.get("error", "")
        assert "Nothing of this step ran" in r["error"]
        assert r["nothing_ran"], r
        assert r["probe_stepped"], r
        assert r["replicas_agree"], r
        assert r["hook_off"], r


def _manual_steps(s: DistSession) -> dict[str, str]:
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    out: dict[str, str] = {}
    with s.gradient_sync(model, optimizer=opt) as sync:
        _loss(model, s.rank, 0).backward()
        try:
            opt.step()  # before the sync averaged anything: a silent divergence
        except AsyncDistError as exc:
            out["before"] = str(exc)
        sync.wait()
        try:
            opt.step()
        except AsyncDistError as exc:
            out["after"] = str(exc)
        opt.zero_grad()
        with sync.no_sync():
            _loss(model, s.rank, 1).backward()
            try:
                opt.step()  # local gradients only
            except AsyncDistError as exc:
                out["no_sync"] = str(exc)
        _loss(model, s.rank, 2).backward()
        sync.wait()
        out["agree"] = str(_same_everywhere(s, list(model.parameters())))
    opt.step()  # the sync is gone: the optimizer is the user's again
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_manual_step_with_step_overlap_is_refused_before_and_after(world: int) -> None:
    for r in spawn(_manual_steps, world, timeout=60, channels=["gradients"]):
        assert "before the" in r["before"], r
        assert "finished the step" in r["before"], r
        assert "finished the step" in r["no_sync"], r
        assert "already stepped" in r["after"], r
        assert r["agree"] == "True"


# -- one live sync per parameter and optimizer ---------------------------------------------


def test_a_second_live_sync_over_the_same_parameters_or_optimizer_is_refused() -> None:
    def run() -> list[str]:
        model = BNNet()
        other = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
        messages = []
        with DistSession() as s:
            first = s.gradient_sync(model, optimizer=opt)
            for make in (
                lambda: s.gradient_sync(model),
                lambda: s.gradient_sync(model.c),
                lambda: s.gradient_sync(other, optimizer=opt),
            ):
                with pytest.raises(AsyncDistError) as info:
                    make()
                messages.append(str(info.value))
            first.remove()
            s.gradient_sync(model, optimizer=opt).remove()  # free again
        return messages

    messages = run()
    assert "parameter 'a.weight' of BNNet already has a live gradient_sync of BNNet" in messages[0]
    assert "parameter 'weight' of Linear already has a live gradient_sync of BNNet" in messages[1]
    assert "SGD already steps under a live gradient_sync of BNNet" in messages[2]
    assert all("remove()" in m for m in messages)


# -- a forgotten broadcast_parameters -----------------------------------------------------


def _unlike_replicas(s: DistSession, broadcast: bool) -> list[str]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("asyncdist").addHandler(handler)
    try:
        torch.manual_seed(s.rank)  # each rank its own weights...
        model = BNNet()
        with s.gradient_sync(model) as sync:
            if broadcast:
                sync.broadcast_parameters()  # ...unless rank 0's are copied first
            for step in range(2):
                _loss(model, s.rank, step).backward()
                sync.wait()
                model.zero_grad(set_to_none=True)
    finally:
        logging.getLogger("asyncdist").removeHandler(handler)
    return [r.getMessage() for r in records]


@pytest.mark.parametrize("broadcast", [False, True])
def test_a_forgotten_broadcast_parameters_is_told_at_the_first_step(broadcast: bool) -> None:
    messages = spawn(_unlike_replicas, 3, args=(broadcast,), timeout=60)
    for rank, mine in enumerate(messages):
        told = [m for m in mine if "differed from rank 0's" in m]
        if broadcast or rank == 0:
            assert told == [], (rank, mine)
        else:  # once, at the first step only
            assert len(told) == 1, (rank, mine)
            assert "gradient_sync of BNNet (0x" in told[0]
            assert f"on rank {rank}: this rank's parameters" in told[0]
            assert "sync.broadcast_parameters()" in told[0]


# -- parameters that no longer fit their buckets --------------------------------------------


async def _changed_after_the_sync(s: DistSession, how: str, change: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = BNNet()
    if change == "unfreeze":
        model.a.requires_grad_(False)  # frozen when the sync is made
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    sync = s.gradient_sync(model)
    _loss(model, s.rank, 0).backward()
    await _wait(sync, how)
    opt.step()
    opt.zero_grad(set_to_none=True)
    out: dict[str, Any] = {}
    undo = {
        "convert": (model.double, model.float),  # its buckets are float32
        "freeze": (lambda: model.a.requires_grad_(False), lambda: model.a.requires_grad_(True)),
        "unfreeze": (lambda: model.a.requires_grad_(True), lambda: model.a.requires_grad_(False)),
    }
    make, restore = undo[change]
    make()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(s.rank, 1)
    try:
        dtype = next(model.parameters()).dtype
        torch.nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
    except AsyncDistError as exc:
        out["backward"] = str(exc)
    out["pending_after"] = sync.pending
    try:
        await _wait(sync, how)  # a step with no synced backward checks too
    except AsyncDistError as exc:
        out["wait"] = str(exc)
    out["untouched"] = all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
    # restored, training goes on: nothing of the refused steps was launched
    restore()
    opt.zero_grad(set_to_none=True)
    for step in range(2, 4):
        _loss(model, s.rank, step).backward()
        await _wait(sync, how)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["agree"] = _same_everywhere(s, list(model.parameters()))
    return out


@pytest.mark.parametrize(
    ("change", "how", "backend", "what"),
    [
        (
            "convert",
            "sync",
            "asyncio",
            "is now torch.float64 on cpu, but the sync was made for torch.float32 on cpu",
        ),
        ("convert", "await", "trio", "is now torch.float64"),
        ("freeze", "await", "asyncio", "no longer requires grad"),
        ("unfreeze", "sync", "asyncio", "requires grad now, but did not when the sync was made"),
    ],
    ids=["convert", "convert-trio", "freeze", "unfreeze"],
)
def test_a_model_changed_after_its_sync_is_refused_before_anything_launches(
    change: str, how: str, backend: str, what: str
) -> None:
    results = _spawn(_changed_after_the_sync, 2, how, backend, change)
    for rank, r in enumerate(results):
        for key in ("backward", "wait"):
            message = r.get(key, "")
            assert "gradient_sync of BNNet (0x" in message, (rank, key, r)
            assert f"on rank {rank}: parameter 'a.weight' {what}" in message
            assert "Make the sync after converting, moving, freezing or unfreezing" in message
            assert "Nothing of this step was launched" in message
        assert r["pending_after"] is False, rank
        assert r["untouched"], rank
        assert r["agree"], rank


def test_a_changed_parameter_the_module_no_longer_holds_is_named_by_its_shape() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    old = model[0].weight
    with DistSession() as s:
        sync = s.gradient_sync(model)
        model[0] = torch.nn.Linear(3, 2)  # replaced alone: not checked (as DDP does not)...
        old.requires_grad_(False)  # ...but a synced parameter that changed still is
        with pytest.raises(AsyncDistError, match=r"parameter of shape \(2, 3\) \(no longer"):
            model(torch.ones(1, 3)).sum().backward()  # model[1]'s hooks begin the step
        assert not sync.pending
        sync.remove()


def test_a_module_whose_every_synced_parameter_was_replaced_is_refused_at_wait() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with DistSession() as s:
        sync = s.gradient_sync(model)
        model[0] = torch.nn.Linear(3, 2)  # assigned anew: backward reaches no hook of the sync
        model(torch.ones(1, 3)).sum().backward()
        with pytest.raises(AsyncDistError, match=r"2 of its 2 parameters are no longer the"):
            sync.wait()
        sync.remove()


class _SparseGrad(torch.autograd.Function):
    """Identity forward; the gradient comes back sparse."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return w.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to_sparse()


def test_sparse_gradients_are_refused_with_a_clear_error() -> None:
    class Tagger(torch.nn.Module):
        def __init__(self, sparse: bool, frozen: bool = False) -> None:
            super().__init__()
            self.words = torch.nn.Embedding(10, 3, sparse=sparse)
            self.words.requires_grad_(not frozen)
            self.head = torch.nn.Linear(3, 2)

    with DistSession() as s:
        with pytest.raises(ValueError, match="words is an Embedding with sparse=True") as info:
            s.gradient_sync(Tagger(sparse=True))
        assert "dense gradients only; make it with sparse=False" in str(info.value)
        s.gradient_sync(Tagger(sparse=True, frozen=True)).remove()  # no gradient: no matter
        s.gradient_sync(Tagger(sparse=False)).remove()
        # a sparse gradient from elsewhere (a custom autograd function) raises in backward
        w = torch.nn.Parameter(torch.ones(4))
        holder = torch.nn.Module()
        holder.w = w
        sync = s.gradient_sync(holder)
        with pytest.raises(AsyncDistError, match=r"got a torch\.sparse_coo gradient"):
            _SparseGrad.apply(w).sum().backward()
        sync.remove()


def test_a_parameter_off_the_sessions_device_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"))
    with DistSession() as s:
        with pytest.raises(ValueError, match="is on meta") as info:
            s.gradient_sync(model)
        # refused before anything was formed or launched: the model is free
        model.to_empty(device="cpu")
        s.gradient_sync(model).remove()
    assert "parameter '0.weight' of Sequential is on meta" in str(info.value)
    assert "this session's device is cpu; move the model first (model.to('cpu'))" in str(info.value)


# -- hooks end with their session -----------------------------------------------------------


async def _sessions_one_after_another(s: DistSession, how: str) -> dict[str, Any]:
    torch.manual_seed(s.rank)
    model = BNNet()
    sync = s.gradient_sync(model)
    await sync.broadcast_parameters_async()
    _loss(model, s.rank, 0).backward()
    await _wait(sync, how)
    await s.aclose()
    out: dict[str, Any] = {}
    # after the session: plain local autograd
    expected = _local_grads(model, s.rank, 1)
    model.zero_grad(set_to_none=True)
    _loss(model, s.rank, 1).backward()
    out["local_after"] = all(
        torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True)
    )
    # sessions one after another over the same ranks (the launch environment);
    # one ended by an exception detaches too
    try:
        async with DistSession(channels=["gradients"]) as solo:
            solo.gradient_sync(model)
            raise KeyError("user error")
    except KeyError:
        pass
    model.zero_grad(set_to_none=True)
    _loss(model, s.rank, 1).backward()
    out["local_after_error"] = all(
        torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True)
    )
    # ... and one ended by cancellation
    with anyio.move_on_after(0.2):
        async with DistSession(channels=["gradients"]) as solo:
            solo.gradient_sync(model)
            await anyio.sleep(30)
    model.zero_grad(set_to_none=True)
    _loss(model, s.rank, 1).backward()
    out["local_after_cancel"] = all(
        torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True)
    )
    # and the model can get a new sync in a new session
    async with DistSession(channels=["gradients"]) as again:
        fresh = again.gradient_sync(model)
        model.zero_grad(set_to_none=True)
        _loss(model, s.rank, 2).backward()
        await _wait(fresh, how)
        out["fresh_works"] = all(p.grad is not None for p in model.parameters())
    return out


@pytest.mark.parametrize(
    ("world", "how", "backend"),
    [(2, "sync", "asyncio"), (3, "await", "asyncio"), (2, "await", "trio")],
)
def test_hooks_come_off_when_the_session_ends(world: int, how: str, backend: str) -> None:
    results = _spawn(_sessions_one_after_another, world, how, backend)
    for r in results:
        assert r == {
            "local_after": True,
            "local_after_error": True,
            "local_after_cancel": True,
            "fresh_works": True,
        }


# -- buffers follow rank 0, as with DDP's broadcast_buffers ----------------------------------


async def _buffers(s: DistSession, how: str, broadcast: bool) -> dict[str, Any]:
    torch.manual_seed(s.rank)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = s.gradient_sync(model, broadcast_buffers=broadcast)
    await sync.broadcast_parameters_async()
    agreed = []
    for step in range(4):
        opt.zero_grad()
        if step == 2:  # accumulation: the no_sync micro-batch changes buffers too
            with sync.no_sync():
                _loss(model, s.rank, 100 + step).backward()
        _loss(model, s.rank, step).backward()
        await _wait(sync, how)
        opt.step()
        buffers = list(model.buffers())
        agreed.append(_same_everywhere(s, buffers))
    # evaluation after training sees the same statistics on every rank
    model.eval()
    with torch.inference_mode():
        out = model(_batch(0, 99)[0])
    sync.remove()
    return {
        "agreed": agreed,
        "eval_agrees": _same_everywhere(s, [out]),
        "params_agree": _same_everywhere(s, list(model.parameters())),
        "tracked": int(model.bn.num_batches_tracked),
    }


@pytest.mark.parametrize(
    ("world", "how", "backend"),
    [(2, "sync", "asyncio"), (3, "await", "asyncio"), (2, "await", "trio")],
)
def test_buffers_are_rank_0s_after_every_step(world: int, how: str, backend: str) -> None:
    results = _spawn(_buffers, world, how, backend, True)
    for r in results:
        assert r["agreed"] == [True] * 4
        assert r["eval_agrees"]
        assert r["params_agree"]
        # rank 0's count after the last synced step's forward: 5 forwards in
        # all, of which the broadcast at the last step carried 5
        assert r["tracked"] == 5


class _Tally(torch.nn.Module):
    """A module with a buffer and no parameters: set or dropped at will."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.register_buffer("count", torch.full((3,), value))


def _buffers_as_the_tree_changes(s: DistSession, how: str) -> dict[str, Any]:
    """After the sync is made, the module's tree changes in each way torch
    offers; each step's broadcast carries the buffers the module holds then,
    the same list on every rank, and none of a module it no longer holds."""
    torch.manual_seed(0)
    model = BNNet()
    model.extras = torch.nn.ModuleList()  # no buffers yet
    r = float(s.rank)
    prebuilt = _Tally(40 + r)  # made before the sync: no hook saw its buffer
    sync = s.gradient_sync(model)
    dropped = _Tally(10 + r)

    def step(n: int) -> bool:
        model.zero_grad(set_to_none=True)
        _loss(model, s.rank, n).backward()
        sync.wait()
        return _same_everywhere(s, list(model.buffers()))

    def delete() -> None:
        del model.extras[-1]  # del: no hook
        dropped.count.fill_(30 + r)  # each rank's own from now on
        if s.rank == 0:  # only rank 0 forms another module: its count moves, not rank 1's
            torch.nn.Sequential(torch.nn.Linear(2, 2))

    changes = {
        "baseline": lambda: None,
        # set as an attribute: torch's module registration hook
        "attribute": lambda: setattr(model, "tally", _Tally(r)),
        # ModuleList.insert writes the module dict directly
        "insert": lambda: model.extras.insert(0, _Tally(20 + r)),
        # a buffer registered on a module already in the tree
        "register_buffer": lambda: model.a.register_buffer("seen", torch.full((2,), r)),
        # a buffer's tensor replaced
        "reassigned": lambda: setattr(model.bn, "running_mean", torch.full((8,), r)),
        # a child replaced by another: the same number of children (the
        # module registration hook)
        "replaced": lambda: model.extras.__setitem__(0, prebuilt),
        # one written over it behind torch's back, as quantization's convert
        # does: making it registered its buffer (the buffer hook)
        "swapped": lambda: model.extras._modules.__setitem__("0", _Tally(50 + r)),
        "appended": lambda: model.extras.append(dropped),
        "deleted": delete,
        "deleted attribute": lambda: delattr(model, "tally"),
    }
    agreed = {}
    for n, (name, change) in enumerate(changes.items()):
        change()
        agreed[name] = step(n)
    hooks = (_module._global_module_registration_hooks, _module._global_buffer_registration_hooks)
    before = [len(h) for h in hooks]
    sync.remove()  # the last live sync: torch's global hooks come off with it
    return {
        "hooks_off": [len(h) for h in hooks] == [n - 1 for n in before],
        "agreed": agreed,
        "buffers": [tuple(b.shape) for b in model.buffers()],
        "dropped": dropped.count.tolist(),  # out of the tree: its own values stay
        "replacement": model.extras[0].count.tolist(),
        "seen": model.a.seen.tolist(),
    }


def test_buffers_follow_the_module_as_its_tree_changes() -> None:
    results = spawn(_buffers_as_the_tree_changes, 2, args=("sync",), timeout=60)
    for rank, r in enumerate(results):
        assert all(r["agreed"].values()), r["agreed"]
        assert r["replacement"] == [50.0] * 3  # rank 0's, on every rank
        assert r["seen"] == [0.0] * 2
        assert r["hooks_off"]
        # dropped from the tree: no longer broadcast, each rank keeps its own
        assert r["dropped"] == [30.0 + rank] * 3
    assert results[0]["buffers"] == results[1]["buffers"]


def test_broadcast_buffers_false_keeps_each_ranks_own() -> None:
    results = spawn(_buffers, 2, args=("sync", False), timeout=60, channels=["gradients"])
    for r in results:
        assert r["agreed"] == [False] * 4  # the statistics drift apart, as they would
        assert r["params_agree"]


def test_broadcast_buffers_must_be_a_bool() -> None:
    with DistSession() as s, pytest.raises(TypeError, match="broadcast_buffers must be True"):
        s.gradient_sync(BNNet(), broadcast_buffers="yes")  # type: ignore[arg-type]


def test_a_session_that_ends_mid_step_names_the_sync(caplog: pytest.LogCaptureFixture) -> None:
    model = BNNet()
    with DistSession() as s:
        sync = s.gradient_sync(model)
        _loss(model, 0, 0).backward()  # and no `await sync` before leaving
        assert sync.pending
    assert repr(sync) == "<GradientSync of BNNet removed>"  # the session took it off
    assert "ends with the session mid-step" in caplog.text
    assert "GradientSync of BNNet" in caplog.text


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_step_whose_wait_was_cancelled_is_not_called_forgotten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning is for a backward never followed by ``await sync``; a
    wait that began and did not end (cancelled here, or raised) is not that,
    and its caller saw it. On trio every await checkpoints, so the cancelled
    scope cancels the wait on its first handle."""
    model = BNNet()
    async with DistSession() as s:
        sync = s.gradient_sync(model)
        _loss(model, 0, 0).backward()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await sync
        assert scope.cancelled_caught
        assert sync.pending  # the step did not finish
    assert "mid-step" not in caplog.text
    assert repr(sync) == "<GradientSync of BNNet removed>"


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_step_whose_wait_raised_at_a_launch_is_not_called_forgotten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The wait itself launches the buckets backward left (here the unused
    parameter's); on a broken session that launch raises. The wait began and
    told its caller: no "never followed by `await sync`" at the end."""
    from asyncdist import CollectiveTimeout, SessionBroken

    model = _WithUnused()
    with DistSession() as s:
        sync = s.gradient_sync(model, bucket_mb=1e-5, first_bucket_mb=1e-5)
        model(torch.ones(2, 4)).sum().backward()
        s._lane.health.record_fault(CollectiveTimeout("a test's fault", op="test", rank=0))
        with pytest.raises(SessionBroken):
            sync.wait()
        assert sync.pending
    assert "mid-step" not in caplog.text


# -- awaiting a finished step again, and a removed sync ---------------------------------


async def _train(s: DistSession, how: str, overlap: bool, again: dict[int, set[int]]) -> Any:
    """Four steps of SGD with momentum; at step ``n`` the ranks in
    ``again[n]`` await the finished step a second time. Rank 1 skips
    backward at steps 1 and 2 (after ``zero_grad``, in place and to None),
    so it joins those steps with no gradients. The parameters at the end."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with s.gradient_sync(model, optimizer=opt if overlap else None) as sync:
        for step in range(4):
            opt.zero_grad(set_to_none=step % 2 == 0)
            if not (step in (1, 2) and s.rank == 1):
                _loss(model, s.rank, step).backward()
            await _wait(sync, how)
            if s.rank in again.get(step, set()):
                await _wait(sync, how)
            if not overlap:
                opt.step()
    return [p.detach().clone() for p in model.parameters()]


async def _awaited_twice(s: DistSession, how: str, overlap: bool) -> dict[str, Any]:
    once = await _train(s, how, overlap, {})
    twice = await _train(s, how, overlap, {0: {0, 1}, 1: {0}, 3: {1}})
    return {
        "same_as_once": all(torch.equal(a, b) for a, b in zip(once, twice, strict=True)),
        "agree": _same_everywhere(s, twice),
    }


@pytest.mark.parametrize(("how", "backend", "overlap"), [
    ("sync", "asyncio", False), ("await", "trio", False), ("sync", "asyncio", True),
    ("await", "asyncio", True),
])  # fmt: skip
def test_awaiting_a_finished_step_again_changes_nothing(
    how: str, backend: str, overlap: bool
) -> None:
    """A second ``await sync`` with no backward since is a no-op, on every
    rank or on one: it used to launch the step again (with ``optimizer=``,
    a second update; on one rank, collectives that paired with the next
    step's on the others)."""
    for r in _spawn(_awaited_twice, 2, how, backend, overlap):
        assert r == {"same_as_once": True, "agree": True}


def _loaded_with_assign(s: DistSession) -> str:
    model = BNNet()
    sync = s.gradient_sync(model)
    _loss(model, s.rank, 0).backward()
    sync.wait()
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    model.zero_grad(set_to_none=True)
    _loss(model, s.rank, 1).backward()  # reaches the new parameters: no hooks
    try:
        sync.wait()
    except AsyncDistError as exc:
        return str(exc)
    return "averaged nothing, silently"


def test_parameters_replaced_by_load_state_dict_assign_are_refused() -> None:
    for message in spawn(_loaded_with_assign, 2, timeout=60):
        assert "6 parameters are no longer the module's" in message, message
        assert "assign=True" in message


def test_waiting_on_a_removed_sync_says_what_was_not_averaged() -> None:
    """A step launched and never finished when the sync was removed, or when
    its session ended, used to let ``wait()`` return with each rank's own
    gradients in place (and ``pending`` stayed True)."""
    model = BNNet()
    with DistSession() as s:
        sync = s.gradient_sync(model)
        _loss(model, 0, 0).backward()
        sync.remove()  # a step launched and never finished
        assert sync.pending is False
        with pytest.raises(AsyncDistError, match="removed with a step launched and not finished"):
            sync.wait()
        sync.wait()  # told once; a removed sync is otherwise a no-op
        ended = s.gradient_sync(model)
        _loss(model, 0, 1).backward()  # and no await before leaving
    assert ended.pending is False
    with pytest.raises(SessionClosed, match="its session has ended"):
        ended.wait()

    async def awaited() -> None:
        await ended

    with pytest.raises(SessionClosed, match="its session has ended"):
        anyio.run(awaited)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_on_trio_await_sync_with_nothing_to_wait_for_is_a_checkpoint() -> None:
    """trio's rule holds for a sync too: a disabled (no_sync) or removed sync
    has nothing to await, yet ``await sync`` is still a cancel point."""
    async with DistSession() as s:
        model = torch.nn.Linear(3, 2)
        sync = s.gradient_sync(model)
        with sync.no_sync():
            model(torch.ones(1, 3)).sum().backward()
            with anyio.CancelScope() as scope:
                scope.cancel()
                await sync
            assert scope.cancelled_caught, "await sync under no_sync ignored a cancelled scope"
        sync.remove()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await sync
        assert scope.cancelled_caught, "await of a removed sync ignored a cancelled scope"


# -- several syncs on one channel ----------------------------------------------------------


def _tower(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))


async def _two_models_one_task(s: DistSession, how: str, pattern: str) -> list[bool]:
    """Two models, each with its own sync, made by one task: both push
    buckets onto the channel "gradients" in one backward (a generator
    trained through its discriminator), or in two backward calls before
    either is awaited (an actor's loss and a critic's), so one sync's
    buckets launch while the other's are still on the wire."""
    first, second = _tower(0), _tower(1)
    params = [p for model in (first, second) for p in model.parameters()]
    tiny = {"bucket_mb": 0.005, "first_bucket_mb": 0.002}  # a bucket a layer, about
    syncs = [s.gradient_sync(first, **tiny), s.gradient_sync(second, **tiny)]
    same = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * s.rank + step)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        if pattern == "one backward":
            losses = [second(first(x)).square().mean()]
        else:
            losses = [first(x).square().mean(), second(y).square().mean()]
        # this rank's own gradients, taken before backward puts them in buckets
        # (once zero_grad(set_to_none=False) made the buckets the .grad, they
        # are on the wire as soon as backward returns)
        local = [torch.zeros_like(p) for p in params]
        for loss in losses:
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            for total, grad in zip(local, grads, strict=True):
                if grad is not None:
                    total += grad
            loss.backward()
        for sync in syncs:
            await _wait(sync, how)
        for mine, param in zip(local, params, strict=True):
            both = s.all_gather(mine).wait()
            same.append(torch.equal(param.grad, (both[0] + both[1]) * 0.5))
        for model in (first, second):
            model.zero_grad(set_to_none=step % 2 == 0)
    assert len(syncs[0].bucket_sizes) >= 3, syncs[0].bucket_sizes
    return same


@pytest.mark.parametrize("pattern", ["one backward", "two backward calls"])
@pytest.mark.parametrize("how", ["sync", "async"])
def test_two_syncs_made_by_one_task_share_the_gradients_channel(how: str, pattern: str) -> None:
    """Both syncs' launches count as one issuer's (autograd orders them alike
    on every rank, as with two DDP modules on one group), so neither is
    refused as a second task, and every gradient is the average."""
    for same in _spawn(_two_models_one_task, 2, how, "asyncio", pattern):
        assert same
        assert all(same), [i for i, ok in enumerate(same) if not ok]


async def _two_tasks_two_syncs(
    s: DistSession, how: str, family: bool = False
) -> tuple[list[str], str]:
    """Each of two tasks makes its own sync on the one channel "gradients" and
    runs backward: rank 0's second task launches while the first task's
    collectives are outstanding (rank 1 is a second late), which the two
    ranks could interleave in different orders. Refused on rank 0 alone;
    rank 1's second task never launches, so the first tasks still pair.

    With ``family``, the first task makes two syncs and runs one backward
    through both (the later model's sync launches first: backward runs from
    the loss); returned with what rank 0 was told, the name of the sync
    that launched last, outstanding for certain (a lane's collectives
    finish in order), which the refusal must name."""
    launched = anyio.Event()
    told: list[str] = []
    last: list[str] = []

    async def first() -> None:
        models = [_tower(0), _tower(1)] if family else [BNNet()]
        syncs = [s.gradient_sync(model) for model in models]
        last.append(syncs[0]._name)  # the name its messages use
        if s.rank == 1:
            await anyio.sleep(1.0)
        if family:
            models[1](models[0](torch.randn(4, 32))).sum().backward()
        else:
            _loss(models[0], s.rank, 0).backward()
        launched.set()
        for sync in syncs:
            await _wait(sync, how)

    async def second() -> None:
        model = BNNet()
        sync = s.gradient_sync(model)
        await launched.wait()
        if s.rank == 0:
            try:
                _loss(model, 0, 1).backward()
            except AsyncDistError as exc:
                told.append(f"{type(exc).__name__}: {exc}")
        sync.remove()

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        tg.start_soon(second)
    return told, last[0]


def _refused_once_on_rank_0(ranks: list[list[str]]) -> None:
    told, quiet = ranks
    assert quiet == []
    assert len(told) == 1, told
    assert told[0].startswith("CollectiveMismatch: "), told
    assert "two tasks at once issue on channel 'gradients'" in told[0], told


def test_syncs_made_by_two_tasks_are_two_issuers_on_one_channel() -> None:
    ranks = _spawn(_two_tasks_two_syncs, 2, "async", "asyncio")
    _refused_once_on_rank_0([told for told, _ in ranks])


def test_a_refusal_names_the_sync_of_a_family_that_launched_last() -> None:
    (told, first), (quiet, _) = _spawn(_two_tasks_two_syncs, 2, "async", "asyncio", True)
    _refused_once_on_rank_0([told, quiet])
    assert f"({first} still has a collective outstanding" in told[0], (first, told)


async def _two_tasks_finish_one_family(s: DistSession, how: str) -> list[str]:
    """One task makes two syncs and runs one backward through both; then two
    tasks finish them at once (as ``asyncio.gather(sync_a, sync_b)`` does).
    Each first step's finish sends its sync's bucket order, and two tasks'
    sends interleave in whatever order their waits end, which can differ
    between ranks. Rank 0's second finisher is refused (the first's send is
    outstanding: rank 1 is a second late); rank 1 finishes the first alone,
    so the ranks still pair."""
    first, second = _tower(0), _tower(1)
    syncs = [s.gradient_sync(first), s.gradient_sync(second)]
    second(first(torch.randn(4, 32))).sum().backward()
    told: list[str] = []

    async def finish(sync: Any, delay: float) -> None:
        await anyio.sleep(delay)
        try:
            await sync
        except AsyncDistError as exc:
            told.append(f"{type(exc).__name__}: {exc}")

    async with anyio.create_task_group() as tg:
        if s.rank == 0:
            tg.start_soon(finish, syncs[0], 0.0)
            tg.start_soon(finish, syncs[1], 0.2)
        else:
            tg.start_soon(finish, syncs[0], 1.0)
    return told


def test_two_tasks_finishing_syncs_of_one_task_at_once_are_refused() -> None:
    _refused_once_on_rank_0(_spawn(_two_tasks_finish_one_family, 2, "async", "asyncio"))


async def _finished_by_another_task(s: DistSession, how: str) -> list[float]:
    """Backward in this task, through two syncs of its making; the first is
    finished by a task of its own (as ``asyncio.wait_for(sync, t)`` does
    before Python 3.12). Its bucket launches only then (a parameter with no
    gradient keeps it from launching in backward), while the second sync's
    bucket from the hooks is still on the wire (rank 1 is a second late):
    the hooks' launches and a task's launches for the family follow each
    other, whichever task it is."""
    first, second = _tower(0), _tower(1)
    first.register_parameter("unused", torch.nn.Parameter(torch.zeros(2)))
    syncs = [s.gradient_sync(first), s.gradient_sync(second)]
    if s.rank == 1:
        await anyio.sleep(1.0)
    second(first(torch.randn(4, 32) + s.rank)).sum().backward()
    from asyncdist._grad import buckets_of

    assert [b.handle is None for b in buckets_of(syncs[0])] == [True]  # left for the finish
    assert [b.handle is None for b in buckets_of(syncs[1])] == [False]  # on the wire
    async with anyio.create_task_group() as tg:
        tg.start_soon(_wait, syncs[0], how)
    await _wait(syncs[1], how)
    assert first.unused.grad is None  # no gradient on any rank
    return [
        float(p.grad.sum()) for m in (first, second) for p in m.parameters() if p.grad is not None
    ]


def test_a_step_finished_by_another_task_follows_the_hooks() -> None:
    mine, theirs = _spawn(_finished_by_another_task, 2, "async", "asyncio")
    assert mine == theirs  # averaged: the ranks' inputs differ
