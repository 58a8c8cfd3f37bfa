"""Elastic sessions: the survivors of a dead rank re-form and keep training.

Each scenario trains a small MLP with ``gradient_sync`` (Adam) on local gloo
ranks under ``spawn(..., elastic=True)``; one rank SIGKILLs itself at the
start of a step. The survivors must end bitwise equal to each other *and* to
a reference that replays the same membership: a plain (not elastic) run on
the first world's ranks up to the last commit before the death, then a plain
run on the survivors' number of ranks from that state. Rank order in the new
world: the survivors, by old rank (all hold the same commit).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import anyio
import pytest
import torch
import torch.optim.optimizer as _optimizer
from _stall import STALL_BOUND, no_stall

from asyncdist import (
    AsyncDistError,
    CollectiveTimeout,
    DistSession,
    InitError,
    MembershipChanged,
    MembershipLost,
    PeerFailure,
    SessionClosed,
    spawn,
)
from asyncdist._elastic import ElasticState, guard, unguard
from asyncdist._membership import REFORM_GRACE, Decision, Report, decide

STEPS = 12
EVERY = 3  # commit every this many steps
TIMEOUT = 10.0  # the sessions' timeout: the re-forming bound is this + REFORM_GRACE


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = _batch(step, rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


# -- the elastic run -------------------------------------------------------------------


def _set_up(s: DistSession) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any]:
    """The model, its Adam, the elastic state holding both and a step
    counter, and the model's gradient sync."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = s.elastic_state(model=model, optimizer=opt, step=0)
    return model, opt, state, s.gradient_sync(model)


async def _train(s: DistSession, victim: int, kill_at: int) -> dict[str, Any]:
    launch_rank = s.rank
    model, opt, state, sync = _set_up(s)
    worlds: list[tuple[int, int, int, int, int]] = []
    caught_at = None
    reformed_in = None
    threads: list[int] = []
    async for world in s.elastic(state):
        worlds.append((world.generation, world.rank, world.world_size, world.restored, state.step))
        async with world:
            while state.step < STEPS:
                if launch_rank == victim and world.generation == 0 and state.step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                _step(model, opt, state.step, world.rank)
                await sync
                opt.step()
                state.step += 1
                if caught_at is not None and reformed_in is None:
                    reformed_in = time.monotonic() - caught_at
                if state.step % EVERY == 0:
                    state.commit()
                if state.step == 2 or state.step == STEPS:
                    threads.append(len(os.listdir("/proc/self/task")))  # OS threads, gloo's too
        if world.error is not None:
            caught_at = time.monotonic()
    return {
        "worlds": worlds,
        "params": _params(model),
        "reformed_in": reformed_in,
        "threads": threads,
    }


def _train_sync(s: DistSession, victim: int, kill_at: int) -> dict[str, Any]:
    launch_rank = s.rank
    model, opt, state, sync = _set_up(s)
    worlds = []
    for world in s.elastic(state):
        worlds.append((world.generation, world.rank, world.world_size, world.restored, state.step))
        with world:
            while state.step < STEPS:
                if launch_rank == victim and world.generation == 0 and state.step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                _step(model, opt, state.step, world.rank)
                sync.wait()
                opt.step()
                state.step += 1
                if state.step % EVERY == 0:
                    state.commit()
    return {"worlds": worlds, "params": _params(model)}


# -- the reference: the same membership, replayed without elasticity ---------------------


def _reference(
    s: DistSession, start: dict[str, Any] | None, first: int, last: int
) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if start is not None:
        # a copy: spawn hands tensor arguments over in shared memory, and
        # Adam steps its state in place (the ranks would share one state)
        start = copy.deepcopy(start)
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optimizer"])
    sync = s.gradient_sync(model)
    for step in range(first, last):
        _step(model, opt, step, s.rank)
        sync.wait()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "params": _params(model)}


def _replayed(world_size: int, survivors: int, commit: int) -> list[torch.Tensor]:
    before = spawn(_reference, world_size, args=(None, 0, commit), timeout=TIMEOUT)[0]
    after = spawn(_reference, survivors, args=(before, commit, STEPS), timeout=TIMEOUT)
    return list(after[0]["params"])


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- scenarios -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("victim", "async_backend"), [(2, "asyncio"), (0, "trio"), (1, "asyncio")])
def test_survivors_of_a_killed_rank_go_on_bitwise_equal_to_a_replay(
    victim: int, async_backend: str
) -> None:
    kill_at = 7 if victim else 5  # rank 0 dies right after a commit; the others after a step
    results = spawn(
        _train,
        3,
        args=(victim, kill_at),
        elastic=True,
        min_world_size=2,
        timeout=TIMEOUT,
        async_backend=async_backend,
        join_timeout=60,
    )
    dead = results[victim]
    assert isinstance(dead, Exception)
    assert "exited with code -9" in str(dead)
    alive = [r for i, r in enumerate(results) if i != victim]
    commit = kill_at // EVERY * EVERY
    for launch_rank, result in zip([i for i in range(3) if i != victim], alive, strict=True):
        old_rank = launch_rank
        new_rank = sorted(i for i in range(3) if i != victim).index(launch_rank)
        # world 0 from the start; world 1 of 2 ranks, from the commit before the death
        assert result["worlds"] == [
            (0, old_rank, 3, 1, 0),
            (1, new_rank, 2, 1 + commit // EVERY, commit),
        ]
        assert result["reformed_in"] < TIMEOUT + REFORM_GRACE
        before, after = result["threads"]
        assert after <= before, "the first world's threads outlived it"
    assert _bitwise(alive[0]["params"], alive[1]["params"])
    assert _bitwise(alive[0]["params"], _replayed(3, 2, commit))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sync_code_re_forms_through_the_sync_loop() -> None:
    results = spawn(_train_sync, 3, args=(1, 4), elastic=True, min_world_size=2, timeout=TIMEOUT)
    alive = [results[0], results[2]]
    assert [r["worlds"][-1][:3] for r in alive] == [(1, 0, 2), (1, 1, 2)]
    assert _bitwise(alive[0]["params"], alive[1]["params"])
    assert _bitwise(alive[0]["params"], _replayed(3, 2, 3))


async def _two_left_one(s: DistSession, min_world_size: int) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = s.elastic_state(model=model, optimizer=opt, step=0)
    sync = s.gradient_sync(model)
    sizes = []
    caught = 0.0
    try:
        async for world in s.elastic(state):
            sizes.append(world.world_size)
            async with world:
                while state.step < 6:
                    if s.rank == 1 and world.generation == 0 and state.step == 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                    _step(model, opt, state.step, world.rank)
                    await sync
                    opt.step()
                    state.step += 1
                    state.commit()
            caught = time.monotonic()
    except MembershipLost as exc:
        return {"lost": exc.why, "after": time.monotonic() - caught, "message": str(exc)}
    return {"sizes": sizes, "step": state.step}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_one_survivor_goes_on_alone_when_allowed() -> None:
    results = spawn(_two_left_one, 2, args=(1,), elastic=True, timeout=TIMEOUT)
    assert results[0] == {"sizes": [2, 1], "step": 6}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_below_min_world_size_the_survivor_is_told_within_the_bound() -> None:
    results = spawn(_two_left_one, 2, args=(2,), elastic=True, min_world_size=2, timeout=TIMEOUT)
    seen = results[0]
    assert seen["lost"] == "too_few"
    assert "fewer than min_world_size=2" in seen["message"]
    assert seen["after"] < TIMEOUT + REFORM_GRACE


async def _rank_0_dies_before_the_loop(s: DistSession) -> dict[str, Any]:
    """Every rank starts from weights of its own (no common seed); rank 0
    dies before the loop's first world has shared its state."""
    torch.manual_seed(100 + s.rank)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = s.elastic_state(model=model, optimizer=opt, step=0)
    sync = s.gradient_sync(model)
    if s.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    worlds = []
    async for world in s.elastic(state):
        worlds.append((world.generation, world.world_size, world.restored))
        async with world:
            while state.step < 3:
                opt.zero_grad()
                model(torch.ones(8, 4)).pow(2).mean().backward()
                await sync
                opt.step()
                state.step += 1
                state.commit()
    return {"worlds": worlds, "params": _params(model)}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_rank_0_dying_before_the_first_share_leaves_the_survivors_one_state() -> None:
    """Each member takes the state as the loop found it, so the survivor that
    becomes rank 0 has one to share: the survivors start from its weights,
    not each from its own."""
    _, first, second = spawn(
        _rank_0_dies_before_the_loop, 3, elastic=True, min_world_size=2, timeout=TIMEOUT
    )
    assert first["worlds"] == second["worlds"] == [(1, 2, 1)]
    assert _bitwise(first["params"], second["params"])


async def _two_loops(s: DistSession) -> list[dict[str, Any]]:
    """Two elastic loops in one session (say pretraining, then fine-tuning);
    each trains to step 5, committing at step 3: the first ends 2 steps past
    its last commit."""
    model, opt, state, sync = _set_up(s)
    loops = []
    for _loop in range(2):
        ended: dict[str, Any] = {}
        async for world in s.elastic(state):
            ended |= {"began": (state.step, world.restored, _params(model))}
            async with world:
                while state.step < 5:
                    _step(model, opt, state.step, world.rank)
                    await sync
                    opt.step()
                    state.step += 1
                    if state.step % EVERY == 0:
                        state.commit()
        loops.append(ended | {"ended": (state.step, _params(model))})
    return loops


def test_a_second_loop_starts_from_the_state_the_first_left() -> None:
    """A later loop starts from the state as it finds it (committed then, as
    the first), never from the first loop's last commit (step 3)."""
    for first, second in spawn(_two_loops, 2, elastic=True, timeout=TIMEOUT):
        assert first["began"][:2] == (0, 1)
        assert first["ended"][0] == 5
        # its own commit (count 3: the first loop's start, step 3, this start)
        assert second["began"][:2] == (5, 3)
        assert _bitwise(second["began"][2], first["ended"][1])
        assert _bitwise(second["ended"][1], first["ended"][1])


# -- misuse ----------------------------------------------------------------------------


async def _misuse(s: DistSession, case: str) -> str:
    """What the elastic session says to one misuse (``case``), on each rank."""
    model = _model()
    try:
        if case == "no block":
            state = s.elastic_state(step=0)
            async for _world in s.elastic(state):
                state.step += 1  # the body outside `with world:`
        elif case == "collective first":
            await s.barrier()  # before the loop
        elif case == "sync not in state":
            state = s.elastic_state(step=0)
            s.gradient_sync(model)
            async for _world in s.elastic(state):
                pass
        elif case == "sync's optimizer not in state":
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            state = s.elastic_state(model=model, step=0)
            s.gradient_sync(model, optimizer=opt)
            async for _world in s.elastic(state):
                pass
        elif case == "optimizer not in state":
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            state = s.elastic_state(model=model, step=0)  # the optimizer forgotten
            sync = s.gradient_sync(model)
            before = _params(model)
            async for world in s.elastic(state):
                async with world:
                    _step(model, opt, 0, world.rank)
                    await sync
                    try:
                        opt.step()
                    finally:
                        assert _bitwise(_params(model), before)  # nothing of it ran
    except AsyncDistError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("no block", "must run inside `with world:`"),
        ("collective first", "inside the elastic loop"),
        ("sync not in state", "elastic_state(model=...)"),
        ("sync's optimizer not in state", "elastic_state(optimizer=...)"),
        ("optimizer not in state", "does not hold the optimizer"),
    ],
)
def test_misuse_is_refused_on_every_rank(case: str, said: str) -> None:
    told = spawn(_misuse, 2, args=(case,), elastic=True, timeout=TIMEOUT)
    assert all(said in t for t in told), told


