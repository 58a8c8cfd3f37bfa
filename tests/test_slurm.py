"""Real SLURM: srun and sbatch on a throwaway two-node cluster (tools/slurm.py).

Each node is a network namespace with its own hostname; slurmctld, two
slurmd and munged run as root for each test and are stopped, with every
process they started, when it ends. The job (tests/slurm_job.py) gets
nothing from the test but SLURM's own environment: its rank, world and
master come from what srun gives every task.

Needs root and the SLURM packages (``apt-get install -y slurm-wlm munge``);
skips with the reason otherwise. Marked slow: each job starts 2-4 Python
processes with torch on two cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.slurm import SlurmCluster, leftovers, missing  # noqa: E402

JOB = Path(__file__).resolve().parent / "slurm_job.py"
LAUNCHING = ROOT / "docs" / "guides" / "launching.md"
BATCH = re.compile(r"^```bash\n(#!/bin/bash\n.*?)^```", re.S | re.M)
JOB_TIMEOUT = 150  # seconds for one srun/sbatch (a healthy one takes 10-20)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(missing() is not None, reason=f"real SLURM test {missing()}"),
]


@pytest.fixture
def cluster() -> Iterator[SlurmCluster]:
    """A fresh cluster per test (it starts in about two seconds), so each test
    also checks that stopping one leaves nothing behind."""
    with SlurmCluster() as c:
        directory, namespaces = c.dir, c.nodes.ns
        yield c
    assert not leftovers(directory), "a process of the cluster outlived it"
    assert not directory.exists()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    assert not set(namespaces) & set(listed.stdout.split())


def _submit(
    cluster: SlurmCluster, workdir: Path, argv: list[str]
) -> subprocess.CompletedProcess[str]:
    """Run a client in ``workdir`` with this interpreter first on PATH (the job
    says plain ``python``, as on a cluster with the environment activated)."""
    path = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    return cluster.run(argv, cwd=workdir, timeout=JOB_TIMEOUT, env={"PATH": path})


def _job_id(done: subprocess.CompletedProcess[str]) -> int:
    """The job id ``sbatch`` printed."""
    found = re.search(r"Submitted batch job (\d+)", done.stdout)
    assert found, done.stdout + done.stderr
    return int(found.group(1))


def _reports(workdir: Path, world: int) -> list[dict[str, object]]:
    found = sorted(workdir.glob("rank*.json"))
    assert len(found) == world, [p.name for p in found]
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]


def _check(cluster: SlurmCluster, reports: list[dict[str, object]], per_node: int) -> None:
    world = len(reports)
    first = cluster.node_names[0]
    for rank, r in enumerate(reports):
        assert r["launcher"] == "slurm"
        assert r["preset"] == [], "the test must not set the launch variables"
        assert (r["rank"], r["world"]) == (rank, world)
        assert r["rank"] == r["procid"], "the global rank is SLURM_PROCID"
        assert r["local_rank"] == r["localid"] == rank % per_node, "local rank is SLURM_LOCALID"
        assert r["host"] == cluster.node_names[rank // per_node]
        assert r["master_addr"] == first, "the master is the node list's first host"
        assert r["master_ip"] == cluster.nodes.addr[0]
        assert r["master_port"] == reports[0]["master_port"]
        assert r["sum"] == sum(range(world))
        assert r["grads_equal"]
        # d(sum(Wx))/dW00 over a batch of 4 rows of (rank + 1), averaged over ranks
        assert r["grad00"] == pytest.approx(4 * sum(range(1, world + 1)) / world)


def test_srun_two_tasks(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = _submit(cluster, tmp_path, ["srun", "-n", "2", "python", str(JOB)])
    assert done.returncode == 0, done.stderr[-3000:]
    _check(cluster, _reports(tmp_path, 2), per_node=2)


def test_srun_ntasks_per_node_across_two_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    """Ranks 2 and 3 run on the second node with local ranks 0 and 1."""
    argv = ["srun", "-N", "2", "--ntasks-per-node=2", "python", str(JOB)]
    done = _submit(cluster, tmp_path, argv)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = _reports(tmp_path, 4)
    _check(cluster, reports, per_node=2)
    assert cluster.job_state(int(str(reports[0]["job_id"])))["JobState"] == "COMPLETED"


def test_sbatch_wait_runs_the_documented_script(cluster: SlurmCluster, tmp_path: Path) -> None:
    """docs/guides/launching.md's batch script, verbatim, with the job as train.py."""
    scripts = BATCH.findall(LAUNCHING.read_text())
    assert len(scripts) == 1, "launching.md holds one batch script"
    assert "srun python train.py" in scripts[0]
    (tmp_path / "train.sbatch").write_text(scripts[0])
    shutil.copy(JOB, tmp_path / "train.py")
    done = _submit(cluster, tmp_path, ["sbatch", "--wait", "train.sbatch"])
    job_id = _job_id(done)
    output = tmp_path / f"slurm-{job_id}.out"
    log = output.read_text()[-3000:] if output.exists() else "(no output file)"
    assert done.returncode == 0, f"{done.stderr}\n{log}"
    _check(cluster, _reports(tmp_path, 4), per_node=2)
    state = cluster.job_state(job_id)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0")


