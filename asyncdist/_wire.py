"""The wire: the one module that calls ``torch.distributed`` collectives.

Everything a lane sends goes through here, described as data:

* ``Spec``: one collective to issue (which call, which tensors as they
  travel, reduce op, root, object payload) and the step that turns the
  completed work into the handle's result.
* ``Route``: where the tensors of one device type travel (the group, its
  backend there, the device).
* ``issue(group, spec)``: a one-step collective, launched with
  ``async_op=True``; the work it returns is the handle's to observe.
  ``futureless(spec)`` says which gloo works give no future and so need a
  completer thread (torch 2.13's gloo has no ``get_future()`` for
  ``reduce_scatter`` and ``send``/``recv``: "Work::getFuture not
  implemented").
* ``exchange(group, spec, world_size, rank)``: a multi-step exchange
  (objects as bytes, rows of uneven length), blocking, run in program order
  on a lane's completer thread over its objects side group. Each is two steps
  (sizes, then payload); issued from a callback, the second step would race
  with collectives the program issues meanwhile on the same group.
* ``exchange_fingerprints``: the debug-mode agreement on what each rank is
  about to issue.

Groups are made and destroyed in ``_groups``; nothing here keeps one.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar

import torch
import torch.distributed as dist

from . import _ops
from ._debug import describe

T = TypeVar("T")

Call = Literal[
    "allreduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
    "broadcast_object",
    "all_gather_object",
    "gather_object",
    "all_gather_rows",
]


@dataclass(frozen=True, slots=True)
class Route:
    """Where the tensors of one device type travel: the group that carries
    them, its backend there, and the one device of that type the lane serves.

    A CUDA session has two, like torch's default group
    (``"cpu:gloo,cuda:nccl"``): ``cuda`` on NCCL, ``cpu`` on gloo, both over
    one process group that dispatches by device.
    """

    group: Any
    backend: str
    device: torch.device

    def __str__(self) -> str:
        return f"{self.device} ({self.backend})"


def device_type(tensor: torch.Tensor) -> str:
    """The default routing key: the tensor's device type."""
    return tensor.device.type


# two ranks only: debug mode has nothing to compare across the group
POINT_TO_POINT = frozenset({"send", "recv"})


@dataclass(slots=True, eq=False)
class Spec(Generic[T]):
    """One collective to issue, as data.

    ``inputs``/``outputs`` are the tensors as they travel (wire views);
    ``described`` the tensors as the caller passed them, described in debug
    fingerprints and counted in traces (default: ``inputs``). ``root`` is
    the group rank of the source, destination or peer. ``finish()`` gives
    the handle's result once the work completed; for object calls it takes
    what was received.
    """

    op: str
    call: Call
    finish: Callable[..., T]
    inputs: Sequence[torch.Tensor] = ()
    outputs: Sequence[torch.Tensor] | None = ()
    reduce: _ops.Reduction | None = None
    root: int | None = None
    payload: bytes = b""
    described: Sequence[torch.Tensor] | None = None
    pairwise: bool = False


# -- issuing: spec -> torch work (async_op=True) ----------------------------------------


def _allreduce(group: Any, spec: Spec[Any]) -> Any:
    assert spec.reduce is not None
    return allreduce(group, spec.inputs[0], spec.reduce)


def allreduce(group: Any, tensor: torch.Tensor, reduction: _ops.Reduction) -> Any:
    """Launch the allreduce of ``tensor`` in place on ``group`` (``async_op=True``,
    checked by the caller) and return torch's work; ``Lane.launch_allreduce``'s
    way around a ``Spec``.

    Raises:
        RuntimeError, ValueError: torch refused the call before anything was sent.
    """
    # The ProcessGroup method directly: dist.all_reduce re-does the checks the
    # collectives made already and costs ~10 µs a call.
    return group.allreduce([tensor], _allreduce_options(reduction.wire_op))


# Options objects by reduce op, made once: torch copies what it needs from
# them at the call, and making one (its ReduceOp converted from the enum
# value) costs a few µs of the hot path. Keyed by identity: a wire op is one
# of ``ReduceOp``'s class attributes (``_ops._resolve``), which live as long
# as torch does, and hashing one (a pybind enum) costs more than the rest of
# the lookup; the entry keeps its op, so an id is only ever trusted for it.
_ALLREDUCE_OPTIONS: dict[int, tuple[Any, Any]] = {}


