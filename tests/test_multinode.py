"""Multi-node on torchrun: two network namespaces as two hosts, 2 ranks each.

Needs root (network namespaces), ``ip`` and ``tc``; skips with the reason
otherwise. CI runs as root, so it runs there (also ``nox -s multinode``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _hosts import run_on_hosts  # noqa: E402

from tools.netns import TwoHosts, missing  # noqa: E402

JOB = Path(__file__).resolve().parent / "multinode_job.py"

pytestmark = pytest.mark.timeout(240)
needs_namespaces = pytest.mark.skipif(missing() is not None, reason=f"multi-node test {missing()}")


def _torchrun(tmp_path: Path, *extra: str, **env_extra: str) -> list[dict[str, object]]:
    with TwoHosts() as hosts:
        port = hosts.free_port(0)
        commands = []
        for host in (0, 1):
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={hosts.name[0]}:{port}",
                "--rdzv-id=asyncdist-test",
                # the namespaces' addresses are not this machine's hostname: say who hosts
                f"--rdzv-conf=is_host={'true' if host == 0 else 'false'}",
                "--monitor-interval=0.5",
                *extra,
                str(JOB),
            ]
            env = hosts.env(
                host,
                ASYNCDIST_OUT=str(tmp_path),
                PYTHONPATH=str(ROOT),
                **env_extra,
            )
            commands.append((argv, env))
        for code, log in run_on_hosts(hosts, commands, timeout=200):
            assert code == 0, log[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]


def _check(reports: list[dict[str, object]], per_host: int) -> None:
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert report["world"] == 4
        assert report["local_rank"] == rank % per_host
        assert report["sum"] == 6.0
        assert report["bcast"] == 3.0
        assert report["grads_equal"]
        # d(sum(Wx))/dW00 = sum of x[:, 0] over the batch of 4 = 4 * (rank + 1); averaged
        assert report["grad00"] == pytest.approx(4 * (1 + 2 + 3 + 4) / 4)


@needs_namespaces
def test_torchrun_two_hosts_four_ranks(tmp_path: Path) -> None:
    _check(_torchrun(tmp_path), per_host=2)


@needs_namespaces
@pytest.mark.parametrize("dies", [3, 0], ids=["rank3-on-host1", "rank0-on-host0"])
def test_torchrun_restart_across_two_hosts(tmp_path: Path, dies: int) -> None:
    """--max-restarts=1 on both hosts; one rank dies once after the group formed.

    torchrun restarts every worker on both hosts, but only the failed rank's
    host counts a restart (TORCHELASTIC_RESTART_COUNT is per node), so this
    passes only if the ranks agree on fresh store keys without that count.
    Rank 0's death also restarts the rank that leads that agreement."""
    reports = _torchrun(
        tmp_path, "--max-restarts=1", ASYNCDIST_FAIL_ONCE="1", ASYNCDIST_FAIL_RANK=str(dies)
    )
    assert (tmp_path / "died").read_text() == f"rank {dies} died once\n"
    _check(reports, per_host=2)
    failed_host = dies // 2
    counts = [1 if rank // 2 == failed_host else 0 for rank in range(4)]
    assert [r["attempt"] for r in reports] == counts, "torchrun's per-node restart counts"


def test_torchrun_restarts_after_a_worker_dies(tmp_path: Path) -> None:
    """--max-restarts=1 on one host (torchrun --standalone), rank 3 dies once:
    the job recovers and finishes. Needs no root."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        str(JOB),
    ]
    env = dict(
        os.environ,
        ASYNCDIST_OUT=str(tmp_path),
        ASYNCDIST_FAIL_ONCE="1",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "died").read_text() == "rank 3 died once\n"
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    _check(reports, per_host=4)
    assert all(r["attempt"] == 1 for r in reports), "the job finished in the second attempt"
