"""Scaling: how asyncdist's costs grow with world size, burst size and handles held.

Local gloo ranks on loopback, at each world size (2, 4, 8 by default). The
ranks share the machine's cores, so absolute times are not comparable across
world sizes: every figure that is judged is a ratio to raw torch measured
side by side in the same processes, in alternating or rotating order (medians).

* entry: from entering ``DistSession()`` to its first barrier done, against
  raw ``init_process_group(store=...)`` plus a first ``barrier`` on a store
  rank 0 hosts; each round destroys the group again. The session's parts
  are timed where it calls them (its ``init_process_group``, its objects
  side group, its root lane, its first barrier), and raw's
  ``init_process_group`` apart from its barrier; the table also shows what
  the goal leaves a session for all it adds (0.2x raw). After the barrier, not in the
  entry: the session's first ``broadcast_object`` and a second one. Each
  round starts on every rank at once (a store barrier); a round's time is
  its slowest rank's.
* burst: N allreduces of ``torch.ones(1)`` (a tensor of its own each: no two
  in-flight ops share memory), all issued, then all waited: asyncdist
  ``s.allreduce(t)`` then ``wait_all(hs).wait()``, raw
  ``dist.all_reduce(t, async_op=True)`` then each ``work.wait()``. Issue alone
  and issue + wait, per op; ``reps * 1000 / N`` bursts per arm (at least 1).
  Beside them, not judged: the issuing thread's CPU time per op
  (``time.thread_time``: the gloo threads' turns on the cores do not count),
  and a third arm, the floor of any Python layer over torch: a type check
  and one object holding the work and the tensor per op.
  The largest burst runs again with the cyclic GC off in every arm (not
  judged): a pending handle keeps two GC-tracked objects (its op and
  itself), a raw work none, and each collection walks them.
* wait_all: ``wait_all(hs).wait()`` and ``await wait_all(hs)`` (asyncio) over
  10,000 handles already complete, per handle; beside them raw
  ``work.wait()`` over as many complete works.
* memory: rank 0's heap growth per outstanding handle (all issued, none
  waited; the other ranks issue theirs once rank 0 measured, so none has
  completed) at 1,000 and 10,000, asyncdist and raw; the tensors are made
  beforehand. The heap is glibc's count of bytes in use (C++ allocations
  included); RSS growth, in the JSON, is coarser: an allocation that reuses
  freed memory does not show.

Threads and idle CPU per session and per channel: ``benchmarks/threads.py``.
Goals (issue 25): burst <= 1.15x raw at every world size (issue alone and
issue + wait); entry <= 1.2x ``init_process_group``; per-handle memory flat
to 10,000 outstanding (at 10,000 at most 1.25x that at 1,000).

    python benchmarks/scaling.py [--world-sizes 2,4,8] [--rounds 5] [--reps 3] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

BURSTS = [100, 1000, 10_000]
HANDLES = 10_000  # wait_all over this many complete handles
MEMORY = [1000, 10_000]  # outstanding handles
MEMORY_ROUNDS = 1
ENTRY_GOAL, BURST_GOAL, FLAT_GOAL = 1.2, 1.15, 1.25


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


@contextlib.contextmanager
def _gloo_on_loopback() -> Iterator[None]:
    """Raw groups listen on loopback, as a local session's do (it sets the
    same variable while it forms its groups)."""
    names = [name for _, name in socket.if_nameindex()]
    if "GLOO_SOCKET_IFNAME" in os.environ or "lo" not in names:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _memory_now() -> tuple[int, int]:
    """(heap bytes in use, resident bytes) of this process.

    The heap figure (glibc's ``mallinfo2``: every arena's allocated chunks plus
    mmapped ones) counts C++ allocations too (torch's works, gloo's queue),
    unlike ``tracemalloc``, and unlike RSS does not hide an allocation that
    reuses memory freed earlier; 0 where glibc lacks it. RSS comes after
    giving freed heap back to the OS (``malloc_trim``).
    """
    import psutil

    gc.collect()
    heap = 0
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        heap = int(info.uordblks + info.hblkhd)
        libc.malloc_trim(0)
    return heap, int(psutil.Process().memory_info().rss)


# the burst's arms: raw torch, the thinnest layer a Python library can be
# (a type check and one object per op), asyncdist
ARMS = ("raw", "floor", "ad")


class _Thinnest:
    """The floor arm's record of an op: its work and tensor, one GC-tracked
    object (asyncdist keeps two: the op record and its handle)."""

    __slots__ = ("tensor", "work")

    def __init__(self, work: Any, tensor: Any) -> None:
        self.work, self.tensor = work, tensor


def _bursts(
    session: Any, bursts: list[int], reps: int, keep: int, *, collect: bool = True
) -> tuple[dict[str, Any], tuple[list[Any], list[Any]] | None]:
    """Per burst size: per-op issue and issue+wait times, each arm, rotating;
    and the last burst of ``keep`` ops, done (handles, raw works), if any.
    ``collect=False``: the cyclic GC is off during each burst (both arms)."""
    import torch
    import torch.distributed as dist

    from asyncdist import wait_all

    group, clock, cpu = session.group, time.perf_counter, time.thread_time

    def thinnest(tensor: Any) -> _Thinnest:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("a tensor")
        return _Thinnest(dist.all_reduce(tensor, group=group, async_op=True), tensor)

    out: dict[str, Any] = {}
    kept = None
    for n in bursts:
        times: dict[str, list[float]] = {
            f"{arm}_{what}": [] for arm in ARMS for what in ("issue", "all", "cpu")
        }
        count = max(1, reps * 1000 // n)  # short bursts: more of them
        first = 0 if n == bursts[0] else 1  # round 0 (the first size only) warms up
        for r in range(first, count + 1):
            for arm in ARMS[r % 3 :] + ARMS[: r % 3]:  # each arm takes each place
                tensors = [torch.ones(1) for _ in range(n)]
                session.barrier().wait()
                if not collect:
                    gc.disable()
                t0, c0 = clock(), cpu()
                if arm == "raw":
                    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
                    t1, c1 = clock(), cpu()
                    for work in works:
                        work.wait()
                elif arm == "floor":
                    floors = [thinnest(t) for t in tensors]
                    t1, c1 = clock(), cpu()
                    for record in floors:
                        record.work.wait()
                else:
                    handles = [session.allreduce(t) for t in tensors]
                    t1, c1 = clock(), cpu()
                    wait_all(handles).wait()
                t2 = clock()
                gc.enable()
                if r:
                    times[f"{arm}_issue"].append((t1 - t0) / n)
                    times[f"{arm}_all"].append((t2 - t0) / n)
                    times[f"{arm}_cpu"].append((c1 - c0) / n)
                floors = []
        if n == keep:
            kept = handles, works
        works = handles = []
        out[str(n)] = times
    return out, kept


def _wait_all(
    session: Any, n: int, reps: int, done: tuple[list[Any], list[Any]] | None
) -> dict[str, list[float]]:
    """Per handle: ``wait_all(hs).wait()``, ``await wait_all(hs)`` (asyncio)
    and raw ``work.wait()`` over ``n`` complete ones (``done``'s, or new)."""
    import anyio
    import torch
    import torch.distributed as dist

    from asyncdist import wait_all

    clock = time.perf_counter
    if done is None:
        handles = [session.allreduce(torch.ones(1)) for _ in range(n)]
        wait_all(handles).wait()
        group = session.group
        works = [dist.all_reduce(torch.ones(1), group=group, async_op=True) for _ in range(n)]
        for work in works:
            work.wait()
    else:
        handles, works = done
    times: dict[str, list[float]] = {"wait": [], "await": [], "raw": []}

    async def awaited() -> float:
        t0 = clock()
        await wait_all(handles)
        return clock() - t0

    for _ in range(max(3, reps)):
        t0 = clock()
        wait_all(handles).wait()
        times["wait"].append((clock() - t0) / n)
        times["await"].append(anyio.run(awaited, backend="asyncio") / n)
        t0 = clock()
        for work in works:
            work.wait()
        times["raw"].append((clock() - t0) / n)
    return times


def _memory(session: Any, store: Any, counts: list[int]) -> dict[str, Any]:
    """Per count: rank 0's heap and RSS growth per outstanding handle (or raw
    work), per round. The other ranks issue theirs only once rank 0 measured
    (told through ``store``), so all of rank 0's are still pending then: the
    figure does not depend on how many completed meanwhile."""
    import torch
    import torch.distributed as dist

    from asyncdist import wait_all

    group = session.group
    out: dict[str, Any] = {}
    counts = [n for n in counts if n > 0]  # 0: skip (and the first kept count warms up)
    for n in counts:
        grown: dict[str, list[float]] = {"raw": [], "ad": [], "raw_rss": [], "ad_rss": []}
        first = 0 if n == counts[0] else 1  # round 0 (the first count only) warms up
        for r in range(first, MEMORY_ROUNDS + 1):  # steady from round to round: few do
            for arm in ("raw", "ad") if r % 2 else ("ad", "raw"):
                tensors = [torch.ones(1) for _ in range(n)]
                key = f"memory/{n}/{r}/{arm}"
                session.barrier().wait()
                if session.rank:
                    store.wait([key])
                heap, rss = _memory_now()
                if arm == "raw":
                    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
                    heap_after, rss_after = _memory_now()
                    if not session.rank:
                        store.set(key, "measured")
                    for work in works:
                        work.wait()
                else:
                    handles = [session.allreduce(t) for t in tensors]
                    heap_after, rss_after = _memory_now()
                    if not session.rank:
                        store.set(key, "measured")
                    wait_all(handles).wait()
                if r:  # the first round warms the heap up
                    grown[arm].append((heap_after - heap) / n)
                    grown[f"{arm}_rss"].append((rss_after - rss) / n)
                works = handles = tensors = []
        out[str(n)] = grown
    return out


def _align(store: Any, key: str, world_size: int) -> None:
    """Return on every rank at about the same moment (the last arrival frees all)."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/go", "1")
    store.wait([f"{key}/go"])


def _entry(rank: int, world_size: int, store: Any, rounds: int) -> dict[str, list[float]]:
    """Per round: raw init + barrier, and a session's entry + barrier with its parts."""
    import torch.distributed as dist

    from asyncdist import DistSession, _groups, _lane

    parts: dict[str, float] = {}

    # the session's parts, timed where it calls them (this process only)
    _groups.form_world = _common.timed_calls(parts, "init", _groups.form_world)  # type: ignore[method-assign]
    _lane.Lane.root = _common.timed_calls(parts, "root", _lane.Lane.root)  # type: ignore[method-assign]
    _lane.Lane.form_side_groups = _common.timed_calls(  # type: ignore[method-assign]
        parts, "side", _lane.Lane.form_side_groups
    )
    keys = ("raw", "raw_init", "session", "init", "rest", "root", "side", "barrier")
    keys += ("first_object", "object")
    times: dict[str, list[float]] = {key: [] for key in keys}
    clock = time.perf_counter
    for r in range(rounds + 1):  # the first round warms up
        for arm in ("raw", "session") if r % 2 else ("session", "raw"):
            _align(store, f"align/{r}/{arm}", world_size)
            parts.clear()
            t0 = clock()
            if arm == "raw":
                with _gloo_on_loopback():
                    dist.init_process_group(
                        "gloo",
                        store=dist.PrefixStore(f"raw/{r}", store),
                        rank=rank,
                        world_size=world_size,
                        timeout=datetime.timedelta(seconds=60),
                    )
                raw_init = clock() - t0
                dist.barrier()
                elapsed = clock() - t0
                dist.destroy_process_group()
            else:
                with DistSession(timeout=60) as s:
                    t1 = clock()
                    s.barrier().wait()
                    elapsed = clock() - t0
                    for key in ("first_object", "object"):  # not part of the entry
                        t2 = clock()
                        s.broadcast_object(r).wait()
                        parts[key] = clock() - t2
                parts["barrier"] = elapsed - (t1 - t0)
                parts["rest"] = elapsed - parts["init"]
            if r:
                times[arm].append(elapsed)
                if arm == "raw":
                    times["raw_init"].append(raw_init)
                else:
                    for key in keys[3:]:
                        times[key].append(parts[key])
    return times


def _rank(
    session: Any,
    rounds: int,
    bursts: list[int],
    reps: int,
    handles: int,
    memory: list[int],
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world_size = session.rank, session.world_size
    timeout = datetime.timedelta(seconds=120)
    # the raw arm's rendezvous store, hosted by rank 0 on a port from the OS
    store = None
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
    port = session.broadcast_object(None if store is None else store.port).wait()
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    burst, done = _bursts(session, bursts, reps, handles)
    # the largest burst again with the cyclic GC off: what the GC's walks of
    # the objects outstanding handles keep cost (raw works keep none)
    no_gc, _ = _bursts(session, bursts[-1:], reps, 0, collect=False)
    out: dict[str, Any] = {
        "burst": burst,
        "burst_no_gc": no_gc,
        "wait_all": _wait_all(session, handles, reps, done) if handles else None,
        "memory": _memory(session, store, memory),
    }
    done = None
    session.barrier().wait()
    session.close()  # the entry rounds open fresh sessions
    out["entry"] = _entry(rank, world_size, store, rounds)
    _align(store, "done", world_size)
    # rank 0 hosts the store: it returns (and its process takes the store
    # down) only once every peer said it is done with it
    if rank:
        store.add("done/left", 1)
    else:
        deadline = time.monotonic() + 60
        while store.add("done/left", 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    return out


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def summarize(
    results: dict[int, list[dict[str, Any]]], smoke: bool = False
) -> tuple[str, list[str], list[list[str]], dict[str, Any]]:
    """Every rank's results per world size -> the table's title, columns and
    rows, and the JSON payload. Entry: per round, the slowest rank; the rest:
    rank 0's."""
    med = _common.median
    sizes = sorted(results)
    per: dict[int, dict[str, Any]] = {}
    for ws in sizes:
        ranks = results[ws]
        # per round: the raw arm's slowest rank, and the session's slowest with its parts
        entry: dict[str, list[float]] = {key: [] for key in ranks[0]["entry"]}
        for i in range(len(ranks[0]["entry"]["raw"])):
            raw = max(ranks, key=lambda r: r["entry"]["raw"][i])["entry"]
            slowest = max(ranks, key=lambda r: r["entry"]["session"][i])["entry"]
            for key in entry:
                entry[key].append((raw if key.startswith("raw") else slowest)[key][i])
        e = {key: med(values) for key, values in entry.items()}
        e["ratio"] = e["session"] / e["raw"]
        burst = {}
        for n, t in ranks[0]["burst"].items():
            b = {key: med(values) for key, values in t.items()}
            b["issue_ratio"] = b["ad_issue"] / b["raw_issue"]
            b["all_ratio"] = b["ad_all"] / b["raw_all"]
            if "floor_issue" in b:  # the floor arm and CPU times (runs from 6 December on)
                b["floor_issue_ratio"] = b["floor_issue"] / b["raw_issue"]
                b["cpu_ratio"] = b["ad_cpu"] / b["raw_cpu"]
                b["floor_cpu_ratio"] = b["floor_cpu"] / b["raw_cpu"]
            burst[n] = b
        no_gc, no_gc_cpu = {}, {}
        for n, t in ranks[0].get("burst_no_gc", {}).items():
            no_gc[n] = med(t["ad_issue"]) / med(t["raw_issue"])
            if "ad_cpu" in t:
                no_gc_cpu[n] = med(t["ad_cpu"]) / med(t["raw_cpu"])
        waits = ranks[0]["wait_all"]
        memory = {
            n: {arm: med(values) for arm, values in grown.items()}
            for n, grown in ranks[0]["memory"].items()
        }
        per[ws] = {
            "entry_s": e,
            "burst": burst,
            "issue_ratio_no_gc": no_gc,
            "issue_cpu_ratio_no_gc": no_gc_cpu,
            "wait_all_s_per_handle": None
            if waits is None
            else {key: med(values) for key, values in waits.items()},
            "bytes_per_handle": memory,
        }
        counts = sorted(memory, key=int)
        if len(counts) >= 2 and memory[counts[0]]["ad"] > 0:
            per[ws]["memory_growth"] = memory[counts[-1]]["ad"] / memory[counts[0]]["ad"]

    rows: list[list[str]] = []
    goals: dict[str, bool] = {}

    def row(
        label: str, values: list[float | None], fmt: str, goal: str = "", met: bool = True
    ) -> None:
        rows.append(
            [label, *(_cell(v, fmt) for v in values), goal and _common.verdict(goal, met, smoke)]
        )

    entry = [per[ws]["entry_s"] for ws in sizes]
    row("entry ms: raw init+barrier", [e["raw"] * 1e3 for e in entry], ".1f")
    row("entry ms: DistSession", [e["session"] * 1e3 for e in entry], ".1f")
    row("session: its init ms", [e["init"] * 1e3 for e in entry], ".1f")
    row("session: the rest ms", [e["rest"] * 1e3 for e in entry], ".1f")
    for key, label in (("side", "side group"), ("root", "root lane"), ("barrier", "barrier")):
        if all(key in e for e in entry):
            row(f"  of it: {label} ms", [e[key] * 1e3 for e in entry], ".1f")
    if all("raw_init" in e for e in entry):
        row("raw: its init ms", [e["raw_init"] * 1e3 for e in entry], ".1f")
    # what the goal leaves a session for all it adds to raw's init and barrier
    margin = [(ENTRY_GOAL - 1) * e["raw"] * 1e3 for e in entry]
    row(f"{ENTRY_GOAL}× leaves a session ms", margin, ".1f")
    goals["entry"] = all(e["ratio"] <= ENTRY_GOAL for e in entry)
    row("entry ×", [e["ratio"] for e in entry], ".2f", f"<= {ENTRY_GOAL}", goals["entry"])
    row("1st broadcast_object ms", [e["first_object"] * 1e3 for e in entry], ".1f")
    row("next broadcast_object ms", [e["object"] * 1e3 for e in entry], ".1f")
    bursts = sorted(per[sizes[0]]["burst"], key=int)
    for n in bursts:
        b = [per[ws]["burst"].get(n) for ws in sizes]
        label = f"{int(n):,} ops"
        row(f"{label}: raw µs/op", [None if x is None else x["raw_all"] * 1e6 for x in b], ".1f")
        for key, what in (("issue_ratio", "issue"), ("all_ratio", "+wait")):
            values = [None if x is None else x[key] for x in b]
            met = all(v is not None and v <= BURST_GOAL for v in values)
            goals[f"burst_{n}_{what}"] = met
            row(f"{label}: {what} ×", values, ".2f", f"<= {BURST_GOAL}", met)
        for key, what in (
            ("floor_issue_ratio", "floor issue ×"),
            ("cpu_ratio", "issue CPU ×"),
            ("floor_cpu_ratio", "floor issue CPU ×"),
        ):
            if any(x is not None and key in x for x in b):
                row(f"{label}: {what}", [None if x is None else x.get(key) for x in b], ".2f")
        if any(n in per[ws]["issue_ratio_no_gc"] for ws in sizes):
            values = [per[ws]["issue_ratio_no_gc"].get(n) for ws in sizes]
            row(f"{label}: issue × GC off", values, ".2f")
        if any(n in per[ws]["issue_cpu_ratio_no_gc"] for ws in sizes):
            values = [per[ws]["issue_cpu_ratio_no_gc"].get(n) for ws in sizes]
            row(f"{label}: issue CPU × GC off", values, ".2f")
    waits = [per[ws]["wait_all_s_per_handle"] for ws in sizes]
    if all(w is not None for w in waits):
        for key, label in (
            ("wait", "wait_all().wait() µs/h"),
            ("await", "await wait_all() µs/h"),
            ("raw", "raw work.wait() µs/h"),
        ):
            row(label, [w[key] * 1e6 for w in waits if w is not None], ".2f")
    counts = sorted(per[sizes[0]]["bytes_per_handle"], key=int)
    for arm, name in (("raw", "raw"), ("ad", "asyncdist")):
        for n in counts:
            values = [per[ws]["bytes_per_handle"][n][arm] for ws in sizes]
            row(f"{name} B/h at {int(n):,}", values, ".0f")
    if len(counts) >= 2:
        growth = [per[ws].get("memory_growth") for ws in sizes]
        goals["memory_flat"] = all(g is not None and g <= FLAT_GOAL for g in growth)
        label = f"B/h at {int(counts[-1]):,} ÷ {int(counts[0]):,}"
        row(label, growth, ".2f", f"<= {FLAT_GOAL}", goals["memory_flat"])
    payload = {
        "smoke": smoke,
        "world_sizes": {str(ws): per[ws] for ws in sizes},
        "goals": {
            "entry_x": ENTRY_GOAL,
            "burst_x": BURST_GOAL,
            "memory_growth_x": FLAT_GOAL,
            "met": None if smoke else goals,
        },
        "samples": {str(ws): results[ws] for ws in sizes},
    }
    title = "asyncdist ÷ raw torch by world size: gloo, loopback, medians"
    return title, ["measure", *(f"{ws} ranks" for ws in sizes), "goal"], rows, payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-sizes", type=_ints, default=[2, 4, 8], help="e.g. 2,4,8")
    parser.add_argument("--rounds", type=int, default=5, help="entry rounds per arm")
    parser.add_argument(
        "--reps", type=int, default=3, help="bursts of 1,000 per arm (of N ops: reps*1000/N, >= 1)"
    )
    parser.add_argument("--bursts", type=_ints, default=BURSTS, help="burst sizes")
    parser.add_argument("--handles", type=int, default=HANDLES, help="for wait_all (0: skip)")
    parser.add_argument("--memory", type=_ints, default=MEMORY, help="outstanding counts (0: skip)")
    parser.add_argument("--smoke", action="store_true", help="a smoke run: goals not judged")
    args = parser.parse_args(argv)
    import asyncdist

    results = {}
    for ws in args.world_sizes:
        t0 = time.monotonic()
        results[ws] = asyncdist.spawn(
            _rank,
            ws,
            args=(args.rounds, args.bursts, args.reps, args.handles, args.memory),
            timeout=120,
        )
        print(f"{ws} ranks: {time.monotonic() - t0:.0f} s")
    title, columns, rows, payload = summarize(results, args.smoke)
    return _common.publish("scaling", title, columns, rows, payload, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
