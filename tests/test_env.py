from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
from _ports import listening

from asyncdist._env import (
    bind_loopback,
    detect,
    first_slurm_host,
    is_loopback,
)
from asyncdist._groups import gloo_on_loopback
from asyncdist.errors import InitError


def test_local_default_is_one_process_on_loopback() -> None:
    env = detect({})
    assert env.launcher == "local"
    assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
    assert env.master_addr == "127.0.0.1"
    assert env.master_port is None, "the local default takes its port from the OS"


def test_torchrun_environment() -> None:
    env = detect(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "2",
        }
    )
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size, env.local_rank) == (5, 8, 1)
    assert (env.master_addr, env.master_port) == ("node0", 29400)
    assert env.agent_store
    assert env.attempt == 2


SLURM = {  # a task of `srun` (step 0) in job 123456
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "2",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[007-008,012],cpu1",
}


def test_slurm_environment_uses_global_procid() -> None:
    env = detect(SLURM)
    assert env.launcher == "slurm"
    assert env.rank == 6, "the global rank is SLURM_PROCID, not SLURM_LOCALID"
    assert env.local_rank == 2
    assert env.world_size == 8
    assert env.master_addr == "gpu007"
    assert env.master_port is not None
    assert 1024 < env.master_port < 65536
    assert detect(SLURM).master_port == env.master_port, "every rank derives the same port"


def test_slurm_master_is_the_first_node_of_the_step() -> None:
    """A step may run on a subset of the job's nodes (`srun -N1 -r1` in a
    batch script): its rank 0 is on the step's first node, not the job's."""
    env = detect({**SLURM, "SLURM_STEP_NODELIST": "gpu[008,012]"})
    assert env.master_addr == "gpu008"


def test_slurm_port_is_the_jobs_for_step_0_and_differs_per_step() -> None:
    step0 = detect(SLURM).master_port
    assert step0 == 20000 + 123456 % 20000
    ports = {detect({**SLURM, "SLURM_STEP_ID": str(step)}).master_port for step in range(50)}
    assert len(ports) == 50, "concurrent steps of one job must not share a port"
    assert all(p is not None and 20000 <= p < 40000 for p in ports)


def test_slurm_batch_script_of_a_multi_task_job_is_refused() -> None:
    """sbatch runs its script with SLURM_PROCID=0 and the job's SLURM_NTASKS but
    no step id: a session there would wait for peers nobody starts."""
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    with pytest.raises(InitError, match=r"batch script of SLURM job 123456 .*srun"):
        detect(batch)
    assert detect({**batch, "SLURM_NTASKS": "1"}).world_size == 1, "a one-task job is fine"
    assert detect(batch, rank=0, world_size=1).world_size == 1, "explicit arguments win"
    assert detect({**batch, "SLURM_STEPID": "0"}).world_size == 8, "the older name counts"


def test_slurm_explicit_master_needs_no_node_list() -> None:
    env = detect({**SLURM, "SLURM_JOB_NODELIST": ""}, master_addr="head")
    assert env.master_addr == "head"


def test_slurm_master_port_and_addr_from_environment_win() -> None:
    env = detect({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "31000"})
    assert (env.master_addr, env.master_port) == ("head", 31000)


def test_torchrun_wins_over_slurm() -> None:
    env = detect({**SLURM, "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"})
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size) == (1, 2)


def test_explicit_arguments_win() -> None:
    env = detect(SLURM, rank=1, world_size=4, master_addr="10.0.0.1", master_port=999)
    assert (env.rank, env.world_size) == (1, 4)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 999)
    explicit = detect({}, rank=0, world_size=2, master_port=1234)
    assert explicit.launcher == "explicit"


