"""Drop-in replacement for DI-engine's later ``pytorch_ddp_dist_helper``
(``ding.utils``, v0.2 onwards: what ``pip install di-engine`` gives).

After v0.1.0 the helper changed one meaning and grew names:
``allreduce(x)`` takes one tensor and leaves the **mean** (the sum divided by
the world size), where v0.1's ([asyncdist.compat.allreduce][asyncdist.compat.allreduce]) was
``torch.distributed.all_reduce``, a sum. ``allreduce_async``,
``synchronize`` (v0.2), ``allreduce_data``, ``reduce_data``,
``broadcast_object_list``, ``to_ddp_config`` (v0.4.9) and
``allreduce_with_indicator`` (after v0.5.3) are new; ``DistContext`` was
renamed ``DDPContext`` (v0.4.9, both names are here); ``dist_init`` takes a
``timeout`` (after v0.5.3).

The helper's bugs are fixed here the way [asyncdist.compat][asyncdist.compat] fixes
v0.1's, and these:

* ``allreduce_async(name, x)`` dropped its work handle and ``synchronize``
  was ``torch.cuda.synchronize``, which on CPU waits for nothing: a race.
  Here it returns the [Handle][asyncdist.Handle] and remembers it;
  ``synchronize`` waits for every async op launched through compat, on
  CPU and GPU alike.
* ``allreduce_data``/``reduce_data`` moved numbers to ``.cuda()``; here they
  go to the session's device. ``allreduce_data(n, "avg")`` of an ``int``
  crashed after the collective; here it returns a ``float``.
* ``dist_finalize`` did nothing from v0.4.5 (destroying the group "usually
  hangs"); here it releases the group, without the barrier that hung.
* ``DDPContext``/``DistContext`` return the session; ``dist_init`` works
  without CUDA.
* Bad input (a wrong type, an op other than ``"sum"``/``"avg"``, an integer
  tensor to average) raises on the calling rank before anything is launched.
* ``error_wrapper(fn, default_ret, warning_msg)`` raised a ``TypeError``
  from its handler when given a message (it passed two arguments to the
  one-argument ``one_time_warning``); here it returns ``default_ret`` and
  logs the warning.

To run DI-engine itself on asyncdist without editing it, see ``install``.
"""

from __future__ import annotations

import datetime
import importlib
import math
import numbers
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping, MutableSequence
from types import ModuleType, TracebackType
from typing import Any, TypeVar, cast

import torch

from .._handle import Handle
from .._ops import check_tensor
from .._session import DistSession
from ..errors import AsyncDistError
from . import _shared
from ._shared import (
    allgather,
    broadcast,
    dist_finalize,
    get_group,
    get_rank,
    get_world_size,
    simple_group_split,
)

__all__ = [
    "HELPER_NAMES",
    "DDPContext",
    "DistContext",
    "Installation",
    "allgather",
    "allreduce",
    "allreduce_async",
    "allreduce_data",
    "allreduce_with_indicator",
    "broadcast",
    "broadcast_object_list",
    "dist_finalize",
    "dist_init",
    "dist_mode",
    "error_wrapper",
    "get_group",
    "get_rank",
    "get_world_size",
    "install",
    "keep_grad_accumulators",
    "reduce_data",
    "simple_group_split",
    "synchronize",
    "to_ddp_config",
    "uninstall",
]

F = TypeVar("F", bound=Callable[..., Any])
Number = int | float

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60000)  # the helper's own default

# allreduce_with_indicator leaves grad alone when the summed indicator is this
# close to zero, as the helper's torch.isclose(indicator, 0) did
_INDICATOR_ATOL = 1e-8


def error_wrapper(
    fn: Callable[..., Any], default_ret: Any, warning_msg: str | None = None
) -> Callable[..., Any]:
    """Wrap ``fn`` so that an ``Exception`` inside it returns ``default_ret``.

    The later helper's form (DI-engine's ``ding.utils.error_wrapper``): with
    a ``warning_msg`` (neither ``None`` nor ``""``), a failure logs a warning
    (``asyncdist.compat`` logger) reading ``warning_msg``, then
    ``"\\ndefault_ret = <default_ret>\\terror = <the exception>"``, once per
    distinct text, as DI-engine's ``one_time_warning`` meant to (its own
    call passes it two arguments and raises a ``TypeError`` in the handler).
    The exception is always logged at debug level. Use it for optional
    probes, not for initialisation.
    """
    return _shared.wrap_errors(fn, default_ret, warning_msg)


