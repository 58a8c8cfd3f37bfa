"""A throwaway two-node SLURM cluster on this machine, for tests.

Each node is a network namespace with its own hostname and address (the
"hosts" of :mod:`tools.netns`): slurmctld and the first slurmd run on node 0,
the second slurmd on node 1, munged in the root namespace (its socket is a
file, which both nodes see, as they see every other file: the shared
filesystem of a real cluster). Clients (``srun``, ``sbatch``, ``sinfo``) run
on node 0, the login node. Node names resolve on both nodes, so a job finds
its master from the node list exactly as on a real cluster.

Everything lives in one temporary directory (munge key, ``slurm.conf``,
state, spool, logs), removed on exit. Every daemon, and through it every
``slurmstepd`` and task, carries a marker variable naming that directory;
leaving the ``with`` kills what carries it, so a failed or hung test leaves
nothing behind.

Needs root, ``munged``, ``slurmctld``, ``slurmd`` and the SLURM clients
(Debian: ``apt-get install -y slurm-wlm munge``), and what :mod:`tools.netns`
needs; :func:`missing` says what is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from tools.netns import TwoHosts
from tools.netns import missing as netns_missing

_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("srun", "sbatch", "sinfo", "scontrol", "scancel", "squeue")
_SBIN = os.pathsep.join(("/usr/sbin", "/usr/local/sbin", "/sbin"))
_MARKER = "ASYNCDIST_SLURM_CLUSTER"

# Variables of an enclosing launcher that would leak into the job: a test run
# under torchrun or inside a SLURM allocation must not hand its own rank on.
_LAUNCHER_VARS = re.compile(
    r"(SLURM_.*|SLURMD_.*|SBATCH_.*|SALLOC_.*|SRUN_.*|RANK|WORLD_SIZE|LOCAL_RANK|"
    r"LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|"
    r"GLOO_SOCKET_IFNAME|ASYNCDIST_.*)"
)


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.pathsep.join((os.environ.get("PATH", ""), _SBIN)))


def missing() -> str | None:
    """Why a cluster cannot be started here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (slurmd and munged run as root)"
    for tool in _DAEMONS + _CLIENTS:
        if _which(tool) is None:
            return f"needs '{tool}' (apt-get install -y slurm-wlm munge)"
    return netns_missing()


