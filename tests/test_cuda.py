"""The CUDA / NCCL path: what a CPU machine can check, and the rest on a GPU.

Device selection and backend choice are tested with a fake device count;
tests that need a GPU are marked ``cuda`` and skip with the reason here
(benchmarks/gpu_check.py runs them on a GPU machine).
"""

from __future__ import annotations

import time

import pytest
import torch

from asyncdist import DistSession, InitError, spawn, wait_all
from asyncdist._env import choose_backend, choose_device
from asyncdist._handle import op_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_nccl = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
    reason="needs a CUDA GPU and a torch build with NCCL",
)


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_device_comes_from_local_rank_never_rank_modulo(fake_gpus: None) -> None:
    # global rank 13 on a node of 4 GPUs with LOCAL_RANK 1: cuda:1, not cuda:(13 % 4)
    assert choose_device(None, None, local_rank=1) == torch.device("cuda", 1)
    assert choose_device("cuda", None, local_rank=3) == torch.device("cuda", 3)
    assert choose_device("cuda:2", None, local_rank=0) == torch.device("cuda", 2)
    assert choose_device(None, "gloo", local_rank=1) == torch.device("cpu")
    assert choose_device("cpu", None, local_rank=1) == torch.device("cpu")


def test_more_local_ranks_than_gpus_is_an_init_error(fake_gpus: None) -> None:
    with pytest.raises(InitError, match="LOCAL_RANK=5"):
        choose_device(None, None, local_rank=5)


def test_no_gpu_means_cpu_and_no_division_by_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert choose_device(None, None, local_rank=7) == torch.device("cpu")


def test_backend_follows_the_device() -> None:
    assert choose_backend(None, torch.device("cuda", 0)) == "nccl"
    assert choose_backend(None, torch.device("cpu")) == "gloo"
    assert choose_backend("GLOO", torch.device("cuda", 0)) == "gloo"  # gloo carries CUDA too
    with pytest.raises(ValueError, match="CUDA device"):
        choose_backend("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        choose_backend("mpi", torch.device("cpu"))
    with pytest.raises(TypeError):
        choose_backend(3, torch.device("cpu"))  # type: ignore[arg-type]


def test_nccl_session_without_cuda_fails_before_forming_a_group() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the check is for machines without it")
    with pytest.raises((ValueError, InitError)):
        DistSession("nccl").__enter__()


# -- on a GPU --------------------------------------------------------------------------


@needs_nccl
@pytest.mark.cuda
def test_nccl_allreduce_on_one_gpu() -> None:
    with DistSession(device="cuda") as s:
        assert s.backend == "nccl"
        t = torch.full((1 << 20,), 2.0, device="cuda")
        h = s.allreduce(t, op="mean")
        assert s.allreduce(t).wait() is t  # stream-ordered after h: safe to use here
        torch.cuda.synchronize()
        assert h.done()
        assert t[0].item() == 2.0


@needs_nccl
@pytest.mark.cuda
def test_await_does_not_block_the_host_while_a_kernel_runs() -> None:
    import anyio

    async def main() -> float:
        async with DistSession(device="cuda") as s:
            a = torch.randn(8192, 8192, device="cuda")
            for _ in range(3):
                a = a @ a  # queue a few seconds' worth of work on the current stream
                a /= a.norm()
            h = s.allreduce(a)
            t0 = time.perf_counter()
            await h  # wakes at enqueue; the stream now waits on the collective
            host = time.perf_counter() - t0
            h.synchronize()  # now the host waits for the device
            assert h.done()
            return host

    assert anyio.run(main) < 0.5


def _gloo_cuda(s: DistSession) -> float:
    t = torch.full((1000,), float(s.rank + 1), device="cuda")
    return s.allreduce(t).wait()[0].item()


@needs_cuda
@pytest.mark.cuda
def test_gloo_with_cuda_tensors_two_ranks_on_one_gpu() -> None:
    assert spawn(_gloo_cuda, 2, backend="gloo", device="cpu") == [3.0, 3.0]


@needs_nccl
@pytest.mark.cuda
def test_one_session_serves_cpu_tensors_on_gloo_and_cuda_tensors_on_nccl() -> None:
    with DistSession() as s:  # the default on a CUDA machine
        assert (s.backend, s.device.type) == ("nccl", "cuda")
        metric = torch.ones(4)  # the quickstart's CPU tensor, unchanged
        grads = torch.full((1 << 20,), 2.0, device="cuda")
        on_cpu, on_gpu = s.allreduce(metric), s.allreduce(grads, op="mean")
        assert on_cpu.wait() is metric  # CPU: final once the handle completes
        assert not op_of(on_cpu).streamed
        assert op_of(on_gpu).streamed  # CUDA: stream-ordered
        both = wait_all([s.allreduce(torch.zeros(2)), s.allreduce(torch.zeros(2, device="cuda"))])
        both.synchronize()
        assert metric.tolist() == [1.0] * 4
        assert grads[0].item() == 2.0
        assert s.broadcast_object({"step": 1}).wait() == {"step": 1}  # the CPU side group
        with pytest.raises(ValueError, match=r"serves cuda:\d \(nccl\) and cpu \(gloo\)"):
            s.allreduce(torch.ones(1, device="meta"))
        if torch.cuda.device_count() > 1:
            other = (s.device.index + 1) % torch.cuda.device_count()
            with pytest.raises(ValueError, match=f"is on cuda:{other}"):
                s.allreduce(torch.ones(1, device=f"cuda:{other}"))


@needs_nccl
@pytest.mark.cuda
def test_backend_forces_one_backend_for_every_tensor() -> None:
    with DistSession(backend="nccl") as s, pytest.raises(ValueError, match="is on cpu"):
        s.allreduce(torch.ones(1))
