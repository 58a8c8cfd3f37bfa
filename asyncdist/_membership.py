"""Membership: who is in an elastic session's next world, agreed on a store
that outlives every rank.

The coordinator is a ``TCPStore`` hosted by a process that is not a rank:
``spawn``'s parent, torchrun's node-0 agent (static rendezvous), a sidecar
a SLURM step's task 0 starts on the step's master address and port
(``_coordinator``), or one hosted by hand (``asyncdist coordinator``), named
by ``ASYNCDIST_COORDINATOR=host:port``. It
is linearizable, so one ``compare_set`` from ``""`` is a decision nobody can
overwrite: there is no consensus among the ranks themselves, and a side cut
off from the store decides nothing. Keys, under ``ROOT``:

* ``rank/{r}``: the member id (``host:pid``) of launch rank ``r`` (world 0);
* ``hb/{member}``: a counter each member's watcher thread adds to;
* ``probe/{member}``: where its probe port listens (``_reach``);
* ``dead/{member}``: the member is gone for sure (its launcher saw it exit,
  or it left its session);
* ``gen/{g}/reform``: world ``g`` is over, and why (its first writer wins);
* ``gen/{g}/report/{member}``: a survivor of world ``g``, its progress,
  and the other members it reached;
* ``gen/{g}/world``: the decision: world ``g``'s members in rank order, or
  why there is none;
* ``generation``: a counter, the newest world formed (joiners read it);
* ``joins`` and ``join/{n}``: the joiners, numbered as they register;
  ``admitted``: the joins settled, in order (taken in by a world, or gone
  before one did), whose keys are deleted;
* ``gen/{g}/planned``: the commit (by count) at which world ``g`` ends to
  admit joiners, written by its rank 0;
* ``pg/{g}/...``: world ``g``'s process groups (gloo's own keys).

A joiner (``ASYNCDIST_ELASTIC_JOIN=1``: a replacement ``spawn`` starts, or a
process started by hand with the job's coordinator; or a worker torchrun
restarted) registers and waits.
Rank 0 sees it at a commit and names the next commit as the world's last;
every rank reads that at its next commit (a step, whose collectives need
rank 0, lies between: the write is visible by then), ends the world there,
and the re-forming takes the joiners in after the survivors.

A world never grows past ``max_world_size``: rank 0 plans no end while the
world is full, a re-forming takes in only the joiners that fit, in their
order, and the others go on waiting (spares, taken in when a member dies),
with no deadline while the world that keeps them out is alive.

The rule (``decide``): the survivors that reported go on when they are a
strict majority of world ``g``'s members not known to be gone (so two sides
of a partition never both go on) and at least ``min_world_size``, counting
only the survivors that all reach each other (``_reach``). The new
rank 0 is the survivor with the most commits (on a tie the lowest old rank),
so the state every rank restores is the latest any survivor committed.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

from ._coordinator import ROOT, start_sidecar
from ._env import detect, is_loopback
from ._groups import form_generation, refuse_while_held
from ._reach import PROBE_TIMEOUT, Probe, connected, reachable
from .errors import InitError, MembershipChanged, MembershipLost

logger = logging.getLogger("asyncdist")

COORDINATOR_ENV = "ASYNCDIST_COORDINATOR"
JOIN_ENV = "ASYNCDIST_ELASTIC_JOIN"  # "1": this process joins a running session
HEARTBEAT = 0.25  # seconds between a member's beats (and its look at the reform key)
POLL = 0.02  # seconds between looks while re-forming
# Past the session timeout, what a re-forming may take (reports, decision,
# forming the groups); the proposer waits this long for a missing report.
REFORM_GRACE = 5.0
LEAVE_TIMEOUT = 2.0  # seconds a leaving member waits to tell the coordinator


T = TypeVar("T")


class _Silent(Exception):
    """The coordinator gave no answer within the bound."""


@dataclass
class _Request:
    """One round trip: what to call, its outcome once made, and whether its
    caller stopped waiting (then it is not made, if it has not started)."""

    call: Callable[[], Any]
    outcome: list[tuple[bool, Any]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False


class _Requests:
    """A member's round trips to the coordinator, made one at a time on a
    daemon thread of their own and each waited for with a bound.

    torch's store client has no receive timeout: a coordinator that went
    silent (cut off, stopped) would hold a read forever, on the training
    thread at a commit or while re-forming. Here the thread that is held is
    this one; the caller gets ``_Silent`` at the bound, and a later request
    queues behind the held one (the client runs one request at a time
    anyway) and is bounded the same way. A request whose caller gave up is
    dropped unmade: a late re-form must not report a member that has
    already raised.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (request := self._queue.get()) is not None:
            if not request.abandoned:
                try:
                    request.outcome.append((True, request.call()))
                except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                    request.outcome.append((False, exc))
            request.done.set()

    def answer(self, call: Callable[[], T], limit: float) -> T:
        """``call()``'s result (or its exception), within ``limit`` seconds.

        Raises:
            _Silent: no answer within ``limit``.
        """
        request = _Request(call)
        self._queue.put(request)
        if not request.done.wait(limit):
            request.abandoned = True
            raise _Silent
        answered, value = request.outcome[0]
        if not answered:
            raise value
        return value  # type: ignore[no-any-return]

    def send(self, call: Callable[[], None]) -> None:
        """Make ``call()`` after the requests before it, waiting for nothing
        (its errors are its own to handle)."""
        self._queue.put(_Request(call))

    def close(self, limit: float) -> None:
        """Stop the thread once the requests before are answered (within
        ``limit``: a held one stays held, on a daemon thread)."""
        self._queue.put(None)
        self._thread.join(limit)


