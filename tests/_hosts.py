"""Running one command per namespace host (``tools/netns.TwoHosts``) and
collecting what each printed, for the torchrun tests across two hosts.

Tests import it as ``from _hosts import run_on_hosts`` (``tests/`` is on
``sys.path``, see ``_ports``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any


def run_on_hosts(
    hosts: Any, commands: Sequence[tuple[list[str], dict[str, str]]], timeout: float
) -> list[tuple[int, str]]:
    """Start ``commands[h]`` (argv, env) on host ``h`` of ``hosts``, all at
    once; each one's exit code and output (stdout and stderr) once all
    exited. Whatever still runs after ``timeout`` seconds, or when waiting
    fails, is killed and reaped."""
    procs = [
        subprocess.Popen(
            hosts.command(host, argv),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for host, (argv, env) in enumerate(commands)
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [(p.returncode, log) for p, log in zip(procs, logs, strict=True)]
