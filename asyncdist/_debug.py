"""Debug mode: fingerprints of collectives, compared across ranks before launch.

With ``DistSession(debug=True)`` (or ``ASYNCDIST_DEBUG=1``), every collective
first exchanges a fixed-size fingerprint (sequence number, op, shapes, dtypes,
reduce op, root) over a group of its own, where every message has the same
size, so a disagreement never reaches gloo (which may abort the whole process
from C++ on a size mismatch). If the fingerprints differ, every rank raises
[CollectiveMismatch][asyncdist.errors.CollectiveMismatch] naming both sides, and nothing is
launched.

This module is pure: it numbers, builds, encodes and compares fingerprints
(``Verifier``); the communication layer does the exchange.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .errors import CollectiveMismatch

FINGERPRINT_BYTES = 1024


def debug_from_env() -> bool:
    """Whether ``ASYNCDIST_DEBUG`` asks for debug mode (set, and neither empty nor ``0``)."""
    return os.environ.get("ASYNCDIST_DEBUG", "") not in ("", "0")


def describe(tensor: torch.Tensor) -> str:
    """``float32[4, 2]`` (``float32[]`` for a scalar)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{', '.join(str(d) for d in tensor.shape)}]"


def _digest(data: bytes) -> str:
    """A short digest of ``data``, the same in every process."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to issue, in rank-independent terms."""

    seq: int
    op: str
    tensors: Sequence[str] = ()
    reduce: str = ""
    root: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        if len(data) > FINGERPRINT_BYTES - 4:
            # too many tensors to list: keep the count and a digest of the list.
            # Not the built-in hash(): it is randomised per process, so ranks would differ.
            listed = json.dumps(list(self.tensors), separators=(",", ":")).encode()
            digest = f"{len(self.tensors)} tensors, digest {_digest(listed)}"
            short = Fingerprint(self.seq, self.op, (digest,), self.reduce, self.root, self.extra)
            data = json.dumps(asdict(short), separators=(",", ":")).encode()[
                : FINGERPRINT_BYTES - 4
            ]
        return len(data).to_bytes(4, "little") + data.ljust(FINGERPRINT_BYTES - 4, b"\0")

    @classmethod
    def decode(cls, raw: bytes) -> Fingerprint:
        size = int.from_bytes(raw[:4], "little")
        fields = json.loads(raw[4 : 4 + size].decode())
        fields["tensors"] = tuple(fields["tensors"])
        return cls(**fields)


def _what(fp: Fingerprint) -> str:
    parts = [fp.op]
    if fp.tensors:
        parts.append("of " + ", ".join(fp.tensors))
    if fp.reduce:
        parts.append(f"({fp.reduce})")
    if fp.root is not None:
        parts.append(f"with root {fp.root}")
    return " ".join(parts)


def pairwise(fp: Fingerprint) -> bool:
    """Whether ``fp.tensors[j]`` is what this rank exchanges with rank ``j``
    (``all_to_all``), so shapes may differ between ranks, pair by pair."""
    return bool(fp.extra.get("pairwise"))


def _pairwise_mismatch(fingerprints: Sequence[Fingerprint]) -> str | None:
    """Rank ``i`` sends rank ``j`` its ``tensors[j]``; rank ``j`` receives it
    into a tensor shaped like its own ``tensors[i]``: the two must agree."""
    world = len(fingerprints)
    if any(len(fp.tensors) != world for fp in fingerprints):
        return None  # a list too long to ship: its digest cannot be compared pairwise
    for i, sender in enumerate(fingerprints):
        for j in range(i + 1, world):
            sent, expected = sender.tensors[j], fingerprints[j].tensors[i]
            if sent != expected:
                return (
                    f"collective #{sender.seq}: {sender.op}: rank {i} exchanges {sent} with "
                    f"rank {j}, which exchanges {expected} with rank {i}"
                )
    return None


def mismatch(fingerprints: Sequence[Fingerprint]) -> str | None:
    """A message naming both sides of the first disagreement, or ``None``."""
    if all(pairwise(fp) for fp in fingerprints):
        problem = mismatch([replace(fp, tensors=(), extra={}) for fp in fingerprints])
        return problem or _pairwise_mismatch(fingerprints)
    first = fingerprints[0]
    for rank, fp in enumerate(fingerprints[1:], start=1):
        if fp == first:
            continue
        if fp.seq != first.seq:
            return (
                f"collective #{first.seq} ({_what(first)}) on rank 0 meets collective "
                f"#{fp.seq} ({_what(fp)}) on rank {rank}: the ranks issued different "
                "numbers of collectives"
            )
        if fp.op != first.op:
            detail = f"{first.op} on rank 0 vs {fp.op} on rank {rank}"
        elif fp.tensors != first.tensors:
            detail = (
                f"{first.op} of {', '.join(first.tensors) or 'nothing'} on rank 0 vs "
                f"{', '.join(fp.tensors) or 'nothing'} on rank {rank}"
            )
        elif fp.reduce != first.reduce:
            detail = f"{first.op} with op {first.reduce} on rank 0 vs {fp.reduce} on rank {rank}"
        elif fp.root != first.root:
            detail = f"{first.op} with root {first.root} on rank 0 vs {fp.root} on rank {rank}"
        else:
            detail = f"{_what(first)} on rank 0 vs {_what(fp)} on rank {rank}"
        return f"collective #{first.seq}: {detail}"
    return None


class Verifier:
    """Debug mode's bookkeeping for one lane: the sequence number of each
    collective. ``fingerprint`` runs at the call, in program order;
    ``check`` once every rank's fingerprint is in. (Two tasks issuing on
    one lane at once are refused before this, in every mode.)
    """

    __slots__ = ("_seq", "rank")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._seq = 0

    def fingerprint(
        self,
        op: str,
        tensors: Sequence[torch.Tensor] = (),
        *,
        reduce: str = "",
        root: int | None = None,
        pairwise: bool = False,
    ) -> Fingerprint:
        """Number this call and describe it."""
        self._seq += 1
        return Fingerprint(
            self._seq,
            op,
            tuple(describe(t) for t in tensors),
            reduce,
            root,
            {"pairwise": True} if pairwise else {},
        )

    def check(self, op: str, fingerprints: Sequence[Fingerprint]) -> None:
        """Raise if the ranks' fingerprints (by rank) disagree.

        Raises:
            CollectiveMismatch: naming both sides of the first disagreement.
        """
        problem = mismatch(fingerprints)
        if problem is not None:
            raise CollectiveMismatch(f"{op} on rank {self.rank}: {problem}")