def _allreduce_options(wire_op: Any) -> Any:
    entry = _ALLREDUCE_OPTIONS.get(id(wire_op))
    if entry is not None and entry[0] is wire_op:
        return entry[1]
    options = dist.AllreduceOptions()
    options.reduceOp = wire_op
    options.asyncOp = True
    _ALLREDUCE_OPTIONS[id(wire_op)] = (wire_op, options)
    return options


def _broadcast(group: Any, spec: Spec[Any]) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = _root(spec)
    options.rootTensor = 0
    options.asyncOp = True
    return group.broadcast([spec.inputs[0]], options)


def _wire_op(spec: Spec[Any]) -> Any:
    assert spec.reduce is not None
    return spec.reduce.wire_op


def _outputs(spec: Spec[Any]) -> list[torch.Tensor] | None:
    return None if spec.outputs is None else list(spec.outputs)


def _out(spec: Spec[Any]) -> torch.Tensor:
    assert spec.outputs is not None
    return spec.outputs[0]


def _root(spec: Spec[Any]) -> int:
    assert spec.root is not None
    return spec.root


_ISSUE: dict[str, Callable[[Any, Spec[Any]], Any]] = {
    "allreduce": _allreduce,
    "broadcast": _broadcast,
    # gloo takes the concatenated (flat) forms only
    "all_gather": lambda g, s: dist.all_gather_single(_out(s), s.inputs[0], group=g, async_op=True),
    "reduce_scatter": lambda g, s: dist.reduce_scatter_single(
        _out(s), s.inputs[0], op=_wire_op(s), group=g, async_op=True
    ),
    "all_to_all": lambda g, s: dist.all_to_all(_outputs(s), list(s.inputs), group=g, async_op=True),
    "reduce": lambda g, s: dist.reduce(
        s.inputs[0], op=_wire_op(s), group=g, group_dst=s.root, async_op=True
    ),
    "gather": lambda g, s: dist.gather(
        s.inputs[0], _outputs(s), group=g, group_dst=s.root, async_op=True
    ),
    # off the source, scatter takes no chunks: inputs is empty there
    "scatter": lambda g, s: dist.scatter(
        _out(s), list(s.inputs) or None, group=g, group_src=s.root, async_op=True
    ),
    "send": lambda g, s: dist.isend(s.inputs[0], group=g, group_dst=s.root),
    "recv": lambda g, s: dist.irecv(_out(s), group=g, group_src=s.root),
    "barrier": lambda g, s: dist.barrier(group=g, async_op=True),
}


def futureless(spec: Spec[Any]) -> str | None:
    """The completer key of a gloo work that gives no future (see the module
    docstring), or None.

    Works of one key complete in issue order (one collective stream, or one
    peer and direction), so one thread waiting on them in order delays none.
    """
    if spec.call == "reduce_scatter":
        return "collectives"
    if spec.call == "send":
        return f"send->{spec.root}"
    if spec.call == "recv":
        return f"recv<-{spec.root}"
    return None


# -- object exchanges: two steps (size, then payload) on the side group ----------------


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a CPU uint8 tensor (no numpy needed)."""
    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel()) if tensor.numel() else b""


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# A side group is a ``ProcessGroupGloo`` of its own, not a torch.distributed
# group (see ``_groups``), so the exchanges call its methods and wait.


def _side_broadcast(group: Any, tensor: torch.Tensor, src: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def _side_all_gather(group: Any, out: torch.Tensor, mine: torch.Tensor, world_size: int) -> None:
    """Every rank's ``mine`` into ``out``, rank by rank (views: no copy back)."""
    if out.is_complex():  # gloo has no complex type; torch's own wrappers do this too
        out, mine = torch.view_as_real(out), torch.view_as_real(mine)
    group.allgather([list(out.view(-1).tensor_split(world_size))], [mine.view(-1)]).wait()


def _side_gather(group: Any, mine: torch.Tensor, into: list[torch.Tensor] | None, dst: int) -> None:
    options = dist.GatherOptions()
    options.rootRank = dst
    group.gather([into] if into is not None else [], [mine], options).wait()


def _broadcast_bytes(group: Any, spec: Spec[Any], world_size: int, rank: int) -> bytes:
    src = _root(spec)
    size = torch.tensor([len(spec.payload)], dtype=torch.int64)
    _side_broadcast(group, size, src)
    if rank == src:
        buffer = _byte_tensor(spec.payload)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    if buffer.numel():
        _side_broadcast(group, buffer, src)
    return tensor_bytes(buffer)


