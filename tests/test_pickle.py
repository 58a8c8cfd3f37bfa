"""Object collectives' trust model: an allow-list restricts what peers can make us build."""

from __future__ import annotations

import collections
import pickle
from fractions import Fraction

import pytest
import torch

from asyncdist import DistSession, spawn
from asyncdist._pickle import allow_list, dumps, loads

pytestmark = pytest.mark.timeout(60)


class Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("this would run on the receiver",))


def test_plain_data_passes_an_allow_list() -> None:
    data = {"a": [1, 2.5, "x", b"y", (3, None)], "s": {1, 2}, "c": 1 + 2j}
    assert loads(dumps(data, op="t"), allow_list([])) == data
    od = collections.OrderedDict(a=1)
    assert loads(dumps(od, op="t"), allow_list([])) == od


def test_unlisted_globals_are_refused() -> None:
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print"):
        loads(dumps(Exploit(), op="t"), allow_list([]))
    with pytest.raises(pickle.UnpicklingError, match=r"fractions\.Fraction"):
        loads(dumps(Fraction(1, 3), op="t"), allow_list([]))
    assert loads(dumps(Fraction(1, 3), op="t"), allow_list([Fraction])) == Fraction(1, 3)
    assert loads(dumps(Fraction(1, 3), op="t"), allow_list(["fractions.Fraction"])) == Fraction(
        1, 3
    )


def test_tensors_when_allowed() -> None:
    t = torch.arange(3)
    assert torch.equal(loads(dumps(t, op="t"), allow_list([torch.Tensor])), t)
    with pytest.raises(pickle.UnpicklingError):
        loads(dumps(t, op="t"), allow_list([]))


def test_no_allow_list_trusts_peers() -> None:
    assert loads(dumps(Fraction(1, 3), op="t"), None) == Fraction(1, 3)


def test_bad_allow_lists() -> None:
    with pytest.raises(TypeError, match="iterable"):
        allow_list("fractions.Fraction")
    with pytest.raises(TypeError, match="classes"):
        allow_list([3])


def _restricted(s: DistSession) -> dict[str, str]:
    out = {}
    try:
        s.broadcast_object(Fraction(1, 3), src=0, allowed=[]).wait()
        out["broadcast"] = "accepted"
    except pickle.UnpicklingError as exc:
        out["broadcast"] = str(exc)
    try:
        s.all_gather_object(Fraction(s.rank, 7), allowed=[int]).wait()
        out["gather"] = "accepted"
    except pickle.UnpicklingError as exc:
        out["gather"] = str(exc)
    # a refusal is local: the session is not broken and stays in step
    out["after"] = repr(s.all_gather_object(s.rank, allowed=[]).wait())
    return out


def test_object_collectives_refuse_unlisted_types() -> None:
    src, other = spawn(_restricted, 2, timeout=20)
    assert src["broadcast"] == "accepted", "the source does not unpickle its own object"
    assert "fractions.Fraction" in other["broadcast"]
    assert "fractions.Fraction" in src["gather"]
    assert "fractions.Fraction" in other["gather"]
    assert src["after"] == other["after"] == "[0, 1]"
