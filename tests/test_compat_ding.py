"""asyncdist.compat.ding: DI-engine's later helper (v0.2 onwards), bugs fixed,
and running DI-engine itself on asyncdist."""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import inspect
import logging
import sys
import time
import types
import warnings
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
from _ports import free_port

from asyncdist import AsyncDistError, DistSession, Handle, compat, spawn
from asyncdist.compat import _shared
from asyncdist.compat import ding as ding_compat

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _finalized() -> Any:
    yield
    ding_compat.uninstall()
    ding_compat.dist_finalize()


# Every name the later helper module defines, with its parameters in order
# (DI-engine's ding/utils/pytorch_ddp_dist_helper.py; ``allreduce_with_indicator``
# and ``dist_init(timeout=)`` came after v0.5.3).
LATER_SIGNATURES = {
    "get_rank": [],
    "get_world_size": [],
    "broadcast": ["tensor", "src", "group", "async_op"],
    "allgather": ["tensor_list", "tensor", "group", "async_op"],
    "broadcast_object_list": ["object_list", "src", "group", "device"],
    "allreduce": ["x"],
    "allreduce_with_indicator": ["grad", "indicator"],
    "allreduce_async": ["name", "x"],
    "reduce_data": ["x", "dst"],
    "allreduce_data": ["x", "op"],
    "synchronize": ["device"],
    "get_group": ["group_size"],
    "dist_mode": ["func"],
    "dist_init": ["backend", "addr", "port", "rank", "world_size", "timeout"],
    "dist_finalize": [],
    "simple_group_split": ["world_size", "rank", "num_groups"],
    "to_ddp_config": ["cfg"],
}
V01_SIGNATURES = {
    "get_rank": [],
    "get_world_size": [],
    "broadcast": ["tensor", "src", "group", "async_op"],
    "allreduce": ["tensor", "op", "group", "async_op"],
    "allgather": ["tensor_list", "tensor", "group", "async_op"],
    "get_group": ["group_size"],
    "dist_mode": ["func"],
    "dist_init": ["backend", "addr", "port", "rank", "world_size"],
    "dist_finalize": [],
    "simple_group_split": ["world_size", "rank", "num_groups"],
    "error_wrapper": ["fn", "default_ret"],
}


def test_every_name_of_both_releases_drops_in_by_signature() -> None:
    for module, names in ((ding_compat, LATER_SIGNATURES), (compat, V01_SIGNATURES)):
        for name, params in names.items():
            assert name in module.__all__, (module.__name__, name)
            assert list(inspect.signature(getattr(module, name)).parameters) == params, name
    assert {"DistContext"} <= set(compat.__all__)
    assert {"DDPContext", "DistContext", "install", "uninstall"} <= set(ding_compat.__all__)
    assert set(ding_compat.HELPER_NAMES) == set(LATER_SIGNATURES) | {"DDPContext", "DistContext"}
    assert issubclass(ding_compat.DistContext, ding_compat.DDPContext)  # v0.2 to v0.4.8's name
    replacements = {id(getattr(ding_compat, name)) for name in ding_compat.HELPER_NAMES}
    assert len(replacements) == len(ding_compat.HELPER_NAMES), "undo tells them apart"
    # the one semantic fork: v0.1's allreduce is torch's (a sum), the later one a mean
    assert compat.allreduce is not ding_compat.allreduce
    assert ding_compat.dist_init.__defaults__ is not None
    assert ding_compat.dist_init.__defaults__[-1] == datetime.timedelta(seconds=60000)


