"""_ops: the pure helpers of the collectives, without any process group."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncdist import _ops

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("op", "name", "wire", "divide"),
    [
        ("sum", "sum", dist.ReduceOp.SUM, False),
        ("SUM", "sum", dist.ReduceOp.SUM, False),
        ("mean", "mean", dist.ReduceOp.SUM, True),  # gloo: sum, then divide
        ("avg", "mean", dist.ReduceOp.SUM, True),
        (dist.ReduceOp.AVG, "mean", dist.ReduceOp.SUM, True),
        ("max", "max", dist.ReduceOp.MAX, False),
        (dist.ReduceOp.MIN, "min", dist.ReduceOp.MIN, False),
        ("product", "product", dist.ReduceOp.PRODUCT, False),
    ],
)
def test_reduction_on_gloo(op: Any, name: str, wire: Any, divide: bool) -> None:
    reduction = _ops.reduction(op, torch.float32, backend="gloo", collective="allreduce")
    assert reduction.name == name
    assert reduction.wire_op == wire
    assert reduction.divide is divide


def test_mean_is_native_on_nccl() -> None:
    reduction = _ops.reduction("mean", torch.float32, backend="nccl", collective="allreduce")
    assert reduction.wire_op == dist.ReduceOp.AVG
    assert not reduction.divide


@pytest.mark.parametrize(
    ("op", "dtype", "error", "match"),
    [
        ("median", torch.float32, ValueError, r"^allreduce: unknown reduce op 'median'"),
        (3, torch.float32, TypeError, r"^allreduce: op must be a string or .*ReduceOp, not int"),
        ("mean", torch.int64, ValueError, r"'mean' of a torch.int64 tensor would truncate"),
        ("max", torch.complex64, ValueError, r"'max' is not defined for complex"),
        ("band", torch.float32, ValueError, r"'band' needs an integer or bool tensor"),
    ],
)
def test_reduction_refuses(op: Any, dtype: torch.dtype, error: type, match: str) -> None:
    # memoised ops first: an int equal to a cached RedOpType must still be refused
    for cached in (dist.ReduceOp.MAX, dist.ReduceOp.SUM, dist.ReduceOp.MIN, "max"):
        _ops.reduction(cached, torch.float32, backend="gloo", collective="allreduce")
    with pytest.raises(error, match=match):
        _ops.reduction(op, dtype, backend="gloo", collective="allreduce")


def test_reduction_name_ignores_the_dtype() -> None:
    assert _ops.reduction_name(dist.ReduceOp.AVG, collective="x") == "mean"
    with pytest.raises(ValueError, match=r"^x: unknown"):
        _ops.reduction_name("bogus", collective="x")


def test_check_tensor() -> None:
    t = torch.ones(2)
    assert _ops.check_tensor(t, collective="c", backend="gloo", device=CPU) is t
    with pytest.raises(TypeError, match=r"^c: tensor must be a torch.Tensor, not list"):
        _ops.check_tensor([1], collective="c", backend="gloo", device=CPU)
    with pytest.raises(ValueError, match="not contiguous"):
        _ops.check_tensor(torch.ones(2, 3).t(), collective="c", backend="gloo", device=CPU)
    with pytest.raises(ValueError, match="sparse"):
        _ops.check_tensor(t.to_sparse(), collective="c", backend="gloo", device=CPU)
    with pytest.raises(ValueError, match=r"gloo cannot carry dtype torch\.uint16"):
        _ops.check_tensor(t.to(torch.uint16), collective="c", backend="gloo", device=CPU)
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"is on cpu but this nccl session works on cuda:0"):
        _ops.check_tensor(t, collective="c", backend="nccl", device=cuda)


def test_check_rank_and_peer() -> None:
    assert _ops.check_rank(1, world_size=2, collective="c", what="src") == 1
    with pytest.raises(ValueError, match=r"^c: src=2 is outside this group's ranks 0..1"):
        _ops.check_rank(2, world_size=2, collective="c", what="src")
    with pytest.raises(TypeError, match="int rank, not bool"):
        _ops.check_rank(True, world_size=2, collective="c", what="src")
    assert _ops.check_peer(0, rank=1, world_size=2, collective="send", what="dst") == 0
    with pytest.raises(ValueError, match=r"^send: dst=1 is this rank"):
        _ops.check_peer(1, rank=1, world_size=2, collective="send", what="dst")


def test_tensor_list() -> None:
    kwargs: dict[str, Any] = {"collective": "c", "backend": "gloo", "device": CPU, "what": "xs"}
    items = (torch.ones(1), torch.zeros(2))
    assert _ops.tensor_list(items, **kwargs) == list(items)
    with pytest.raises(TypeError, match="list of tensors, not Tensor"):
        _ops.tensor_list(torch.ones(2), **kwargs)
    with pytest.raises(ValueError, match=r"must hold 3 tensors \(one per rank\), not 2"):
        _ops.tensor_list(items, length=3, **kwargs)
    with pytest.raises(TypeError, match=r"xs\[1\] must be a torch.Tensor"):
        _ops.tensor_list([torch.ones(1), "x"], **kwargs)


def test_wire_views_complex_as_reals_without_copying() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    wire = _ops.wire(z)
    assert wire.dtype == torch.float32
    assert wire.shape == (2, 2)
    assert wire.data_ptr() == z.data_ptr()
    real = torch.ones(3)
    assert _ops.wire(real) is real


def test_pack_unpack_round_trip_by_dtype() -> None:
    a, b, c = torch.arange(4.0).reshape(2, 2), torch.arange(3), torch.tensor([9.0])
    groups = _ops.by_dtype([a, b, c])
    assert list(groups) == [torch.float32, torch.int64]
    assert groups[torch.float32] == [a, c], "order within a dtype is kept"
    flat = _ops.pack(groups[torch.float32])
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 9.0]
    flat.mul_(10)
    _ops.unpack(flat, groups[torch.float32])
    assert a.tolist() == [[0.0, 10.0], [20.0, 30.0]]
    assert c.tolist() == [90.0]
    assert _ops.nbytes([a, b, c]) == 4 * 4 + 3 * 8 + 4


def test_averaged_divides_only_a_summed_mean_where_it_lands() -> None:
    mean = _ops.reduction("mean", torch.float32, backend="gloo", collective="c")
    total = _ops.reduction("sum", torch.float32, backend="gloo", collective="c")
    t = torch.full((2,), 6.0)
    assert _ops.averaged(t, mean, 3)() is t
    assert t.tolist() == [2.0, 2.0]
    assert _ops.averaged(t, total, 3)().tolist() == [2.0, 2.0]
    assert _ops.averaged(t, mean, 3, here=False)().tolist() == [2.0, 2.0], "not on this rank"


@pytest.mark.parametrize(
    ("collective", "what", "says"),
    [
        ("allreduce", "tensor", "reduce that copy"),
        ("allreduce_coalesced", "tensors[1]", "reduce that copy"),
        ("allreduce_tree", "tree['loss']", "reduce that copy"),
        ("reduce", "tensor", "reduce that copy"),
        ("broadcast", "tensor", "broadcast that copy"),
        ("recv", "tensor", "receive into that copy"),
        ("scatter", "out", "scatter into that copy"),
    ],
)
def test_non_contiguous_message_is_worded_per_op(collective: str, what: str, says: str) -> None:
    with pytest.raises(
        ValueError, match=rf"^{collective}: {re.escape(what)} is not contiguous"
    ) as info:
        _ops.check_tensor(
            torch.ones(2, 3).t(), collective=collective, backend="gloo", device=CPU, what=what
        )
    assert says in str(info.value)
    assert "read the result from it" in str(info.value)


def test_a_read_only_tensor_may_be_strided() -> None:
    strided = torch.ones(2, 3).t()
    checked = _ops.check_tensor(
        strided, collective="all_gather", backend="gloo", device=CPU, read_only=True
    )
    assert checked is strided, "checked, not copied (the call copies what the backend needs)"
    listed = _ops.tensor_list(
        [torch.ones(2), strided],
        collective="all_to_all",
        backend="gloo",
        device=CPU,
        what="inputs",
        read_only=True,
    )
    assert listed[1] is strided
    with pytest.raises(ValueError, match="sparse"):
        _ops.check_tensor(
            strided.to_sparse(), collective="send", backend="gloo", device=CPU, read_only=True
        )
