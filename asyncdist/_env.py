"""Launch-environment detection: who am I, how many are we, where is the master.

Precedence, field by field: explicit arguments > torchrun (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) > SLURM
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, master from the node
list) > a single-process world on 127.0.0.1 with a port the OS picks.

Nothing here writes to ``os.environ`` (asyncdist's one scoped write, for
gloo groups of a loopback-only world, is ``_groups.gloo_on_loopback``).
"""

from __future__ import annotations

import datetime
import ipaddress
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .errors import InitError

Launcher = Literal["explicit", "torchrun", "slurm", "local"]

LOOPBACK = "127.0.0.1"

# SLURM gives no port; derive one from the job and step ids inside this range so
# that two jobs sharing a node, or two steps of one job, rarely collide (step 0
# gets the job's own port; a prime stride keeps steps off nearby jobs' ports).
# MASTER_PORT, when set, wins.
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 20000
_SLURM_STEP_STRIDE = 7919


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job.

    ``master_port`` is ``None`` when the store should listen on a port the OS
    picks (the local default and [asyncdist.spawn][asyncdist.spawn]'s parent).
    ``agent_store`` is true when a launcher agent (torchrun, ``spawn``) already
    hosts the store, so rank 0 connects to it instead of hosting one.
    ``attempt`` is torchrun's ``TORCHELASTIC_RESTART_COUNT``: the restarts this
    node's workers caused. Nodes disagree on it, so it is for display only; the
    store keeps attempts apart by a generation the ranks agree on.
    """

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int | None
    agent_store: bool = False
    attempt: int = 0


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise InitError(f"environment variable {name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """Return the first host of a SLURM node list.

    ``"gpu[007-010,12],cpu1"`` -> ``"gpu007"``; ``"node1,node2"`` -> ``"node1"``;
    ``"node[1-4]-ib"`` -> ``"node1-ib"``.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise InitError("SLURM node list is empty; set MASTER_ADDR")
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\]([^,]*))?", nodelist)
    assert match is not None  # the pattern matches every string
    prefix, ranges, rest = match.group(1), match.group(2), match.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + (first_slurm_host(rest) if rest else "")


def launcher_local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's index on its machine as the launcher gives it:
    ``LOCAL_RANK`` under torchrun, ``SLURM_LOCALID`` under SLURM, else ``None``."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _int(env, "LOCAL_RANK")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _int(env, "SLURM_LOCALID")
    return _int(env, "LOCAL_RANK")


def _slurm_port(environ: Mapping[str, str]) -> int | None:
    job_id = _int(environ, "SLURM_JOB_ID")
    if job_id is None:
        return None
    step_id = _int(environ, "SLURM_STEP_ID") or 0
    return _SLURM_PORT_BASE + (job_id + _SLURM_STEP_STRIDE * step_id) % _SLURM_PORT_SPAN


def _in_slurm_batch_script(environ: Mapping[str, str]) -> bool:
    """True in a SLURM job's batch script, outside any ``srun`` step.

    sbatch gives its script ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``
    but no step id; taken as rank 0 of that world, a process there would wait
    for peers that nobody starts.
    """
    return "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ


