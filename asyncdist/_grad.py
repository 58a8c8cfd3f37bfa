"""GradientSync: bucketed gradient averaging that overlaps with backward.

Gradients are packed into buckets, and each bucket's allreduce is launched
the moment its last gradient is accumulated, while backward goes on computing
the next ones.  ``await sync`` (or ``sync.wait()``) launches what is left,
waits for every bucket and writes the averaged gradients back.

Buckets are the same on every rank, and are launched in bucket order, so the
stream of collectives is identical everywhere:

* first backward: buckets follow the reverse order of ``module.parameters()``
  (roughly the order backward produces gradients), with a small first bucket
  so communication starts early, as DDP does;
* after it, the buckets are rebuilt from the order gradients actually arrived
  on rank 0 (broadcast to all ranks once), so later steps fill each bucket
  with gradients that become ready together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable, Iterator
from typing import Any, Protocol

import torch

from . import _ops
from ._handle import Handle, combined, wait_all
from ._wakeup import issuing_as

MB = 1 << 20


class Lane(Protocol):
    """What gradient averaging needs of a session (or any lane)."""

    @property
    def device(self) -> torch.device: ...

    def allreduce(
        self, tensor: torch.Tensor, op: _ops.ReduceOpLike = ...
    ) -> Handle[torch.Tensor]: ...

    def broadcast(self, tensor: torch.Tensor, src: int = ...) -> Handle[torch.Tensor]: ...

    def broadcast_object(
        self, obj: Any, src: int = ..., *, allowed: Iterable[Any] | None = ...
    ) -> Handle[Any]: ...


class _Bucket:
    """One flat buffer of gradients of one dtype, reduced by one allreduce."""

    __slots__ = ("buffer", "handle", "offsets", "params", "pending")

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.offsets: list[int] = []
        total = 0
        for param in params:
            self.offsets.append(total)
            total += param.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=device)
        self.pending = len(params)
        self.handle: Handle[torch.Tensor] | None = None

    def slot(self, index: int) -> torch.Tensor:
        param = self.params[index]
        start = self.offsets[index]
        return self.buffer[start : start + param.numel()].view_as(param)


class GradientSync:
    """Average gradients across ranks, overlapped with backward.

    Made by :meth:`DistSession.gradient_sync`; await it (or ``.wait()``)
    after ``loss.backward()`` and before ``optimizer.step()``::

        sync = session.gradient_sync(model)
        await sync.broadcast_parameters_async()  # same start on every rank
        for x, y in loader:
            loss_fn(model(x), y).backward()  # buckets reduced during backward
            await sync                       # every .grad is now the average
            opt.step(); opt.zero_grad(set_to_none=True)

    Parameters without ``requires_grad`` are left alone; a parameter that got
    no gradient on this rank in a step counts as a zero gradient, and receives
    the average of the others. Use it as a context manager (or call
    :meth:`remove`) to take its hooks off the module.
    """

    def __init__(
        self,
        session: Lane,
        module: torch.nn.Module,
        *,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        op: _ops.ReduceOpLike = "mean",
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"gradient_sync: module must be a torch.nn.Module, not {type(module).__name__}"
            )
        for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"gradient_sync: {name} must be a positive number of MiB, got {value!r}"
                )
        name = _ops.reduction_name(op, collective="gradient_sync")
        if name not in ("mean", "sum"):
            raise ValueError(f"gradient_sync: op must be 'mean' or 'sum', not {op!r}")
        self._lane = session
        self._issuer = f"gradient_sync of {type(module).__name__} ({id(self):#x})"
        self._module = module
        self._op = name
        self._cap = int(bucket_mb * MB)
        self._first_cap = int(min(first_bucket_mb, bucket_mb) * MB)
        seen: set[int] = set()
        self._params: list[torch.nn.Parameter] = []
        for param in module.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                self._params.append(param)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # param index -> (bucket, slot)
        self._build(list(reversed(range(len(self._params)))))
        self._arrivals: list[int] | None = []  # recorded during the first backward
        self._ready = [False] * len(self._params)
        self._next_launch = 0
        self._enabled = True
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in self._params
        ]

    # -- buckets ----------------------------------------------------------------------

    def _build(self, order: list[int]) -> None:
        """Pack parameters, in ``order``, into buckets of one dtype each."""
        buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for index in order:
            param = self._params[index]
            if current and param.dtype != current[0].dtype:
                buckets.append(current)
                current, size = [], 0
            current.append(param)
            size += param.numel() * param.element_size()
            if size >= (self._first_cap if not buckets else self._cap):
                buckets.append(current)  # a bucket closes once it reaches its cap
                current, size = [], 0
        if current:
            buckets.append(current)
        device = self._lane.device
        self._buckets = [_Bucket(params, device) for params in buckets]
        self._where = {
            self._index[id(param)]: (b, slot)
            for b, bucket in enumerate(self._buckets)
            for slot, param in enumerate(bucket.params)
        }

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes in each bucket, in launch order."""
        return [b.buffer.numel() * b.buffer.element_size() for b in self._buckets]

    # -- during backward ----------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._enabled or param.grad is None:
            return
        index = self._index[id(param)]
        if self._arrivals is not None:
            self._arrivals.append(index)
        b, slot = self._where[index]
        bucket = self._buckets[b]
        target = bucket.slot(slot)
        if param.grad.data_ptr() != target.data_ptr():  # not already accumulated in place
            target.copy_(param.grad)
        if not self._ready[index]:  # a second call in one step only refreshes the copy
            self._ready[index] = True
            bucket.pending -= 1
            self._launch_ready()

    def _launch_ready(self, *, everything: bool = False) -> None:
        """Launch buckets in order while the next one is complete."""
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.pending > 0 and not everything:
                return
            if bucket.pending > 0:  # no gradient arrived for some parameters
                for slot, param in enumerate(bucket.params):
                    if param.grad is None:
                        bucket.slot(slot).zero_()
            # hooks run on autograd's threads (CUDA) or the caller's: every
            # launch of this object counts as its own, whichever thread runs it
            with issuing_as(self, self._issuer):
                bucket.handle = self._lane.allreduce(bucket.buffer, op=self._op)
            self._next_launch += 1

    # -- finishing a step ---------------------------------------------------------------

    def _launch_rest(self) -> list[Handle[torch.Tensor]]:
        self._launch_ready(everything=True)
        return [b.handle for b in self._buckets if b.handle is not None]

    def _write_back(self) -> None:
        """Point each ``.grad`` at its averaged slot of the bucket (no copy).

        Like DDP's ``gradient_as_bucket_view``: with ``zero_grad(set_to_none=
        False)`` the next backward accumulates straight into the bucket, and
        with ``set_to_none=True`` the hook copies the fresh gradient in.
        """
        for bucket in self._buckets:
            for slot, param in enumerate(bucket.params):
                param.grad = bucket.slot(slot)
            bucket.handle = None
            bucket.pending = len(bucket.params)
        self._ready = [False] * len(self._params)
        self._next_launch = 0

    def _rank0_order(self) -> Handle[list[int]] | None:
        """After the first step: every rank's bucket order, taken from rank 0's
        observed arrival order (buckets must be alike on every rank)."""
        arrivals, self._arrivals = self._arrivals, None
        if arrivals is None:
            return None
        seen = set(arrivals)
        order = list(dict.fromkeys(arrivals)) + [
            i for i in reversed(range(len(self._params))) if i not in seen
        ]
        with issuing_as(self, self._issuer):
            return self._lane.broadcast_object(order, src=0, allowed=[])

    def wait(self) -> None:
        """Block until every bucket is reduced and gradients are written back."""
        if not self._enabled:
            return
        wait_all(self._launch_rest()).wait()
        self._write_back()
        order = self._rank0_order()
        if order is not None:
            self._build(order.wait())

    async def _wait_async(self) -> None:
        if not self._enabled:
            return
        await wait_all(self._launch_rest())
        self._write_back()
        order = self._rank0_order()
        if order is not None:
            self._build(await order)

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait_async().__await__()

    # -- extras -------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block;
        the first synced step after it reduces the accumulated sum."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    def _broadcast_parameters(self, src: int) -> Handle[None]:
        """Launch the broadcasts of every parameter and buffer, one flat buffer
        per dtype; waiting copies the received values back."""
        tensors = [p.data for p in self._module.parameters()]
        tensors += [b.data for b in self._module.buffers()]
        groups = list(_ops.by_dtype(tensors).values())
        flats = [_ops.pack(group, self._lane.device) for group in groups]
        with issuing_as(self, self._issuer):
            parts = [self._lane.broadcast(flat, src=src) for flat in flats]

        def copy_back(received: list[torch.Tensor]) -> None:
            for flat, group in zip(received, groups, strict=True):
                _ops.unpack(flat, group)

        return combined("broadcast_parameters", parts, copy_back)

    def broadcast_parameters(self, src: int = 0) -> None:
        """Copy every parameter and buffer from rank ``src`` to all ranks,
        blocking until done (in async code, use
        [broadcast_parameters_async][asyncdist.GradientSync.broadcast_parameters_async])."""
        self._broadcast_parameters(src).wait()

    async def broadcast_parameters_async(self, src: int = 0) -> None:
        """[broadcast_parameters][asyncdist.GradientSync.broadcast_parameters]
        for async code: the broadcasts launch at once and are awaited, so the
        event loop runs while a peer is late."""
        await self._broadcast_parameters(src)

    def remove(self) -> None:
        """Take the hooks off the module. Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> GradientSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
