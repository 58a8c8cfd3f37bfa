"""GradientSync: bucketed gradient averaging that overlaps with backward.

Gradients are packed into buckets, and each bucket's allreduce is launched
the moment its last gradient is accumulated, while backward goes on computing
the next ones.  ``await sync`` (or ``sync.wait()``) launches what is left,
waits for every bucket and writes the averaged gradients back.

Buckets are the same on every rank, and are launched in bucket order, so the
stream of collectives is identical everywhere:

* first backward: buckets follow the reverse order of ``module.parameters()``
  (roughly the order backward produces gradients), with a small first bucket
  so communication starts early, as DDP does, and a small last one so little
  is left on the wire when backward ends (``layout``);
* after it, the buckets are rebuilt from the order gradients actually arrived
  on rank 0 (broadcast to all ranks once), so later steps fill each bucket
  with gradients that become ready together.

Two options go beyond DDP's reach:

* **step overlap** (``optimizer=``): buckets are finished in launch order, and
  each bucket's parameters are updated by the optimizer the moment its
  allreduce lands, while later buckets are still on the wire;
* **wire compression** (``compression="bf16"`` / ``"fp16"``): a bucket travels
  in the narrow type, pre-divided by the world size, and is copied back into
  the full-precision bucket, as DDP's ``bf16_compress_hook`` and
  ``fp16_compress_hook`` do.

It is as safe as DDP: a step must be finished (``await sync``) before the
next backward reaches the sync, or that backward raises; module buffers are
rank 0's after every synced step (DDP's ``broadcast_buffers``); and the hooks
come off when the session that made the sync ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import weakref
from collections.abc import Generator, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import _ops, _wakeup
from ._handle import Handle, combined
from ._wakeup import issuing_as
from .errors import AsyncDistError, SessionClosed

logger = logging.getLogger("asyncdist")

MB = 1 << 20


class Carrier(Protocol):
    """What gradient averaging needs of what carries its buckets: a session or
    a channel (their collective surface, not a ``_lane.Lane``)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    def allreduce(
        self, tensor: torch.Tensor, op: _ops.ReduceOpLike = ...
    ) -> Handle[torch.Tensor]: ...

    def broadcast(self, tensor: torch.Tensor, src: int = ...) -> Handle[torch.Tensor]: ...

    def broadcast_object(
        self, obj: Any, src: int = ..., *, allowed: Iterable[Any] | None = ...
    ) -> Handle[Any]: ...


COMPRESSION = {"bf16": torch.bfloat16, "fp16": torch.float16}
_WIDE = (torch.float32, torch.float64)  # the dtypes worth narrowing on the wire