def _session(op: str) -> DistSession:
    return _shared.session_for(None, op)


# -- reductions ---------------------------------------------------------------------------


def allreduce(x: torch.Tensor) -> None:
    """Average ``x`` in place over every rank: the sum divided by the world size.

    This is the later helper's meaning (v0.1's ``allreduce`` summed).

    Raises:
        TypeError, ValueError: ``x`` is not a floating tensor the session can
            carry (nothing is launched).
    """
    target = _session("allreduce")
    with _shared.issuing():
        handle = target.allreduce(x, "mean")
    handle.wait()


def allreduce_async(name: str, x: torch.Tensor) -> Handle[torch.Tensor]:
    """Start averaging ``x`` in place over every rank; return its handle.

    As in the later helper, ``x`` is divided by the world size at once and
    then summed, so it holds the mean as soon as the collective completes,
    however the caller waits: the handle, ``synchronize``, or torch itself
    (a ``torch.distributed.barrier()``, a later collective's ``wait()``).

    ``name`` (the parameter's name in DI-engine) only labels the call. The
    handle is also remembered: ``synchronize`` waits for it, so the
    helper's pattern (launch from gradient hooks, then ``synchronize()``)
    is race-free.

    Raises:
        TypeError, ValueError: bad ``name``, or ``x`` is not a floating
            tensor the session can carry (``x`` untouched, nothing launched).
        AsyncDistError: the session cannot launch (closed or broken); ``x``
            is multiplied back (exactly for a power-of-two world size).
    """
    op = "allreduce_async"
    if not isinstance(name, str):
        raise TypeError(f"{op}: name must be a str, not {type(name).__name__}")
    target = _session(op)
    check_tensor(x, collective=op, backend=target.backend, device=target.device, what="x")
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{op}: x must be a floating tensor to average, not {x.dtype}")
    world = target.world_size
    x.div_(world)
    try:
        with _shared.issuing():
            handle = target.allreduce(x, "sum")
    except BaseException:
        x.mul_(world)
        raise
    return _shared.track(handle)


def synchronize(device: Any = None) -> None:
    """Wait for every async op launched through compat (``allreduce_async``,
    ``async_op=True`` calls), then, where CUDA is in use, for the device
    (``torch.cuda.synchronize(device)``, what the helper's ``synchronize`` was).

    Raises:
        AsyncDistError: one of those ops failed (the first, in issue order).
    """
    _shared.wait_pending()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize(device)


def allreduce_with_indicator(grad: torch.Tensor, indicator: torch.Tensor) -> None:
    """Sum ``grad`` and ``indicator`` over every rank, in place, then divide
    ``grad`` by the summed indicator unless that is (close to) zero.

    With ``indicator`` 1 on ranks that computed a gradient and 0 elsewhere,
    ``grad`` becomes the mean over the contributing ranks only.

    Raises:
        TypeError, ValueError: ``grad`` is not a floating tensor, or
            ``indicator`` not a one-element tensor, the session can carry
            (checked for both before either is launched).
    """
    op = "allreduce_with_indicator"
    target = _session(op)
    for what, tensor in (("grad", grad), ("indicator", indicator)):
        check_tensor(tensor, collective=op, backend=target.backend, device=target.device, what=what)
    if not (grad.is_floating_point() or grad.is_complex()):
        raise TypeError(f"{op}: grad must be a floating tensor to divide, not {grad.dtype}")
    if indicator.numel() != 1:
        raise ValueError(f"{op}: indicator must hold one element, not {indicator.numel()}")
    with _shared.issuing():
        summed_grad = target.allreduce(grad, "sum")
        summed_indicator = target.allreduce(indicator, "sum")
    summed_grad.wait()
    contributors = float(summed_indicator.wait().item())
    if abs(contributors) > _INDICATOR_ATOL:
        grad.div_(contributors)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real)


def _number_tensor(x: Any, target: DistSession, *, floating: bool) -> torch.Tensor:
    exact = isinstance(x, numbers.Integral) and not floating
    dtype = torch.int64 if exact else torch.float64
    return torch.tensor([int(x) if exact else float(x)], dtype=dtype, device=target.device)