def check_world_sizes(elastic: bool, least: object, most: object) -> None:
    """Refuse bad ``min_world_size``/``max_world_size`` arguments before
    anything starts (a ``DistSession``'s or ``spawn``'s).

    Raises:
        TypeError: one is not an int (``most``: nor ``None``).
        ValueError: out of range, or given for a session that is not elastic.
    """
    if isinstance(least, bool) or not isinstance(least, int):
        raise TypeError(f"min_world_size must be an int, not {least!r}")
    if most is not None and (isinstance(most, bool) or not isinstance(most, int)):
        raise TypeError(f"max_world_size must be an int or None, not {most!r}")
    if least < 1:
        raise ValueError(f"min_world_size must be at least 1, not {least}")
    if most is not None and most < least:
        raise ValueError(f"max_world_size={most} is below min_world_size={least}")
    if not elastic and (least != 1 or most is not None):
        raise ValueError(
            "min_world_size and max_world_size bound the worlds of an elastic session: "
            "pass elastic=True (a plain session's world is the launch's, and ends with it)"
        )


def member_id() -> str:
    """This process's id among the members: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def dead_key(member: str) -> str:
    """The key a launcher writes when ``member`` exited (see ``_spawn``)."""
    return f"{ROOT}/dead/{member}"


def coordinator_address() -> tuple[str, int] | None:
    """Where the coordinator is: ``ASYNCDIST_COORDINATOR`` (host:port), else
    torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``: the store at
    ``MASTER_ADDR:MASTER_PORT`` lives in node 0's agent, which outlives its
    workers); None if neither."""
    value = os.environ.get(COORDINATOR_ENV)
    if not value:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if agent and host and port.isdigit():
            return host, int(port)
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{COORDINATOR_ENV}={value!r} is not host:port")
    return host, int(port)


_RESTARTED_TOGETHER = (
    " torchrun restarts every worker of a node at once, so on one node none is left "
    "holding the state: launch with asyncdist.spawn(fn, n, elastic=True) on one machine"
)


def _restarted_by_torchrun() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def joining() -> bool:
    """Whether this process joins a running session: asked to
    (``ASYNCDIST_ELASTIC_JOIN=1``), or restarted by torchrun (its agent
    restarted this node's workers; the other nodes' went on)."""
    return os.environ.get(JOIN_ENV) == "1" or _restarted_by_torchrun()


def connect(address: tuple[str, int], timeout: float) -> dist.Store:
    """A client of the coordinator store at ``address``, keys under ``ROOT``."""
    host, port = address
    store = dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    return dist.PrefixStore(ROOT, store)


@dataclass(frozen=True, slots=True)
class Report:
    """A survivor of a world, as it reports itself for the next one."""

    member: str
    rank: int  # its rank in the world that ended
    commits: int  # how many commits its state holds
    # the other members of that world it reached (None: it did not probe)
    reach: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The next world: its members in rank order, and what they restore."""

    generation: int
    members: tuple[str, ...]
    commits: int  # the commits of the state rank 0 restores and sends
    channels: tuple[str, ...]  # the channels to form again, in order
    reason: str

    def encode(self) -> str:
        return json.dumps(
            {
                "members": list(self.members),
                "commits": self.commits,
                "channels": list(self.channels),
                "reason": self.reason,
            }
        )