@dataclasses.dataclass(frozen=True)
class Options:
    """gradient_sync's arguments, checked (before anything is launched)."""

    params: tuple[torch.nn.Parameter, ...]
    cap: int
    first_cap: int
    op: str
    optimizer: torch.optim.Optimizer | None
    compression: torch.dtype | None
    clip_grad_norm: float | None
    broadcast_buffers: bool

    @classmethod
    def checked(
        cls,
        module: torch.nn.Module,
        *,
        device: torch.device,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        op: _ops.ReduceOpLike = "mean",
        optimizer: torch.optim.Optimizer | None = None,
        compression: str | None = None,
        clip_grad_norm: float | None = None,
        broadcast_buffers: bool = True,
    ) -> Options:
        """Raises TypeError / ValueError naming the bad argument (a parameter
        off the session's ``device`` too), or AsyncDistError when another
        live GradientSync covers the module."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"gradient_sync: module must be a torch.nn.Module, not {type(module).__name__}"
            )
        for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
            if not _positive(value):
                raise ValueError(
                    f"gradient_sync: {name} must be a positive number of MiB, got {value!r}"
                )
        reduction = _ops.reduction_name(op, collective="gradient_sync")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"gradient_sync: op must be 'mean' or 'sum', not {op!r}")
        if compression is not None and compression not in COMPRESSION:
            raise ValueError(
                f"gradient_sync: compression must be 'bf16', 'fp16' or None, not {compression!r}"
            )
        seen: set[int] = set()
        params: list[torch.nn.Parameter] = []
        for name, param in module.named_parameters():
            if param.requires_grad and id(param) not in seen:
                if param.device != device:  # its buckets live on the session's device
                    raise ValueError(
                        f"gradient_sync: parameter {name!r} of {type(module).__name__} is on "
                        f"{param.device}, but this session's device is {device}; move the "
                        f"model first (model.to({str(device)!r}))"
                    )
                seen.add(id(param))
                params.append(param)
        for name, sub in module.named_modules():
            sparse = isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse
            if sparse and sub.weight.requires_grad:
                raise ValueError(
                    f"gradient_sync: {name or 'the module'} is an {type(sub).__name__} with "
                    f"sparse=True, and gradient_sync averages dense gradients only; make it "
                    f"with sparse=False"
                )
        if clip_grad_norm is not None:
            if not _positive(clip_grad_norm):
                raise ValueError(
                    f"gradient_sync: clip_grad_norm must be a positive number, "
                    f"got {clip_grad_norm!r}"
                )
            if optimizer is None:
                raise ValueError(
                    "gradient_sync: clip_grad_norm needs optimizer= (without one, clip "
                    "after `await sync` with torch.nn.utils.clip_grad_norm_)"
                )
        if optimizer is not None:
            _check_optimizer(optimizer, module, params)
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(
                f"gradient_sync: broadcast_buffers must be True or False, not {broadcast_buffers!r}"
            )
        _check_not_synced(module, params, optimizer)
        return cls(
            params=tuple(params),
            cap=int(bucket_mb * MB),
            first_cap=int(min(first_bucket_mb, bucket_mb) * MB),
            op=reduction,
            optimizer=optimizer,
            compression=None if compression is None else COMPRESSION[compression],
            clip_grad_norm=None if clip_grad_norm is None else float(clip_grad_norm),
            broadcast_buffers=broadcast_buffers,
        )


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _check_optimizer(
    optimizer: object, module: torch.nn.Module, params: list[torch.nn.Parameter]
) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"gradient_sync: optimizer must be a torch.optim.Optimizer, "
            f"not {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "gradient_sync: LBFGS updates all parameters together (it needs a closure); "
            "step overlap needs an optimizer whose update is per parameter"
        )
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {id(p): name for name, p in module.named_parameters()}
    missing = [names[id(p)] for p in params if id(p) not in owned]
    if missing:
        raise ValueError(
            f"gradient_sync: the optimizer does not own the module's parameter(s) "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; step overlap "
            f"needs an optimizer over the module's parameters"
        )


# The live GradientSync of each parameter and optimizer. Process-wide because
# hooks live on the tensors (and the optimizer) themselves, whichever session
# made them: two syncs over one parameter would both write its .grad, and two
# over one optimizer would each step the other's parameters.
# (Keyed by identity: a tensor's == is elementwise.)
_LIVE_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LIVE_OPTIMIZERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


# Every live sync; while there is one, torch's global optimizer step pre-hook
# refuses a step over the parameters of a sync whose step is in flight (a
# forgotten `await sync`: the update would use gradients not yet averaged,
# being written as the buckets land). The hook comes off once no sync is
# left, at the last one's remove() or at a session's end.
_SYNCS: weakref.WeakSet[GradientSync] = weakref.WeakSet()
_step_hook: Any = None

# How many times a submodule or a buffer was set or registered anywhere in
# the process while a sync was live (torch's global registration hooks, on
# and off with _step_hook): a sync's _Buffers walks its module again when it
# moved.
_structure = [0]
_structure_hooks: list[Any] = []


def _structure_changed(module: torch.nn.Module, name: str, value: object) -> None:
    _structure[0] += 1


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not any(sync.pending for sync in _SYNCS) or optimizer in _STEPPING:
        return  # the usual case, a few hundred ns
    if _live(_LIVE_OPTIMIZERS, optimizer) is not None:
        return  # a sync's own optimizer (optimizer=): its guard speaks
    for group in optimizer.param_groups:
        for param in group["params"]:
            sync = _live(_LIVE_PARAMS, param)
            if sync is not None and sync.pending:
                raise AsyncDistError(
                    f"{type(optimizer).__name__}.step() on rank {sync._carrier.rank} came "
                    f"before the {sync._name} finished its step: the gradients are not "
                    f"averaged yet (they are written as the buckets land). Call `await "
                    f"sync` (or `sync.wait()`) after backward, before the optimizer "
                    f"steps. Nothing of this step ran"
                )


def _watch(sync: GradientSync) -> None:
    """Count ``sync`` live; the first live sync puts torch's global hooks on
    (the optimizer step check, the structure count)."""
    global _step_hook
    _SYNCS.add(sync)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_check_step)
    if not _structure_hooks:
        _structure_hooks.append(register_module_module_registration_hook(_structure_changed))
        _structure_hooks.append(register_module_buffer_registration_hook(_structure_changed))


def _unwatch(sync: GradientSync | None) -> None:
    """Forget ``sync`` (``None``: only those already dropped); with no live
    sync left, torch's global hooks come off."""
    global _step_hook
    if sync is not None:
        _SYNCS.discard(sync)
    if not _SYNCS and _step_hook is not None:
        _step_hook.remove()
        _step_hook = None
    while not _SYNCS and _structure_hooks:
        _structure_hooks.pop().remove()


def _live(table: WeakIdKeyDictionary, key: object) -> GradientSync | None:
    sync: GradientSync | None = table.get(key)  # type: ignore[no-untyped-call]
    return sync


def _check_not_synced(
    module: torch.nn.Module,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
) -> None:
    names = {id(p): name for name, p in module.named_parameters()}
    for param in params:
        other = _live(_LIVE_PARAMS, param)
        if other is not None:
            raise AsyncDistError(
                f"gradient_sync: parameter {names[id(param)]!r} of {type(module).__name__} "
                f"already has a live {other._name}; call its remove() (or leave its `with` "
                f"block) before making another over the same parameters"
            )
    if optimizer is not None:
        other = _live(_LIVE_OPTIMIZERS, optimizer)
        if other is not None:
            raise AsyncDistError(
                f"gradient_sync: {type(optimizer).__name__} already steps under a live "
                f"{other._name} (optimizer=); one sync per optimizer: call its remove() "
                f"first, or sync the whole model with one gradient_sync"
            )


# the first and the last bucket are never made smaller than this
EDGE_FLOOR = 64 << 10


