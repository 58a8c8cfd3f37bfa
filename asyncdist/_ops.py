"""Pure helpers of the collectives: argument checks, reduce ops, packing, wire views.

Everything here is pure: it inspects or reshapes tensors and raises
``TypeError`` or ``ValueError`` with a message naming the collective, and
never touches the process group. Checks run on the calling rank before
launch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from ._op import Returns

ReduceOpLike: TypeAlias = "str | dist.ReduceOp | dist.ReduceOp.RedOpType"

_BY_NAME = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.AVG,
    "avg": dist.ReduceOp.AVG,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
_NAME_OF = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "mean",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}
_BITWISE = frozenset({"band", "bor", "bxor"})
_ORDERED = frozenset({"min", "max"})

# What gloo can carry; anything else fails inside gloo with "Invalid scalar type".
GLOO_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)


@dataclass(frozen=True, slots=True)
class Reduction:
    """How to run a reduction: the op sent to the backend, and whether the
    result is divided by the group size afterwards ("mean" without a trusted
    native AVG)."""

    name: str
    wire_op: Any
    divide: bool


def _is_integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


# A memo of a pure function, process-wide because its results are: they
# depend on the key alone, and every lane of every session resolves the same
# few ops on each call (a per-lane memo would only resolve them again).
_resolved: dict[tuple[Any, torch.dtype, str], Reduction] = {}


def reduction(op: Any, dtype: torch.dtype, *, backend: str, collective: str) -> Reduction:
    """Resolve ``op`` for a tensor of ``dtype`` on ``backend`` (memoised).

    Raises:
        TypeError: ``op`` is neither a string nor a ``torch.distributed.ReduceOp``.
        ValueError: an unknown name, or an op the dtype cannot do ("mean" on
            integers, "min"/"max"/"product" on complex, bitwise ops on floats).
    """
    # Only names and RedOpTypes are memoised: an int such as 3 hashes and
    # compares equal to a RedOpType and must not hit the cache (it is refused).
    memoised = type(op) is str or type(op) is dist.ReduceOp.RedOpType
    if memoised:
        cached = _resolved.get((op, dtype, backend))
        if cached is not None:
            return cached
    result = _resolve(op, dtype, backend=backend, collective=collective)
    if memoised:
        _resolved[op, dtype, backend] = result
    return result


def reduction_name(op: Any, *, collective: str) -> str:
    """The canonical name of ``op`` ("sum", "mean", ...), without dtype checks.

    Raises:
        TypeError, ValueError: ``op`` is not a reduce op.
    """
    return _resolve(op, torch.float32, backend="", collective=collective).name


def _resolve(op: Any, dtype: torch.dtype, *, backend: str, collective: str) -> Reduction:
    if isinstance(op, str):
        key = op.lower()
        if key not in _BY_NAME:
            known = ", ".join(repr(k) for k in ("sum", "mean", "min", "max", "product"))
            raise ValueError(f"{collective}: unknown reduce op {op!r}; use one of {known}")
        name = _NAME_OF[_BY_NAME[key]]
    elif isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        name = next((n for o, n in _NAME_OF.items() if op == o), "")
        if not name:
            raise ValueError(f"{collective}: reduce op {op} is not supported")
    else:
        raise TypeError(
            f"{collective}: op must be a string or torch.distributed.ReduceOp, "
            f"not {type(op).__name__}"
        )
    if name == "mean" and _is_integral(dtype):
        raise ValueError(
            f"{collective}: 'mean' of a {dtype} tensor would truncate; "
            "convert to a floating dtype first, or use 'sum'"
        )
    if dtype.is_complex and name != "sum" and name != "mean":
        raise ValueError(f"{collective}: {name!r} is not defined for complex dtype {dtype}")
    if name in _BITWISE and not _is_integral(dtype):
        raise ValueError(f"{collective}: {name!r} needs an integer or bool tensor, got {dtype}")
    if name == "mean" and backend != "nccl":
        # gloo's AVG has an open silent-correctness report upstream: sum, then divide.
        return Reduction(name, dist.ReduceOp.SUM, divide=True)
    return Reduction(name, _BY_NAME[name], divide=False)


# What each collective that writes into the tensor passed does with it: a
# result written into a contiguous copy of a strided view would not reach the
# view, so the caller must pass the copy and read the result from it. Tensors
# that are only read need no such care: the collective copies them (only when
# strided) where the backend reads contiguous memory.
_WRITES_INTO = {
    "allreduce": "reduce",
    "allreduce_coalesced": "reduce",
    "allreduce_tree": "reduce",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "recv": "receive into",
    "scatter": "scatter into",
}


def _not_contiguous(collective: str, what: str) -> str:
    """The message for a strided ``what`` that ``collective`` writes into."""
    verb = _WRITES_INTO.get(collective, "use")
    return (
        f"{collective}: {what} is not contiguous; call .contiguous() and {verb} that "
        "copy, then read the result from it (a collective on a strided view would not "
        "write back in place)"
    )


def check_tensor(
    tensor: Any,
    *,
    collective: str,
    backend: str,
    device: torch.device,
    what: str = "tensor",
    read_only: bool = False,
) -> torch.Tensor:
    """Return ``tensor`` if a collective on ``backend`` can take it.

    ``read_only``: the collective only reads ``tensor``, so it may be strided
    (the caller copies it where the backend needs contiguous memory); a
    tensor written in place must be contiguous.

    Raises:
        TypeError: not a tensor.
        ValueError: sparse, a lazy conjugate or negative view,
            non-contiguous and written in place, a dtype the backend cannot
            carry, or on a device this session's backend cannot use.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{collective}: {what} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{collective}: {what} is sparse; pass a dense tensor")
    if tensor.is_conj() or tensor.is_neg():
        # a lazy view: its memory holds the unconjugated (unnegated) values,
        # which is what the wire would carry, or be written into
        kind, fix = (
            ("conjugate", "resolve_conj") if tensor.is_conj() else ("negative", "resolve_neg")
        )
        raise ValueError(
            f"{collective}: {what} is a lazy {kind} view (from .conj() or similar); pass "
            f"{what}.{fix}() (torch's collectives refuse it too)"
        )
    if not read_only and not tensor.is_contiguous():
        raise ValueError(_not_contiguous(collective, what))
    if backend == "gloo":
        if tensor.dtype not in GLOO_DTYPES:
            raise ValueError(f"{collective}: gloo cannot carry dtype {tensor.dtype}")
        if not (tensor.is_cpu or tensor.is_cuda):
            raise ValueError(f"{collective}: gloo takes CPU or CUDA tensors, not {tensor.device}")
    elif tensor.device.type != device.type:
        raise ValueError(
            f"{collective}: {what} is on {tensor.device} but this {backend} session "
            f"works on {device}; move it with .to({str(device)!r}) (or open the session "
            "with device='cpu' for CPU tensors on gloo)"
        )
    return tensor