async def _optimizers_beside_the_state(s: DistSession) -> dict[str, Any]:
    """A scheduler left out of the state, an optimizer of other parameters,
    and one of the state's model stepped once the session is over."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("asyncdist").addHandler(handler)
    model, probe = _model(), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    state = s.elastic_state(model=model, optimizer=opt, step=0)
    sync = s.gradient_sync(model)
    async for world in s.elastic(state):
        async with world:
            for step in range(3):
                _step(model, opt, step, world.rank)
                await sync
                opt.step()
                sched.step()
                probe(torch.ones(1, 2)).sum().backward()
                probe_opt.step()  # not the state's parameters: no check
    await s.__aexit__(None, None, None)
    other = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, other, 0, 0)
    other.step()  # the session is over: its state no longer looks
    return {"said": [m for m in said if "scheduler" in m]}


def test_a_scheduler_left_out_warns_once_and_other_optimizers_pass() -> None:
    for rank, told in enumerate(spawn(_optimizers_beside_the_state, 2, elastic=True)):
        assert len(told["said"]) == 1, told
        assert f"on rank {rank}" in told["said"][0]
        assert "elastic_state(..., scheduler=...)" in told["said"][0]


def test_an_optimizer_check_comes_off_with_the_state() -> None:
    """The global step hook lives only while a state is guarded."""
    model = _model()
    state = ElasticState({"model": model}, lambda call: None, rank=lambda: 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, 0)
    hooks = len(_optimizer._global_optimizer_pre_hooks)
    guard(state)
    assert len(_optimizer._global_optimizer_pre_hooks) == hooks + 1
    with pytest.raises(AsyncDistError, match="on rank 3: SGD steps parameters"):
        opt.step()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    with pytest.raises(AsyncDistError, match="does not hold the optimizer"):
        opt.step()  # judged again with its new group
    unguard(weakref.WeakSet([state]))
    assert len(_optimizer._global_optimizer_pre_hooks) == hooks
    opt.step()  # no longer looked at


async def _commits_mid_step(s: DistSession) -> str:
    model = _model()
    state = s.elastic_state(model=model)
    sync = s.gradient_sync(model)
    async for world in s.elastic(state):
        async with world:
            model(torch.ones(2, 6)).sum().backward()
            try:
                state.commit()
            except AsyncDistError as exc:
                said = str(exc)
            await sync
    return said


def test_commit_with_a_step_in_flight_is_refused() -> None:
    said = spawn(_commits_mid_step, 2, elastic=True, timeout=TIMEOUT)
    assert all("await sync" in s and "in flight" in s for s in said)


def test_an_elastic_session_without_a_coordinator_says_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ASYNCDIST_COORDINATOR", raising=False)
    with pytest.raises(InitError, match=r"spawn\(fn, n, elastic=True\)") as info:
        DistSession(elastic=True).__enter__()
    assert "srun" in str(info.value)
    assert "`asyncdist coordinator --port P`" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"elastic": True, "backend": "nccl"}, ValueError),
        ({"elastic": True, "init_method": "tcp://127.0.0.1:1"}, ValueError),
        ({"elastic": 1}, TypeError),
        ({"elastic": True, "min_world_size": 0}, ValueError),
        ({"elastic": True, "min_world_size": 3, "max_world_size": 2}, ValueError),
        ({"elastic": True, "max_world_size": 2.0}, TypeError),
        ({"min_world_size": 2}, ValueError),  # not elastic: it would bound nothing
        ({"max_world_size": 2}, ValueError),
    ],
)
def test_bad_elastic_arguments_are_refused_at_construction(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        DistSession(**kwargs)


def test_an_elastic_world_that_does_not_form_leaves_no_watcher_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both launch ranks registered (rank 1 by hand, never to form a group),
    so rank 0's world 0 times out forming: InitError, and its heartbeat
    thread and probe port are gone with it, its exit written."""
    import datetime
    import threading

    import torch.distributed as dist

    from asyncdist._coordinator import ROOT

    limit = datetime.timedelta(seconds=5)
    coordinator = dist.TCPStore("127.0.0.1", 0, None, True, limit, wait_for_workers=False)
    keys = dist.PrefixStore(ROOT, coordinator)
    keys.set("rank/1", "ghost:1")
    monkeypatch.setenv("ASYNCDIST_COORDINATOR", f"127.0.0.1:{coordinator.port}")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InitError, match="world 0 of the elastic session did not form"):
        DistSession(elastic=True, timeout=1.5).__enter__()
    left = [t.name for t in threading.enumerate() if t.name.startswith("asyncdist-elastic")]
    assert left == []
    assert [k for k in keys.list_keys() if k.startswith("dead/")], "its exit is written"