def test_explicit_master_is_not_the_agent_store() -> None:
    torchrun = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_PORT": "1000",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    assert detect(torchrun).agent_store
    assert detect(torchrun, master_port=1000).agent_store
    assert not detect(torchrun, master_port=2000).agent_store, "rank 0 must host its own store"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("gpu[007-010,12]", "gpu007"),
        ("gpu[3,5-6],cpu[1-2]", "gpu3"),
        ("a-b-c[10-11]", "a-b-c10"),
        ("node[1-4]-ib,login1", "node1-ib"),
        ("rack[2-3]-n[05-08]", "rack2-n05"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize(
    ("environ", "kwargs", "match"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, {}, "outside"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, {}, "not an integer"),
        ({}, {"world_size": 2, "rank": 0}, "master port"),
        ({}, {"world_size": 0}, "at least 1"),
        ({}, {"world_size": 2, "rank": 0, "master_port": 70000}, "outside 1..65535"),
    ],
)
def test_inconsistent_environment_raises(
    environ: dict[str, str], kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(InitError, match=match):
        detect(environ, **kwargs)


def test_bind_loopback_listens_on_loopback_only() -> None:
    sock = bind_loopback()
    try:
        host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1"
        assert port > 0
        with socket.create_connection((host, port), timeout=2):
            pass
    finally:
        sock.close()


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1")
    assert is_loopback("127.1.2.3")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("node0")


IFNAME = "GLOO_SOCKET_IFNAME"
needs_lo = pytest.mark.skipif(
    not {"lo", "lo0"} & {name for _, name in socket.if_nameindex()},
    reason="no loopback interface named lo/lo0",
)


@needs_lo
def test_gloo_env_write_excludes_other_group_creations(monkeypatch: pytest.MonkeyPatch) -> None:
    """While one creation has GLOO_SOCKET_IFNAME set, another waits, then sees it gone."""
    monkeypatch.delenv(IFNAME, raising=False)
    inside, release, entered = threading.Event(), threading.Event(), threading.Event()
    seen: list[str | None] = []

    def loopback_creation() -> None:
        with gloo_on_loopback(True):
            inside.set()
            release.wait(10)

    def other_creation() -> None:  # e.g. a multi-node session opening in another thread
        with gloo_on_loopback(False):
            seen.append(os.environ.get(IFNAME))
            entered.set()

    first = threading.Thread(target=loopback_creation)
    first.start()
    second = threading.Thread(target=other_creation)
    try:
        assert inside.wait(5)
        assert os.environ.get(IFNAME) in ("lo", "lo0"), "the write is scoped to the block"
        second.start()
        assert not entered.wait(0.3), "another creation must wait while the variable is set"
    finally:
        release.set()
        first.join(5)
        if second.ident is not None:
            second.join(5)
    assert entered.is_set()
    assert seen == [None], "the other creation must not read the loopback value"
    assert IFNAME not in os.environ


@needs_lo
def test_gloo_env_write_is_undone_on_error_and_nests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IFNAME, raising=False)
    with pytest.raises(KeyError), gloo_on_loopback(True):
        with gloo_on_loopback(True):  # reentrant: a creation inside a creation
            assert os.environ.get(IFNAME) in ("lo", "lo0")
        assert os.environ.get(IFNAME) in ("lo", "lo0"), "the outer block owns the write"
        raise KeyError("creation failed")
    assert IFNAME not in os.environ


def test_gloo_env_never_overrides_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IFNAME, "eth7")
    with gloo_on_loopback(True):
        assert os.environ[IFNAME] == "eth7"
    assert os.environ[IFNAME] == "eth7"


@needs_lo
def test_gloo_group_made_under_gloo_on_loopback_listens_on_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(IFNAME, raising=False)
    before = listening()
    try:
        with gloo_on_loopback(True):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert IFNAME not in os.environ
        t = torch.ones(2)
        dist.all_reduce(t)
        gloo = listening() - before  # a HashStore listens nowhere: these are gloo's
        assert gloo, "gloo's device listens"
        assert all(is_loopback(ip) for ip, _ in gloo), gloo
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_nccl_without_any_gpu_says_so_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncdist import DistSession

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA device; this machine has none") as info:
        DistSession(backend="nccl").__enter__()
    assert "backend='gloo'" in str(info.value)
    assert "sees" not in str(info.value)
    with pytest.raises(InitError, match="no CUDA device"):
        DistSession(device="cuda").__enter__()