def test_sbatch_steps_on_part_of_the_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    """Two steps of one job: one on both nodes, then one on the second node only,
    whose master is that node (the step's node list), not the job's first.
    Before them, the job run in the batch script itself (not a task) fails at
    once with InitError instead of waiting for 3 peers."""
    (tmp_path / "steps.sbatch").write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\nset -e\n"
        f"if python {JOB} 2> batch.err; then exit 9; fi\n"
        f"mkdir all part\n(cd all && srun python {JOB})\n"
        f"(cd part && srun -N 1 -r 1 -n 2 python {JOB})\n"
    )
    done = _submit(cluster, tmp_path, ["sbatch", "--wait", "steps.sbatch"])
    job_id = _job_id(done)
    output = tmp_path / f"slurm-{job_id}.out"
    assert done.returncode == 0, output.read_text()[-3000:] if output.exists() else done.stderr
    assert "InitError: this process is the batch script of SLURM job" in (
        (tmp_path / "batch.err").read_text()
    )
    _check(cluster, _reports(tmp_path / "all", 4), per_node=2)
    part = _reports(tmp_path / "part", 2)
    second = cluster.node_names[1]
    assert [r["host"] for r in part] == [second, second]
    assert [r["master_addr"] for r in part] == [second, second]
    assert [(r["rank"], r["local_rank"], r["world"]) for r in part] == [(0, 0, 2), (1, 1, 2)]
    assert part[0]["sum"] == 1.0
    assert part[0]["grads_equal"]