def test_a_commit_after_the_session_closed_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state kept past its session: its commit cannot ask a coordinator
    or end a world any more, so it is refused before it copies anything."""
    import datetime

    import torch.distributed as dist

    limit = datetime.timedelta(seconds=5)
    coordinator = dist.TCPStore("127.0.0.1", 0, None, True, limit, wait_for_workers=False)
    monkeypatch.setenv("ASYNCDIST_COORDINATOR", f"127.0.0.1:{coordinator.port}")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    model = _model()
    with DistSession(elastic=True, timeout=5) as s:
        state = s.elastic_state(model=model, step=0)
        for world in s.elastic(state):
            with world:
                state.step += 1
                state.commit()
    commits, committed = state.commits, state.committed()
    with pytest.raises(SessionClosed, match=r"commit\(\) on rank 0: the session is closed"):
        state.commit()
    with pytest.raises(SessionClosed, match=r"commit_async\(\) on rank 0: the session"):
        anyio.run(state.commit_async)
    assert state.commits == commits
    assert state.committed()[1] is committed[1]  # nothing was copied


def _closes_without_waiting(s: DistSession) -> dict[str, Any] | None:
    if s.rank == 1:
        time.sleep(2 * QUICK_CLOSE + 1)  # silent: rank 0's allreduce ends at its timeout
        return None
    handle = s.allreduce(torch.ones(4))
    lane = s._lane
    assert lane is not None
    started = time.monotonic()
    release = lane.close(defer=True)
    closed = time.monotonic() - started
    release()
    released = time.monotonic() - started
    with pytest.raises(CollectiveTimeout):
        handle.wait()  # (seen: the session's exit has nothing to report)
    return {"closed": closed, "released": released}


QUICK_CLOSE = 2.0


def test_an_ended_worlds_groups_go_at_once_and_its_works_are_waited_for_after() -> None:
    """What a re-form does with the world that ended (``Lane.close(defer=
    True)``): an allreduce a silent peer never joins is still running, yet
    the groups go at once, so the rank reports and the next world forms
    meanwhile; letting go of the works (before anything is restored) is what
    waits, until the allreduce's own timeout."""
    first, _ = spawn(_closes_without_waiting, 2, timeout=QUICK_CLOSE)
    assert first["closed"] < 0.5, first
    assert first["released"] > QUICK_CLOSE * 0.75, first


def test_elastic_calls_on_a_plain_session_say_it_is_not_elastic() -> None:
    with DistSession() as s, pytest.raises(AsyncDistError, match="not elastic"):
        s.elastic_state(step=0)


def test_elastic_state_values_are_attributes_and_objects_are_restored_in_place() -> None:
    model = _model()
    state = ElasticState({"model": model, "step": 3}, lambda call: None)
    state.commit()
    state.step += 1
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    commits, snapshot = state.committed()
    assert snapshot is not None
    state.restore(commits, snapshot)
    assert state.step == 3
    assert _bitwise(_params(model), _params(_model()))
    with pytest.raises(AttributeError, match="only the plain values"):
        state.epoch = 1
    with pytest.raises(TypeError, match="state_dict"):
        ElasticState({"tensor": torch.ones(1)}, lambda call: None)


@pytest.mark.parametrize(
    "item",
    [
        pytest.param(lambda: _model().state_dict(), id="a state_dict"),
        pytest.param(lambda: list(_model().parameters()), id="a list of parameters"),
        pytest.param(lambda: {"best": [(1, torch.zeros(2))]}, id="a tensor deep inside"),
        pytest.param(lambda: {torch.zeros(1)}, id="a set of tensors"),
    ],
)
def test_tensors_inside_a_plain_value_are_refused(item: Any) -> None:
    """A plain value is restored as a value: a state_dict given as one would
    be a separate copy, never loaded into the model."""
    with pytest.raises(TypeError, match="Pass the module or optimizer object itself"):
        ElasticState({"weights": item()}, lambda call: None)


def test_a_class_is_refused_and_plain_nested_values_are_kept() -> None:
    with pytest.raises(TypeError, match="the class Linear, not an object of it"):
        ElasticState({"model": torch.nn.Linear}, lambda call: None)
    state = ElasticState({"log": {"loss": [1.0, (2, "x")], "seen": {3}}}, lambda call: None)
    assert state.log == {"loss": [1.0, (2, "x")], "seen": {3}}


def test_spawn_refuses_a_non_bool_elastic_as_the_session_does() -> None:
    with pytest.raises(TypeError, match="elastic must be True or False"):
        spawn(_capped_rank, 2, args=("",), elastic=1)  # type: ignore[arg-type]


# -- the membership rule (pure) ---------------------------------------------------------


MEMBERS = ["a", "b", "c", "d"]


def _reports(*ranks_commits: tuple[int, int]) -> dict[str, Report]:
    return {MEMBERS[r]: Report(MEMBERS[r], r, c) for r, c in ranks_commits}


@pytest.mark.parametrize(
    ("heard", "gone", "least", "most", "joiners", "outcome"),
    [
        # the survivor with the latest commit becomes rank 0, then by old rank
        ([(1, 4), (2, 5), (3, 5)], {"a"}, 1, None, [], ("c", "b", "d")),
        # joiners come last
        ([(1, 4), (2, 5), (3, 5)], {"a"}, 1, None, ["e"], ("c", "b", "d", "e")),
        # two of four heard, nobody known dead: the others may be alive elsewhere
        ([(0, 1), (1, 1)], set(), 1, None, [], "no_majority"),
        # the same two, with the others known dead (their launcher saw them exit)
        ([(0, 1), (1, 1)], {"c", "d"}, 1, None, [], ("a", "b")),
        # three left, four needed; a joiner makes up for one
        ([(0, 1), (1, 1), (2, 1)], {"d"}, 4, None, [], "too_few"),
        ([(0, 1), (1, 1), (2, 1)], {"d"}, 4, None, ["e"], ("a", "b", "c", "e")),
        # capped at 4: the first joiner fits, the other waits
        ([(0, 1), (1, 1), (2, 1)], {"d"}, 1, 4, ["e", "f"], ("a", "b", "c", "e")),
        # capped at 3: none fits
        ([(0, 1), (1, 1), (2, 1)], {"d"}, 1, 3, ["e"], ("a", "b", "c")),
    ],
)
def test_the_membership_rule(
    heard: list[tuple[int, int]],
    gone: set[str],
    least: int,
    most: int | None,
    joiners: list[str],
    outcome: tuple[str, ...] | str,
) -> None:
    decided = decide(
        1,
        MEMBERS,
        _reports(*heard),
        gone,
        min_world_size=least,
        channels=["gradients"],
        reason="",
        joiners=joiners,
        max_world_size=most,
    )
    if isinstance(outcome, str):
        assert isinstance(decided, MembershipLost)
        assert decided.why == outcome
    else:
        assert isinstance(decided, Decision)
        assert decided.members == outcome
        assert decided.commits == max(c for _, c in heard)


def test_joins_are_settled_in_order_and_their_keys_deleted() -> None:
    """The new rank 0 settles the joins a world took in (or that died before
    one did): their keys go, and nobody counts a member as a joiner again,
    which would end every world at its next commit."""
    import datetime

    import torch.distributed as dist

    from asyncdist._membership import Coordinator

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=5),
    )
    rank0 = Coordinator(store, "a", 5.0)

    def register(member: str) -> None:  # as Coordinator.join does
        store.set(f"join/{int(store.add('joins', 1))}", member)

    def join_keys() -> list[str]:
        return sorted(k for k in store.list_keys() if k.startswith("join/"))

    register("j1")
    register("j2")
    store.set("dead/j1", "exited")  # gone before a world took it in
    assert rank0.joiners(["a", "b"]) == ["j2"]
    rank0.announce(Decision(1, ("a", "b", "j2"), 3, (), "joined"))
    assert join_keys() == []
    assert rank0.joiners(["a", "b", "j2"]) == []
    store.add("joins", 1)  # j3 is counted, its key not written yet
    register("j4")
    rank0.announce(Decision(2, ("a", "b", "j2", "j4"), 4, (), "joined"))
    assert join_keys() == ["join/4"], "settling stops at a join not written yet"
    store.set("join/3", "j3")
    assert rank0.joiners(["a", "b", "j2", "j4"]) == ["j3"]
    rank0.announce(Decision(3, ("a", "b", "j2", "j4", "j3"), 5, (), "joined"))
    assert join_keys() == []
    assert int(store.add("admitted", 0)) == 4
    # a joiner started by hand dies while it waits: no launcher writes its
    # dead/ key, but its heartbeat stops
    watching = Coordinator(store, "a", 0.3)
    register("j5")
    store.add("hb/j5", 1)
    assert watching.joiners(["a"]) == ["j5"]
    time.sleep(0.4)
    assert watching.joiners(["a"]) == [], "a joiner whose heartbeat stood still is gone"
    watching.announce(Decision(4, ("a", "b", "j2", "j4", "j3"), 6, (), "died"))
    assert join_keys() == []


