"""Elastic sessions: the state that survives a re-form, and the loop over worlds.

``ElasticState`` holds what training needs to go on (modules, optimizers,
schedulers: anything with ``state_dict``/``load_state_dict``; plain values as
attributes) and its last committed copy, in memory. ``Worlds`` is what
``DistSession.elastic(state)`` returns: each ``World`` it yields is one
membership of the session; the body runs inside ``with world:`` (or
``async with world:``), which catches the failure that ends a world so the
loop can re-form. (An exception raised in a ``for`` body never reaches the
iterator: hence the block.)
"""

from __future__ import annotations

import copy
import enum
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import AsyncDistError, MembershipChanged

logger = logging.getLogger("asyncdist")


class ElasticState:
    """Training state that an elastic session restores after a re-form.

    Made by [DistSession.elastic_state][asyncdist.DistSession.elastic_state].
    ``commit()`` copies it in memory; after a re-form every rank holds the
    latest commit any survivor made (sent from the new rank 0), loaded in
    place: the same module and optimizer objects, with the committed values.
    """

    def __init__(
        self,
        items: dict[str, Any],
        busy: Callable[[str], str | None],
        ends_at: Callable[[int], str | None] = lambda commits: None,
        rank: Callable[[], int] = lambda: 0,
    ) -> None:
        objects, values = {}, {}
        for name, item in items.items():
            if isinstance(item, type):
                raise TypeError(
                    f"elastic_state: {name}= is the class {item.__name__}, not an object of "
                    "it: pass the module, optimizer or scheduler itself (an instance)"
                )
            if callable(getattr(item, "state_dict", None)) and callable(
                getattr(item, "load_state_dict", None)
            ):
                objects[name] = item
            elif callable(item) or isinstance(item, torch.Tensor):
                raise TypeError(
                    f"elastic_state: {name}= must have state_dict()/load_state_dict() (a "
                    f"module, optimizer, scheduler...) or be a plain value (a number, a "
                    f"string, a list...), not {type(item).__name__}"
                )
            elif _holds_tensor(item):
                # e.g. model.state_dict() or list(model.parameters()): a plain
                # value is restored as a value, never loaded into the model
                raise TypeError(
                    f"elastic_state: {name}= holds tensors (in a {type(item).__name__}); as "
                    "a plain value it would be restored apart from the objects they came "
                    "from, never loaded into them. Pass the module or optimizer object "
                    f"itself ({name}=model, not {name}=model.state_dict() or "
                    "list(model.parameters()))"
                )
            else:
                values[name] = item
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_busy", busy)
        object.__setattr__(self, "_ends_at", ends_at)
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_snapshot", None)
        object.__setattr__(self, "_commits", 0)
        # optimizers whose steps were looked at (``check_step``), with how
        # many parameter groups they had then: each is judged once
        object.__setattr__(self, "_judged", weakref.WeakKeyDictionary())

    # plain values read and written as attributes: state.step += 1
    def __getattr__(self, name: str) -> Any:
        values = self.__dict__["_values"]
        if name in values:
            return values[name]
        if name in self.__dict__["_objects"]:
            return self.__dict__["_objects"][name]
        raise AttributeError(f"the elastic state has no {name!r}; give it to elastic_state()")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_snapshot", "_commits", "_ends_at"):
            object.__setattr__(self, name, value)
            return
        if name not in self._values:
            raise AttributeError(
                f"the elastic state has no value {name!r}: only the plain values given to "
                f"elastic_state() ({', '.join(self._values) or 'none'}) can be set"
            )
        self._values[name] = value

    def __repr__(self) -> str:
        names = ", ".join([*self._objects, *(f"{k}={v!r}" for k, v in self._values.items())])
        return f"<ElasticState {names}; {self._commits} commits>"

    @property
    def commits(self) -> int:
        """How many commits the state holds (a restore brings the count of
        the commit it restored)."""
        return self._commits

    def commit(self) -> None:
        """Copy the state in memory: after a re-form, training goes on from
        the latest commit. Call it between steps (after the optimizer
        stepped), every N steps; it costs copying the state once, and
        (until a joiner is planned in) one question to the elastic
        coordinator, waited for the session timeout at most.

        Every rank commits at the same steps: a commit is also where a
        waiting joiner is taken in (the world then ends there, on every rank
        alike, and ``with world:`` re-forms with it).

        Raises:
            AsyncDistError: a gradient sync's step is launched but not
                finished (``await sync`` first): its values would be half a step.
            SessionClosed: the state's session is closed (nothing is copied).
            MembershipChanged: (after the copy) the world ends here to take
                in a joiner, or, on this rank, because the elastic
                coordinator did not answer within the session timeout;
                ``with world:`` catches it.
        """
        self._copy("commit()")
        self._end_if(self._ends_at(self._commits))

    async def commit_async(self) -> None:
        """[commit][asyncdist.ElasticState.commit] for async code: the copy
        is taken at once, and the coordinator's answer is awaited off the
        event loop, so other tasks run while it comes (up to the session
        timeout when the coordinator is silent). Cancelled, it stops waiting
        at once (the copy stays taken); an answer that comes later still
        counts at the next commit.

        Raises:
            AsyncDistError, MembershipChanged: as ``commit``.
        """
        self._copy("commit_async()")
        commits = self._commits
        ends = await anyio.to_thread.run_sync(self._ends_at, commits, abandon_on_cancel=True)
        self._end_if(ends)

    def _copy(self, call: str) -> None:
        """A commit's copy, once no gradient sync has a step in flight."""
        busy = self._busy(call)
        if busy is not None:
            raise AsyncDistError(
                f"{call} while {busy} has a step in flight: `await sync` (or "
                "`sync.wait()`) before committing, so the copy is a whole step"
            )
        self.take()

    def _end_if(self, reason: str | None) -> None:
        """End the world at this commit, for ``reason`` (if any)."""
        if reason is not None:
            raise MembershipChanged(
                f"the world ends at commit {self._commits} on every rank: {reason}",
                op="commit",
                reason=reason,
            )

    def take(self) -> None:
        """Copy the state now (a commit, without its checks)."""
        self._snapshot = self._take()
        self._commits += 1

    def _take(self) -> dict[str, Any]:
        return {
            "objects": {k: copy.deepcopy(o.state_dict()) for k, o in self._objects.items()},
            "values": copy.deepcopy(self._values),
        }

    def holds(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is restored with this state (it is, or is part
        of, one of its modules)."""
        return any(
            isinstance(item, torch.nn.Module) and any(m is module for m in item.modules())
            for item in self._objects.values()
        )

    def holds_object(self, item: object) -> bool:
        """Whether ``item`` itself (by identity: an optimizer, a scheduler)
        is one of the objects this state restores."""
        return any(held is item for held in self._objects.values())

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse a step of an optimizer that updates this state's parameters
        but is not part of the state: after a re-form the parameters would
        be the commit's and its own state (Adam's moments, the step count,
        the learning rate) the live one, and a joiner's would start empty, so
        the replicas would drift apart silently. Judged once per optimizer
        (again if it gains a parameter group); a step of an optimizer of
        other parameters (a probe, a local model) passes.

        Raises:
            AsyncDistError: the optimizer is missing (nothing of the step ran).
        """
        groups = len(optimizer.param_groups)
        if self._judged.get(optimizer) == groups:
            return
        if not self.holds_object(optimizer):
            held = {
                id(param)
                for item in self._objects.values()
                if isinstance(item, torch.nn.Module)
                for param in item.parameters()
            }
            if any(id(p) in held for group in optimizer.param_groups for p in group["params"]):
                raise AsyncDistError(
                    f"on rank {self._rank()}: {type(optimizer).__name__} steps parameters of "
                    "the elastic state's model, but the state does not hold the optimizer: "
                    "after a re-form the parameters would be the commit's and its state "
                    "(moments, step count, learning rate) would not, and a joiner's would "
                    "start empty, so the ranks would drift apart. Pass it: "
                    "s.elastic_state(model=..., optimizer=...) (its scheduler too, if it "
                    "has one). Nothing of this step ran"
                )
        elif getattr(optimizer.step, "_wrapped_by_lr_sched", False) and not any(
            getattr(item, "optimizer", None) is optimizer for item in self._objects.values()
        ):
            # a scheduler was made for it (torch marks the optimizer's step),
            # and none in the state is its: likely forgotten, perhaps discarded
            logger.warning(
                "on rank %d: a learning-rate scheduler was made for the %s in the elastic "
                "state, but the state holds no scheduler of it: after a re-form a joiner's "
                "schedule would start over, and its learning rate would differ from the "
                "others'. Pass the scheduler too: s.elastic_state(..., scheduler=...)",
                self._rank(),
                type(optimizer).__name__,
            )
        self._judged[optimizer] = groups

    def committed(self) -> tuple[int, dict[str, Any] | None]:
        """(commits, the last commit) to send to the ranks of a new world."""
        return self._commits, self._snapshot

    def restore(self, commits: int, snapshot: dict[str, Any]) -> None:
        """Load ``snapshot`` in place (it becomes this rank's last commit,
        ``commits`` its count); gradients are cleared (``None``), as after
        ``zero_grad()``: those of the step in flight are gone."""
        for name, item in self._objects.items():
            # a copy: an optimizer keeps the tensors it is given, and steps them in place
            item.load_state_dict(copy.deepcopy(snapshot["objects"][name]))
            if isinstance(item, torch.nn.Module):
                for param in item.parameters():
                    param.grad = None
            elif isinstance(item, torch.optim.Optimizer):
                item.zero_grad(set_to_none=True)
        self._values.clear()
        self._values.update(copy.deepcopy(snapshot["values"]))
        self._snapshot = snapshot
        self._commits = commits


# The elastic states of open sessions. While there is one, torch's global
# optimizer step pre-hook shows each of them every optimizer step of the
# process (``check_step``); the hook comes off with the last one.
_GUARDED: weakref.WeakSet[ElasticState] = weakref.WeakSet()
_step_hook: Any = None


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for state in list(_GUARDED):
        state.check_step(optimizer)


def guard(state: ElasticState) -> None:
    """Check every optimizer step against ``state`` until ``unguard``."""
    global _step_hook
    _GUARDED.add(state)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_check_step)