def detect(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> LaunchEnv:
    """Work out this process's place in the job from arguments and environment.

    Raises:
        InitError: the environment is inconsistent (rank outside the world,
            a multi-process world without a master port, a non-integer value),
            or this is the batch script of a multi-task SLURM job, not a task.
    """
    env = os.environ if environ is None else environ
    launcher: Launcher
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")
    agent_store = False
    attempt = 0
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        env_rank, env_world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        env_local = launcher_local_rank(env)
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        attempt = _int(env, "TORCHELASTIC_RESTART_COUNT") or 0
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher = "slurm"
        env_rank, env_world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        env_local = launcher_local_rank(env)
        explicit_world = rank is not None or world_size is not None
        if (env_world or 0) > 1 and not explicit_world and _in_slurm_batch_script(env):
            raise InitError(
                f"this process is the batch script of SLURM job {env.get('SLURM_JOB_ID', '?')} "
                f"({env_world} tasks), not one of its tasks (no SLURM_STEP_ID): start the "
                "tasks with `srun python ...`, or pass rank= and world_size="
            )
        if addr is None and master_addr is None:
            # the step's nodes: a step may run on a subset of the job's
            nodelist = (
                env.get("SLURM_STEP_NODELIST")
                or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST")
                or ""
            )
            addr = first_slurm_host(nodelist)
        if port is None:
            port = _slurm_port(env)
    else:
        launcher = "local"
        env_rank, env_world, env_local = 0, 1, 0

    if rank is not None or world_size is not None:
        launcher = "explicit" if launcher == "local" else launcher
    final_rank = rank if rank is not None else env_rank
    final_world = world_size if world_size is not None else env_world
    if final_rank is None or final_world is None:
        raise InitError(f"{launcher} environment lacks a rank or world size")
    if final_world < 1:
        raise InitError(f"world_size must be at least 1, got {final_world}")
    if not 0 <= final_rank < final_world:
        raise InitError(f"rank {final_rank} is outside a world of size {final_world}")
    if local_rank is None:
        local_rank = env_local if env_local is not None else final_rank
    final_addr = master_addr or addr or LOOPBACK
    final_port = master_port if master_port is not None else port
    if (master_addr is not None and master_addr != addr) or (
        master_port is not None and master_port != port
    ):
        agent_store = False  # an explicit master is not the launcher agent's store
    if final_port is None and final_world > 1:
        raise InitError(
            f"a world of {final_world} processes needs a master port: pass master_port= "
            "or set MASTER_PORT (torchrun and asyncdist.spawn set it for you)"
        )
    if final_port is not None and not 0 < final_port < 65536:
        raise InitError(f"master port {final_port} is outside 1..65535")
    return LaunchEnv(
        launcher=launcher,
        rank=final_rank,
        world_size=final_world,
        local_rank=local_rank,
        master_addr=final_addr,
        master_port=final_port,
        agent_store=agent_store,
        attempt=attempt,
    )


_NCCL_WITHOUT_CUDA = "the nccl backend needs a CUDA device"


def choose_device(device: Any, backend: str | None, local_rank: int) -> torch.device:
    """The session's device: explicit, else CUDA ``LOCAL_RANK`` for NCCL or when
    CUDA is present (and the backend is not gloo), else CPU. Never
    ``rank % device_count``.

    Raises:
        ValueError: NCCL on a machine without CUDA devices.
        InitError: the chosen CUDA device does not exist here.
    """
    if device is not None:
        chosen = torch.device(device)
        if str(chosen) == "cuda":  # no index: this process's LOCAL_RANK
            chosen = torch.device("cuda", local_rank)
    elif backend == "gloo":
        return torch.device("cpu")
    elif backend == "nccl" or torch.cuda.is_available():
        chosen = torch.device("cuda", local_rank)
    else:
        return torch.device("cpu")
    if chosen.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0 and str(backend).lower() == "nccl":
            raise ValueError(
                _NCCL_WITHOUT_CUDA + "; this machine has none; use backend='gloo' on CPU"
            )
        if count == 0:
            raise InitError(
                f"{chosen} was requested, but this machine has no CUDA device; use "
                "device='cpu' (and the gloo backend)"
            )
        if chosen.index is not None and chosen.index >= count:
            raise InitError(
                f"this process wants {chosen} (LOCAL_RANK={local_rank}) but sees "
                f"{count} CUDA device(s); start at most one process per GPU, or check "
                "CUDA_VISIBLE_DEVICES"
            )
    return chosen


def choose_backend(backend: str | None, device: torch.device) -> str:
    """``backend`` checked, or the default for ``device``: NCCL on CUDA, else gloo.

    Raises:
        TypeError, ValueError: not a backend name, or NCCL without a CUDA device.
    """
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, not {type(backend).__name__}")
    backend = backend.lower()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(_NCCL_WITHOUT_CUDA + "; use backend='gloo' on CPU")
    return backend


MIXED = "cpu:gloo,cuda:nccl"  # torch's default group on a CUDA machine


def backends_by_device(backend: str) -> dict[str, str]:
    """torch's backend string by device type: ``"cpu:gloo,cuda:nccl"`` gives
    ``{"cpu": "gloo", "cuda": "nccl"}``; a plain ``"gloo"`` serves CPU and
    CUDA tensors, ``"nccl"`` CUDA ones."""
    backend = backend.lower()
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(","))
    return {"cuda": backend} if backend == "nccl" else {"cpu": backend, "cuda": backend}


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_loopback(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A listening TCP socket on a loopback address (port 0: the OS picks one).

    Binding it here, rather than letting ``TCPStore`` bind, keeps the store off
    every other interface (TCPStore binds ``::``) and makes the port race-free.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


DEFAULT_TIMEOUT = 1800.0  # torch's own default for gloo and NCCL groups


def timeout_seconds(timeout: float | datetime.timedelta | None) -> float:
    """``timeout`` (seconds or a ``timedelta``; ``None``: torch's default) in seconds.

    Raises:
        TypeError, ValueError: not a positive, finite duration.
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout must be seconds (a number) or a timedelta, not {type(timeout).__name__}"
        )
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return seconds