@pytest.mark.timeout(30)
def test_a_survivor_waits_for_a_dead_members_heartbeat_before_it_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A world of two whose other member died where no launcher tells the
    coordinator (torchrun across two nodes): past the grace the survivor is
    alone, no strict majority of two. It must not end everyone's session
    then, but wait until the dead member's heartbeat has stood still for
    the timeout, which makes it known gone, and go on alone. (It ended with
    MembershipLost at the grace, whenever the timeout was longer.)"""
    import torch.distributed as dist

    from asyncdist import _membership
    from asyncdist._membership import Coordinator

    monkeypatch.setattr(_membership, "REFORM_GRACE", 0.3)
    store = dist.HashStore()
    store.add("hb/b", 7)  # b beat, then died
    started = time.monotonic()
    decided = Coordinator(store, "a", 1.0).reform(
        0, ["a", "b"], Report("a", 0, 2), min_world_size=1, channels=[], reason="b died"
    )
    assert decided.members == ("a",)
    assert 1.0 <= time.monotonic() - started < 1.3 + 1.0  # the timeout, within the deadline


class _SilentCoordinator:
    """A coordinator cut off mid-request: every call blocks (as torch's store
    client does, which has no receive timeout) until ``release``."""

    def __init__(self, answers: dict[str, Any] | None = None) -> None:
        self.release = threading.Event()
        self._answers = answers or {}

    def __getattr__(self, name: str) -> Any:
        if name in self._answers:
            return lambda *args, **kwargs: self._answers[name]

        def blocked(*args: Any, **kwargs: Any) -> Any:
            self.release.wait(20)
            raise RuntimeError("answered too late")

        return blocked


def _silent_member(coordinator: _SilentCoordinator, timeout: float) -> Any:
    from asyncdist._membership import Membership

    member = Membership(min_world_size=1)
    member._coordinator = coordinator  # type: ignore[assignment]
    member._timeout, member._address = timeout, ("10.0.0.9", 4321)
    member.generation, member.members = 3, (member.me, "b")
    return member


@pytest.mark.timeout(30)
def test_a_coordinator_silent_at_a_commit_ends_the_world_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cut that lands while a commit asks the coordinator whether a joiner
    waits held the training thread in a read with no deadline (the store
    client has none), with nothing outstanding for the watchdog to break:
    the cut-off rank never ended. The commit now waits the session timeout
    at most, then ends the world on that rank, and the re-forming that
    follows is bounded too: MembershipLost("coordinator")."""
    from asyncdist import _membership

    monkeypatch.setattr(_membership, "REFORM_GRACE", 0.2)
    silent = _SilentCoordinator()
    member = _silent_member(silent, 0.5)
    try:
        started = time.monotonic()
        with pytest.raises(MembershipChanged) as told:
            member.at_commit(1, 7)
        assert 0.5 <= time.monotonic() - started < 1.5
        assert str(told.value).startswith(
            "world 3 ends on rank 1: the elastic coordinator at "
            "10.0.0.9:4321 did not answer within 0.5 s at commit 7"
        ), told.value
        assert (told.value.generation, told.value.op) == (3, "commit")
        started = time.monotonic()
        with pytest.raises(MembershipLost, match=r"did not answer within 1\.1 s") as lost:
            member.reform(told.value.reason, 1, 7, channels=[])
        assert lost.value.why == "coordinator"
        assert time.monotonic() - started < 1.1 + 1.0
    finally:
        silent.release.set()
        member.leave("exited")  # and its requests' thread ends
    # a coordinator that answers with an error is told about, and the world goes on
    failing = _silent_member(_SilentCoordinator(), 5.0)
    failing._coordinator.release.set()
    assert failing.at_commit(1, 8) is False
    failing.leave("exited")
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncdist-coordinator")]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("joins", "answers", "bound"),
    [
        (False, {}, 0.7),  # registering as a launch rank: the timeout and a grace
        (True, {}, 0.5),  # registering as a joiner
        (True, {"add": 1, "compare_set": b"me"}, 0.5),  # registered, then looking
    ],
)
def test_a_coordinator_silent_while_a_process_enters_is_an_init_error(
    monkeypatch: pytest.MonkeyPatch, joins: bool, answers: dict[str, Any], bound: float
) -> None:
    """Entering registers with the coordinator, and a joiner (a spare
    without a deadline, too) keeps looking at it: a cut there held the
    process in a read with no deadline. Each round trip is bounded now."""
    from asyncdist import InitError, _membership

    monkeypatch.setattr(_membership, "REFORM_GRACE", 0.2)
    silent = _SilentCoordinator(answers)  # as the store itself
    monkeypatch.setattr(_membership, "connect", lambda address, timeout: silent)
    member = _membership.Membership(min_world_size=1, max_world_size=2)
    member._timeout = 0.5
    try:
        started = time.monotonic()
        with pytest.raises(InitError) as told:
            member._register(("10.0.0.9", 4321), 1, 2, joins)
        assert bound <= time.monotonic() - started < bound + 1.0
        who = f"joiner {member.me}" if joins else "rank 1"
        assert str(told.value) == (
            f"{who}: the elastic coordinator at 10.0.0.9:4321 did not answer within {bound:g} "
            "s while this process entered the session: it is stopped, or cut off from this "
            "process"
        )
    finally:
        silent.release.set()
        member.leave("raised")  # and its requests' thread ends
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncdist-coordinator")]


@pytest.mark.timeout(60)
def test_a_coordinator_frozen_while_a_world_forms_is_an_init_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A world's default group forms over the coordinator's store; its host
    freezing there held the forming forever (torch's client never gives up
    on a connected store that stopped answering, whatever its timeout). It is
    given up on at the timeout plus the grace now, and ends once the store
    closes."""
    import datetime
    import types

    import torch.distributed as dist
    from _store_host import store_host, until_no_forming_is_held

    from asyncdist import InitError, _groups

    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.5)
    with store_host() as host:
        limit = datetime.timedelta(seconds=5)
        client = dist.TCPStore("127.0.0.1", host.port, None, False, limit)
        member = _silent_member(_SilentCoordinator(), 1.0)
        member._coordinator = types.SimpleNamespace(store=client)  # what forming asks of it
        host.stop()
        started = time.monotonic()
        with pytest.raises(InitError) as told:
            member.form(3, 0, 2)
        assert 1.5 <= time.monotonic() - started < 1.5 + 2.0
        assert str(told.value).startswith(
            "rank 0 of 2: world 3 of the elastic session did not form: the elastic "
            "coordinator at 10.0.0.9:4321 did not answer its rendezvous (rank 0's forming "
            "of world 3: the rendezvous store did not answer within 1.5 s"
        ), told.value
        assert not dist.is_initialized()
        host.kill()
        until_no_forming_is_held()
        del client


@pytest.mark.timeout(30)
def test_a_coordinator_silent_when_rank_0_announces_the_new_world_is_lost() -> None:
    """The new world's rank 0 tells the joiners, on the coordinator: a cut
    there held it forever too, and an error there came out as torch's own."""
    silent = _SilentCoordinator()
    member = _silent_member(silent, 0.5)
    silent._answers["reform"] = Decision(4, (member.me,), 7, (), "b died")
    try:
        started = time.monotonic()
        with pytest.raises(MembershipLost, match="when world 4 was announced") as lost:
            member.reform("b died", 0, 7, channels=[])
        assert lost.value.why == "coordinator"
        assert 0.5 <= time.monotonic() - started < 1.5
    finally:
        silent.release.set()
        member.leave("exited")  # and its requests' thread ends
    # one that answers with an error there is no bare RuntimeError either
    member = _silent_member(silent, 0.5)
    with pytest.raises(MembershipLost, match="stopped answering when world 4 was announced"):
        member.reform("b died", 0, 7, channels=[])
    member.leave("exited")
    # tidying the store afterwards is waited for by nobody: a slow one loses nothing
    slow_tidy = _SilentCoordinator({"reform": Decision(4, (member.me,), 7, (), "b died")})
    slow_tidy._answers["announce"] = None
    member = _silent_member(slow_tidy, 0.5)
    try:
        started = time.monotonic()
        assert member.reform("b died", 0, 7, channels=[]).generation == 4
        assert time.monotonic() - started < 0.4
    finally:
        slow_tidy.release.set()
        member.leave("exited")


