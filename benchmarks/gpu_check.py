"""The device check: the CUDA path on one GPU, in one command, under 5 minutes.

    python benchmarks/gpu_check.py          # results in $OUT (or benchmarks/results)

1. runs the CUDA-marked tests (pytest -m cuda);
2. two ranks on one GPU with gloo over CUDA tensors, and one rank with NCCL;
3. overlap of a real matmul stream with an NCCL allreduce issued on a side
   stream: efficiency as in the overlap benchmark;
4. that awaiting a handle never blocks the host while a kernel runs
   (host timestamps around ``await``, against the kernel's device time);
5. mixed devices in one default session: the quickstart's CPU tensor on
   gloo and CUDA tensors on NCCL, interleaved, awaited together; and, with
   two GPUs visible, the same with two NCCL ranks (one per GPU).

Prints a table and writes gpu_check.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))


def _cuda_tests() -> dict[str, Any]:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "tests/test_cuda.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    return {"returncode": done.returncode, "summary": tail[0], "seconds": time.monotonic() - t0}


def _gloo_ranks(s: Any) -> float:
    import torch

    t = torch.full((1 << 20,), float(s.rank + 1), device="cuda")
    return float(s.allreduce(t).wait()[0].item())


def _mixed(s: Any) -> dict[str, Any]:
    """One default session: CPU metrics on gloo, CUDA gradients on NCCL."""
    import anyio
    import torch

    from asyncdist import wait_all
    from asyncdist._handle import op_of

    async def main() -> dict[str, Any]:
        metric = torch.ones(4) * (s.rank + 1)  # the quickstart's CPU tensor
        grads = torch.full((1 << 22,), float(s.rank + 1), device=s.device)
        handles = [s.allreduce(metric), s.allreduce(grads, op="mean")]
        for _ in range(20):  # interleaved, as a training loop issues them
            handles += [s.allreduce(torch.ones(1)), s.allreduce(torch.ones(8, device=s.device))]
        await wait_all(handles)
        torch.cuda.synchronize()
        world = s.world_size
        return {
            "backend": s.backend,
            "cpu_sum_ok": metric.tolist() == [world * (world + 1) / 2] * 4,
            "cuda_mean_ok": grads[0].item() == (world + 1) / 2,
            "streamed": [op_of(h).streamed for h in handles[:2]],
        }

    return anyio.run(main)


def _nccl_checks() -> dict[str, Any]:
    import anyio
    import torch

    from asyncdist import DistSession

    out: dict[str, Any] = {}

    async def main() -> None:
        async with DistSession(device="cuda", timeout=60) as s:
            out["backend"] = s.backend
            n = 4096
            a = torch.randn(n, n, device="cuda")
            grads = torch.randn(64 << 20 >> 2, device="cuda")  # 64 MiB
            torch.cuda.synchronize()

            def matmuls(k: int) -> None:
                x = a
                for _ in range(k):
                    x = x @ a
                    x /= 1000.0

            # calibrate: matmul time and allreduce time, alone
            def timed(fn: Any) -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            compute = statistics.median(timed(lambda: matmuls(8)) for _ in range(5))
            comm = statistics.median(timed(lambda: s.allreduce(grads).wait()) for _ in range(5))
            side = torch.cuda.Stream()
            seq, ovl = [], []
            for _ in range(7):
                seq.append(timed(lambda: (s.allreduce(grads).wait(), matmuls(8))))

                def overlapped() -> None:
                    with torch.cuda.stream(side):
                        h = s.allreduce(grads)
                    matmuls(8)
                    h.wait()  # the current stream waits for the collective

                ovl.append(timed(overlapped))
            seq_s, ovl_s = statistics.median(seq), statistics.median(ovl)
            bound = max(comm, compute)
            out.update(
                comm_s=comm,
                compute_s=compute,
                sequential_s=seq_s,
                overlapped_s=ovl_s,
                efficiency=(seq_s - ovl_s) / (seq_s - bound) if seq_s > bound else 0.0,
            )
            # awaiting must not block the host while a long kernel runs
            matmuls(40)
            h = s.allreduce(grads)
            t0 = time.perf_counter()
            await h
            out["await_host_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            h.synchronize()
            out["synchronize_host_s"] = time.perf_counter() - t1
            out["done_after_synchronize"] = h.done()

    anyio.run(main)
    return out


def main() -> int:
    import torch

    from asyncdist import spawn

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 3
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    results["cuda_tests"] = _cuda_tests()
    results["gloo_cuda_two_ranks"] = spawn(
        _gloo_ranks, 2, backend="gloo", device="cpu", timeout=120
    )
    results["nccl"] = _nccl_checks()
    results["mixed_one_rank"] = spawn(_mixed, 1, backend=None, timeout=120)
    if torch.cuda.device_count() > 1:
        results["mixed_two_ranks"] = spawn(_mixed, 2, backend=None, timeout=120)
    n = results["nccl"]
    rows = [
        ("CUDA tests", results["cuda_tests"]["summary"]),
        ("gloo, 2 ranks, CUDA tensors", str(results["gloo_cuda_two_ranks"])),
        ("NCCL allreduce 64 MiB alone", f"{n['comm_s'] * 1e3:.2f} ms"),
        ("matmul stream alone", f"{n['compute_s'] * 1e3:.2f} ms"),
        ("overlap efficiency (goal >= 0.95)", f"{n['efficiency']:.3f}"),
        ("host time in `await` during a long kernel", f"{n['await_host_s'] * 1e3:.2f} ms"),
        ("host time in synchronize()", f"{n['synchronize_host_s'] * 1e3:.1f} ms"),
        ("mixed CPU+CUDA session, 1 rank", str(results["mixed_one_rank"])),
        ("mixed, 2 NCCL ranks", str(results.get("mixed_two_ranks", "one GPU: not run"))),
    ]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"asyncdist device check on {results['device']}")
    table.add_column("check")
    table.add_column("result", justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    out_dir = Path(os.environ.get("OUT") or HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out_dir / 'gpu_check.json'}")
    return 0 if results["cuda_tests"]["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