def _all_gather_bytes(group: Any, spec: Spec[Any], world_size: int, rank: int) -> list[bytes]:
    payload = spec.payload
    sizes = torch.empty(world_size, dtype=torch.int64)
    _side_all_gather(group, sizes, torch.tensor([len(payload)], dtype=torch.int64), world_size)
    longest = int(sizes.max().item())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = _byte_tensor(payload)
    everyone = torch.empty(world_size * longest, dtype=torch.uint8)
    if longest:
        _side_all_gather(group, everyone, mine, world_size)
    return [
        tensor_bytes(everyone[r * longest : r * longest + int(sizes[r])]) for r in range(world_size)
    ]


def _gather_bytes(group: Any, spec: Spec[Any], world_size: int, rank: int) -> list[bytes] | None:
    payload, dst = spec.payload, _root(spec)
    sizes = torch.empty(world_size, dtype=torch.int64)
    _side_all_gather(group, sizes, torch.tensor([len(payload)], dtype=torch.int64), world_size)
    longest = int(sizes.max().item())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = _byte_tensor(payload)
    buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    if longest:
        _side_gather(group, mine, buffers if rank == dst else None, dst)
    if rank != dst:
        return None
    return [tensor_bytes(buffers[r][: int(sizes[r])]) for r in range(world_size)]


def _all_gather_rows(
    group: Any, spec: Spec[Any], world_size: int, rank: int
) -> tuple[list[torch.Tensor], str]:
    """All-gather CPU tensors whose first dimension differs by rank: exchange
    the row counts (and a digest of the rest of the shape and the dtype),
    gather every rank's rows padded to the longest, trim. Returns the rows by
    rank and ``""``, or ``[]`` and what the ranks disagree on (every rank
    sees the same headers, so every rank stops at the same point)."""
    mine = spec.inputs[0]
    kind = f"{mine.dtype}{list(mine.shape[1:])}".encode()
    header = torch.tensor([mine.shape[0], zlib.crc32(kind)], dtype=torch.int64)
    headers = torch.empty(2 * world_size, dtype=torch.int64)
    _side_all_gather(group, headers, header, world_size)
    rows, digests = headers[0::2].tolist(), headers[1::2].tolist()
    if len(set(digests)) > 1:
        described = replace(spec, payload=describe(mine).encode())
        shapes = [data.decode() for data in _all_gather_bytes(group, described, world_size, rank)]
        listed = ", ".join(f"{shape} on rank {r}" for r, shape in enumerate(shapes))
        return [], (
            f"{spec.op} on rank {rank}: only the first dimension may differ between ranks, "
            f"got {listed}"
        )
    longest, rest = max(rows), mine.shape[1:]
    padded = mine.new_zeros((longest, *rest))
    padded[: mine.shape[0]] = mine
    everyone = mine.new_empty((world_size * longest, *rest))
    if everyone.numel():
        _side_all_gather(group, everyone, padded, world_size)
    return [everyone[r * longest : r * longest + rows[r]] for r in range(world_size)], ""


_EXCHANGE: dict[str, Callable[[Any, Spec[Any], int, int], Any]] = {
    "broadcast_object": _broadcast_bytes,
    "all_gather_object": _all_gather_bytes,
    "gather_object": _gather_bytes,
    "all_gather_rows": _all_gather_rows,
}


def issue(group: Any, spec: Spec[Any]) -> Any:
    """Launch the one-step collective ``spec`` on ``group`` (``async_op=True``)
    and return torch's work.

    Raises:
        RuntimeError, ValueError: torch refused the call before anything was sent.
    """
    return _ISSUE[spec.call](group, spec)


def is_exchange(spec: Spec[Any]) -> bool:
    """Whether ``spec`` is a multi-step exchange (``exchange``), not one collective."""
    return spec.call in _EXCHANGE


def exchange(group: Any, spec: Spec[Any], world_size: int, rank: int) -> Any:
    """Run the multi-step exchange ``spec`` on ``group`` now, blocking; what was received.

    Raises:
        RuntimeError: the backend failed (a peer died or timed out).
    """
    return _EXCHANGE[spec.call](group, spec, world_size, rank)


def exchange_fingerprints(group: Any, encoded: bytes, world_size: int) -> list[bytes]:
    """Every rank's ``encoded`` fingerprint, by rank (all equally long), blocking.

    Raises:
        RuntimeError: the backend failed (a peer died or timed out).
    """
    raw = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    size = raw.numel()
    everyone = torch.empty(world_size * size, dtype=torch.uint8)
    _side_all_gather(group, everyone, raw, world_size)
    return [tensor_bytes(everyone[r * size : (r + 1) * size]) for r in range(world_size)]