def test_a_request_given_up_on_is_not_made_late() -> None:
    """A re-form whose caller gave up (the coordinator was silent) must not
    reach the coordinator once it answers again: it would report a member
    that already raised MembershipLost, and the others would wait for it."""
    from asyncdist._membership import _Requests, _Silent

    requests = _Requests("asyncdist-test-requests")
    held, made = threading.Event(), []
    try:
        with pytest.raises(_Silent):
            requests.answer(lambda: held.wait(10), 0.1)  # the coordinator goes silent
        with pytest.raises(_Silent):
            requests.answer(lambda: made.append("late"), 0.1)  # queued behind it
        held.set()  # it answers again
        assert requests.answer(lambda: "next", 5.0) == "next"
        assert made == []
    finally:
        held.set()
        requests.close(5.0)


def test_an_elastic_loop_waits_for_a_late_peer_off_the_event_loop() -> None:
    """The worlds are formed on a worker thread (``Worlds.__anext__``): the
    first world's state broadcast waits for a late peer without stalling."""
    results = spawn(_late_peer, 2, elastic=True, timeout=TIMEOUT)
    assert results[0] < STALL_BOUND


async def _late_peer(s: DistSession) -> float:
    if s.rank == 1:
        await anyio.sleep(1.0)
    state = s.elastic_state(step=0)
    async with no_stall(what="elastic start", bound=10.0) as meter:  # measured, not judged
        async for world in s.elastic(state):
            async with world:
                pass
    return meter.max_stall


async def _slow_coordinator(s: DistSession) -> dict[str, float]:
    """Each commit's question to the coordinator takes half a second here:
    ``commit_async`` awaits it with the loop running; ``commit`` holds the
    loop for it (what it measures shows that the delay was in force)."""
    from asyncdist import _membership

    asked = _membership.Coordinator.planned

    def slow(self: Any, generation: int) -> int | None:
        time.sleep(0.5)
        return asked(self, generation)

    _membership.Coordinator.planned = slow  # type: ignore[method-assign]
    state = s.elastic_state(step=0)
    took: dict[str, float] = {}
    async for world in s.elastic(state):
        async with world:
            async with no_stall(what="commit_async", bound=10.0) as meter:
                started = time.monotonic()
                await state.commit_async()
                took["async"] = time.monotonic() - started
            took["async stall"] = meter.max_stall
            async with no_stall(what="commit", bound=10.0) as meter:
                state.commit()
            took["sync stall"] = meter.max_stall
            started = time.monotonic()
            with anyio.move_on_after(0.1):
                await state.commit_async()
            took["cancelled"] = time.monotonic() - started
            await s.barrier()
    took["commits"] = state.commits
    return took


@pytest.mark.parametrize("async_backend", ["asyncio", "trio"])
def test_commit_async_waits_for_the_coordinator_off_the_event_loop(async_backend: str) -> None:
    ranks = spawn(_slow_coordinator, 2, elastic=True, timeout=TIMEOUT, async_backend=async_backend)
    for took in ranks:
        assert took["commits"] == 4, took  # the loop's start, then the three
        assert took["async"] >= 0.5, took  # it did wait for the answer
        assert took["async stall"] < STALL_BOUND, took
        assert took["sync stall"] > 0.4, took  # commit() holds the loop: the delay was real
        assert took["cancelled"] < 0.4, took  # a cancelled commit_async stops waiting at once


# -- a replacement joins ----------------------------------------------------------------


async def _train_and_regrow(s: DistSession, victim: int, kill_at: int) -> dict[str, Any]:
    """Like ``_train``; the launcher replaces the victim, whose replacement
    joins at a commit. The survivors train on (past ``STEPS``) until it has."""
    launch_rank = s.rank
    model, opt, state, sync = _set_up(s)
    worlds: list[tuple[int, int, int, int, int]] = []
    starts: list[list[torch.Tensor]] = []
    async for world in s.elastic(state):
        worlds.append((world.generation, world.rank, world.world_size, world.restored, state.step))
        starts.append(_params(model))  # before the world's first step
        async with world:
            while state.step < STEPS or world.world_size < 3:
                if launch_rank == victim and world.generation == 0 and state.step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                _step(model, opt, state.step, world.rank)
                await sync
                opt.step()
                state.step += 1
                if state.step % EVERY == 0:
                    state.commit()
                await anyio.sleep(0.02)  # the replacement takes seconds to start
    return {"worlds": worlds, "starts": starts, "params": _params(model), "step": state.step}