def layout(
    sizes: list[int], dtypes: list[torch.dtype], *, cap: int, edge_cap: int
) -> list[list[int]]:
    """Buckets over gradients in arrival order (their sizes in bytes, their
    dtypes): lists of positions, each bucket of one dtype, in launch order.

    A bucket closes once it reaches ``cap``. The first and the last bucket
    are small: the first so that communication starts early in backward (as
    DDP's first bucket), the last so that little is left on the wire when
    backward ends and, with step overlap, little of the update is left after
    the last bucket lands. Their size is ``edge_cap``, or a quarter of all
    the gradients if that is smaller (but not under ``EDGE_FLOOR``), so a
    small model is still split where that lets most of it overlap: the first
    bucket closes once it reaches that size, the last holds at most that
    (or the one gradient that is larger).
    """
    edge = min(edge_cap, cap, max(sum(sizes) // 4, EDGE_FLOOR))
    # the last bucket: the longest run at the end, of one dtype, within edge
    tail = len(sizes) - 1 if sizes else 0
    tail_size = sizes[tail] if sizes else 0
    while tail > 0 and dtypes[tail - 1] == dtypes[-1] and tail_size + sizes[tail - 1] <= edge:
        tail -= 1
        tail_size += sizes[tail]
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in range(tail):
        if current and dtypes[i] != dtypes[current[0]]:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += sizes[i]
        if size >= (edge if not buckets else cap):
            buckets.append(current)  # a bucket closes once it reaches its cap
            current, size = [], 0
    if current:
        last = buckets[-1] if len(buckets) > 1 else None
        if last is not None and size < edge and dtypes[last[0]] == dtypes[current[0]]:
            last += current  # a small remainder rides with the bucket before it
        else:
            buckets.append(current)
    if sizes:
        buckets.append(list(range(tail, len(sizes))))
    return buckets


# integer views by element size: a fingerprint sums bits, exactly
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(params: Iterable[torch.Tensor]) -> int:
    """An exact fingerprint of the parameters' values: equal on every rank
    where they are bitwise equal (a sum of their bits, as integers, weighted
    by position so that swapped parameters differ; one device sync)."""
    total: torch.Tensor | None = None
    for position, param in enumerate(params, start=1):
        values = param.detach()
        if values.is_complex():
            values = torch.view_as_real(values)
        bits = values.contiguous().view(-1).view(_BITS[values.element_size()])
        part = bits.sum(dtype=torch.int64) * position
        total = part if total is None else total + part
    return 0 if total is None else int(total.item())


class _Bucket:
    """One flat buffer of gradients of one dtype, reduced by one allreduce
    (of ``wire``, its narrow copy, when compressed).

    A compressed bucket's gradients go straight into ``wire`` (narrowed as
    they are copied in: no full-precision pass first), and come back into
    ``buffer`` when the sum lands; each ``.grad`` is then a view of
    ``buffer``.

    The buffer (the wire, when compressed) ends with one flag per parameter,
    1 where this rank has a gradient for it and 0 where it has none, summed
    with the gradients: a
    parameter whose flag sums to 0 got a gradient on no rank, and its
    ``.grad`` is left ``None``, as DDP (``find_unused_parameters``) and
    local autograd leave it (an optimizer then skips it, where a zero
    average would still move it by momentum or weight decay). The flags
    ride in the bucket's own allreduce: no round trip of their own.
    """

    __slots__ = (
        "buffer",
        "fills",
        "flags",
        "handle",
        "params",
        "pending",
        "scale",
        "size",
        "slots",
        "unused",
        "wire",
    )

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        device: torch.device,
        narrow: torch.dtype | None,
        mean_of: int | None,
    ) -> None:
        self.params = params
        total = sum(param.numel() for param in params)
        self.size = total * params[0].element_size()  # the gradients' bytes
        self.buffer = torch.zeros(total + len(params), dtype=params[0].dtype, device=device)
        self.wire: torch.Tensor | None = None
        if narrow is not None and self.buffer.dtype in _WIDE:
            self.wire = torch.zeros(self.buffer.numel(), dtype=narrow, device=device)
        incoming = self.buffer if self.wire is None else self.wire
        self.flags = incoming[total:]
        self.flags.fill_(1)
        self.unused = False  # this step, some parameter of it has no gradient here
        # each parameter's slot, a view of the buffer shaped like it (its
        # .grad once the sum lands), and where its gradient is copied in (the
        # same slot, or the wire's); made once: slicing and viewing in every
        # hook cost more than the hook's own work
        self.slots = _views(self.buffer, params)
        self.fills = self.slots if self.wire is None else _views(self.wire, params)
        # for a mean, each gradient is multiplied by 1/world as it is copied
        # in (one pass, as DDP does) and the bucket is summed: no pass to
        # divide afterwards. A narrowed bucket is divided on the wire instead,
        # in the narrow type, as DDP's compress hooks do.
        #
        # The factor is a 0-dim CPU tensor, not a float: torch wraps a float
        # into a tensor at every call (1.2 µs of a 2 µs multiply, measured),
        # and a CPU scalar takes the same kernel path, so the result is the
        # same to the bit. It is held in the type the kernel computes in
        # (float32 for a half bucket, the bucket's own type above), so its
        # value is the one a float would have been rounded to.
        self.scale: torch.Tensor | None = None
        if mean_of is not None and self.wire is None:
            kind = torch.promote_types(self.buffer.dtype, torch.float32)
            self.scale = torch.tensor(1.0 / mean_of, dtype=kind)
        self.pending = len(params)
        self.handle: Handle[torch.Tensor] | None = None

    def fill(self, slot: int, grad: torch.Tensor | None) -> None:
        """Put ``grad`` (``None``: a zero gradient, and its flag down) into
        its slot, scaled (or narrowed onto the wire)."""
        target = self.fills[slot]
        if grad is None:
            target.zero_()
            self.flags[slot] = 0
            self.unused = True
        elif grad.data_ptr() != target.data_ptr():
            if self.scale is None:
                target.copy_(grad)
            else:
                torch.mul(grad, self.scale, out=target)
        elif self.scale is not None:  # accumulated in place, in the slot
            target.mul_(self.scale)


class _Buffers:
    """A module's buffers, as ``module.buffers()`` lists them, without
    walking the module tree at every step: on a model of 50 modules the walk
    costs 25 µs warm and about 90 µs inside a backward, each step.

    What is kept is the tree's modules, each with its number of children when
    the list was made. Each step reads the buffers from those modules, so a
    buffer registered, assigned or converted (``.to()``) since is seen. The
    list is made again when a submodule or a buffer was set or registered
    anywhere in the process since (``_structure``, from torch's global
    hooks), or when a kept module's number of children changed (``del``, and
    ``ModuleList.insert``, which writes the dict directly). A module swapped
    in by writing ``module._modules[name]`` over an existing child (torch's
    quantization ``convert`` does) is seen too, because making it registered
    its buffers or children; the one change missed is such a write of a
    module made before the sync was. Every rank must list the same buffers
    (their broadcast pairs them), and so it lists what a walk would, never
    an older tree.
    """

    __slots__ = ("_made_at", "_module", "_modules")

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._modules: list[tuple[torch.nn.Module, int]] = []
        self._made_at = -1  # _structure's count when _modules was made; -1: never

    def tensors(self) -> list[torch.Tensor]:
        """The buffers' ``.data``, in ``module.buffers()`` order (each once)."""
        if self._made_at != _structure[0]:
            self._make()
        out = self._collect()
        while out is None:  # a kept module's children changed
            self._make()
            out = self._collect()
        return out

    def _make(self) -> None:
        self._made_at = _structure[0]
        self._modules = [(m, len(m._modules)) for m in self._module.modules()]

    def _collect(self) -> list[torch.Tensor] | None:
        out: list[torch.Tensor] = []
        seen: set[int] = set()
        for module, children in self._modules:
            if len(module._modules) != children:
                return None
            buffers = module._buffers
            if buffers:
                for buffer in buffers.values():
                    if buffer is not None and id(buffer) not in seen:
                        seen.add(id(buffer))
                        out.append(buffer.data)
        return out


def _views(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Consecutive views of ``flat``, one shaped like each parameter."""
    views, start = [], 0
    for param in params:
        views.append(flat[start : start + param.numel()].view_as(param))
        start += param.numel()
    return views


# Optimizers a _Stepper is stepping right now: no sync's guard refuses those
# calls. Process-wide, not per sync: an optimizer's step pre-hooks are its
# own, so a guard left by a removed sync (or one of another session's) sees
# the same step and must let it through as well.
_STEPPING: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class _Stepper:
    """Runs an optimizer's update over a part of its parameters at a time.

    Each group's ``params`` list is narrowed to the part for one call of
    ``optimizer.step()`` and restored after it; per-parameter optimizers
    (SGD, Adam, AdamW, ...) then compute exactly what one full step would.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def parts(self, bucket_of: dict[int, int], buckets: int) -> list[list[list[Any]]]:
        """Per bucket (and one more for parameters in no bucket), per group,
        the parameters it updates, in the group's own order."""
        groups = self.optimizer.param_groups
        parts: list[list[list[Any]]] = [[[] for _ in groups] for _ in range(buckets + 1)]
        for g, group in enumerate(groups):
            for param in group["params"]:
                parts[bucket_of.get(id(param), buckets)][g].append(param)
        return parts

    def step(self, part: list[list[Any]] | None) -> None:
        """``optimizer.step()`` over ``part`` (per group), or over everything."""
        if part is not None and not any(part):
            return
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        try:
            if part is not None:
                for group, params in zip(groups, part, strict=True):
                    group["params"] = params
            _STEPPING.add(self.optimizer)
            self.optimizer.step()
        finally:
            _STEPPING.discard(self.optimizer)
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params


class _Phase(enum.Enum):
    """Where a GradientSync is in its step."""

    IDLE = "idle"  # the last step finished; no backward has reached the sync since
    ACCUMULATING = "accumulating"  # backwards under no_sync() only: local gradients
    LAUNCHED = "launched"  # a synced backward reached it: buckets may be on the wire


class GradientSync:
    """Average gradients across ranks, overlapped with backward.

    Made by [DistSession.gradient_sync][asyncdist.DistSession.gradient_sync];
    await it (or ``.wait()``) after ``loss.backward()``::

        sync = session.gradient_sync(model)
        await sync.broadcast_parameters_async()  # same start on every rank
        for x, y in loader:
            loss_fn(model(x), y).backward()  # buckets reduced during backward
            await sync                       # every .grad is now the average
            opt.step(); opt.zero_grad(set_to_none=True)

    With ``gradient_sync(model, optimizer=opt)``, awaiting also updates the
    parameters, bucket by bucket as each allreduce lands (do not call
    ``opt.step()`` yourself; ``zero_grad`` and schedulers are used as usual).

    Rules that keep every rank's model the same (each broken one raises an
    [AsyncDistError][asyncdist.AsyncDistError] on the rank that broke it,
    before anything is launched):

    * a step must be finished (``await sync`` / ``sync.wait()``) before an
      optimizer steps its parameters, and before the next backward reaches
      the sync; to accumulate gradients over several
      backwards, run all but the last inside ``with sync.no_sync():``
      (awaiting a finished step again, with no backward since, changes
      nothing; a rank with no backward in a step still awaits, after
      ``zero_grad``, and joins it with no gradients);
    * with ``optimizer=``, ``opt.step()`` is the sync's to call: a manual one
      in a step that a backward has reached, or after the sync stepped, raises;
    * one live sync per parameter and per optimizer;
    * the parameters keep the dtype, device and ``requires_grad`` they had
      when the sync was made (on the session's device): convert, move, freeze
      or unfreeze the model first.

    Module buffers (BatchNorm's running statistics, anything registered with
    ``register_buffer``) are rank 0's on every rank once a synced step is
    finished, as with DDP's ``broadcast_buffers=True`` (pass
    ``broadcast_buffers=False`` to keep each rank's own).

    Parameters without ``requires_grad`` (when the sync is made) are left
    alone; a parameter that got no gradient on this rank in a step counts as
    a zero gradient, and receives the average of the others; one that got no
    gradient on any rank keeps ``.grad`` ``None`` (so the optimizer skips
    it), as with DDP's ``find_unused_parameters``. The sync lives inside its
    session: when the session ends (however it ends) its hooks come off, and
    backward is plain local autograd again. Use it as a context manager (or
    call [remove][asyncdist.GradientSync.remove]) to take them off sooner.
    """

    def __init__(self, session: Carrier, module: torch.nn.Module, options: Options) -> None:
        self._carrier = session
        self._name = f"gradient_sync of {type(module).__name__} ({id(self):#x})"
        self._module = module
        self._module_buffers = _Buffers(module)
        self._options = options
        self._params = list(options.params)
        # the parameters left out (no grad then): one that requires grad later is refused
        synced = {id(p) for p in self._params}
        self._frozen = [p for p in module.parameters() if id(p) not in synced]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._buckets: list[_Bucket] = []
        self._where: list[tuple[_Bucket, int]] = []  # by param index: (bucket, slot)
        self._start()
        self._enabled = True
        self._removed = False
        self._dropped = False  # removed with a step launched and never finished
        optimizer = options.optimizer
        self._stepper = None if optimizer is None else _Stepper(optimizer)
        # With step overlap, buckets go on the wire one at a time, in order:
        # gloo runs two collectives of a group at once, and two buckets that
        # share the link both land late, so the update of the first could not
        # run while the second is sent. Each then lands as early as the link
        # allows, and its update runs while the next one travels.
        self._serial = optimizer is not None
        # Who launches, on the lane's check (``_wakeup.one_after_another``).
        # The syncs one task (or thread) makes are one family: their hooks'
        # launches, from whatever thread autograd runs them on, come in
        # autograd's order, alike on every rank (a GAN's two models in one
        # backward, or two backward calls before one await), as DDP's
        # reducers share a process group. What a step's finish launches
        # counts as the finishing task's, so two tasks finishing syncs of one
        # family at once are refused. With step overlap a bucket launches
        # when the one before landed, at times that differ between ranks:
        # such a sync is an issuer of its own.
        self._issuer = _wakeup.own_key(self) if self._serial else _wakeup.family_key()
        self._hooks: list[Any] = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, index))  # type: ignore[no-untyped-call]
            for index, p in enumerate(self._params)
        ]
        for param in self._params:
            _LIVE_PARAMS[param] = self
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._guard))
            _LIVE_OPTIMIZERS[optimizer] = self
        _watch(self)

    def _start(self) -> None:
        """Fresh buckets over the carrier as it is now, and no step begun:
        at creation, and in each new world of an elastic session."""
        self._build(list(reversed(range(len(self._params)))))
        self._arrivals: list[int] | None = []  # recorded during the first backward
        self._ready = [False] * len(self._params)
        self._next_launch = 0
        self._landed = 0  # buckets of this step written back (and stepped)
        self._parts: list[list[list[Any]]] | None = None  # this step's optimizer parts
        # the pending bucket rebuild, with rank 0's parameter fingerprint
        self._order: Handle[tuple[list[int], int]] | None = None
        self._fingerprint: int | None = None  # this rank's, as its first synced step began
        self._buffers: Handle[None] | None = None  # this step's buffer broadcast
        self._phase = _Phase.IDLE
        self._finishing = False  # every bucket of this step is launched; awaiting them
        self._stepped = False  # the update of this step is done; a manual step would repeat it
        # each parameter's .grad as the last finished step left it, with its
        # version: while they are untouched, `await sync` again is a no-op
        self._finished: list[tuple[weakref.ref[torch.Tensor] | None, int]] | None = None

    # -- buckets ----------------------------------------------------------------------

    def _build(self, order: list[int]) -> None:
        """Pack parameters, in ``order``, into buckets of one dtype each."""
        params = [self._params[index] for index in order]
        groups = layout(
            [p.numel() * p.element_size() for p in params],
            [p.dtype for p in params],
            cap=self._options.cap,
            edge_cap=self._options.first_cap,
        )
        device, narrow = self._carrier.device, self._options.compression
        world = self._carrier.world_size
        mean_of = world if self._options.op == "mean" and world > 1 else None
        self._buckets = [
            _Bucket([params[i] for i in group], device, narrow, mean_of) for group in groups
        ]
        where = {
            self._index[id(param)]: (bucket, slot)
            for bucket in self._buckets
            for slot, param in enumerate(bucket.params)
        }
        self._where = [where[index] for index in range(len(self._params))]
        # what each parameter must still be at each step: its slot's dtype and device
        self._expected = [
            (param, bucket.slots[slot].dtype, bucket.slots[slot].device)
            for param, (bucket, slot) in zip(self._params, self._where, strict=True)
        ]

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes in each bucket, in launch order (before any compression)."""
        return [b.size for b in self._buckets]

    # -- during backward ----------------------------------------------------------------

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        """The hook of parameter ``index``: its gradient was just accumulated.

        It runs once per parameter per backward, so it is kept lean: a
        bucket is launched from here only once its last gradient is in.
        """
        grad = param.grad
        if self._removed or grad is None:
            return
        if grad.layout is not torch.strided:
            raise AsyncDistError(
                f"{self._name} on rank {self._carrier.rank}: a parameter got a "
                f"{grad.layout} gradient, and gradient_sync averages dense gradients only "
                f"(an nn.Embedding or nn.EmbeddingBag with sparse=True gives sparse ones)"
            )
        if self._carrier.closed:  # its session ended (a lane of another session's, say)
            self.remove()
            return
        phase = self._phase
        if phase is _Phase.LAUNCHED and (
            self._ready[index] or self._finishing or not self._enabled
        ):
            # buckets of the last step may be on the wire: writing into them,
            # or launching this step's, would pair wrong values across ranks
            raise self._unfinished()
        self._stepped = False  # a new step has begun
        if not self._enabled:
            if phase is _Phase.IDLE:
                self._phase = _Phase.ACCUMULATING
            return
        if phase is not _Phase.LAUNCHED:
            self._begin()
        if self._arrivals is not None:
            self._arrivals.append(index)
        bucket, slot = self._where[index]
        bucket.fill(slot, grad)
        self._ready[index] = True
        bucket.pending -= 1
        if bucket.pending == 0 or self._serial:  # serial: one may be held back
            self._launch_ready()

    def _unfinished(self) -> AsyncDistError:
        return AsyncDistError(
            f"backward reached the {self._name} on rank {self._carrier.rank} before its previous "
            f"step finished: call `await sync` (or `sync.wait()`) after every backward, before "
            f"the next one (to accumulate gradients over several backwards, run all but the "
            f"last inside `with sync.no_sync():`). Nothing of this backward was launched"
        )

    def _begin(self, *, by_task: bool = False) -> None:
        """A synced step starts: launch the buffer broadcast ahead of its
        buckets (rank 0's buffers as the forward left them; backward does not
        change buffers, and this copy is what every rank holds afterwards).
        ``by_task``: from a step's finish, not a gradient hook.

        Raises:
            AsyncDistError: a parameter changed dtype, device or
                ``requires_grad`` since the buckets were built (nothing of
                this step is launched).
        """
        self._check_parameters()
        if self._arrivals is not None and self._carrier.world_size > 1:
            # the first synced step: the replicas must start as one model
            self._fingerprint = fingerprint(self._module.parameters())
        self._phase = _Phase.LAUNCHED
        if self._options.broadcast_buffers and self._carrier.world_size > 1:
            buffers = self._module_buffers.tensors()
            if buffers:
                self._buffers = self._broadcast(buffers, src=0, by_task=by_task)

    def _check_parameters(self) -> None:
        """Refuse a step whose parameters are no longer those the buckets
        were built for: the model was converted (``.double()``), moved,
        frozen or unfrozen after the sync was made. A converted one could not
        take its average back; a frozen one would be updated from the zeros
        it averages to (momentum, weight decay), and an unfrozen one would
        train on this rank's gradient alone."""
        for param, dtype, device in self._expected:
            if param.dtype is dtype and param.requires_grad and param.device == device:
                continue
            if not param.requires_grad:
                raise self._changed(param, "no longer requires grad")
            raise self._changed(
                param,
                f"is now {param.dtype} on {param.device}, but the sync was made for "
                f"{dtype} on {device}",
            )
        for param in self._frozen:
            if param.requires_grad:
                raise self._changed(param, "requires grad now, but did not when the sync was made")

    def _check_held(self) -> None:
        """Refuse a step over parameters the module no longer holds: after
        ``load_state_dict(..., assign=True)`` backward reaches new parameter
        objects, without hooks, and trains on each rank's own gradients.
        Checked only in a step that no synced backward reached (walking the
        module costs tens of µs); a submodule replaced alone, while the rest
        still reach the sync, is not caught (as DDP does not catch it)."""
        held = {id(p) for p in self._module.parameters()}
        replaced = sum(id(p) not in held for p in self._params)
        if replaced:
            raise AsyncDistError(
                f"{self._name} on rank {self._carrier.rank}: {replaced} of its "
                f"{len(self._params)} parameters are no longer the module's (replaced by "
                f"load_state_dict(..., assign=True), or by a submodule assigned anew), so "
                f"backward no longer reaches the sync and gradients would not be averaged. "
                f"Make the sync after loading (or remove() this sync and make a new one); "
                f"load_state_dict without assign=True copies into the same parameters. "
                f"Nothing of this step was launched"
            )

    def _changed(self, param: torch.Tensor, what: str) -> AsyncDistError:
        names = (repr(n) for n, p in self._module.named_parameters() if p is param)
        name = next(names, f"of shape {tuple(param.shape)} (no longer in the module)")
        return AsyncDistError(
            f"{self._name} on rank {self._carrier.rank}: parameter {name} {what}. Make "
            f"the sync after converting, moving, freezing or unfreezing the model (or "
            f"remove() this sync and make a new one). Nothing of this step was launched"
        )

    def _launch_ready(self, *, everything: bool = False) -> None:
        """Launch buckets in order while the next one is complete (with step
        overlap, and the one before it no longer on the wire); ``everything``
        (a step's finish, not a gradient hook): complete or not."""
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.pending > 0 and not everything:
                return
            if self._serial and self._next_launch > 0:
                before = self._buckets[self._next_launch - 1].handle
                if before is not None and not before.done():
                    return
            if bucket.pending > 0:  # no gradient arrived (this step) for some parameters
                for slot, param in enumerate(bucket.params):
                    if not self._ready[self._index[id(param)]]:
                        bucket.fill(slot, param.grad)  # accumulated under no_sync() only
            with self._issuing(by_task=everything):
                bucket.handle = self._launch(bucket)
            self._next_launch += 1

    def _issuing(self, *, by_task: bool) -> contextlib.AbstractContextManager[None]:
        """Launches inside the block count as this sync's (see ``__init__``):
        its family's from a gradient hook, on whatever thread autograd runs
        it; ``by_task`` (finishing a step, broadcasting parameters), the
        calling task's for its family."""
        if self._serial or not by_task:
            return issuing_as(self._issuer, self._name)
        by = _wakeup.current_issuer()
        return issuing_as((*self._issuer, *_wakeup.issuer_key()), f"{self._name} ({by})")

    def _launch(self, bucket: _Bucket) -> Handle[torch.Tensor]:
        if bucket.wire is None:
            # a mean's gradients were scaled as they came in: the sum is the mean
            op = self._options.op if bucket.scale is None else "sum"
            return self._carrier.allreduce(bucket.buffer, op=op)
        # DDP's compress hooks: narrow (done as the gradients came in),
        # pre-divide (so fp16 cannot overflow), sum
        if self._options.op == "mean":
            bucket.wire.div_(self._carrier.world_size)
        return self._carrier.allreduce(bucket.wire, op="sum")

    # -- finishing a step ---------------------------------------------------------------

    def _finish(self) -> Iterator[Handle[Any]]:
        """Finish this step, yielding each handle to wait on (sync and async
        callers share it). Progress lives on ``self``, so a cancelled await
        resumes where it stopped."""
        if self._order is None:
            try:
                if self._phase is not _Phase.LAUNCHED:
                    self._check_held()  # backward does not reach replaced parameters' hooks
                    if self._phase is _Phase.IDLE and self._untouched():
                        return  # this step is finished already: awaiting it again changes nothing
                    self._begin(by_task=True)  # no synced backward: reduce what there is
                self._launch_ready(everything=True)
            finally:
                # the wait began, even where a launch raised (its caller was told)
                self._finishing = self._phase is _Phase.LAUNCHED
            if self._buffers is not None:
                yield self._buffers  # launched first, so it lands first
                self._buffers = None
            stepper, clip = self._stepper, self._options.clip_grad_norm
            if stepper is not None and self._parts is None:
                bucket_of = {
                    id(p): b for b, bucket in enumerate(self._buckets) for p in bucket.params
                }
                self._parts = stepper.parts(bucket_of, len(self._buckets))
            while self._landed < len(self._buckets):
                bucket = self._buckets[self._landed]
                self._launch_ready(everything=True)  # serial: now that the one before landed
                assert bucket.handle is not None
                yield bucket.handle
                self._launch_ready(everything=True)  # serial: the next, before this update
                self._land(bucket)
                if stepper is not None and self._parts is not None and clip is None:
                    stepper.step(self._parts[self._landed])
                self._landed += 1
            if stepper is not None and self._parts is not None:
                self._finish_step(stepper, clip, self._parts)
            self._ready = [False] * len(self._params)
            self._next_launch = self._landed = 0
            self._parts = None
            self._order = self._rank0_order()
        if self._order is not None:  # the step is not over until the rebuild
            yield self._order
            pending, self._order = self._order, None
            order, rank0 = pending.wait()  # already complete
            self._build(order)
            mine, self._fingerprint = self._fingerprint, None
            if mine is not None and mine != rank0:
                # told, not raised: averaging gradients of unlike models is legal,
                # only almost never meant
                logger.warning(
                    "%s on rank %d: this rank's parameters differed from rank 0's when "
                    "the first synced step began, so the replicas are not one model and "
                    "averaging gradients will not make them one. Call "
                    "`sync.broadcast_parameters()` (`await sync.broadcast_parameters_async()`) "
                    "once before training, as DDP's constructor does, or load the same "
                    "weights on every rank",
                    self._name,
                    self._carrier.rank,
                )
        self._phase, self._finishing = _Phase.IDLE, False
        # weakly: a dropped gradient (zero_grad(set_to_none=True)) must not
        # keep its bucket's memory alive (after the first step's rebuild)
        self._finished = [
            (None, -1) if grad is None else (weakref.ref(grad), grad._version)
            for grad in (param.grad for param in self._params)
        ]

    def _untouched(self) -> bool:
        """Whether every ``.grad`` is as the last finished step left it: no
        backward, ``zero_grad`` or write since (a rank that skipped backward
        after ``zero_grad`` still joins the step, with no gradients)."""
        finished = self._finished
        if finished is None:
            return False
        for param, (ref, version) in zip(self._params, finished, strict=True):
            grad = param.grad
            if ref is None:
                if grad is not None:
                    return False
            elif grad is None or grad is not ref() or grad._version != version:
                return False
        return True

    def _land(self, bucket: _Bucket) -> None:
        """Point each ``.grad`` at its averaged slot of the bucket (no copy).

        Like DDP's ``gradient_as_bucket_view``: with ``zero_grad(set_to_none=
        False)`` the next backward accumulates straight into the bucket, and
        with ``set_to_none=True`` the hook copies the fresh gradient in.
        """
        if bucket.wire is not None:
            bucket.buffer.copy_(bucket.wire)  # back to full precision
        # a parameter with no gradient on any rank keeps .grad None; where
        # this rank had every gradient, so did the sum
        used = bucket.flags.tolist() if bucket.unused else None
        for slot, param in enumerate(bucket.params):
            if used is None or used[slot] != 0:
                param.grad = bucket.slots[slot]
        bucket.flags.fill_(1)
        bucket.handle = None
        bucket.pending = len(bucket.params)
        bucket.unused = False

    def _finish_step(
        self, stepper: _Stepper, clip: float | None, parts: list[list[list[Any]]]
    ) -> None:
        """The update's last part: the optimizer's parameters in no bucket,
        or, when clipping, everything (the global norm needs every bucket)."""
        if clip is None:
            stepper.step(parts[-1])
        else:
            torch.nn.utils.clip_grad_norm_(self._module.parameters(), clip)
            stepper.step(None)
        self._stepped = True

    def _guard(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook: only the sync steps it."""
        if optimizer in _STEPPING:
            return
        name = type(optimizer).__name__
        if self._stepped:
            raise AsyncDistError(
                f"{name}.step() called after `await sync` already stepped it: "
                f"gradient_sync(optimizer=...) updates the parameters itself, bucket by "
                f"bucket; remove the optimizer.step() call"
            )
        if self._phase is not _Phase.IDLE:
            raise AsyncDistError(
                f"{name}.step() called before the {self._name} finished the step (the "
                f"gradients are not averaged yet): with gradient_sync(optimizer=...), "
                f"`await sync` (or `sync.wait()`) runs the update itself; remove the "
                f"optimizer.step() call"
            )

    def _rank0_order(self) -> Handle[tuple[list[int], int]] | None:
        """After the first step: every rank's bucket order, taken from rank 0's
        observed arrival order (buckets must be alike on every rank), and
        rank 0's parameter fingerprint from that step's start."""
        arrivals, self._arrivals = self._arrivals, None
        if arrivals is None:
            return None
        seen = set(arrivals)
        order = list(dict.fromkeys(arrivals)) + [
            i for i in reversed(range(len(self._params))) if i not in seen
        ]
        mine = -1 if self._fingerprint is None else self._fingerprint
        with self._issuing(by_task=True):
            return self._carrier.broadcast_object((order, mine), src=0, allowed=[])

    def __repr__(self) -> str:
        state = "removed" if self._removed else self._phase.value
        return f"<GradientSync of {type(self._module).__name__} {state}>"

    @property
    def pending(self) -> bool:
        """True while a synced backward has launched a step that is not yet
        finished (``await sync`` / ``sync.wait()`` finishes it)."""
        return self._phase is _Phase.LAUNCHED

    def wait(self) -> None:
        """Block until every bucket is reduced and gradients are written back
        (and, with ``optimizer=``, the parameters updated). Again, with no
        backward since, it returns at once; inside ``no_sync()`` it does nothing.

        Raises:
            SessionClosed: the session that made the sync has ended (its
                hooks came off with it: gradients are no longer averaged).
            AsyncDistError: the sync was removed with a step launched and
                never finished (that step's gradients were not averaged).
        """
        if self._removed:
            self._refuse_removed()
        elif self._enabled:
            for handle in self._finish():
                handle.wait()

    async def _wait_async(self) -> None:
        awaited = False
        if self._enabled and not self._removed:
            for handle in self._finish():
                await handle  # on trio, a checkpoint even when done
                awaited = True
        if not awaited and _wakeup.on_trio():  # trio's rule: every await is a checkpoint
            await _wakeup.trio_checkpoint()
        if self._removed:
            self._refuse_removed()

    def _refuse_removed(self) -> None:
        """Waiting on a removed sync: an error where gradients a caller
        expects averaged are not; else nothing (``remove()`` was meant)."""
        rank = self._carrier.rank
        if self._carrier.closed:
            raise SessionClosed(
                f"{self._name} on rank {rank}: its session has ended, and its hooks came "
                f"off with it, so gradients are no longer averaged (backward is plain "
                f"local autograd). Use the sync inside the session that made it"
            )
        if self._dropped:
            self._dropped = False  # told once
            raise AsyncDistError(
                f"{self._name} on rank {rank} was removed with a step launched and not "
                f"finished: that step's gradients were not averaged. Finish the step "
                f"(`await sync`) before remove()"
            )

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

    def _broadcast(self, tensors: list[torch.Tensor], src: int, *, by_task: bool) -> Handle[None]:
        """Launch the broadcasts of ``tensors``, one flat buffer per dtype;
        waiting copies the received values back (on the waiting thread).
        ``by_task``: as ``_issuing``'s."""
        groups = list(_ops.by_dtype(tensors).values())
        flats = [_ops.pack(group, self._carrier.device) for group in groups]
        with self._issuing(by_task=by_task):
            parts = [self._carrier.broadcast(flat, src=src) for flat in flats]

        def copy_back(received: list[torch.Tensor]) -> None:
            for flat, group in zip(received, groups, strict=True):
                _ops.unpack(flat, group)

        return combined("broadcast_parameters", parts, copy_back)

    def _broadcast_parameters(self, src: int) -> Handle[None]:
        tensors = [p.data for p in self._module.parameters()]
        tensors += [b.data for b in self._module.buffers()]
        return self._broadcast(tensors, src, by_task=True)

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
        """Take the hooks off the module (and the optimizer): backward is plain
        local autograd again. Idempotent; the session calls it when it ends."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if not self._removed and self._phase is _Phase.LAUNCHED:
            self._dropped = True
        self._removed = True
        self._phase, self._finishing = _Phase.IDLE, False  # nothing will finish it now
        for param in self._params:
            if _live(_LIVE_PARAMS, param) is self:
                del _LIVE_PARAMS[param]
        optimizer = self._options.optimizer
        if optimizer is not None and _live(_LIVE_OPTIMIZERS, optimizer) is self:
            del _LIVE_OPTIMIZERS[optimizer]
        _unwatch(self)

    def __enter__(self) -> GradientSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def buckets_of(sync: GradientSync) -> tuple[_Bucket, ...]:
    """The buckets of ``sync``, in launch order (each with its ``buffer``,
    its ``wire`` copy when compressed, and its ``handle`` while a step is in
    flight). A seam for tests and tools, not API."""
    return tuple(sync._buckets)


def module_of(sync: GradientSync) -> torch.nn.Module:
    """The module ``sync`` averages the gradients of."""
    return sync._module


def optimizer_of(sync: GradientSync) -> torch.optim.Optimizer | None:
    """The optimizer ``sync`` steps (``optimizer=``), if any."""
    return sync._options.optimizer


def regenerate(syncs: weakref.WeakSet[GradientSync]) -> None:
    """A new world of an elastic session: every sync starts afresh on its
    carrier's new lane (new buckets for the new world size; the step that
    was in flight is dropped, and its buckets with it, so a late write of
    the old world lands nowhere the new one reads). Parameters are not
    broadcast: the session restores the committed state on every rank."""
    for sync in syncs:
        if not sync._removed:
            sync._start()


def detach(syncs: weakref.WeakSet[GradientSync], *, rank: int, warn: bool) -> None:
    """Take every sync's hooks off its module (its session ends: backward
    afterwards is plain local autograd). ``warn``: the session ends
    normally, so a sync mid-step is worth a warning (else the exception is
    the news). A step whose wait began and did not end (it raised, or was
    cancelled) is not: the caller saw that."""
    for sync in list(syncs):
        if sync.pending and warn and not sync._finishing:
            logger.warning(
                "rank %d: %r ends with the session mid-step: its last backward was "
                "never followed by `await sync` / `sync.wait()`, so those gradients were "
                "not averaged",
                rank,
                sync,
            )
        sync.remove()
    syncs.clear()
    _unwatch(None)  # also if a sync was dropped without remove()