def check_rank(value: Any, *, world_size: int, collective: str, what: str) -> int:
    """Return ``value`` if it names a rank of a world of ``world_size``.

    Raises:
        TypeError: not an ``int``.
        ValueError: outside ``0 .. world_size - 1``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{collective}: {what} must be an int rank, not {type(value).__name__}")
    if not 0 <= value < world_size:
        raise ValueError(
            f"{collective}: {what}={value} is outside this group's ranks 0..{world_size - 1}"
        )
    return value


def check_peer(value: Any, *, rank: int, world_size: int, collective: str, what: str) -> int:
    """``check_rank``, and not this rank itself (point-to-point ops).

    Raises:
        TypeError, ValueError: as ``check_rank``, or ``value`` is ``rank``.
    """
    peer = check_rank(value, world_size=world_size, collective=collective, what=what)
    if peer == rank:
        raise ValueError(
            f"{collective}: {what}={peer} is this rank; a rank cannot {collective} to itself"
        )
    return peer


def tensor_list(
    tensors: Any,
    *,
    collective: str,
    backend: str,
    device: torch.device,
    what: str,
    length: int | None = None,
    read_only: bool = False,
) -> list[torch.Tensor]:
    """Return ``tensors`` as a list if each passes ``check_tensor`` (with ``read_only``).

    Raises:
        TypeError: not a sequence of tensors.
        ValueError: not ``length`` of them, or a tensor ``check_tensor`` refuses.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(
            f"{collective}: {what} must be a list of tensors, not {type(tensors).__name__}"
        )
    if length is not None and len(tensors) != length:
        raise ValueError(
            f"{collective}: {what} must hold {length} tensors (one per rank), not {len(tensors)}"
        )
    return [
        check_tensor(
            t,
            collective=collective,
            backend=backend,
            device=device,
            what=f"{what}[{i}]",
            read_only=read_only,
        )
        for i, t in enumerate(tensors)
    ]


# -- shaping for the wire -----------------------------------------------------------


def wire(tensor: torch.Tensor) -> torch.Tensor:
    """What travels for ``tensor``: complex as pairs of reals (backends reduce
    those element-wise, which is right for sum and mean)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def by_dtype(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """``tensors`` grouped by dtype, each group in the given order."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return groups


def pack(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """One flat buffer holding ``tensors`` (all of one dtype) back to back."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat if device is None else flat.to(device)


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``pack``'s buffer back into ``tensors``, in place."""
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset : offset + count].view_as(tensor))
        offset += count


def averaged(
    tensor: torch.Tensor, reduction: Reduction, world_size: int, *, here: bool = True
) -> Callable[[], torch.Tensor]:
    """The finishing step of a reduction into ``tensor``: divide by the group
    size for a "mean" the backend summed (only where the result lands,
    ``here``), then hand back ``tensor``."""
    # An op keeps a ``Returns``' value, not the object, and a partial is one
    # object where a closure is three: fewer for the cyclic GC to walk while
    # the op is outstanding.
    if not (reduction.divide and here):
        return Returns(tensor)
    return functools.partial(torch.Tensor.div_, tensor, world_size)
