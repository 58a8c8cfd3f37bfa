"""Reachability for elastic re-forms: the probe port, the probing, and the
pick of the members that all reach each other (asyncdist._reach), and how
the membership rule uses it."""

from __future__ import annotations

import socket
import time

import pytest

from asyncdist._membership import Decision, Report, decide
from asyncdist._reach import Probe, connected, reachable

A, B, C, D = "a", "b", "c", "d"


@pytest.mark.parametrize(
    ("reach", "picked"),
    [
        # everyone reaches everyone: all of them
        ({A: {B, C}, B: {A, C}, C: {A, B}}, [A, B, C]),
        # c is cut from a and b (both ways): a and b
        ({A: {B}, B: {A}, C: set()}, [A, B]),
        # one way is not enough: b reaches c, c does not reach b
        ({A: {B, C}, B: {A, C}, C: {A}}, [A, B]),
        # a member that did not probe reaches everyone
        ({A: {B}, B: {A}, C: None}, [A, B]),
        ({A: None, B: None, C: None}, [A, B, C]),
        # two pairs: the first pair in order
        ({A: {B}, B: {A}, C: {D}, D: {C}}, [A, B]),
        # the best connected first: d reaches all, a only d
        ({A: {D}, B: {C, D}, C: {B, D}, D: {A, B, C}}, [B, C, D]),
    ],
)
def test_connected_keeps_the_members_that_all_reach_each_other(
    reach: dict[str, set[str] | None], picked: list[str]
) -> None:
    rows = {m: None if r is None else frozenset(r) for m, r in reach.items()}
    assert connected(list(reach), rows) == picked


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_probe_port_is_reached_and_a_closed_one_is_not() -> None:
    probe = Probe(("127.0.0.1", 1))
    try:
        assert probe.address.startswith("127.0.0.1:")
        started = time.monotonic()
        found = reachable({"up": probe.address, "down": f"127.0.0.1:{_free_port()}"}, 1.0)
        assert found == {"up"}
        assert time.monotonic() - started < 0.5, "a refused connection is known at once"
    finally:
        probe.close()
    assert reachable({"closed": probe.address}, 1.0) == frozenset()


def test_a_silent_address_costs_the_probe_timeout_and_no_more() -> None:
    """An address nobody answers (TEST-NET-1, routed nowhere): not reached,
    within the bound."""
    started = time.monotonic()
    assert reachable({"nowhere": "192.0.2.1:9"}, 0.3) == frozenset()
    assert time.monotonic() - started < 1.0


def test_drained_probe_ports_never_fill_their_queue() -> None:
    """Re-forms probe over and over; the watcher drains between them."""
    probe = Probe(("127.0.0.1", 1))
    try:
        for _ in range(4):
            for _ in range(100):
                assert reachable({"p": probe.address}, 1.0) == {"p"}
            probe.drain()
    finally:
        probe.close()


def test_the_rule_leaves_out_a_survivor_cut_off_from_the_others() -> None:
    """All three reached the coordinator, but c reaches neither a nor b: a
    world of a and b (a strict majority of three), c left out."""
    reports = {
        A: Report(A, 0, 5, frozenset({B})),
        B: Report(B, 1, 5, frozenset({A})),
        C: Report(C, 2, 5, frozenset()),
    }
    decided = decide(1, [A, B, C], reports, set(), min_world_size=1, channels=[], reason="")
    assert isinstance(decided, Decision)
    assert decided.members == (A, B)


def test_the_rule_lets_no_side_of_an_even_split_go_on() -> None:
    reports = {
        A: Report(A, 0, 5, frozenset({B})),
        B: Report(B, 1, 5, frozenset({A})),
        C: Report(C, 2, 5, frozenset({D})),
        D: Report(D, 3, 5, frozenset({C})),
    }
    decided = decide(1, [A, B, C, D], reports, set(), min_world_size=1, channels=[], reason="")
    assert not isinstance(decided, Decision)
    assert decided.why == "no_majority"
    assert "and each other" in str(decided)