def version() -> str:
    """The installed SLURM's version, as ``slurmd -V`` prints it (the clients
    need a configuration even for ``--version``)."""
    out = subprocess.run(
        [_which("slurmd") or "slurmd", "-V"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


class _Nodes(TwoHosts):
    """Two namespace hosts named like cluster nodes: ``sl<tag>n0``, ``sl<tag>n1``,
    which SLURM writes as ``sl<tag>n[0-1]``."""

    def __init__(self) -> None:
        super().__init__()
        tag = f"{os.getpid() % 100000}"
        self.name = (f"sl{tag}n0", f"sl{tag}n1")


class SlurmCluster:
    """``with SlurmCluster() as c: c.run(["srun", "-n", "2", ...])``.

    Entering writes the configuration, starts munged, slurmctld and one slurmd
    per node, and waits (up to ``start_timeout`` seconds) until ``sinfo``
    shows every node idle. Leaving cancels every job, stops the daemons, kills
    whatever the cluster started that is still alive, deletes the namespaces
    and removes the directory, whatever state the cluster is in.
    """

    def __init__(
        self,
        cpus_per_node: int | None = None,
        start_timeout: float = 60.0,
        *,
        kill_on_bad_exit: bool = False,
    ) -> None:
        self.cpus = cpus_per_node or os.cpu_count() or 1
        self.start_timeout = start_timeout
        # KillOnBadExit=1, as some sites set it: a task's failure ends its step
        self.kill_on_bad_exit = kill_on_bad_exit
        self.dir = Path()
        self.nodes = _Nodes()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._hosts_up = False

    # -- paths and environment -------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def node_names(self) -> tuple[str, str]:
        return self.nodes.name[0], self.nodes.name[1]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a client on the login node: this machine's, less
        any launcher's variables, plus ``SLURM_CONF`` and the cleanup marker."""
        env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.fullmatch(k)}
        env["PATH"] = os.pathsep.join((env.get("PATH", ""), _SBIN))
        env["SLURM_CONF"] = str(self.conf)
        env[_MARKER] = str(self.dir)
        env.update(extra or {})
        return env

    def log(self, name: str) -> str:
        """The tail of one of the cluster's logs (``slurmctld``, ``slurmd-<node>``,
        ``munged``), for assertion messages."""
        path = self.dir / "log" / f"{name}.log"
        try:
            return path.read_text(errors="replace")[-3000:]
        except OSError:
            return f"(no {path})"

    # -- clients ----------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client on the login node (node 0) and wait for it.

        ``env`` adds to :meth:`env`. Raises ``subprocess.TimeoutExpired`` after
        ``timeout`` seconds (the client is killed; leaving the cluster kills its
        job).
        """
        return subprocess.run(
            self.nodes.command(0, list(argv)),
            env=self.env(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def job_state(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields for ``job_id`` (``JobState``, ``ExitCode``...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=30)
        fields: dict[str, str] = {}
        for item in out.stdout.split():
            key, sep, value = item.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    # -- lifecycle --------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.dir = Path(tempfile.mkdtemp(prefix="asyncdist-slurm-"))
        try:
            self.nodes.__enter__()
            self._hosts_up = True
            self._write_files()
            self._start_munge()
            self._start_daemons()
            self._wait_idle()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _write_files(self) -> None:
        for sub in ("munge", "log", "state", "spool"):
            (self.dir / sub).mkdir(mode=0o700)
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.dir / "plugstack.conf").write_text("")
        # `ip netns exec` mounts a fresh /sys, without cgroups; nothing here needs
        # them (proctrack/pgid, task/none), but slurmd 22.05 loads the plugin
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        for name in self.nodes.name:
            (self.dir / "spool" / name).mkdir(mode=0o700)
        (n0, n1), (a0, a1) = self.nodes.name, self.nodes.addr
        d = self.dir
        # MinJobAge=16: `sbatch --wait` sleeps 2, 8, then 32 s between polls, but
        # stops growing the sleep once it reaches MinJobAge / 2 (8 s here, not
        # 32); a finished job's record stays at least that long, long enough
        # for `scontrol show job` right after
        self.conf.write_text(
            f"""\
ClusterName=asyncdist
SlurmctldHost={n0}({a0})
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
KillOnBadExit={int(self.kill_on_bad_exit)}
MinJobAge=16
NodeName={n0} NodeAddr={a0} CPUs={self.cpus} State=UNKNOWN
NodeName={n1} NodeAddr={a1} CPUs={self.cpus} State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, argv: list[str], host: int | None = None) -> None:
        argv = argv if host is None else self.nodes.command(host, argv)
        self._logs.append(open(self.dir / "log" / "daemons.log", "ab"))  # noqa: SIM115
        self._procs.append(
            subprocess.Popen(
                argv,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._logs[-1],
            )
        )

    def _start_munge(self) -> None:
        m = self.dir / "munge"
        self._spawn(
            [
                _which("munged") or "munged",
                "--foreground",
                "--force",
                f"--key-file={m / 'munge.key'}",
                f"--socket={m / 'munge.socket'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}",
                f"--log-file={self.dir / 'log' / 'munged.log'}",
            ]
        )
        self._wait(lambda: (m / "munge.socket").exists(), "munged to create its socket", "munged")

    def _start_daemons(self) -> None:
        conf = str(self.conf)
        self._spawn([_which("slurmctld") or "slurmctld", "-D", "-i", "-f", conf], host=0)
        for host, name in enumerate(self.nodes.name):
            self._spawn([_which("slurmd") or "slurmd", "-D", "-N", name, "-f", conf], host=host)

    def _wait(self, ready: Callable[[], bool], what: str, log: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not ready():
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"a daemon ({p.args!r}) exited with {p.returncode} while waiting for "
                        f"{what}:\n{self.log(log)}\n{self.log('daemons')}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.start_timeout}s for {what}:\n{self.log(log)}")
            time.sleep(0.2)

    def _wait_idle(self) -> None:
        def idle() -> bool:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            return all(states.get(n) == "idle" for n in self.nodes.name)

        self._wait(idle, "sinfo to show both nodes idle", "slurmctld")

    def __exit__(self, *exc: object) -> None:
        try:
            if self._procs and self.conf.exists():
                subprocess.run(
                    self.nodes.command(0, ["scancel", "--full", "--user=root"]),
                    env=self.env(),
                    capture_output=True,
                    timeout=15,
                    check=False,
                )
        except (OSError, subprocess.SubprocessError):
            pass
        # slurmd first (it stops its steps), then slurmctld, then munged
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self.dir != Path():
            self._kill_marked()
        if self._hosts_up:
            self.nodes.__exit__()
            self._hosts_up = False
        if self.dir != Path():
            shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_marked(self) -> None:
        """Kill every process that carries this cluster's marker (slurmstepd
        and tasks that outlived their slurmd), then reap what is ours."""
        marker = f"{_MARKER}={self.dir}".encode()
        for _ in range(50):
            pids = [pid for pid in _pids() if pid != os.getpid() and _has(pid, marker)]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _has(pid: int, marker: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return marker in environ.split(b"\0")


def leftovers(directory: Path) -> list[int]:
    """Pids still carrying the marker of a cluster that lived in ``directory``."""
    marker = f"{_MARKER}={directory}".encode()
    return [pid for pid in _pids() if _has(pid, marker)]
