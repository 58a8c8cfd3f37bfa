"""Developer sessions. CI runs tests, lint, typecheck and docs; also bench and multinode."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch pulls CUDA (several GB)


def install(session: nox.Session, *extras: str) -> None:
    """torch first (pinned), then the project with ``extras``."""
    session.install(TORCH)
    session.install("-e", f".[{','.join(extras)}]" if extras else ".")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, every async test on asyncio and trio."""
    install(session, "test")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package."""
    install(session, "test")
    session.install("mypy>=1.10")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site, strict (broken links and references fail)."""
    install(session, "docs")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark; JSON and plots under benchmarks/results/ (shaped links need root)."""
    install(session, "bench")
    session.run("python", "benchmarks/run_all.py", *session.posargs)


@nox.session
def multinode(session: nox.Session) -> None:
    """torchrun --nnodes=2 on two network-namespace "hosts", with restarts (needs root)."""
    install(session, "test")
    session.run("python", "-m", "pytest", "tests/test_multinode.py", "-v", *session.posargs)


@nox.session
def slurm(session: nox.Session) -> None:
    """srun and sbatch on a throwaway two-node SLURM cluster (root, slurm-wlm, munge)."""
    install(session, "test")
    session.run("python", "-m", "pytest", "tests/test_slurm.py", "-v", *session.posargs)