def _replayed_worlds(phases: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Plain runs, one per (world size, first step, last step), each from
    the state the one before ended with."""
    state = None
    for world_size, first, last in phases:
        state = spawn(_reference, world_size, args=(state, first, last), timeout=TIMEOUT)[0]
    assert state is not None
    return list(state["params"])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_backend", ["asyncio", "trio"])
def test_a_replacement_joins_at_a_commit_and_the_world_grows_back(async_backend: str) -> None:
    results = spawn(
        _train_and_regrow,
        3,
        args=(1, 4),
        elastic=True,
        min_world_size=2,
        max_restarts=1,
        timeout=TIMEOUT,
        async_backend=async_backend,
        join_timeout=90,
    )
    first, joiner, second = results
    # the survivors: world 0 (3 ranks), world 1 (2, from the commit at step 3),
    # world 2 (3 again, from the commit at which the joiner was taken in)
    assert [w[:3] for w in first["worlds"]] == [(0, 0, 3), (1, 0, 2), (2, 0, 3)]
    assert [w[:3] for w in second["worlds"]] == [(0, 2, 3), (1, 1, 2), (2, 1, 3)]
    regrown = first["worlds"][2][4]
    assert regrown % EVERY == 0
    assert first["worlds"][1][4] == 3
    # the joiner: only world 2, last in rank order, from the same commit
    assert joiner["worlds"] == [(2, 2, 3, first["worlds"][2][3], regrown)]
    # bitwise equal to the others before its first step, and at the end
    assert _bitwise(joiner["starts"][0], first["starts"][2])
    assert _bitwise(joiner["params"], first["params"])
    assert _bitwise(second["params"], first["params"])
    end = first["step"]
    assert joiner["step"] == second["step"] == end
    assert _bitwise(
        first["params"], _replayed_worlds([(3, 0, 3), (2, 3, regrown), (3, regrown, end)])
    )


async def _done_before_the_replacement(s: DistSession) -> int:
    """Rank 2 dies; the survivors finish without another commit, so the
    replacement can never be taken in: it comes to a finished session."""
    model, opt, state, sync = _set_up(s)
    joining = "ASYNCDIST_ELASTIC_JOIN" in os.environ
    async for world in s.elastic(state):
        async with world:
            while state.step < 8:
                if s.rank == 2 and world.generation == 0 and state.step == 4 and not joining:
                    os.kill(os.getpid(), signal.SIGKILL)
                _step(model, opt, state.step, world.rank)
                await sync
                opt.step()
                state.step += 1
                if state.step == EVERY:
                    state.commit()
    return state.step


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_replacement_after_the_others_finished_leaves_their_results() -> None:
    results = spawn(
        _done_before_the_replacement,
        3,
        elastic=True,
        min_world_size=2,
        max_restarts=1,
        timeout=TIMEOUT,
        join_timeout=80,
    )
    assert results[:2] == [8, 8]
    dead = results[2]
    assert isinstance(dead, PeerFailure)
    assert "exited with code -9" in str(dead)
    assert any("came after the others had finished" in note for note in dead.__notes__)


# -- a capped world: a spare waits, and takes a dead rank's place --------------------------

CAPPED = 2.0  # the capped run's session timeout: a joiner's own deadline is this + grace
SPARE = """
import json, sys, time
import anyio, torch
sys.path.insert(0, sys.argv[2])
from test_elastic import CAPPED, _capped
from asyncdist import DistSession

async def main(folder):
    torch.set_num_threads(1)
    joining = time.monotonic()
    with open(folder + "/spare.joining", "w") as file:
        file.write(str(time.time()))
    async with DistSession(elastic=True, max_world_size=2, timeout=CAPPED) as s:
        result = await _capped(s, folder, "spare")
    result["waited"] = result.pop("entered") - joining
    with open(folder + "/spare.json", "w") as file:
        json.dump(result, file)

anyio.run(main, sys.argv[1])
"""


def _spare_waited_out_its_deadline(folder: str) -> bool:
    """The spare registered, and has waited longer than a joiner may wait
    for a world with room (its timeout plus the grace), and a second more."""
    try:
        with open(os.path.join(folder, "spare.joining")) as file:
            since = float(file.read())
    except (OSError, ValueError):  # not yet (or half written)
        return False
    return time.time() > since + CAPPED + REFORM_GRACE + 1.0


def _start_spare(folder: str) -> subprocess.Popen[bytes]:
    """The spare: a joiner of this rank's session, started by hand."""
    env = os.environ | {"ASYNCDIST_ELASTIC_JOIN": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.Popen([sys.executable, "-c", SPARE, folder, here], env=env)


async def _capped(s: DistSession, folder: str, role: str) -> dict[str, Any]:
    """Train in a world capped at 2 ranks, committing every step. Launch
    rank 0 starts a spare, which registers as a joiner; launch rank 1 dies
    once the spare has waited past a joiner's deadline; the world that
    follows trains 10 more steps."""
    entered = time.monotonic()
    model, opt, state, sync = _set_up(s)
    spare = None
    if role == "0":
        spare = await anyio.to_thread.run_sync(_start_spare, folder)
    worlds: list[list[int]] = []
    starts: list[list[list[float]]] = []
    try:
        async for world in s.elastic(state):
            worlds.append([world.generation, world.rank, world.world_size, state.step])
            starts.append([p.flatten().tolist() for p in _params(model)])
            first = state.step
            async with world:
                while world.generation == 0 or state.step < first + 10:
                    if role == "1" and _spare_waited_out_its_deadline(folder):
                        os.kill(os.getpid(), signal.SIGKILL)
                    _step(model, opt, state.step, world.rank)
                    await sync
                    opt.step()
                    state.step += 1
                    state.commit()
                    await anyio.sleep(0.02)
    finally:
        if spare is not None:
            try:
                await anyio.to_thread.run_sync(functools.partial(spare.wait, timeout=60))
            finally:
                spare.kill()
                spare.wait()
    return {
        "entered": entered,
        "worlds": worlds,
        "starts": starts,
        "params": [p.flatten().tolist() for p in _params(model)],
        "step": state.step,
    }


async def _capped_rank(s: DistSession, folder: str) -> dict[str, Any]:
    return await _capped(s, folder, str(s.rank))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_spare_waits_while_the_world_is_full_and_takes_a_dead_ranks_place(
    tmp_path: Any,
) -> None:
    """max_world_size=2: rank 0 plans no re-form for the spare at its commits
    (without the cap the world would grow to 3 at the next one), the spare
    waits past a joiner's deadline without giving up, and when rank 1 dies
    the survivor takes it in: a world of 2 again, the spare bitwise equal."""
    folder = str(tmp_path)
    first, dead = spawn(
        _capped_rank,
        2,
        args=(folder,),
        elastic=True,
        max_world_size=2,
        timeout=CAPPED,
        join_timeout=100,
    )
    assert isinstance(dead, PeerFailure), dead
    with open(os.path.join(folder, "spare.json")) as file:
        spare = json.load(file)
    (gen0, gen1) = first["worlds"]
    assert gen0 == [0, 0, 2, 0]
    assert gen1[:3] == [1, 0, 2], "the survivor's second world: itself and the spare"
    assert spare["worlds"] == [[1, 1, 2, gen1[3]]], "the spare joins world 1, as rank 1"
    assert spare["waited"] > CAPPED + REFORM_GRACE, "it waited past a joiner's deadline"
    assert spare["starts"][0] == first["starts"][1], "restored from the survivor's commit"
    assert spare["params"] == first["params"]
    assert spare["step"] == first["step"] == gen1[3] + 10


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"world_size": 3, "elastic": True, "max_world_size": 2}, "above max_world_size"),
        ({"world_size": 2, "elastic": True, "min_world_size": 3}, "below min_world_size"),
        ({"world_size": 2, "min_world_size": 2}, "pass elastic=True"),
        ({"world_size": 2, "max_world_size": 4}, "pass elastic=True"),
    ],
)
def test_spawn_refuses_world_sizes_that_cannot_hold(kwargs: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        spawn(_capped_rank, args=("",), **kwargs)


# -- the end of a world wakes every waiter ----------------------------------------------------


async def _ended_mid_launch(s: DistSession, folder: str) -> dict[str, Any]:
    """World 0 ends while rank 0 launches an allreduce (its watcher hears
    the end while rank 0 is inside torch's launch, as it happens when the
    launch releases the GIL), and while rank 1 waits in a ``recv`` that no
    send matches (on a completer's thread, which holds the op). Neither
    collective is ever matched: only the interrupt can end them."""
    from asyncdist import _wire
    from asyncdist._membership import Coordinator, connect, coordinator_address, member_id

    address = coordinator_address()
    assert address is not None
    coordinator = Coordinator(connect(address, TIMEOUT), member_id(), TIMEOUT)
    state = s.elastic_state(step=0)
    launch_rank, seen, real = s.rank, {}, _wire.allreduce

    def ending_mid_issue(group: Any, tensor: Any, reduction: Any) -> Any:
        work = real(group, tensor, reduction)
        if "issued" not in seen:
            seen["issued"] = True
            coordinator.end(0, "ended mid-launch")
            deadline = time.monotonic() + TIMEOUT
            while s._lane.health.fault is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the watcher's thread interrupts the lane meanwhile
        return work

    async for world in s.elastic(state):
        async with world:
            if world.generation == 1:
                total = await s.allreduce(torch.ones(1))  # the next world works
                return {**seen, "total": total.item()}
            if launch_rank == 0:
                _wire.allreduce = ending_mid_issue
                try:
                    handle = s.allreduce(torch.ones(1))
                finally:
                    _wire.allreduce = real
                seen["at_once"] = handle.done()
                seen["error"] = type(handle.exception()).__name__
                await anyio.to_thread.run_sync(_await_mark, folder, "recv")  # rank 1's ended too
                await handle
            else:
                try:
                    await s.recv(torch.zeros(1), src=0)
                except BaseException as exc:
                    seen["error"] = type(exc).__name__
                    _mark(folder, "recv")
                    raise
    raise AssertionError("the elastic loop ended without world 1")


@pytest.mark.timeout(60)
def test_a_world_that_ends_mid_launch_fails_that_launch_and_a_completers_wait(
    tmp_path: Any,
) -> None:
    """Without the launch's own look at the lane's end, rank 0's allreduce
    stayed pending (the interrupt had copied the outstanding queue before it
    was appended); without settling past a completer's claim, rank 1's recv
    stayed pending until rank 0's group went. Both collectives stay in gloo,
    unmatched (it has no abort): world 1 is agreed on and formed at once,
    and its restore waits until they end at their timeout (hence ``QUICK``)."""
    first, second = spawn(_ended_mid_launch, 2, args=(str(tmp_path),), elastic=True, timeout=QUICK)
    assert first["at_once"], "the allreduce launched as the world ended is failed at once"
    assert first["error"] == second["error"] == "MembershipChanged"
    assert first["total"] == second["total"] == 2.0


@pytest.mark.parametrize(
    ("launched", "bounds", "said"),
    [
        ("1", {"min_world_size": 2}, "fewer than min_world_size=2"),
        ("3", {"max_world_size": 2}, "more than max_world_size=2"),
    ],
)
def test_an_elastic_session_refuses_a_launch_outside_its_bounds_at_entry(
    monkeypatch: pytest.MonkeyPatch, launched: str, bounds: dict[str, int], said: str
) -> None:
    """Launched by hand (or torchrun): the entry refuses before it reaches the
    coordinator (none listens at this address) or starts anything."""
    monkeypatch.setenv("ASYNCDIST_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", launched)
    with pytest.raises(ValueError, match=said), DistSession(elastic=True, timeout=3, **bounds):
        pass


# -- many re-forms: nothing of a world outlives it ------------------------------------------


REFORMS = 50


def _footprint(coordinator: Any) -> tuple[int, int, list[str]]:
    import gc

    import psutil

    gc.collect()
    return (
        len(os.listdir("/proc/self/task")),
        psutil.Process().memory_info().rss,
        sorted(coordinator.store.list_keys()),
    )


async def _soak(s: DistSession) -> dict[str, Any]:
    from asyncdist._membership import Coordinator, connect, coordinator_address, member_id

    address = coordinator_address()
    assert address is not None
    coordinator = Coordinator(connect(address, TIMEOUT), member_id(), TIMEOUT)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = s.elastic_state(model=model, optimizer=opt, step=0)
    sync = s.gradient_sync(model)
    seen: dict[int, tuple[int, int, list[str]]] = {}
    took = []
    ended = 0.0
    async for world in s.elastic(state):
        if world.generation:
            took.append(time.monotonic() - ended)
        if world.generation in (10, REFORMS - 1):  # in the last, a rank may have left
            seen[world.generation] = _footprint(coordinator)
        async with world:
            steps = 0
            while world.generation < REFORMS:
                _step(model, opt, state.step, world.rank)
                await sync
                opt.step()
                state.step += 1
                steps += 1
                state.commit()
                if s.rank == 0 and steps == 2:  # the world ends, as for a silent peer
                    coordinator.end(world.generation, "soak")
        ended = time.monotonic()
    return {"seen": seen, "params": _params(model), "took": sorted(took)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fifty_re_forms_leave_threads_memory_and_store_keys_flat() -> None:
    """Each world is ended through the coordinator (the path a silent peer
    takes: the watcher hears it and fails what is outstanding), and the
    ranks re-form with the same members, 50 times."""
    results = spawn(_soak, 2, elastic=True, timeout=TIMEOUT, join_timeout=280)
    for result in results:
        (threads_10, rss_10, keys_10) = result["seen"][10]
        (threads_50, rss_50, keys_50) = result["seen"][REFORMS - 1]
        assert threads_50 == threads_10
        assert len(keys_50) <= len(keys_10), (keys_10, keys_50)
        assert rss_50 < rss_10 * 1.05, (rss_10, rss_50)
        assert result["took"][-1] < TIMEOUT + REFORM_GRACE
    assert _bitwise(results[0]["params"], results[1]["params"])


# -- a silent rank, and a slow one ----------------------------------------------------------

QUICK = 3.0  # a short session timeout: a silent peer is found at this bound


def _mark(folder: str, name: str, text: str = "") -> None:
    with open(os.path.join(folder, name), "w") as file:
        file.write(text)


def _await_mark(folder: str, name: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(os.path.join(folder, name)):
        assert time.monotonic() < deadline, f"no {name} mark within {TIMEOUT:g} s"
        time.sleep(0.02)


async def _stopped_and_resumed(s: DistSession, folder: str) -> dict[str, Any]:
    launch_rank = s.rank
    _mark(folder, f"pid.{launch_rank}", str(os.getpid()))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = s.elastic_state(model=model, optimizer=opt, step=0)
    sync = s.gradient_sync(model)
    worlds = []
    try:
        async for world in s.elastic(state):
            worlds.append((world.generation, world.world_size))
            if world.generation == 1 and world.rank == 0:
                _mark(folder, "world1")
            async with world:
                while state.step < 40:
                    _step(model, opt, state.step, world.rank)
                    await sync
                    opt.step()
                    state.step += 1
                    state.commit()
                    if state.step == 3 and world.generation == 0:
                        _mark(folder, f"step3.{launch_rank}")
                    await anyio.sleep(0.05)
    except MembershipLost as exc:
        return {"worlds": worlds, "lost": exc.why}
    return {"worlds": worlds, "params": _params(model)}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_stopped_rank_is_left_behind_and_told_so_when_it_resumes(tmp_path: Any) -> None:
    """SIGSTOP: the others' collectives time out, they re-form without it
    (its heartbeat stood still); SIGCONT once they did: it is evicted."""
    import concurrent.futures

    folder = str(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            spawn,
            _stopped_and_resumed,
            3,
            args=(folder,),
            elastic=True,
            min_world_size=2,
            timeout=QUICK,
            join_timeout=80,
        )
        victim = None
        try:
            deadline = time.monotonic() + 40
            while not (tmp_path / "step3.2").exists():
                assert time.monotonic() < deadline, "rank 2 never reached step 3"
                time.sleep(0.05)
            victim = int((tmp_path / "pid.2").read_text())
            os.kill(victim, signal.SIGSTOP)
            stopped = time.monotonic()
            while not (tmp_path / "world1").exists():
                assert time.monotonic() - stopped < QUICK + 2 * REFORM_GRACE + 5, "no re-form"
                time.sleep(0.05)
            reformed = time.monotonic() - stopped
        finally:
            if victim is not None:
                os.kill(victim, signal.SIGCONT)
        results = running.result()
    first, second, stopped_rank = results
    assert first["worlds"] == [(0, 3), (1, 2)]
    assert second["worlds"] == [(0, 3), (1, 2)]
    assert _bitwise(first["params"], second["params"])
    assert stopped_rank == {"worlds": [(0, 3)], "lost": "evicted"}
    assert reformed < QUICK + REFORM_GRACE + 3


async def _a_program_bug(s: DistSession) -> dict[str, Any]:
    """At step 3 rank 0 issues an allreduce no other rank issues (a bug in
    the program, not a lost peer): every world ends there, at the timeout."""
    model, opt, state, sync = _set_up(s)
    worlds = []
    started = time.monotonic()
    try:
        async for world in s.elastic(state):
            worlds.append((world.generation, world.world_size, state.step))
            async with world:
                while state.step < 6:
                    if s.rank == 0 and state.step == 3:
                        await s.allreduce(torch.ones(1))
                    _step(model, opt, state.step, world.rank)
                    await sync
                    opt.step()
                    state.step += 1
                    if state.step % 2 == 0:
                        state.commit()
    except MembershipLost as exc:
        return {
            "worlds": worlds,
            "why": exc.why,
            "message": str(exc),
            "cause": type(exc.__cause__).__name__,
            "took": time.monotonic() - started,
        }
    return {"worlds": worlds, "finished": True}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_program_error_with_every_rank_alive_ends_the_loop_instead_of_re_forming() -> None:
    """The world keeps failing at the same step with the same ranks and no
    commit: one re-form at the same commit is allowed (a passing fault), the
    second is refused on every rank, with the world's error chained."""
    results = spawn(_a_program_bug, 3, elastic=True, timeout=QUICK, join_timeout=80)
    for result in results:
        # world 0 committed at step 2 before failing; worlds 1 and 2 began there
        assert result["worlds"] == [(0, 3, 0), (1, 3, 2), (2, 3, 2)], result
        assert result["why"] == "no_progress"
        assert "every rank is alive" in result["message"]
        assert "program error" in result["message"]
        assert result["cause"] in ("CollectiveTimeout", "MembershipChanged", "PeerFailure")
        assert result["took"] < 3 * (QUICK + REFORM_GRACE)


async def _one_slow_step(s: DistSession) -> list[int]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = s.elastic_state(model=model, optimizer=opt, step=0)
    sync = s.gradient_sync(model)
    generations = []
    async for world in s.elastic(state):
        generations.append(world.generation)
        async with world:
            while state.step < 8:
                if s.rank == 1 and state.step == 3:
                    await anyio.sleep(QUICK / 2)  # slow, within the timeout
                _step(model, opt, state.step, world.rank)
                await sync
                opt.step()
                state.step += 1
                state.commit()
    return generations


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_slow_rank_within_the_timeout_is_not_expelled() -> None:
    results = spawn(_one_slow_step, 3, elastic=True, timeout=QUICK, join_timeout=50)
    assert results == [[0], [0], [0]]


# -- a partition: the majority goes on, the side cut off ends ------------------------------


def _partition(tmp_path: Any, *, spare_coordinator: bool) -> tuple[list[Any], float, float]:
    """Ranks 0 and 1 and the coordinator on namespace host 0, rank 2 on host
    1; once all three trained, every packet between the hosts is dropped
    (``spare_coordinator``: but the coordinator's port). What each rank
    wrote at its end, when the cut came, and the bound it had."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from netns import TwoHosts, missing, missing_firewall

    why = missing() or missing_firewall()
    if why:
        pytest.skip(why)
    worker = str(Path(__file__).resolve().parent / "elastic_worker.py")
    procs: list[subprocess.Popen[bytes]] = []
    with TwoHosts() as hosts:
        try:
            port = hosts.free_port(0)
            # the guide's way to host one by hand
            serve = ["-m", "asyncdist", "coordinator", "--host", hosts.addr[0]]
            serve += ["--port", str(port), "--timeout", "60"]
            procs.append(subprocess.Popen(hosts.command(0, [sys.executable, *serve])))
            time.sleep(1.0)  # the coordinator listens (the ranks' clients retry meanwhile)
            for rank, host in enumerate((0, 0, 1)):
                env = hosts.env(
                    host,
                    RANK=str(rank),
                    WORLD_SIZE="3",
                    ASYNCDIST_COORDINATOR=f"{hosts.addr[0]}:{port}",
                )
                command = hosts.command(host, [sys.executable, worker, str(tmp_path)])
                procs.append(subprocess.Popen(command, env=env))
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"ready.{r}").exists() for r in range(3)):
                assert time.monotonic() < deadline, "the ranks never got ready"
                time.sleep(0.05)
            hosts.drop(sparing=port if spare_coordinator else None)
            cut = time.time()
            bound = 3.0 + 3 * REFORM_GRACE + 10
            while not all((tmp_path / f"done.{r}.json").exists() for r in range(3)):
                assert time.time() - cut < bound, "a rank neither went on nor ended"
                time.sleep(0.1)
            done = [json.loads((tmp_path / f"done.{r}.json").read_text()) for r in range(3)]
        finally:
            hosts.heal()
            for proc in procs:
                proc.kill()
                proc.wait()
    return done, cut, bound


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spare_coordinator", "told"),
    [(False, "coordinator"), (True, "evicted")],
    ids=["cut-from-the-coordinator", "the-coordinator-spans-the-cut"],
)
def test_a_partition_leaves_the_connected_majority_training_and_ends_the_cut_off_rank(
    tmp_path: Any, spare_coordinator: bool, told: str
) -> None:
    """The two on the coordinator's host go on as a world of 2; never two
    worlds at once. Rank 2, cut off from its peers and (first case) the
    coordinator alike, ends with MembershipLost("coordinator"). When every
    rank still reaches the coordinator (second case), rank 2 reports too:
    the probes show it reaches neither peer, the two that reach each other
    go on (a world of all three would never form), and rank 2 is told it
    was left out (MembershipLost("evicted"))."""
    (majority, other, cut_off), cut, bound = _partition(
        tmp_path, spare_coordinator=spare_coordinator
    )
    assert majority["worlds"] == other["worlds"] == [[0, 3], [1, 2]]
    assert majority["params"] == other["params"]
    assert cut_off["worlds"] == [[0, 3]]
    assert cut_off["lost"] == told
    assert cut_off["t"] - cut < bound


# -- torchrun: the survivor node goes on, the restarted worker joins --------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_under_torchrun_the_other_node_goes_on_and_the_restarted_worker_joins(
    tmp_path: Any,
) -> None:
    """Two namespace hosts, one worker each, static rendezvous: node 0's
    agent hosts the store, the coordinator. Node 1's worker dies; node 0's
    keeps its process and state, and node 1's agent restarts its worker,
    which joins instead of forming a world."""
    import json
    import sys
    from pathlib import Path

    from _hosts import run_on_hosts

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tools"))
    from netns import TwoHosts, missing

    why = missing()
    if why:
        pytest.skip(why)
    job = str(Path(__file__).resolve().parent / "elastic_torchrun_job.py")
    with TwoHosts() as hosts:
        port = hosts.free_port(0)
        commands = []
        for host in (0, 1):
            argv = [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2"),
                *("--nproc-per-node=1", f"--node-rank={host}", f"--master-addr={hosts.addr[0]}"),
                *(f"--master-port={port}", "--max-restarts=1", "--monitor-interval=0.5", job),
            ]
            env = hosts.env(host, ASYNCDIST_OUT=str(tmp_path), PYTHONPATH=str(root))
            commands.append((argv, env))
        ran = run_on_hosts(hosts, commands, timeout=150)
    for code, log in ran:
        assert code == 0, log[-3000:]
    survivor = json.loads((tmp_path / "done.0.0.json").read_text())
    joiner = json.loads((tmp_path / "done.1.1.json").read_text())
    assert not (tmp_path / "done.1.0.json").exists()
    # node 0's worker: world 0, then (alone, or already with the joiner, as
    # the restart and the dead worker's heartbeat race) from the commit at step 5
    assert survivor["worlds"][0] == [0, 0, 2, 0]
    assert survivor["worlds"][1][0::3] == [1, 5]
    last = survivor["worlds"][-1]
    assert last[1:3] == [0, 2]
    assert joiner["worlds"] == [[last[0], 1, 2, last[3]]]
    assert survivor["params"] == joiner["params"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_under_torchrun_on_one_node_the_restarted_workers_are_told_nobody_holds_the_state(
    tmp_path: Any,
) -> None:
    """One node, two workers: one dies, and torchrun's agent restarts both,
    so no worker kept the committed state. The restarted workers, joiners
    with nobody alive to take them in, end with MembershipLost naming the
    cause and what to launch instead, within the timeout (not hanging), and
    torchrun ends once its restarts are spent: the guide's documented case."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from _ports import free_port

    root = Path(__file__).resolve().parent.parent
    job = str(Path(__file__).resolve().parent / "elastic_torchrun_job.py")
    argv = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2"),
        *("--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=1"),
        *("--monitor-interval=0.5", job),
    ]
    env = {**os.environ, "ASYNCDIST_OUT": str(tmp_path), "PYTHONPATH": str(root)}
    env["ASYNCDIST_VICTIM"] = "0:1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.pop("ASYNCDIST_COORDINATOR", None)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0, "torchrun must report the failed job"
    assert not list(tmp_path.glob("done.*.json")), "no worker can have finished"
    lost = sorted(tmp_path.glob("lost.*.json"))
    assert [p.name for p in lost] == ["lost.0.0.1.json", "lost.0.1.1.json"], done.stderr[-3000:]
    for path in lost:
        record = json.loads(path.read_text())
        assert record["why"] == "too_few"
        assert "every member of its last world (2) is gone" in record["message"]
        assert "asyncdist.spawn(fn, n, elastic=True)" in record["message"]
        # told once the dead workers' heartbeats stood still for the timeout (4 s)
        assert record["elapsed"] < 4 + REFORM_GRACE + 10


@pytest.mark.timeout(30)
def test_an_elastic_entry_is_refused_while_a_forming_is_held_before_it_is_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that gave up on a forming refuses to enter an elastic
    session before the coordinator counts it in world 0 (its peers would
    otherwise wait for it until their timeout)."""
    import threading

    from _store_host import until_no_forming_is_held

    from asyncdist import InitError, _groups, _membership

    monkeypatch.setattr(_groups, "RENDEZVOUS_GRACE", 0.1)
    release = threading.Event()
    with pytest.raises(TimeoutError):
        _groups.rendezvous(lambda: release.wait(10), "the test's forming", 0.1)
    asked: list[object] = []
    monkeypatch.setattr(_membership, "coordinator_address", lambda: asked.append(1))
    try:
        with pytest.raises(InitError, match="this process gave up on the test's forming"):
            DistSession(elastic=True, rank=0, world_size=1, timeout=2).__enter__()
        assert asked == []  # refused before anything asked for the coordinator
    finally:
        release.set()
        until_no_forming_is_held()
