"""The wake-up module: a completion signalled from any thread reaches the loop."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest
import trio

from asyncdist._wakeup import Callback, current_issuer, one_after_another, wait_for

pytestmark = pytest.mark.timeout(30)


class Watched:
    """Stands in for a torch Work/future: holds callbacks, fires them on demand."""

    def __init__(self, *, fire_on_add: bool = False) -> None:
        self.callbacks: list[Callback] = []
        self.added: list[Callback] = []
        self.removed: list[Callback] = []
        self.fired = False
        self.fire_on_add = fire_on_add

    def add(self, callback: Callback) -> None:
        self.added.append(callback)
        if self.fire_on_add or self.fired:
            callback()  # already complete: the callback runs at once, on this thread
        else:
            self.callbacks.append(callback)

    def remove(self, callback: Callback) -> None:
        self.removed.append(callback)
        if callback in self.callbacks:
            self.callbacks.remove(callback)

    def fire(self) -> None:
        self.fired = True
        for callback in list(self.callbacks):
            callback()


def _fire_from_thread(watched: Watched, delay: float) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        watched.fire()

    thread = threading.Thread(target=run, name="test-waker")
    thread.start()
    return thread


@pytest.mark.anyio
async def test_woken_from_another_thread() -> None:
    watched = Watched()
    thread = _fire_from_thread(watched, 0.05)
    try:
        with anyio.fail_after(5):
            await wait_for(watched.add, watched.remove)
    finally:
        thread.join()
    assert watched.fired
    assert len(watched.added) == 1


@pytest.mark.anyio
async def test_callback_firing_at_once_on_the_loop_thread() -> None:
    """The watched thing completed already: its callback runs inside add_callback."""
    watched = Watched(fire_on_add=True)
    with anyio.fail_after(5):
        await wait_for(watched.add, watched.remove)
    assert len(watched.added) == 1


@pytest.mark.anyio
async def test_callback_firing_before_the_task_sleeps() -> None:
    """A wake that arrives from another thread before the task has parked is kept."""
    watched = Watched()

    def add(callback: Callback) -> None:
        watched.add(callback)
        thread = threading.Thread(target=watched.fire, name="test-early-waker")
        thread.start()
        thread.join()  # fired before wait_for gets to sleep

    with anyio.fail_after(5):
        await wait_for(add, watched.remove)
    assert watched.fired


@pytest.mark.anyio
async def test_cancelling_removes_the_callback_and_leaves_the_watched_thing() -> None:
    watched = Watched()
    with anyio.move_on_after(0.05) as scope:
        await wait_for(watched.add, watched.remove)
    assert scope.cancelled_caught
    assert watched.removed == watched.added, "the cancelled waiter's callback was removed"
    assert watched.callbacks == []
    assert not watched.fired, "cancelling the wait touched nothing else"
    # A wake that raced with the cancellation is harmless.
    watched.added[0]()
    await anyio.sleep(0.01)
    # The watched thing can still be waited on afterwards.
    thread = _fire_from_thread(watched, 0.02)
    try:
        with anyio.fail_after(5):
            await wait_for(watched.add, watched.remove)
    finally:
        thread.join()


@pytest.mark.anyio
async def test_many_waiters_each_woken() -> None:
    watched = Watched()
    woken: list[int] = []

    async def waiter(i: int) -> None:
        await wait_for(watched.add, watched.remove)
        woken.append(i)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(waiter, i)
            await anyio.sleep(0.02)
            thread = _fire_from_thread(watched, 0.0)
    thread.join()
    assert sorted(woken) == list(range(20))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_wake_after_the_loop_closed_does_not_raise(backend: str) -> None:
    watched = Watched()

    async def main() -> None:
        with anyio.move_on_after(0.02):
            await wait_for(watched.add, lambda callback: None)  # never removed

    anyio.run(main, backend=backend)
    (wake,) = watched.added
    wake()  # from the thread that ran the (now closed) loop
    errors: list[BaseException] = []

    def from_thread() -> None:
        try:
            wake()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=from_thread)
    thread.start()
    thread.join()
    assert errors == []


# -- current_issuer -------------------------------------------------------------------


def test_issuer_outside_any_loop_is_the_thread() -> None:
    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(current_issuer()))
    thread.start()
    thread.join()
    here = current_issuer()
    assert here == f"thread {threading.get_ident()}"
    assert seen[0].startswith("thread ")
    assert seen[0] != here


@pytest.mark.anyio
async def test_issuer_is_the_task(anyio_backend: str) -> None:
    issuers: dict[str, str] = {}

    async def record(name: str) -> None:
        issuers[name] = current_issuer()

    async with anyio.create_task_group() as tg:
        tg.start_soon(record, "first", name="first")
        tg.start_soon(record, "second", name="second")
    kind = "trio task" if anyio_backend == "trio" else "asyncio task"
    assert issuers["first"].startswith(f"{kind} 'first'"), issuers
    assert issuers["second"].startswith(f"{kind} 'second'"), issuers
    assert issuers["first"] != issuers["second"]
    assert current_issuer().startswith(kind)
    # a plain thread started from the task is a thread, not the task
    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(current_issuer()))
    thread.start()
    thread.join()
    assert seen[0].startswith("thread ")


def test_issuer_same_name_tasks_differ() -> None:
    """Two asyncio tasks with one name are still told apart."""

    async def main() -> tuple[str, str]:
        async def issuer() -> str:
            return current_issuer()

        one = asyncio.create_task(issuer(), name="same")
        two = asyncio.create_task(issuer(), name="same")
        return await one, await two

    one, two = asyncio.run(main())
    assert one.startswith("asyncio task 'same'")
    assert two.startswith("asyncio task 'same'")
    assert one != two

    async def trio_main() -> list[str]:
        out: list[str] = []

        async def issuer() -> None:
            out.append(current_issuer())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(issuer, name="same")
            nursery.start_soon(issuer, name="same")
        return out

    first, second = trio.run(trio_main)
    assert first.startswith("trio task 'same'")
    assert first != second


def test_which_issuers_follow_each_other_by_construction() -> None:
    """The lane's check: a thread and the tasks on it; a helper family's
    hook launches and the launches a task makes for it; never two tasks,
    two families, or a helper of its own and anything else."""
    thread, task_a, task_b, other_thread = (11, 0), (11, 5), (11, 6), (12, 0)
    family, other_family, own = (-1, 7), (-1, 8), (-3, 9)
    follow = [
        (thread, task_a),
        (task_a, thread),
        (family, (*family, *task_a)),
        ((*family, *task_a), family),
        ((*family, *task_a), (*family, *thread)),
        (own, own),
    ]
    apart = [
        (task_a, task_b),
        (thread, other_thread),
        ((*family, *task_a), (*family, *task_b)),
        ((*family, *task_a), (*family, *other_thread)),
        (family, other_family),
        ((*family, *task_a), (*other_family, *task_a)),
        (family, task_a),
        ((*family, *task_a), task_a),
        (own, family),
        (own, (-3, 10)),
        ((-2, 0), family),
    ]
    for last, new in follow:
        assert one_after_another(last, new), (last, new)
    for last, new in apart:
        assert not one_after_another(last, new), (last, new)
        assert not one_after_another(new, last), (new, last)