def decide(
    generation: int,
    members: Sequence[str],
    reports: dict[str, Report],
    gone: set[str],
    *,
    min_world_size: int,
    channels: Sequence[str],
    reason: str,
    joiners: Sequence[str] = (),
    max_world_size: int | None = None,
) -> Decision | MembershipLost:
    """World ``generation``'s members, from world ``generation - 1``'s
    ``members`` (in rank order), the survivors' ``reports`` and who is known
    to be ``gone``, and the ``joiners`` that fit under ``max_world_size`` (in
    their order); or why there is none. Pure: every proposer with the same
    view decides the same.

    Of the survivors that reported, only those that all reach each other
    count (``_reach.connected``): a survivor cut off from the others is left
    out, as if it had not reported."""
    alive = sorted(reports.values(), key=lambda r: r.rank)
    linked = connected([r.member for r in alive], {r.member: r.reach for r in alive})
    alive = [r for r in alive if r.member in linked]
    base = [m for m in members if m not in gone or m in reports]
    joiners = [j for j in joiners if j not in reports]
    if max_world_size is not None:
        joiners = joiners[: max(max_world_size - len(alive), 0)]
    missing = [f"rank {members.index(m)}" for m in members if m not in linked]
    lost = ", ".join(missing) or "none"
    if len(alive) * 2 <= len(base):
        return MembershipLost(
            f"{len(alive)} of the {len(base)} ranks of world {generation - 1} not known to be "
            f"gone reached the coordinator and each other (missing: {lost}); going on needs a "
            "strict majority (the others may be alive on the other side of a partition)",
            why="no_majority",
        )
    if len(alive) + len(joiners) < min_world_size:
        return MembershipLost(
            f"{len(alive)} rank(s) are left of world {generation - 1} (gone: {lost}), fewer "
            f"than min_world_size={min_world_size}",
            why="too_few",
        )
    source = max(alive, key=lambda r: (r.commits, -r.rank))
    order = [source] + [r for r in alive if r is not source]
    return Decision(
        generation,
        (*(r.member for r in order), *joiners),
        source.commits,
        tuple(channels),
        reason,
    )


def _decoded(generation: int, text: str) -> Decision | MembershipLost:
    data = json.loads(text)
    if "fail" in data:
        return MembershipLost(data["fail"], why=data["why"])
    return Decision(
        generation,
        tuple(data["members"]),
        int(data["commits"]),
        tuple(data["channels"]),
        data["reason"],
    )


def _failure(error: MembershipLost) -> str:
    return json.dumps({"fail": str(error), "why": error.why})


