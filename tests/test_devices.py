"""Per-call routing by the tensor's device: one session, two backends.

A CUDA session carries CUDA tensors on NCCL and CPU tensors on gloo, like
torch's default group. Without a GPU the same routing is exercised with a
second gloo group standing in for the device backend: float64 tensors are
routed to it (the route key is the seam), float32 ones to the session's own
group. The real CUDA tests are in tests/test_cuda.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncdist import DistSession, spawn, wait_all
from asyncdist._collectives import lane_of
from asyncdist._env import MIXED, backends_by_device
from asyncdist._wire import Route, Spec

pytestmark = pytest.mark.timeout(90)


def _two_routes(s: DistSession) -> Any:
    """Give the session a "device" route: a gloo group of its own, for float64."""
    comm = lane_of(s)
    assert comm is not None
    device_group = dist.new_group(backend="gloo")  # every rank, same order
    comm.routes["device"] = Route(device_group, "gloo", torch.device("cpu"))
    comm.route_key = lambda t: "device" if t.dtype == torch.float64 else t.device.type
    return device_group


def _opposite_orders(s: DistSession, use_async: bool) -> dict[str, Any]:
    """Rank 0 issues the device tensor's allreduce first, rank 1 the host
    tensor's: on one group they would pair with each other; on a group per
    route each pairs with its own kind."""
    group = _two_routes(s)
    host = torch.full((3,), float(s.rank + 1))
    device = torch.full((5,), 10.0 * (s.rank + 1), dtype=torch.float64)
    first, second = (device, host) if s.rank == 0 else (host, device)
    sent = device.clone()
    handles = [s.allreduce(first), s.allreduce(second), s.broadcast(sent, src=1)]
    if use_async:
        import anyio

        async def both() -> list[Any]:
            return await wait_all(handles)

        results = anyio.run(both)
    else:
        results = wait_all(handles).wait()
    # coalesced: one launch per dtype, each on its route
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.float64)]
    s.allreduce_coalesced(mixed).wait()
    dist.destroy_process_group(group)
    return {
        "host": host.tolist(),
        "device": device.tolist(),
        "broadcast": results[2].tolist(),
        "coalesced": [t.tolist() for t in mixed],
    }


@pytest.mark.parametrize("use_async", [False, True])
def test_each_route_pairs_its_own_collectives(use_async: bool) -> None:
    for r in spawn(_opposite_orders, 2, args=(use_async,), timeout=30):
        assert r["host"] == [3.0] * 3
        assert r["device"] == [30.0] * 5
        assert r["broadcast"] == [20.0] * 5  # rank 1's value before its allreduce
        assert r["coalesced"] == [[2.0, 2.0], [2.0, 2.0]]


def test_a_device_the_session_does_not_serve_is_refused_before_launch() -> None:
    with DistSession() as s:
        with pytest.raises(ValueError, match=r"is on meta, but this session serves cpu \(gloo\)"):
            s.allreduce(torch.ones(2, device="meta"))
        lane = lane_of(s)
        assert lane is not None
        lane.route_key = lambda t: "xpu" if t.dtype == torch.int64 else t.device.type
        with pytest.raises(ValueError, match="serves cpu"):
            s.broadcast(torch.ones(2, dtype=torch.int64))
        assert float(s.allreduce(torch.ones(1)).wait()) == 1.0  # nothing was launched


def test_one_call_takes_tensors_of_one_route() -> None:
    with DistSession() as s:
        _two_routes(s)
        lane = lane_of(s)
        assert lane is not None
        spec: Spec[Any] = Spec(
            "all_gather",
            "all_gather",
            lambda: None,
            inputs=[torch.ones(1)],
            outputs=[torch.ones(1, dtype=torch.float64)],
        )
        with pytest.raises(ValueError, match="one call takes tensors of one device"):
            lane.launch(spec)
        assert float(s.allreduce(torch.ones(1)).wait()) == 1.0


def test_backend_strings_by_device() -> None:
    assert backends_by_device(MIXED) == {"cpu": "gloo", "cuda": "nccl"}
    assert backends_by_device("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert backends_by_device("NCCL") == {"cuda": "nccl"}
    assert backends_by_device("cpu:gloo") == {"cpu": "gloo"}


def test_an_adopted_group_with_a_per_device_backend_string() -> None:
    """A default group made with torch's per-device backend string is adopted
    with its routes (here CPU on gloo: reduce_scatter, which gloo gives no
    future, goes to the completer as on a plain gloo group)."""
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with DistSession() as s:
            assert s.backend == "gloo"
            assert s.device == torch.device("cpu")
            out = s.reduce_scatter(torch.full((2,), 3.0)).wait()
        assert out.tolist() == [3.0, 3.0]
    finally:
        dist.destroy_process_group()