def test_dist_init_takes_timeout_and_works_without_cuda() -> None:
    backend = "gloo" if torch.cuda.is_available() else "nccl"
    assert ding_compat.dist_init(backend, timeout=datetime.timedelta(seconds=25)) == (0, 1)
    assert dist.get_backend() == "gloo"
    assert _shared.session is not None
    assert _shared.session.timeout == 25.0
    with pytest.raises(AsyncDistError, match="already initialised"):
        ding_compat.dist_init()
    x = torch.tensor([3.0, 5.0])
    ding_compat.allreduce(x)
    assert x.tolist() == [3.0, 5.0]  # a mean over one rank
    assert ding_compat.allreduce_data(7, "sum") == 7
    assert ding_compat.allreduce_data(7, "avg") == 7.0
    assert ding_compat.reduce_data(2.5, 0) == 2.5
    ding_compat.dist_finalize()
    assert not dist.is_initialized()
    ding_compat.dist_finalize()  # idempotent
    with pytest.raises(ValueError, match="backend"):
        ding_compat.dist_init("mpi")
    assert not dist.is_initialized()


def test_contexts_return_the_session_and_release_it() -> None:
    for context in (
        ding_compat.DDPContext(timeout=20),
        ding_compat.DistContext(),
        compat.DistContext(),
    ):
        with context as session:
            assert isinstance(session, DistSession)
            assert dist.is_initialized()
            assert compat.get_world_size() == 1
        assert session.closed
        assert not dist.is_initialized()
    with pytest.raises(KeyError), ding_compat.DDPContext():
        raise KeyError("inside")
    assert not dist.is_initialized()


def test_dist_mode_keeps_the_value() -> None:
    @ding_compat.dist_mode
    def work(x: int) -> int:
        assert dist.is_initialized()
        return x * ding_compat.get_world_size()

    assert work(4) == 4
    assert not dist.is_initialized()