def allreduce_data(x: Number | torch.Tensor, op: str) -> Number | torch.Tensor:
    """Sum (``op="sum"``) or average (``"avg"``) ``x`` over every rank.

    A tensor is reduced in place and returned. A number (``int``, ``float``,
    a numpy scalar) travels as a one-element tensor on the session's device
    and comes back as a number: an ``int`` for an integer sum, else a
    ``float``.

    Raises:
        ValueError: ``op`` is neither ``"sum"`` nor ``"avg"``.
        TypeError: ``x`` is neither a number nor a tensor, or an integer
            tensor is to be averaged (nothing is launched).
    """
    name = "allreduce_data"
    if op not in ("sum", "avg"):
        raise ValueError(f"{name}: op must be 'sum' or 'avg', not {op!r}")
    reduce_op = "sum" if op == "sum" else "mean"
    target = _session(name)
    if isinstance(x, torch.Tensor):
        with _shared.issuing():
            handle = target.allreduce(x, reduce_op)
        return handle.wait()
    if not _is_number(x):
        raise TypeError(f"{name}: x must be a number or a tensor, not {type(x).__name__}")
    tensor = _number_tensor(x, target, floating=op == "avg")
    with _shared.issuing():
        handle = target.allreduce(tensor, reduce_op)
    result: Number = handle.wait().item()
    return result


def reduce_data(x: Number | torch.Tensor, dst: int) -> Number | torch.Tensor:
    """Sum ``x`` over every rank into rank ``dst``.

    A tensor is reduced in place and returned (its value is meaningful on
    ``dst`` only, as with ``torch.distributed.reduce``). A number travels as
    a one-element tensor on the session's device; ``dst`` gets the sum back
    as a number, every other rank its own ``x`` unchanged.

    Raises:
        TypeError: ``x`` is neither a number nor a tensor, or ``dst`` not an int.
        ValueError: ``dst`` is not a rank (nothing is launched).
    """
    name = "reduce_data"
    target = _session(name)
    root = _shared.group_rank(target, dst, name, "dst")
    if isinstance(x, torch.Tensor):
        with _shared.issuing():
            handle = target.reduce(x, root, "sum")
        return handle.wait()
    if not _is_number(x):
        raise TypeError(f"{name}: x must be a number or a tensor, not {type(x).__name__}")
    tensor = _number_tensor(x, target, floating=False)
    with _shared.issuing():
        handle = target.reduce(tensor, root, "sum")
    reduced: Number = handle.wait().item()
    return reduced if target.rank == root else x


def broadcast_object_list(
    object_list: MutableSequence[Any], src: int = 0, group: Any = None, device: Any = None
) -> None:
    """Replace ``object_list``'s contents on every rank of ``group`` by rank
    ``src``'s (``torch.distributed.broadcast_object_list``).

    The objects travel pickled on asyncdist's object lane (``device`` is
    accepted and not needed), and need no numpy. Unpickling trusts the
    sender, as torch's does.

    Raises:
        TypeError: ``object_list`` is not a list, or an object cannot be
            pickled (on ``src``).
        ValueError: ``src`` is not a rank of ``group``.
    """
    name = "broadcast_object_list"
    target = _shared.session_for(group, name)
    if not isinstance(object_list, MutableSequence):
        raise TypeError(f"{name}: object_list must be a list, not {type(object_list).__name__}")
    root = _shared.group_rank(target, src, name, "src")
    mine = target.rank == root
    with _shared.issuing():
        handle = target.broadcast_object(list(object_list) if mine else None, src=root)
    received = handle.wait()
    if not mine:
        object_list[:] = received


# -- set-up -------------------------------------------------------------------------------


def dist_init(
    backend: str | None = None,
    addr: str | None = None,
    port: int | str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
) -> tuple[int, int]:
    """Initialise the default process group; return ``(rank, world_size)``.

    Arguments left ``None`` come from the launch environment (torchrun, SLURM)
    or default to a 1-process world on loopback with a free port; ``backend``
    ``None`` picks NCCL with CUDA, else gloo, and ``"nccl"`` without CUDA falls
    back to gloo (logged). ``timeout`` (seconds or a ``timedelta``; default
    60000 s, the helper's) bounds forming the group and every collective.

    Raises:
        ValueError: ``backend`` is neither ``"nccl"`` nor ``"gloo"``.
        AsyncDistError: already initialised by ``dist_init``.
        InitError: the group could not be formed.
        TypeError, ValueError: ``port`` is not a port number.
    """
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"dist_init: backend must be 'nccl' or 'gloo', not {backend!r}")
    session = _shared.open_session(backend, addr, port, rank, world_size, timeout)
    return session.rank, session.world_size