def unguard(states: weakref.WeakSet[ElasticState]) -> None:
    """Stop checking ``states`` (their session ends); the hook comes off
    once no state is left."""
    global _step_hook
    for state in list(states):
        _GUARDED.discard(state)
    if not _GUARDED and _step_hook is not None:
        _step_hook.remove()
        _step_hook = None


def _holds_tensor(value: object) -> bool:
    """Whether a tensor is anywhere inside ``value`` (dicts, lists, tuples,
    sets, nested; a container met twice is walked once)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            return True
        if isinstance(item, (dict, list, tuple, set, frozenset)) and id(item) not in seen:
            seen.add(id(item))
            todo.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)
    return False


class _Ending(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"  # the block ended normally: training is done
    FAILED = "failed"  # a peer failed: the loop re-forms


@dataclass(eq=False)
class World:
    """One membership of an elastic session, yielded by
    [DistSession.elastic][asyncdist.DistSession.elastic]. Run the body inside
    ``with world:`` (``async with world:``): the failure that ends this world
    is caught there, and the loop re-forms.

    Attributes:
        rank: this process's rank in this world.
        world_size: how many ranks it has.
        generation: 0 for the first world, one more after every re-form.
        restored: how many commits the state restored at its start holds
            (a loop's first world: the commit the loop's start took included).
        reason: why the previous world ended ("" for the first).
    """

    rank: int
    world_size: int
    generation: int
    restored: int
    reason: str
    _ending: _Ending = field(default=_Ending.RUNNING, repr=False)
    _entered: bool = field(default=False, repr=False)
    _ends: Callable[[BaseException], bool] = field(default=lambda exc: False, repr=False)
    error: BaseException | None = field(default=None, repr=False)

    def __enter__(self) -> World:
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            self._ending = _Ending.FINISHED
            return False
        if self._ends(exc):
            self._ending = _Ending.FAILED
            self.error = exc.with_traceback(None)
            return True
        return False

    async def __aenter__(self) -> World:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        return self.__exit__(exc_type, exc, tb)


class Worlds:
    """The worlds of an elastic session, one per membership: ``for world in
    s.elastic(state)`` or ``async for``. The first is formed already; after
    a ``with world:`` block that a failure ended, the next is re-formed (off
    the event loop with ``async for``); after one that ended normally, the
    loop stops."""

    def __init__(
        self,
        first: Callable[[], World],
        following: Callable[[World], World],
    ) -> None:
        self._first = first
        self._following = following
        self._current: World | None = None

    def _next_step(self) -> Callable[[], World] | None:
        current = self._current
        if current is None:
            return self._first
        if not current._entered:
            raise AsyncDistError(
                "the body of an elastic loop must run inside `with world:` (`async with "
                "world:`): that block catches the failure that ends a world, so the loop "
                "can re-form"
            )
        if current._ending is _Ending.FINISHED:
            return None
        if current._ending is _Ending.RUNNING:
            raise AsyncDistError("the elastic loop went on while its world's block was still open")
        return lambda: self._following(current)

    def __iter__(self) -> Worlds:
        return self

    def __next__(self) -> World:
        step = self._next_step()
        if step is None:
            raise StopIteration
        world = self._current = step()
        return world

    def __aiter__(self) -> Worlds:
        return self

    async def __anext__(self) -> World:
        step = self._next_step()
        if step is None:
            raise StopAsyncIteration
        # re-forming waits for peers and the coordinator: off the loop, and whole
        with anyio.CancelScope(shield=True):
            world = await anyio.to_thread.run_sync(step)
        self._current = world
        return world