class Coordinator:
    """One member's view of the coordinator store: generation 0's forming,
    the re-forming protocol, and its keys."""

    def __init__(self, store: dist.Store, me: str, timeout: float) -> None:
        self.store = store
        self.me = me
        self.timeout = timeout
        # joiners' heartbeats as this member last saw them: (count, since when)
        self._joiner_beats: dict[str, tuple[int, float]] = {}

    def create(self, key: str, value: str) -> str:
        """Write ``value`` under ``key`` unless the key exists; the value it
        holds now (``value``, or the first writer's)."""
        return self.store.compare_set(key, "", value).decode()

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def read(self, key: str) -> str:
        return self.store.get(key).decode()

    # -- world 0 --------------------------------------------------------------------

    def first_world(self, rank: int, world_size: int) -> tuple[str, ...]:
        """Register as launch rank ``rank``; world 0's members once all
        ``world_size`` registered.

        Raises:
            MembershipLost: a rank did not register within the timeout, or a
                world was formed already (this process joined late).
        """
        if self.has("gen/0/reform") or int(self.store.add("generation", 0)) > 0:
            raise MembershipLost(
                f"launch rank {rank} started after the elastic session's first world ended; "
                f"to join the running session, start it with {JOIN_ENV}=1",
                why="evicted",
            )
        self.create(f"rank/{rank}", self.me)
        self.store.add(f"hb/{self.me}", 1)
        keys = [f"rank/{r}" for r in range(world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise MembershipLost(
                f"not every one of the {world_size} ranks registered with the coordinator "
                f"within {self.timeout:g} s ({exc})",
                why="timeout",
            ) from exc
        return tuple(self.read(key) for key in keys)

    def join(
        self, max_world_size: int | None, ask: Callable[[Callable[[], Any]], Any]
    ) -> tuple[Decision, int]:
        """Register as a joiner; the world that takes this process in, and
        this process's rank there, once one does. While the running world
        is full (``max_world_size``), this process is a spare: it waits
        with no deadline, as long as that world's members are alive.
        ``ask(call)`` makes each round of questions to the store (a bound
        on each: a spare's wait has none as a whole).

        Raises:
            MembershipLost: no world took it in within the timeout (while
                there was room), or every member of the last world is gone
                (``why="finished"`` when each of them ended its session
                normally: the training is over).
        """

        def register() -> None:
            self.create(f"join/{int(self.store.add('joins', 1))}", self.me)

        ask(register)
        deadline = time.monotonic() + self.timeout + REFORM_GRACE
        beats: dict[str, tuple[int, float]] = {}
        while time.monotonic() < deadline:
            taken, members = ask(lambda: self._join_round(beats))
            if taken is not None:
                return taken, taken.members.index(self.me)
            if max_world_size is not None and len(members) >= max_world_size:
                deadline = time.monotonic() + self.timeout + REFORM_GRACE  # a spare waits
            time.sleep(POLL * 5)
        raise MembershipLost(
            f"this process ({self.me}) registered to join the elastic session, but no world "
            f"took it in within {self.timeout + REFORM_GRACE:g} s: the running ranks admit "
            "joiners at their commits (state.commit()); check that they commit, and that "
            "they are running",
            why="timeout",
        )

    def _join_round(
        self, beats: dict[str, tuple[int, float]]
    ) -> tuple[Decision | None, tuple[str, ...]]:
        """One look of a joiner at the store: the world that took it in (if
        one did), and the running world's members.

        Raises:
            MembershipLost: every member of the last world is gone.
        """
        self.store.add(f"hb/{self.me}", 1)  # until the watcher beats
        generation = int(self.store.add("generation", 0))
        key = f"gen/{generation}/world"
        decided = _decoded(generation, self.read(key)) if self.has(key) else None
        if generation > 0 and isinstance(decided, Decision) and self.me in decided.members:
            return decided, decided.members
        members = self._members_of(generation, decided)
        if members and self._gone(members, beats, time.monotonic()) >= set(members):
            if all(self._finished(m) for m in members):
                raise MembershipLost(
                    f"this process ({self.me}) registered to join the elastic session, "
                    f"but the session has finished: every member of its last world "
                    f"({len(members)}) ended its session normally before a commit took "
                    "this process in. There is nothing left to train",
                    why="finished",
                )
            raise MembershipLost(
                f"this process ({self.me}) registered to join the elastic session, but "
                f"every member of its last world ({len(members)}) is gone, and the "
                "committed state was only in their memory: nobody is left to take it "
                f"in.{_RESTARTED_TOGETHER if _restarted_by_torchrun() else ''}",
                why="too_few",
            )
        return None, members

    def _members_of(
        self, generation: int, decided: Decision | MembershipLost | None
    ) -> tuple[str, ...]:
        """World ``generation``'s members, as far as the store says yet."""
        if isinstance(decided, Decision):
            return decided.members
        if generation == 0:
            return tuple(self.read(k) for k in self.store.list_keys() if k.startswith("rank/"))
        return ()

    def joiners(self, members: Sequence[str] = ()) -> list[str]:
        """The joiners registered and not yet taken in, in order: neither
        gone nor among ``members`` (the running world's)."""
        settled = int(self.store.add("admitted", 0))
        joins = int(self.store.add("joins", 0))
        found = []
        for number in range(settled + 1, joins + 1):
            key = f"join/{number}"
            if self.has(key):
                member = self.read(key)
                if member not in members and not self._joiner_gone(member):
                    found.append(member)
        return found

    def _joiner_gone(self, member: str) -> bool:
        """A joiner is gone when its launcher said so, or when its heartbeat
        (it beats while it waits) stood still for the timeout, as this member
        watched it: a joiner started by hand has no launcher to say it died,
        and taking it in would fail the next world's forming."""
        if self.has(f"dead/{member}"):
            return True
        count, now = int(self.store.add(f"hb/{member}", 0)), time.monotonic()
        last = self._joiner_beats.get(member)
        if last is None or last[0] != count:
            self._joiner_beats[member] = (count, now)
            return False
        return now - last[1] >= self.timeout

    def plan(self, generation: int, commit: int) -> int:
        """Rank 0: end world ``generation`` at commit ``commit`` to take in
        joiners (unless a plan is there already); the commit planned."""
        return int(self.create(f"gen/{generation}/planned", str(commit)))

    def planned(self, generation: int) -> int | None:
        """The commit at which world ``generation`` ends, if one is planned."""
        key = f"gen/{generation}/planned"
        return int(self.read(key)) if self.has(key) else None

    def announce(self, decision: Decision) -> None:
        """The new rank 0, before forming world ``decision.generation``: its
        joiners find it now (and join its forming).

        The joins it settles (taken in, or gone before a world took them) are
        deleted, in registration order up to the first that is not: a
        joiner counted in ``joins`` may not have written its key yet.
        ``admitted`` marks how far that went; ``joiners`` starts after it.
        """
        settled = int(self.store.add("admitted", 0))
        mark = settled
        for number in range(settled + 1, int(self.store.add("joins", 0)) + 1):
            key = f"join/{number}"
            if not self.has(key):
                break
            member = self.read(key)
            if member not in decision.members and not self._joiner_gone(member):
                break
            self._joiner_beats.pop(member, None)
            self.store.delete_key(key)
            mark = number
        if mark > settled:
            self.store.add("admitted", mark - settled)
        self.store.add("generation", decision.generation - int(self.store.add("generation", 0)))

    # -- re-forming -------------------------------------------------------------------

    def end(self, generation: int, reason: str) -> str:
        """Declare world ``generation`` over; why it ended (the first word wins)."""
        return self.create(f"gen/{generation}/reform", reason)

    def reform(
        self,
        generation: int,
        members: Sequence[str],
        mine: Report,
        *,
        min_world_size: int,
        channels: Sequence[str],
        reason: str,
        max_world_size: int | None = None,
        probe: Callable[[Mapping[str, str]], frozenset[str]] | None = None,
    ) -> Decision:
        """Agree with the survivors on world ``generation + 1``. ``probe``
        (``_reach.reachable``): how this member finds whom it reaches, which
        its report says.

        Raises:
            MembershipLost: too few, no majority, this member left out, or
                no decision within the timeout plus ``REFORM_GRACE``.
        """
        ended = self.end(generation, reason)
        report: dict[str, Any] = {"rank": mine.rank, "commits": mine.commits}
        if probe is not None:  # whom this member reaches, of the world that ended
            others = [m for m in members if m != self.me]
            report["reach"] = sorted(probe(self.probe_addresses(others)))
        self.create(f"gen/{generation}/report/{self.me}", json.dumps(report))
        start = time.monotonic()
        wait_all_until = start + REFORM_GRACE  # then go on without the missing
        deadline = start + self.timeout + REFORM_GRACE
        key = f"gen/{generation + 1}/world"
        beats: dict[str, tuple[int, float]] = {}
        while True:
            now = time.monotonic()
            if self.has(key):
                decided = _decoded(generation + 1, self.read(key))
                break
            reports = self._reports(generation, members)
            gone = self._gone(members, beats, now)
            proposer = min(reports.values(), key=lambda r: r.rank).member
            everyone = all(m in reports or m in gone for m in members)
            late = now >= wait_all_until
            # the lowest surviving rank proposes; after the deadline anyone may
            if (proposer == self.me and (everyone or late)) or now >= deadline:
                proposal = decide(
                    generation + 1,
                    members,
                    reports,
                    gone,
                    min_world_size=min_world_size,
                    channels=channels,
                    reason=ended,
                    joiners=self.joiners(members),
                    max_world_size=max_world_size,
                )
                if isinstance(proposal, Decision):
                    decided = _decoded(generation + 1, self.create(key, proposal.encode()))
                    break
                if everyone or now >= deadline:
                    decided = _decoded(generation + 1, self.create(key, _failure(proposal)))
                    break
                # Late, and no world yet: a missing member may still report,
                # or be known gone once its heartbeat stood still for the
                # timeout (a death no launcher tells); wait for that, or the
                # deadline, before ending everyone's session.
            if now >= deadline + REFORM_GRACE:
                raise MembershipLost(
                    f"world {generation + 1} was not agreed on within "
                    f"{self.timeout + 2 * REFORM_GRACE:g} s",
                    why="timeout",
                )
            time.sleep(POLL)
        if isinstance(decided, MembershipLost):
            raise decided
        if self.me not in decided.members:
            raise MembershipLost(
                f"world {generation + 1} was formed without this process ({self.me}): the "
                "others did not hear from it in time, or it could not reach them (a network "
                "partition). Restart it to train again once the network is whole",
                why="evicted",
            )
        return decided

    def _reports(self, generation: int, members: Sequence[str]) -> dict[str, Report]:
        reports = {}
        for member in members:
            key = f"gen/{generation}/report/{member}"
            if self.has(key):
                data = json.loads(self.read(key))
                reach = data.get("reach")
                reports[member] = Report(
                    member,
                    int(data["rank"]),
                    int(data["commits"]),
                    None if reach is None else frozenset(reach),
                )
        return reports

    def publish_probe(self, address: str) -> None:
        """Where this member's probe port listens (``_reach``)."""
        self.store.set(f"probe/{self.me}", address)

    def probe_addresses(self, members: Sequence[str]) -> dict[str, str]:
        """The probe ports of those of ``members`` that published one."""
        return {m: self.read(f"probe/{m}") for m in members if self.has(f"probe/{m}")}

    def _gone(
        self, members: Sequence[str], beats: dict[str, tuple[int, float]], now: float
    ) -> set[str]:
        """Members known to be gone: a launcher saw them exit, they left, or
        their heartbeat stood still for the session timeout."""
        gone = set()
        for member in members:
            if self.has(f"dead/{member}"):
                gone.add(member)
                continue
            count = int(self.store.add(f"hb/{member}", 0))
            last = beats.get(member)
            if last is None or last[0] != count:
                beats[member] = (count, now)
            elif now - last[1] >= self.timeout:
                gone.add(member)
        return gone

    def leave(self, how: str) -> None:
        """This member is gone for good (its session ended)."""
        self.create(f"dead/{self.me}", how)

    def _finished(self, member: str) -> bool:
        """Whether ``member`` left after its session ended normally (not
        died, nor raised)."""
        key = f"dead/{member}"
        return self.has(key) and self.read(key) == "finished"

    def forget(self, generation: int, keep: Sequence[str]) -> None:
        """Delete world ``generation``'s keys (its re-forming records and its
        groups' gloo keys) and the heartbeat and exit keys of its members not
        in ``keep``, so the store does not grow with re-forms.

        The new rank 0 calls it for the world *before* the last one, with the
        members of the last world and the new: nobody reads those keys any
        more (a slow member may still be reading the last world's, and a key
        deleted under a reader's ``get`` reads as empty).
        """
        if generation < 0:
            return
        record = f"gen/{generation}/world"
        if generation == 0:
            members = [self.read(k) for k in self.store.list_keys() if k.startswith("rank/")]
        elif self.has(record):
            decided = _decoded(generation, self.read(record))
            members = list(decided.members) if isinstance(decided, Decision) else []
        else:
            members = []
        kinds = ("hb", "dead", "probe")
        names = {f"{kind}/{m}" for m in members if m not in keep for kind in kinds}
        prefixes = (f"gen/{generation}/", f"pg/{generation}/")
        for key in self.store.list_keys():
            if key.startswith(prefixes) or key in names:
                self.store.delete_key(key)


class Watcher:
    """A member's heartbeat, and its ear for the end of its world: a daemon
    thread with a store client of its own (a blocked store call elsewhere
    must not stop the beats)."""

    def __init__(
        self,
        address: tuple[str, int],
        me: str,
        timeout: float,
        on_end: Callable[[int, str], None],
        probe: Probe | None = None,
    ) -> None:
        self._store = connect(address, timeout)
        self._probe = probe
        self._me = me
        self._on_end = on_end
        self.generation = 0
        self._told = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"asyncdist-elastic-{me}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        beat = f"hb/{self._me}"
        while not self._stop.wait(HEARTBEAT):
            generation = self.generation
            if self._probe is not None:
                self._probe.drain()
            try:
                self._store.add(beat, 1)
                if self._told < generation and self._store.check([f"gen/{generation}/reform"]):
                    reason = self._store.get(f"gen/{generation}/reform").decode()
                    self._told = generation
                    self._on_end(generation, reason)
            except (RuntimeError, dist.DistError) as exc:
                logger.debug("elastic watcher: %s", exc)

    def close(self) -> None:
        """Stop beating; a beat blocked on a silent coordinator is left to
        end with the process (a daemon thread), after a short wait."""
        self._stop.set()
        self._thread.join(2 * HEARTBEAT + 1.0)


class Membership:
    """An elastic session's side of the coordinator: forming world 0, the
    re-forming protocol, the watcher, and the members of the current world."""

    def __init__(self, min_world_size: int, max_world_size: int | None = None) -> None:
        self.min_world_size = min_world_size
        self.max_world_size = max_world_size
        self.me = member_id()
        self.generation = 0
        self.members: tuple[str, ...] = ()
        self.joined: Decision | None = None  # the world a joiner was taken into
        self._planned: int | None = None  # the commit that ends this world (joiners)
        self._coordinator: Coordinator | None = None
        self._watcher: Watcher | None = None
        self._address: tuple[str, int] | None = None
        self._timeout = 0.0
        self._loopback = False
        self._sidecar: Any = None  # a SLURM step's coordinator, which task 0 started
        self._probe: Probe | None = None  # this member's probe port (``_reach``)
        self._asking: _Requests | None = None  # made on entry (or at a first request)

    @property
    def _requests(self) -> _Requests:
        if self._asking is None:
            self._asking = _Requests(f"asyncdist-coordinator-{self.me}")
        return self._asking

    @property
    def coordinator(self) -> Coordinator:
        assert self._coordinator is not None, "entered"
        return self._coordinator

    def enter(self, wanted: Any, on_end: Callable[[int, str], None]) -> Any:
        """Form world 0 (``_groups.World``) from the launch environment.

        Raises:
            InitError: no coordinator, or world 0 did not form.
            ValueError: the launch started more ranks than ``max_world_size``.
        """
        refuse_while_held()  # before the coordinator counts this rank in world 0
        address = coordinator_address()
        joins = joining()
        hosts = False  # a SLURM step's task 0 hosts the coordinator
        if address is None:
            launch = detect(
                rank=wanted.rank,
                world_size=wanted.world_size,
                master_addr=wanted.master_addr,
                master_port=wanted.master_port,
            )
            if launch.launcher != "slurm" or launch.master_port is None:
                raise InitError(
                    "DistSession(elastic=True) needs a coordinator that outlives the ranks: "
                    "launch with asyncdist.spawn(fn, n, elastic=True), under torchrun with "
                    "its static rendezvous (--master-addr/--master-port), or with srun; or "
                    "host one with `asyncdist coordinator --port P` and name it by "
                    f"{COORDINATOR_ENV}=host:port"
                )
            # a SLURM step: task 0 hosts it on the master's address and port
            address = (launch.master_addr, launch.master_port)
            hosts = launch.rank == 0 and not joins
        # the coordinator stands in for the master: no MASTER_PORT needed
        env = detect(
            rank=wanted.rank,
            world_size=wanted.world_size,
            master_addr=address[0],
            master_port=address[1],
        )
        if not joins and self.max_world_size is not None and env.world_size > self.max_world_size:
            raise ValueError(
                f"rank {env.rank}: the launch started {env.world_size} ranks, more than "
                f"max_world_size={self.max_world_size}; launch at most that many (more "
                "processes can join later as spares, with ASYNCDIST_ELASTIC_JOIN=1)"
            )
        if not joins and env.world_size < self.min_world_size:
            raise ValueError(
                f"rank {env.rank}: the launch started {env.world_size} ranks, fewer than "
                f"min_world_size={self.min_world_size}, so the first world would already be "
                "too small; launch at least that many, or lower min_world_size"
            )
        if hosts:
            self._sidecar = start_sidecar(address[1], wanted.timeout)
            logger.info(
                "asyncdist: the elastic coordinator of this SLURM step is at %s:%d "
                "(a replacement joins with %s=%s:%d %s=1)",
                *address,
                COORDINATOR_ENV,
                *address,
                JOIN_ENV,
            )
        self._address, self._timeout = address, wanted.timeout
        self._loopback = is_loopback(address[0])
        self._asking = _Requests(f"asyncdist-coordinator-{self.me}")  # a thread for the session
        try:
            rank = self._register(address, env.rank, env.world_size, joins)
        except BaseException:
            asking, self._asking = self._asking, None
            asking.close(0.0)  # (a request held by a silent coordinator stays held, on its own)
            raise
        self._probe = self._open_probe(address)
        self._watcher = Watcher(address, self.me, wanted.timeout, on_end, self._probe)
        self._watcher.generation = self.generation
        try:
            return self.form(self.generation, rank, len(self.members))
        except BaseException:
            self.leave("raised")  # no session holds this yet: its beats stop here
            raise

    def _register(self, address: tuple[str, int], rank: int, world_size: int, joins: bool) -> int:
        """Register with the coordinator as launch rank ``rank`` of
        ``world_size`` (or as a joiner), each round trip bounded; this
        process's rank in the world it enters.

        Raises:
            InitError: the coordinator did not answer (within the timeout,
                or with an error), or not every rank registered.
            MembershipLost: as ``Coordinator.first_world`` and ``join``.
        """
        timeout, where = self._timeout, f"{address[0]}:{address[1]}"
        who = f"joiner {self.me}" if joins else f"rank {rank}"

        def ask(call: Callable[[], T], limit: float = timeout) -> T:
            try:
                return self._requests.answer(call, limit)
            except _Silent:
                raise InitError(
                    f"{who}: the elastic coordinator at {where} did not answer within "
                    f"{limit:g} s while this process entered the session: it is stopped, "
                    "or cut off from this process"
                ) from None

        try:
            coordinator = Coordinator(connect(address, timeout), self.me, timeout)
            self._coordinator = coordinator
            if joins:
                decision, rank = coordinator.join(self.max_world_size, ask)
                self.members, self.generation = decision.members, decision.generation
                self.joined = decision
            else:  # waits for every launch rank to register: the timeout, and a grace
                first = functools.partial(coordinator.first_world, rank, world_size)
                self.members = ask(first, timeout + REFORM_GRACE)
        except (MembershipLost, InitError):
            raise
        except (RuntimeError, dist.DistError) as exc:
            raise InitError(
                f"{who}: the elastic coordinator at {where} did not answer, or not every "
                f"rank registered with it ({exc})"
            ) from exc
        return rank

    def _open_probe(self, toward: tuple[str, int]) -> Probe | None:
        """Listen on a probe port facing the coordinator and publish it; none
        (probes then count this member as reachable) if that fails."""
        try:
            probe = Probe(toward)
        except OSError as exc:
            logger.warning("elastic: no probe port (%s); reachability is not checked", exc)
            return None
        try:
            self.coordinator.publish_probe(probe.address)
        except (RuntimeError, dist.DistError) as exc:
            probe.close()
            logger.warning("elastic: the probe port was not published (%s)", exc)
            return None
        return probe

    def form(self, generation: int, rank: int, world_size: int) -> Any:
        """World ``generation``'s default group (``_groups.World``).

        Raises:
            InitError: a member did not join within the timeout, or the
                coordinator did not answer the rendezvous (within the timeout
                and ``_groups.RENDEZVOUS_GRACE``).
        """
        try:
            return form_generation(
                self.coordinator.store,
                generation,
                rank,
                world_size,
                timeout=self._timeout,
                loopback=self._loopback,
            )
        except TimeoutError as exc:  # (``_groups.rendezvous``)
            host, port = self._address or ("?", 0)
            raise InitError(
                f"rank {rank} of {world_size}: world {generation} of the elastic session did "
                f"not form: the elastic coordinator at {host}:{port} did not answer its rendezvous "
                f"({exc})"
            ) from exc
        except InitError:
            raise  # refused: a forming given up on still runs (``refuse_while_held``)
        except (RuntimeError, OSError, ValueError) as exc:
            raise InitError(
                f"rank {rank} of {world_size}: world {generation} of the elastic session did "
                f"not form within {self._timeout:g} s ({exc})"
            ) from exc

    def end(self, reason: str) -> None:
        """Declare the current world over (every member's watcher hears it),
        without waiting: the agreement writes it too, with a bound."""
        coordinator, generation = self.coordinator, self.generation

        def tell() -> None:
            with contextlib.suppress(RuntimeError, dist.DistError):
                coordinator.end(generation, reason)

        threading.Thread(target=tell, name=f"asyncdist-end-{self.me}", daemon=True).start()

    def reform(self, reason: str, rank: int, commits: int, channels: Sequence[str]) -> Decision:
        """Agree on the next world; it becomes the current one.

        Raises:
            MembershipLost: no next world for this process.
        """

        coordinator, generation, members = self.coordinator, self.generation, self.members

        def agree() -> Decision:
            return coordinator.reform(
                generation,
                members,
                Report(self.me, rank, commits),
                min_world_size=self.min_world_size,
                channels=channels,
                reason=reason,
                max_world_size=self.max_world_size,
                probe=self._reachable,
            )

        during = f"while world {self.generation + 1} was being agreed on"
        decision = self._agreed(agree, self._timeout + 3 * REFORM_GRACE, during)
        old, self.members = self.members, decision.members
        self.generation = decision.generation
        self._planned = None
        if self._watcher is not None:
            self._watcher.generation = decision.generation
        if decision.members[0] == self.me:  # the new rank 0 tells joiners, and tidies up
            coordinator = self.coordinator
            announced = f"when world {decision.generation} was announced"
            self._agreed(lambda: coordinator.announce(decision), self._timeout, announced)

            def tidy() -> None:  # waited for by nobody: it only keeps the store small
                with contextlib.suppress(RuntimeError, dist.DistError):
                    coordinator.forget(decision.generation - 2, [*old, *decision.members])

            self._requests.send(tidy)
        return decision

    def _agreed(self, call: Callable[[], T], limit: float, during: str) -> T:
        """``call()``'s answer from the coordinator, within ``limit`` seconds.

        Raises:
            MembershipLost: no answer, or the coordinator's error (``during``
                says when, in the message).
        """
        try:
            return self._requests.answer(call, limit)
        except _Silent:
            raise MembershipLost(
                f"the elastic coordinator at {self._where()} did not answer within {limit:g} s "
                f"{during}: it is stopped, or cut off from this process",
                why="coordinator",
            ) from None
        except MembershipLost:
            raise
        except Exception as exc:
            raise MembershipLost(
                f"the elastic coordinator at {self._where()} stopped answering {during} ({exc})",
                why="coordinator",
            ) from exc

    def _reachable(self, addresses: Mapping[str, str]) -> frozenset[str]:
        """The members whose probe ports this member reaches now (bounded by
        the session timeout too, so a short one stays short)."""
        return reachable(addresses, min(PROBE_TIMEOUT, self._timeout / 2))

    def at_commit(self, rank: int, commits: int) -> bool:
        """At the ``commits``-th commit: whether this world ends here to take
        in joiners (the same answer on every rank, see the module docstring).
        Rank 0 plans the next commit as the end when a joiner waits.

        Raises:
            MembershipChanged: the coordinator did not answer within the
                session timeout (stopped, or cut off from this process): this
                world ends here on this rank, and re-forming says whether a
                next one forms.
        """
        if self._planned is None:
            coordinator, generation, members = self.coordinator, self.generation, self.members
            room = self.max_world_size is None or len(members) < self.max_world_size

            def ask() -> int | None:
                planned = coordinator.planned(generation)
                if planned is None and rank == 0 and room and coordinator.joiners(members):
                    planned = coordinator.plan(generation, commits + 1)
                return planned

            try:
                planned = self._requests.answer(ask, self._timeout)
            except _Silent:
                why = (
                    f"the elastic coordinator at {self._where()} did not answer within "
                    f"{self._timeout:g} s at commit {commits}"
                )
                raise MembershipChanged(
                    f"world {generation} ends on rank {rank}: {why}",
                    op="commit",
                    rank=rank,
                    generation=generation,
                    reason=why,
                ) from None
            except (RuntimeError, dist.DistError) as exc:
                logger.warning("elastic: the coordinator did not answer at a commit: %s", exc)
                return False
            if self.generation == generation:  # (``commit_async`` may have given up on it)
                self._planned = planned
        # ``>=``: a commit an elastic loop's start takes (not checked here)
        # may be the planned one; the world then ends at the next, on every rank
        return self._planned is not None and commits >= self._planned

    def _where(self) -> str:
        host, port = self._address or ("?", 0)
        return f"{host}:{port}"

    def leave(self, how: str) -> None:
        """This member's session ends: stop the beats, tell the others."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        coordinator, self._coordinator = self._coordinator, None
        held = False
        if coordinator is not None:
            try:  # told if it can be: the session ends either way
                self._requests.answer(lambda: coordinator.leave(how), LEAVE_TIMEOUT)
            except _Silent:
                held = True
            except (RuntimeError, dist.DistError):
                pass
        asking, self._asking = self._asking, None
        if asking is not None:
            asking.close(0.0 if held else LEAVE_TIMEOUT)