def dist_mode(func: F) -> F:
    """[asyncdist.compat.dist_mode][asyncdist.compat.dist_mode] around this
    release's ``dist_init`` (and its default ``timeout``)."""
    return _shared.dist_mode(dist_init)(func)


class DDPContext(_shared.Context):
    """``with DDPContext() as session:``: ``dist_init`` on entry,
    ``dist_finalize`` on exit, however the block ends.

    Entering returns the [DistSession][asyncdist.DistSession] (the helper's
    returned ``None``). The arguments, all optional, are ``dist_init``'s.
    """

    _default_timeout = DEFAULT_TIMEOUT


class DistContext(DDPContext):
    """``DDPContext`` under the name it had from v0.2 to v0.4.8.

    A class of its own, so that ``install`` can tell the two names apart.
    """


def _get(node: Any, key: str) -> Any:
    return node[key] if isinstance(node, Mapping) else getattr(node, key)


def _has(node: Any, key: str) -> bool:
    return key in node if isinstance(node, Mapping) else hasattr(node, key)


def _set(node: Any, key: str, value: Any) -> None:
    if isinstance(node, MutableMapping):
        node[key] = value
    else:
        setattr(node, key, value)


def to_ddp_config(cfg: Any) -> Any:
    """Divide a DI-engine config's per-process sizes by the world size, rounding up.

    ``cfg.policy.batch_size``, ``cfg.policy.learn.batch_size``,
    ``cfg.policy.collect.n_sample`` and ``cfg.policy.collect.n_episode``
    (those present) become ``ceil(value / world_size)``, in place; returns
    ``cfg``. Works on an ``EasyDict``, a plain nested ``dict`` or attribute
    objects; a missing ``learn``/``collect`` section is skipped.
    """
    world = get_world_size()
    policy = _get(cfg, "policy")
    for section, key in (
        (None, "batch_size"),
        ("learn", "batch_size"),
        ("collect", "n_sample"),
        ("collect", "n_episode"),
    ):
        if section is not None and not _has(policy, section):
            continue
        node = policy if section is None else _get(policy, section)
        if _has(node, key):
            _set(node, key, math.ceil(_get(node, key) / world))
    return cfg


def keep_grad_accumulators(module: torch.nn.Module) -> list[Any]:
    """Keep ``module``'s gradient-accumulator nodes alive; hold the returned list.

    Not in the helper: a fix for its caller. DI-engine's
    ``Policy._init_multi_gpu_setting(model, bp_update_sync=False)`` registers
    its ``allreduce_async`` hooks on these nodes without keeping them; torch
    frees them when that method returns, and the hooks never run (gradients
    are never averaged, on any backend). Call this before the policy is
    created (``DistributedDataParallel`` keeps them the same way) and hold the
    list as long as the model trains.
    """
    # a view's grad_fn leads to the parameter's accumulator node
    return [
        cast(Any, p.expand_as(p).grad_fn).next_functions[0][0]
        for p in module.parameters()
        if p.requires_grad
    ]


# -- running DI-engine on asyncdist -------------------------------------------------------

HELPER = "ding.utils.pytorch_ddp_dist_helper"
# every name of __all__ is the helper's but these, asyncdist's own (error_wrapper
# is the helper's too, but DI-engine's general utility: install leaves it)
_NOT_REPLACED = frozenset(
    {
        "HELPER_NAMES",
        "Installation",
        "error_wrapper",
        "install",
        "keep_grad_accumulators",
        "uninstall",
    }
)
HELPER_NAMES = tuple(name for name in __all__ if name not in _NOT_REPLACED)
"""The helper's names ``install`` replaces (its ``error_wrapper`` is
DI-engine's general utility and stays)."""


def _modules(packages: tuple[str, ...]) -> list[ModuleType]:
    return [
        module
        for name, module in list(sys.modules.items())
        if isinstance(module, ModuleType)
        and any(name == p or name.startswith(p + ".") for p in packages)
    ]