def test_task_exiting_early_fails_its_peers_and_the_job(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Rank 3 exits with status 3 after the group formed: ranks 0-2 raise
    PeerFailure within the session timeout (plus a few seconds), srun exits
    non-zero and SLURM records the job as failed."""
    argv = ["srun", "-N", "2", "--ntasks-per-node=2", "python", str(JOB), "die"]
    done = _submit(cluster, tmp_path, argv)
    assert done.returncode != 0, "srun must report the failed task"
    assert "task 3: Exited with exit code 3" in done.stderr, done.stderr[-3000:]
    survivors = sorted(tmp_path.glob("rank*.json"))
    assert [p.name for p in survivors] == ["rank0.json", "rank1.json", "rank2.json"]
    reports = [json.loads(path.read_text()) for path in survivors]
    for report in reports:
        assert report["error"] == "PeerFailure", report
        assert f"rank {report['rank']}" in str(report["message"])
        # the session timeout in slurm_job.py is 20 s; "a few seconds" more at most
        assert float(str(report["elapsed"])) < 20 + 10, "PeerFailure within the bound"
    state = cluster.job_state(int(str(reports[0]["job_id"])))
    assert state["JobState"] == "FAILED"
    assert state["ExitCode"] == "3:0"


ELASTIC_JOB = Path(__file__).resolve().parent / "elastic_slurm_job.py"


def _coordinators(cluster: SlurmCluster) -> list[int]:
    """The cluster's processes running ``asyncdist coordinator``."""
    found = []
    for pid in leftovers(cluster.dir):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"asyncdist" in argv and b"coordinator" in argv:
            found.append(pid)
    return found


def _elastic_reference(
    phases: tuple[tuple[int, int], ...] = ((2, 5), (1, 20)),
) -> list[list[float]]:
    """elastic_slurm_job.py's parameters, replayed in one process: each phase
    (world size, the step it ends before) from where the one before ended,
    each step the mean of the world's gradients. The default: steps 0-4 on
    two ranks, then, from the commit after step 4, steps 5-19 on one."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    for world, end in phases:
        for step in range(start, end):
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for rank in range(world):
                g = torch.Generator().manual_seed(1000 * step + rank)
                model.zero_grad()
                model(torch.randn(4, 6, generator=g)).sum().backward()
                for total, p in zip(grads, model.parameters(), strict=True):
                    assert p.grad is not None
                    total += p.grad / world
            for total, p in zip(grads, model.parameters(), strict=True):
                p.grad = total
            opt.step()
        start = end
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.mark.parametrize("victim", [0, 1])
def test_an_elastic_step_goes_on_when_a_task_is_killed(
    cluster: SlurmCluster, tmp_path: Path, victim: int
) -> None:
    """docs/guides/elastic.md's srun line: task ``victim`` SIGKILLs itself at
    step 5. The other task goes on alone in the same process, from the last
    commit, to the end; task 0 (the victim or not) hosted the coordinator in
    a sidecar that outlives it, and that sidecar exits by itself once the
    session is over."""
    argv = ["srun", "-N", "2", "-n", "2", "--kill-on-bad-exit=0", "python", str(ELASTIC_JOB)]
    done = _submit(cluster, tmp_path, [*argv, str(victim)])
    assert f"task {victim}: Killed" in done.stderr, done.stderr[-3000:]
    survivor = 1 - victim
    assert sorted(p.name for p in tmp_path.glob("done.*.json")) == [f"done.{survivor}.json"]
    report = json.loads((tmp_path / f"done.{survivor}.json").read_text())
    # world 0: both tasks; world 1: the survivor alone, from the commit of step 5
    assert report["worlds"] == [[0, survivor, 2, 0], [1, 0, 1, 5]]
    # the sidecar task 0 started still ran at the end, task 0 dead or not (the
    # two nodes share one /proc here, so the survivor sees it either way)
    assert report["sidecar"] is True
    want = _elastic_reference()
    for got, ref in zip(report["params"], want, strict=True):
        assert got == pytest.approx(ref, abs=1e-6)
    deadline = time.monotonic() + 20
    while _coordinators(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _coordinators(cluster), "the coordinator sidecar outlived its session"


def test_on_a_cluster_that_kills_on_bad_exit_the_guides_flag_keeps_the_survivor(
    tmp_path: Path,
) -> None:
    """A site with ``KillOnBadExit=1``: a plain ``srun`` ends the whole step
    when task 1 dies, survivor included (what the guide warns about); with
    the guide's ``--kill-on-bad-exit=0`` the survivor goes on to the end."""
    with SlurmCluster(kill_on_bad_exit=True) as strict:
        plain, flagged = tmp_path / "plain", tmp_path / "flagged"
        plain.mkdir()
        flagged.mkdir()
        argv = ["srun", "-N", "2", "-n", "2"]
        ended = _submit(strict, plain, [*argv, "python", str(ELASTIC_JOB), "1"])
        kept = _submit(
            strict, flagged, [*argv, "--kill-on-bad-exit=0", "python", str(ELASTIC_JOB), "1"]
        )
    assert ended.returncode != 0
    assert list(plain.glob("done.*.json")) == [], "the step was ended, survivor included"
    assert "task 1: Killed" in kept.stderr, kept.stderr[-3000:]
    report = json.loads((flagged / "done.0.json").read_text())
    assert report["worlds"] == [[0, 0, 2, 0], [1, 0, 1, 5]]


def test_an_elastic_step_takes_in_a_replacement_started_as_the_guide_says(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """docs/guides/elastic.md's replacement line, in a batch script: task 1
    of the elastic step dies at step 5; once task 0 trains alone, the script
    reads the coordinator's address from the line task 0 logged and starts
    the replacement as a step of its own (``srun --overlap``) on the dead
    task's node. It joins at a commit: a world of two again, both ending
    with the parameters of a one-process replay of the three worlds."""
    node1 = cluster.node_names[1]
    (tmp_path / "regrow.sbatch").write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
        f"srun -N 2 -n 2 --kill-on-bad-exit=0 python {ELASTIC_JOB} regrow 2> step.err &\n"
        "for i in $(seq 600); do [ -e world.0.1 ] && break; sleep 0.1; done\n"
        "addr=$(grep -o 'coordinator of this SLURM step is at [^ ]*' step.err "
        "| head -n 1 | awk '{print $NF}')\n"
        'echo "replacement for $addr"\n'
        "ASYNCDIST_COORDINATOR=$addr ASYNCDIST_ELASTIC_JOIN=1 \\\n"
        f"    srun --overlap --nodes=1 --ntasks=1 -w {node1} python {ELASTIC_JOB} join\n"
        "wait\n"
    )
    done = _submit(cluster, tmp_path, ["sbatch", "--wait", "regrow.sbatch"])
    output = tmp_path / f"slurm-{_job_id(done)}.out"
    log = output.read_text()[-3000:] if output.exists() else done.stderr
    err = (tmp_path / "step.err").read_text()[-3000:] if (tmp_path / "step.err").exists() else ""
    assert "replacement for " in log, log + err
    assert "replacement for \n" not in log, f"no address logged\n{log}{err}"
    assert sorted(p.name for p in tmp_path.glob("done.*.json")) == [
        "done.0.json",
        "done.join.json",
    ], log + err
    survivor = json.loads((tmp_path / "done.0.json").read_text())
    joiner = json.loads((tmp_path / "done.join.json").read_text())
    # worlds: both tasks; task 0 alone from the commit of step 5; task 0 and
    # the replacement, from the commit at which it was taken in
    (w0, w1, w2) = survivor["worlds"]
    assert (w0, w1) == ([0, 0, 2, 0], [1, 0, 1, 5])
    regrown = w2[3]
    assert w2 == [2, 0, 2, regrown]
    assert regrown > 5
    assert joiner["worlds"] == [[2, 1, 2, regrown]]
    assert joiner["params"] == survivor["params"]
    want = _elastic_reference(((2, 5), (1, regrown), (2, regrown + 5)))
    for got, ref in zip(survivor["params"], want, strict=True):
        assert got == pytest.approx(ref, abs=1e-6)
