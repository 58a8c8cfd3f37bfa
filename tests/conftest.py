from __future__ import annotations

import threading
from collections.abc import Iterator

import psutil
import pytest
import torch
import torch.distributed as dist

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