def _rebind(packages: tuple[str, ...], swaps: dict[int, tuple[Any, Any]]) -> int:
    """In every module of ``packages``, bind each attribute that *is* a key
    object of ``swaps`` to its replacement; return how many were rebound."""
    count = 0
    for module in _modules(packages):
        for attr, value in list(vars(module).items()):
            swap = swaps.get(id(value))
            if swap is not None and swap[0] is value:
                setattr(module, attr, swap[1])
                count += 1
    return count


class Installation:
    """DI-engine's helper names rebound to asyncdist's, until ``undo``.

    Returned by ``install``; also a context manager that undoes on exit.
    """

    __slots__ = ("_active", "_packages", "_swaps", "rebound")

    def __init__(self, packages: tuple[str, ...], swaps: dict[int, tuple[Any, Any]]) -> None:
        self._packages = packages
        self._swaps = swaps
        self._active = True
        self.rebound = 0
        """How many module attributes ``install`` rebound."""

    @property
    def active(self) -> bool:
        """True until ``undo``."""
        return self._active

    def undo(self) -> None:
        """Bind DI-engine's own helper back wherever asyncdist's is bound in
        ``packages``, including modules imported since ``install``.
        Idempotent."""
        global _installed
        if not self._active:
            return
        back = {id(ours): (ours, theirs) for theirs, ours in self._swaps.values()}
        _rebind(self._packages, back)
        self._active = False
        if _installed is self:
            _installed = None

    def __enter__(self) -> Installation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<asyncdist.compat.ding.Installation {state}, {self.rebound} bindings>"


# Process-wide, as what it undoes is: install rebinds attributes of the
# modules in sys.modules, so at most one installation is active per process.
_installed: Installation | None = None


def install(packages: Iterable[str] = ("ding",)) -> Installation:
    """Make DI-engine run its distributed code on asyncdist, without editing it.

    DI-engine's modules import the helper's names at import time (``from
    ding.utils import allreduce``), so replacing them in one place is not
    enough. ``install`` imports ``ding.utils``, then in every module already
    imported from ``packages`` (default ``("ding",)``; add e.g. ``"lzero"``
    or ``"__main__"`` for code of your own that imported the names) binds
    each attribute that *is* one of the helper's ``HELPER_NAMES`` objects
    to this module's namesake, under whatever name it was imported.
    ``ding.utils`` and the helper module themselves are rebound, so modules
    imported later get asyncdist's names too.

    Call it before DI-engine calls ``dist_init``/enters ``DDPContext``;
    ``with install():`` or ``Installation.undo`` (or ``uninstall``)
    puts DI-engine's own helper back. Code calling ``torch.cuda`` directly
    (``ddp_termination_checker``'s ``.cuda()``, ``learner_hook``'s
    ``torch.cuda.current_device()``) still needs CUDA.

    Raises:
        ModuleNotFoundError: DI-engine is not installed.
        AsyncDistError: already installed, or DI-engine runs on linklink
            (``ENABLE_LINKLINK``), whose helper this does not replace.
    """
    global _installed
    if _installed is not None and _installed.active:
        raise AsyncDistError(
            "install: asyncdist is already installed into DI-engine; undo it first"
        )
    scanned = tuple(packages)
    if isinstance(packages, str) or not all(isinstance(p, str) and p for p in scanned):
        raise TypeError("install: packages must be an iterable of package names")
    ding = importlib.import_module("ding")
    if getattr(ding, "enable_linklink", False):
        raise AsyncDistError(
            "install: DI-engine runs on linklink (ENABLE_LINKLINK=true); asyncdist replaces "
            "its torch.distributed helper only"
        )
    importlib.import_module("ding.utils")
    helper = importlib.import_module(HELPER)
    ours = sys.modules[__name__]
    swaps = {
        id(theirs): (theirs, getattr(ours, name))
        for name in HELPER_NAMES
        if (theirs := getattr(helper, name, None)) is not None
    }
    installation = Installation(scanned, swaps)
    installation.rebound = _rebind(scanned, swaps)
    _installed = installation
    return installation


def uninstall() -> None:
    """Undo the active ``install``, if any. Idempotent."""
    if _installed is not None:
        _installed.undo()
