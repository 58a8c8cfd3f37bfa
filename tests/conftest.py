from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Generator, Iterator
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
from _stall import StallMeter, no_stall

torch.set_num_threads(1)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    """Every test leaves no process group, no child process and no extra thread."""
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    assert not dist.is_initialized(), "test left the default process group initialised"
    children = [
        child
        for child in psutil.Process().children(recursive=True)
        # multiprocessing's one shared helper, started with the first spawn
        if "resource_tracker" not in " ".join(child.cmdline())
    ]
    assert not children, f"test left child processes: {children}"
    extra = [
        t
        for t in threading.enumerate()
        if t.ident not in threads_before and t.name.startswith("asyncdist")
    ]
    for thread in extra:
        thread.join(5)
    assert not [t for t in extra if t.is_alive()], f"test left threads: {extra}"


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Run every async test inside :func:`_stall.no_stall` (DESIGN: "Async
    tests run under a check that fails them when the loop stalls").

    The test function is swapped for a coroutine function that runs it under
    the check, *before* either plugin reads it:

    * anyio's ``pytest_pyfunc_call`` reads ``item.obj`` and runs it with the
      test's fixtures as keyword arguments on the ``anyio_backend``'s loop;
    * pytest-asyncio's ``runtest`` wraps ``item.obj`` in a sync runner before
      ``pytest_pyfunc_call`` is even called, which is why the swap happens
      here and not in that hook.

    ``functools.wraps`` keeps the name and signature; fixtures are injected by
    name from ``item._fixtureinfo`` in both plugins, so nothing else changes.
    """
    original = getattr(item, "obj", None)
    under_plugin = isinstance(item, pytest.Function) and (
        "anyio_backend" in item.funcargs or item.get_closest_marker("asyncio") is not None
    )
    if not (under_plugin and inspect.iscoroutinefunction(original)):
        yield
        return
    assert original is not None

    @functools.wraps(original)
    async def checked(*args: Any, **kwargs: Any) -> Any:
        meter: StallMeter | None = None
        try:
            async with no_stall(what=item.name) as meter:
                return await original(*args, **kwargs)
        finally:
            if meter is not None:  # in the report (junit XML, report hooks): noise surveys
                item.user_properties.append(("max_loop_stall", round(meter.max_stall, 4)))

    item.obj = checked  # type: ignore[attr-defined]
    try:
        yield
    finally:
        item.obj = original  # type: ignore[attr-defined]