class AttrDict(dict[str, Any]):
    """Like EasyDict: items are attributes too."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def _config() -> AttrDict:
    return AttrDict(
        policy=AttrDict(
            batch_size=10,
            learn=AttrDict(batch_size=7),
            collect=AttrDict(n_sample=9, n_episode=4),
            other=AttrDict(batch_size=12),
        )
    )


def test_to_ddp_config_in_a_world_of_one() -> None:
    cfg = _config()
    assert ding_compat.to_ddp_config(cfg) is cfg
    assert cfg == _config()


def _ding_ranks(session: DistSession) -> dict[str, Any]:
    """Every later-helper name on 4 gloo ranks; values checked by hand."""
    rank, out = session.rank, {}
    _shared.session_for(None, "test")  # every rank adopts spawn's group here
    bad: list[str] = []
    if rank == 0:
        # Refused on this rank alone, before launch: were anything launched,
        # the collectives below would pair with it and come out wrong.
        for call, error in (
            (lambda: ding_compat.allreduce_data(1.0, "max"), ValueError),
            (lambda: ding_compat.allreduce_data("1", "sum"), TypeError),
            (lambda: ding_compat.allreduce_data(torch.ones(2, dtype=torch.int64), "avg"), None),
            (lambda: ding_compat.allreduce(torch.ones(2, dtype=torch.int64)), None),
            (lambda: ding_compat.allreduce([1.0]), TypeError),  # type: ignore[arg-type]
            (lambda: ding_compat.allreduce_async(3, torch.ones(1)), TypeError),  # type: ignore[arg-type]
            (
                lambda: ding_compat.allreduce_with_indicator(torch.ones(2), torch.ones(2)),
                ValueError,
            ),
            (
                lambda: ding_compat.allreduce_with_indicator(
                    torch.ones(2, dtype=torch.int64), torch.ones(1)
                ),
                TypeError,
            ),
            (lambda: ding_compat.allreduce_with_indicator(torch.ones(2), "1"), TypeError),  # type: ignore[arg-type]
            (lambda: ding_compat.reduce_data(1.0, 4), ValueError),
            (lambda: ding_compat.reduce_data(1.0, "0"), TypeError),  # type: ignore[arg-type]
            (lambda: ding_compat.reduce_data(None, 0), TypeError),  # type: ignore[arg-type]
            (lambda: ding_compat.allgather([torch.zeros(2)] * 3, torch.ones(2)), ValueError),
            (lambda: ding_compat.allgather([torch.zeros(3)] * 4, torch.ones(2)), ValueError),
            (lambda: ding_compat.broadcast_object_list(("a",), 0), TypeError),  # type: ignore[arg-type]
            (lambda: ding_compat.broadcast(torch.ones(1), 7), ValueError),
            (lambda: ding_compat.simple_group_split(4, 1, 2), ValueError),
            (lambda: ding_compat.simple_group_split(4, 0, 3), ValueError),
        ):
            try:
                call()
            except (TypeError, ValueError) as exc:
                if error is not None and not isinstance(exc, error):
                    bad.append(f"{type(exc).__name__}: {exc}")
            else:
                bad.append("accepted")
    out["bad"] = bad

    # the fork: later allreduce is the mean, v0.1's the sum
    x = torch.tensor([1.0, 2.0]) + rank
    ding_compat.allreduce(x)
    out["mean"] = x.tolist()  # [(1+2+3+4)/4, (2+3+4+5)/4]
    y = torch.tensor([1.0, 2.0]) + rank
    compat.allreduce(y)
    out["v01_sum"] = y.tolist()

    # allreduce_async from DI-engine-style gradient hooks, then synchronize()
    w = torch.nn.Parameter(torch.zeros(3))
    keep = [w.expand_as(w).grad_fn.next_functions[0][0]]  # type: ignore[union-attr]
    launched: list[Handle[torch.Tensor]] = []
    keep[0].register_hook(lambda *_: launched.append(ding_compat.allreduce_async("w", w.grad)))
    if rank == 0:
        time.sleep(0.3)  # the others' synchronize() must wait for this rank
    (w * (rank + 1)).sum().backward()
    ding_compat.synchronize()
    out["hook_grad"] = w.grad.tolist() if w.grad is not None else None  # 2.5 = (1+2+3+4)/4
    out["hooks_done"] = [h.done() for h in launched]
    out["pending_after_sync"] = _shared.pending_count()

    # returned handles: waited, awaited (and awaited again)
    a = torch.full((2,), float(rank))
    ha = ding_compat.allreduce_async("a", a)
    out["waited"] = ha.wait().tolist()  # 1.5

    async def awaited() -> list[float]:
        b = torch.full((2,), float(2 * rank))
        hb = ding_compat.allreduce_async("b", b)
        first = await hb
        second = await hb
        assert first is second is b
        return b.tolist()  # 3.0

    out["awaited"] = anyio.run(awaited)

    # indicator: ranks 0 and 1 contributed, 2 and 3 did not
    grad = torch.full((2,), float(rank + 1)) if rank < 2 else torch.zeros(2)
    indicator = torch.tensor(1.0 if rank < 2 else 0.0)
    ding_compat.allreduce_with_indicator(grad, indicator)
    out["indicator"] = (grad.tolist(), indicator.item())  # (1+2)/2 = 1.5, 2
    nobody = torch.zeros(2)
    ding_compat.allreduce_with_indicator(nobody, torch.tensor(0.0))
    out["nobody"] = nobody.tolist()

    # numbers and tensors
    out["data"] = (
        ding_compat.allreduce_data(rank + 1, "sum"),  # 10, an int
        ding_compat.allreduce_data(rank + 1, "avg"),  # 2.5
        ding_compat.allreduce_data(float(rank), "sum"),  # 6.0
        ding_compat.allreduce_data(torch.tensor([float(rank)]), "avg").tolist(),  # [1.5]
    )
    out["reduced"] = (
        ding_compat.reduce_data(rank + 1, 2),  # 10 on rank 2, own value elsewhere
        ding_compat.reduce_data(torch.tensor([rank + 1.0]), 2).tolist(),
    )

    # allgather (sync and async), broadcast, broadcast_object_list
    gathered = [torch.zeros(2) for _ in range(4)]
    assert ding_compat.allgather(gathered, torch.tensor([rank, rank * 10.0])) is None
    out["gathered"] = [t.tolist() for t in gathered]
    gathered_async = [torch.zeros(1) for _ in range(4)]
    handle = ding_compat.allgather(gathered_async, torch.tensor([float(rank)]), async_op=True)
    assert isinstance(handle, Handle)
    ding_compat.synchronize()
    out["gathered_async"] = [t.item() for t in gathered_async]
    assert handle.wait() is gathered_async
    flag = torch.tensor([1 if rank == 0 else 0])
    ding_compat.broadcast(flag, 0)  # ddp_termination_checker's use
    out["flag"] = flag.item()
    objects: list[Any] = [f"from {rank}", {"rank": rank}] if rank == 1 else [None, None]
    ding_compat.broadcast_object_list(objects, src=1)
    out["objects"] = objects

    # groups: simple_group_split(world, rank, groups) and get_group(size)
    group = ding_compat.simple_group_split(4, rank, 2)
    z = torch.tensor([float(rank)])
    compat.allreduce(z, group=group)  # v0.1's allreduce takes a group: sum
    out["group_sum"] = z.item()  # 0+1 or 2+3
    names: list[Any] = ["block", rank] if rank in (1, 3) else [None, None]
    ding_compat.broadcast_object_list(names, src=rank // 2 * 2 + 1, group=group)
    out["group_objects"] = names
    pair = ding_compat.get_group(2)
    pair_gather = [torch.zeros(1), torch.zeros(1)]
    ding_compat.allgather(pair_gather, torch.tensor([float(rank)]), group=pair)
    out["pair_gather"] = [t.item() for t in pair_gather]

    # configs are per process
    cfg = ding_compat.to_ddp_config(_config())
    plain = ding_compat.to_ddp_config({"policy": {"learn": {"batch_size": 8}}})
    out["cfg"] = (
        cfg.policy.batch_size,
        cfg.policy.learn.batch_size,
        cfg.policy.collect.n_sample,
        cfg.policy.collect.n_episode,
        cfg.policy.other.batch_size,
        plain["policy"]["learn"]["batch_size"],
    )
    _shared.forget_adopted()
    return out


def test_later_helper_on_four_ranks() -> None:
    results = spawn(_ding_ranks, 4, timeout=30)
    for rank, out in enumerate(results):
        assert out["bad"] == [], out["bad"]
        assert out["mean"] == [2.5, 3.5]
        assert out["v01_sum"] == [10.0, 14.0]
        assert out["hook_grad"] == [2.5, 2.5, 2.5]
        assert out["hooks_done"] == [True]
        assert out["pending_after_sync"] == 0
        assert out["waited"] == [1.5, 1.5]
        assert out["awaited"] == [3.0, 3.0]
        assert out["indicator"] == ([1.5, 1.5], 2.0)
        assert out["nobody"] == [0.0, 0.0]
        assert out["data"] == (10, 2.5, 6.0, [1.5])
        assert type(out["data"][0]) is int
        assert out["reduced"][0] == (10 if rank == 2 else rank + 1)
        if rank == 2:
            assert out["reduced"][1] == [10.0]
        assert out["gathered"] == [[r, r * 10.0] for r in range(4)]
        assert out["gathered_async"] == [0.0, 1.0, 2.0, 3.0]
        assert out["flag"] == 1
        assert out["objects"] == ["from 1", {"rank": 1}]
        assert out["group_sum"] == (1.0 if rank < 2 else 5.0)
        assert out["group_objects"] == ["block", 1 if rank < 2 else 3]
        assert out["pair_gather"] == ([0.0, 1.0] if rank < 2 else [2.0, 3.0])
        assert out["cfg"] == (3, 2, 3, 1, 12, 2)


def _ddp_context_explicit(session: DistSession, port: int) -> dict[str, Any]:
    session.close()  # leave spawn's group; DDPContext makes its own
    rank, out = session.rank, {}
    with ding_compat.DDPContext("gloo", "127.0.0.1", str(port), rank, 2, timeout=20) as s:
        out["session"] = (type(s).__name__, s.rank, s.world_size, s.timeout)
        x = torch.tensor([float(rank)])
        ding_compat.allreduce(x)
        out["mean"] = x.item()
        if rank == 0:
            time.sleep(3.0)  # still inside while rank 1 leaves
        started = time.monotonic()
    out["exit_s"] = time.monotonic() - started
    out["initialized_after"] = dist.is_initialized()
    return out


def test_ddp_context_explicit_address_and_finalize_without_barrier() -> None:
    results = spawn(_ddp_context_explicit, 2, args=(free_port(),), timeout=20)
    for rank, out in enumerate(results):
        assert out["session"] == ("DistSession", rank, 2, 20.0)
        assert out["mean"] == 0.5
        assert out["initialized_after"] is False
    # rank 1 released its group while rank 0 was still in the block: no barrier
    assert results[1]["exit_s"] < 2.0, results[1]["exit_s"]


def test_error_wrapper_takes_the_later_warning_msg(caplog: pytest.LogCaptureFixture) -> None:
    """DI-engine's later ``error_wrapper(fn, default_ret, warning_msg="")``:
    a failure returns ``default_ret`` and, with a message, logs a warning
    (once per message, default and error, as its ``one_time_warning``) naming
    both. DI-engine 0.5.3's own passes two arguments to its one-argument
    ``one_time_warning`` and raises a TypeError instead."""
    params = list(inspect.signature(ding_compat.error_wrapper).parameters)
    assert params == ["fn", "default_ret", "warning_msg"]

    def boom(x: int) -> int:
        raise ValueError(f"no rank {x}")

    message = f"probe failed ({time.monotonic_ns()})"  # unique: warned once per process
    wrapped = ding_compat.error_wrapper(boom, -1, warning_msg=message)
    assert wrapped.__name__ == "boom"
    with caplog.at_level(logging.WARNING):
        assert wrapped(3) == -1
        assert wrapped(3) == -1  # the same failure again: not warned again
        assert ding_compat.error_wrapper(boom, -1, message)(4) == -1  # another error: warned
    warnings_logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings_logged] == [
        f"{message}\ndefault_ret = -1\terror = no rank 3",
        f"{message}\ndefault_ret = -1\terror = no rank 4",
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert ding_compat.error_wrapper(boom, None)(5) is None  # no message: no warning
        assert ding_compat.error_wrapper(boom, None, "")(5) is None  # DI-engine's default
        assert ding_compat.error_wrapper(lambda x: x + 1, -1, "unused")(3) == 4
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _allreduce_async_waited_by_torch(session: DistSession, port: int) -> dict[str, Any]:
    session.close()  # leave spawn's group; DDPContext makes its own
    rank, out = session.rank, {}
    with ding_compat.DDPContext("gloo", "127.0.0.1", str(port), rank, 2, timeout=20):
        # DI-engine waits its own way: a raw barrier (no asyncdist handle waited)
        x = torch.full((3,), float(rank + 1))
        handle = ding_compat.allreduce_async("x", x)
        dist.barrier()
        out["after_barrier"] = x.tolist()  # (1 + 2) / 2
        out["after_wait"] = handle.wait().tolist()  # not divided twice
        # the later helper's hooks then synchronize(): still the mean, once
        y = torch.full((2,), float(4 * rank))
        ding_compat.allreduce_async("y", y)
        ding_compat.synchronize()
        out["after_synchronize"] = y.tolist()  # (0 + 4) / 2
        dist.barrier()
        out["later"] = y.tolist()
    return out


def test_allreduce_async_leaves_the_mean_whatever_waits() -> None:
    """``allreduce_async`` divides before it sums, as the later helper does,
    so ``x`` holds the mean once the collective completes, also for code
    that waits with torch (``dist.barrier()``) rather than the handle."""
    results = spawn(_allreduce_async_waited_by_torch, 2, args=(free_port(),), timeout=30)
    for out in results:
        assert out["after_barrier"] == [1.5, 1.5, 1.5]
        assert out["after_wait"] == [1.5, 1.5, 1.5]
        assert out["after_synchronize"] == [2.0, 2.0]
        assert out["later"] == [2.0, 2.0]


# -- install(): rebinding the helper's names in DI-engine's modules -------------------------


def _fake_ding(monkeypatch: pytest.MonkeyPatch, *, linklink: bool = False) -> dict[str, Any]:
    """A stand-in for DI-engine's modules as its import leaves them."""

    def stub(name: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> None:
            raise AssertionError(f"DI-engine's own {name} was called")

        fn.__name__ = name
        return fn

    helper = types.ModuleType("ding.utils.pytorch_ddp_dist_helper")
    for name in ding_compat.HELPER_NAMES:
        if name != "allreduce_with_indicator":  # v0.5.3 has none
            setattr(helper, name, stub(name))
    helper.broadcast = dist.broadcast  # the helper binds torch's own functions
    helper.allgather = dist.all_gather
    helper.error_wrapper = stub("error_wrapper")
    utils = types.ModuleType("ding.utils")
    for name, value in vars(helper).items():
        if not name.startswith("_"):
            setattr(utils, name, value)
    ding = types.ModuleType("ding")
    ding.enable_linklink = linklink  # type: ignore[attr-defined]
    policy = types.ModuleType("ding.policy.base_policy")
    policy.allreduce = helper.allreduce  # type: ignore[attr-defined]
    policy.sync = helper.synchronize  # type: ignore[attr-defined]  # imported under another name
    policy.dist = dist  # type: ignore[attr-defined]
    outside = types.ModuleType("lzero.policy")
    outside.allreduce = helper.allreduce  # type: ignore[attr-defined]
    modules = {
        "ding": ding,
        "ding.utils": utils,
        "ding.utils.pytorch_ddp_dist_helper": helper,
        "ding.policy.base_policy": policy,
        "lzero.policy": outside,
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    public = {k: v for k, v in vars(helper).items() if not k.startswith("_")}
    return {"original": public, **modules}


def test_install_rebinds_every_import_and_undo_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_ding(monkeypatch)
    original, utils, helper = fake["original"], fake["ding.utils"], fake[ding_compat.HELPER]
    policy, outside = fake["ding.policy.base_policy"], fake["lzero.policy"]
    with ding_compat.install() as installed:
        assert installed.active
        for name in ding_compat.HELPER_NAMES:
            if name in original:
                assert getattr(utils, name) is getattr(ding_compat, name), name
                assert getattr(helper, name) is getattr(ding_compat, name), name
        assert not hasattr(utils, "allreduce_with_indicator"), "no name the helper lacks"
        assert utils.error_wrapper is original["error_wrapper"]
        assert policy.allreduce is ding_compat.allreduce
        assert policy.sync is ding_compat.synchronize
        assert policy.dist is dist
        assert dist.broadcast is not ding_compat.broadcast, "torch itself is left alone"
        assert outside.allreduce is original["allreduce"], "only the packages asked for"
        # every name the fake helper has, in the helper and in ding.utils; two in the policy
        assert installed.rebound == 2 * (len(ding_compat.HELPER_NAMES) - 1) + 2
        with pytest.raises(AsyncDistError, match="already installed"):
            ding_compat.install()
        late = types.ModuleType("ding.late")  # imported while installed
        late.allreduce = utils.allreduce  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "ding.late", late)
    assert not installed.active
    for name, value in original.items():
        assert getattr(utils, name) is value, name
        assert getattr(helper, name) is value, name
    assert policy.allreduce is original["allreduce"]
    assert policy.sync is original["synchronize"]
    assert late.allreduce is original["allreduce"]
    installed.undo()  # idempotent

    again = ding_compat.install(packages=("ding", "lzero"))
    assert outside.allreduce is ding_compat.allreduce
    ding_compat.uninstall()
    assert not again.active
    assert outside.allreduce is original["allreduce"]
    with pytest.raises(TypeError):
        ding_compat.install(packages="ding")


def test_install_refuses_linklink_and_a_missing_ding(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_ding(monkeypatch, linklink=True)
    with pytest.raises(AsyncDistError, match="linklink"):
        ding_compat.install()
    monkeypatch.setitem(sys.modules, "ding", None)
    with pytest.raises(ModuleNotFoundError):
        ding_compat.install()


# -- DI-engine's own Policy on asyncdist ---------------------------------------------------

# What importing ding.policy needs besides torch and numpy, found by importing
# it from di-engine 0.5.3's wheel (``pip install --no-deps``) until it worked.
DING_IMPORT_NEEDS = (
    "easydict DI-toolkit cloudpickle DI-treetensor treevalue hbutils graphviz deprecation "
    "dill flask werkzeug blinker itsdangerous URLObject enum-tools tabulate tensorboardX "
    "protobuf gym==0.25.1 gymnasium einops"
)
DING_MISSING = (
    "di-engine is not installed: its Policy import needs 21 packages besides torch "
    f"({DING_IMPORT_NEEDS}) and its metadata pins numpy<2, so the test extra does not "
    "carry it; install di-engine==0.5.3 and those with --no-deps to run this test"
)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(steps)
    ]


def _train(model: torch.nn.Module, rank: int, world: int, sync: Any) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(3):
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        sync()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _ding_policy(session: DistSession) -> dict[str, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base_policy = importlib.import_module("ding.policy.base_policy")
    except ImportError as exc:
        return {"skip": f"DI-engine is installed but ding.policy does not import: {exc!r}"}
    rank, out = session.rank, {}
    used = [n for n in ding_compat.HELPER_NAMES if hasattr(base_policy, n)]
    with ding_compat.install():
        out["rebound"] = [n for n in used if getattr(base_policy, n) is getattr(ding_compat, n)]
        for bp_update_sync in (True, False):
            model = _model(100 + rank)  # a different model on every rank...
            keep = [] if bp_update_sync else ding_compat.keep_grad_accumulators(model)
            policy = types.SimpleNamespace(_bp_update_sync=bp_update_sync)
            # ...until DI-engine's own code broadcasts rank 0's
            base_policy.Policy._init_multi_gpu_setting(policy, model, bp_update_sync)
            out[f"start_{bp_update_sync}"] = [p.detach().clone() for p in model.parameters()]
            out[f"end_{bp_update_sync}"] = _train(
                model,
                rank,
                session.world_size,
                lambda m=model, p=policy: base_policy.Policy.sync_gradients(p, m),
            )
            del keep
    out["used"] = used
    out["restored"] = [n for n in used if getattr(base_policy, n) is not getattr(ding_compat, n)]
    _shared.forget_adopted()
    return out


@pytest.mark.timeout(120)
def test_di_engine_policy_sync_gradients_on_asyncdist() -> None:
    if importlib.util.find_spec("ding") is None:
        pytest.skip(DING_MISSING)
    results = spawn(_ding_policy, 2, timeout=60)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    for out in results:
        assert {"allreduce", "allreduce_async", "broadcast", "synchronize"} <= set(out["used"])
        assert out["rebound"] == out["used"] == out["restored"]
    start = [p.detach() for p in _model(100).parameters()]  # rank 0's, broadcast
    expected = _train(_model(100), 0, 1, lambda: None)  # one process, the whole batch
    for bp_update_sync in (True, False):
        for out in results:
            for got, want in zip(out[f"start_{bp_update_sync}"], start, strict=True):
                assert torch.equal(got, want)
            for got, want in zip(out[f"end_{bp_update_sync}"], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(
            results[0][f"end_{bp_update_sync}"], results[1][f"end_{bp_update_sync}"], strict=True
        ):
            assert torch.equal(a, b), f"ranks differ with bp_update_sync={bp_update_sync}"
