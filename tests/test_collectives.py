"""Every collective of the design table, on 2, 3 and 4 gloo ranks, against hand values.

One spawn per world size computes everything (spawning costs seconds); each
test then checks one collective.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from asyncdist import DistSession, Handle, spawn, wait_all

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.complex64]


def _value(rank: int, dtype: torch.dtype, n: int = 3) -> torch.Tensor:
    """Rank r holds [r+1, r+2, ...] (times 1+1j for complex)."""
    base = torch.arange(n, dtype=torch.float64) + rank + 1
    if dtype.is_complex:
        return (base * (1 + 1j)).to(dtype)
    return base.to(dtype)


def _surface(s: DistSession) -> dict[str, Any]:
    r, w = s.rank, s.world_size
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        t = _value(r, dtype)
        out[f"allreduce_sum_{dtype}"] = s.allreduce(t).wait().to(torch.complex128).tolist()
        if dtype.is_floating_point or dtype.is_complex:
            t = _value(r, dtype)
            out[f"allreduce_mean_{dtype}"] = (
                s.allreduce(t, "mean").wait().to(torch.complex128).tolist()
            )
        b = _value(r, dtype)
        out[f"broadcast_{dtype}"] = s.broadcast(b, src=w - 1).wait().to(torch.complex128).tolist()
    out["allreduce_empty"] = s.allreduce(torch.empty(0)).wait().tolist()
    out["allreduce_one"] = s.allreduce(torch.tensor([float(r)])).wait().tolist()
    out["allreduce_scalar"] = s.allreduce(torch.tensor(float(r))).wait().item()
    out["all_gather"] = [t.tolist() for t in s.all_gather(torch.tensor([r, 10 * r])).wait()]
    out["all_gather_2d"] = [t.shape for t in s.all_gather(torch.zeros(2, 3)).wait()]
    out["all_gather_bf16"] = [
        t.float().tolist()
        for t in s.all_gather(torch.tensor([r + 0.5], dtype=torch.bfloat16)).wait()
    ]
    rows = torch.arange(2 * w, dtype=torch.float32).reshape(w, 2) * (r + 1)
    out["reduce_scatter"] = s.reduce_scatter(rows).wait().tolist()
    out["reduce_scatter_mean"] = (
        s.reduce_scatter(torch.ones(w) * (r + 1), op="mean").wait().tolist()
    )
    out["reduce_scatter_flat"] = s.reduce_scatter(torch.ones(1, 2 * w)).wait().tolist()
    sends = [torch.tensor([100 * r + j]) for j in range(w)]
    out["all_to_all"] = [t.tolist() for t in s.all_to_all(sends).wait()]
    red = torch.tensor([float(r + 1)])
    out["reduce"] = s.reduce(red, dst=w - 1).wait().tolist()
    out["reduce_mean"] = s.reduce(torch.tensor([float(r + 1)]), dst=0, op="mean").wait().tolist()
    gathered = s.gather(torch.tensor([r * r]), dst=1).wait()
    out["gather"] = None if gathered is None else [t.tolist() for t in gathered]
    chunks = [torch.tensor([7.0 * j, 1.0]) for j in range(w)] if r == 0 else None
    out["scatter"] = s.scatter(torch.zeros(2), chunks, src=0).wait().tolist()
    out["barrier"] = s.barrier().wait()
    # ring of send/recv, issued before either is waited on
    right, left = (r + 1) % w, (r - 1) % w
    inbox = torch.zeros(2)
    hs = s.send(torch.tensor([float(r), 1.0]), dst=right)
    hr = s.recv(inbox, src=left)
    out["send"] = hs.wait()
    received = hr.wait()
    out["recv"] = received.tolist()
    # in-place ops hand back the very tensor they were given, not a copy
    same = {"recv": received is inbox}
    b = torch.zeros(2)
    same["broadcast"] = s.broadcast(b, src=0).wait() is b
    red_in = torch.ones(1)
    same["reduce"] = s.reduce(red_in, dst=0).wait() is red_in
    scatter_out = torch.zeros(1)
    ones = [torch.ones(1)] * w if r == 0 else None
    same["scatter"] = s.scatter(scatter_out, ones, src=0).wait() is scatter_out
    out["same_tensor"] = same
    mixed = [
        torch.ones(2) * r,
        torch.tensor([r], dtype=torch.int64),
        torch.ones(2, 2) * 2,
        torch.tensor([r + 0.5], dtype=torch.float16),
    ]
    result = s.allreduce_coalesced(mixed, op="sum").wait()
    out["coalesced_same_list"] = result is mixed
    out["coalesced"] = [t.float().tolist() for t in mixed]
    out["coalesced_empty"] = s.allreduce_coalesced([]).wait()
    one = [torch.ones(3)]
    out["coalesced_one_mean"] = s.allreduce_coalesced(one, op="mean").wait()[0].tolist()
    out["broadcast_object"] = s.broadcast_object({"from": r, "items": [1, 2]}, src=w - 1).wait()
    out["all_gather_object"] = s.all_gather_object(("rank", r)).wait()
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def surface(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world = int(request.param)
    return world, spawn(_surface, world, timeout=60)


def _sum_of_values(w: int, dtype: torch.dtype) -> list[complex]:
    total = sum(
        _value(r, torch.complex128 if dtype.is_complex else torch.float64) for r in range(w)
    )
    return total.to(torch.complex128).tolist()  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_sum_and_mean(
    surface: tuple[int, list[dict[str, Any]]], dtype: torch.dtype
) -> None:
    w, results = surface
    total = _sum_of_values(w, dtype)
    for out in results:
        assert out[f"allreduce_sum_{dtype}"] == pytest.approx(total, rel=1e-2)
        if f"allreduce_mean_{dtype}" in out:
            assert out[f"allreduce_mean_{dtype}"] == pytest.approx([v / w for v in total], rel=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast(surface: tuple[int, list[dict[str, Any]]], dtype: torch.dtype) -> None:
    w, results = surface
    expected = _value(w - 1, dtype).to(torch.complex128).tolist()
    for out in results:
        assert out[f"broadcast_{dtype}"] == expected


def test_allreduce_edge_sizes(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    for out in results:
        assert out["allreduce_empty"] == []
        assert out["allreduce_one"] == [float(sum(range(w)))]
        assert out["allreduce_scalar"] == float(sum(range(w)))


def test_all_gather(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    for out in results:
        assert out["all_gather"] == [[r, 10 * r] for r in range(w)]
        assert out["all_gather_2d"] == [torch.Size([2, 3])] * w
        assert out["all_gather_bf16"] == [[r + 0.5] for r in range(w)]


def test_reduce_scatter(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    factor = sum(r + 1 for r in range(w))
    for rank, out in enumerate(results):
        assert out["reduce_scatter"] == [[(2 * rank) * factor, (2 * rank + 1) * factor]]
        assert out["reduce_scatter_mean"] == [factor / w]
        assert out["reduce_scatter_flat"] == [float(w)] * 2


def test_in_place_results_are_the_tensors_passed_in(
    surface: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = surface
    for out in results:
        assert out["same_tensor"] == dict.fromkeys(("recv", "broadcast", "reduce", "scatter"), True)


def test_all_to_all(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    for rank, out in enumerate(results):
        assert out["all_to_all"] == [[100 * j + rank] for j in range(w)]


def test_reduce(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    total = float(sum(r + 1 for r in range(w)))
    assert results[w - 1]["reduce"] == [total]
    assert results[0]["reduce_mean"] == [total / w]


def test_gather(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    for rank, out in enumerate(results):
        expected = [[r * r] for r in range(w)] if rank == 1 else None
        assert out["gather"] == expected


def test_scatter(surface: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = surface
    for rank, out in enumerate(results):
        assert out["scatter"] == [7.0 * rank, 1.0]


def test_barrier_send_recv(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    for rank, out in enumerate(results):
        assert out["barrier"] is None
        assert out["send"] is None
        assert out["recv"] == [float((rank - 1) % w), 1.0]


def test_allreduce_coalesced(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    s = float(sum(range(w)))
    for out in results:
        assert out["coalesced_same_list"]
        assert out["coalesced"] == [[s, s], [s], [[2.0 * w] * 2] * 2, [s + 0.5 * w]]
        assert out["coalesced_empty"] == []
        assert out["coalesced_one_mean"] == [1.0, 1.0, 1.0]


def test_object_collectives(surface: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = surface
    for out in results:
        assert out["broadcast_object"] == {"from": w - 1, "items": [1, 2]}
        assert out["all_gather_object"] == [("rank", r) for r in range(w)]


# -- many handles -------------------------------------------------------------------


async def _many_handles(s: DistSession, seed: int) -> bool:
    count = 300
    tensors = [torch.full((8,), float(i + s.rank)) for i in range(count)]
    handles: list[Handle[torch.Tensor]] = []
    for i, t in enumerate(tensors):
        handles.append(s.allreduce(t) if i % 3 else s.broadcast(t, src=i % s.world_size))
    order = list(range(count))
    random.Random(seed + s.rank).shuffle(order)  # each rank awaits in its own order
    for i in order:
        await handles[i]
    for i, t in enumerate(tensors):
        if i % 3:
            expected = sum(i + r for r in range(s.world_size))
        else:
            expected = i + i % s.world_size
        assert torch.equal(t, torch.full((8,), float(expected))), i
    await wait_all(handles)
    await anyio.lowlevel.checkpoint()
    return True


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_300_handles_awaited_in_random_order(backend: str) -> None:
    assert spawn(_many_handles, 3, args=(7,), async_backend=backend) == [True] * 3


# -- bad input ------------------------------------------------------------------------


def _bad_inputs(s: DistSession) -> list[tuple[str, str]]:
    me = s.rank
    # (the call, the error it raises, what its message must say)
    bad = [
        (lambda: s.all_gather([1]), TypeError, r"^all_gather: .*torch\.Tensor.*\blist\b"),
        (
            lambda: s.reduce_scatter(torch.ones(3)),  # 3 does not split in 2
            ValueError,
            r"^reduce_scatter: .*3 elements.*\b2\b",
        ),
        (
            lambda: s.all_to_all([torch.ones(1)]),  # one tensor for two ranks
            ValueError,
            r"^all_to_all: .*2 tensors.*\b1\b",
        ),
        (lambda: s.all_to_all(torch.ones(2)), TypeError, r"^all_to_all: .*list of tensors.*Tensor"),
        (
            lambda: s.all_to_all([torch.ones(1), torch.ones(2)]),  # gloo: one shape
            ValueError,
            rf"^all_to_all on rank {me}: .*float32\[1\], float32\[2\]",
        ),
        (lambda: s.reduce(torch.ones(1), dst=2), ValueError, r"^reduce: dst=2 .*0\.\.1"),
        (lambda: s.gather(torch.ones(1), dst=-1), ValueError, r"^gather: dst=-1 .*0\.\.1"),
        (
            lambda: s.scatter(torch.ones(1), None, src=me),
            ValueError,
            rf"^scatter: rank {me} is the source and must pass chunks",
        ),
        (
            lambda: s.scatter(torch.ones(1), [torch.ones(2)] * 2, src=me),
            ValueError,
            r"^scatter: .*float32\[1\].*float32\[2\]",
        ),
        (lambda: s.send(torch.ones(1), dst=me), ValueError, rf"^send: dst={me} is this rank"),
        (lambda: s.recv(torch.ones(1), src=5), ValueError, r"^recv: src=5 .*0\.\.1"),
        (
            lambda: s.allreduce_coalesced([torch.ones(1), "x"]),
            TypeError,
            r"^allreduce_coalesced: tensors\[1\] .*torch\.Tensor.*\bstr\b",
        ),
        (
            lambda: s.allreduce_coalesced([torch.ones(1, dtype=torch.int64)], op="mean"),
            ValueError,
            r"^allreduce_coalesced: 'mean' .*int64",
        ),
        (
            lambda: s.allreduce_coalesced([], op="bogus"),
            ValueError,
            r"^allreduce_coalesced: .*'bogus'.*'sum', 'mean', 'min', 'max', 'product'",
        ),
        (
            lambda: s.broadcast_object(lambda: 1, src=me),
            TypeError,
            r"^broadcast_object: .*cannot be pickled",
        ),
        (lambda: s.broadcast_object(1, src=2), ValueError, r"^broadcast_object: src=2 .*0\.\.1"),
    ]
    messages = []
    for call, error, expected in bad:
        with pytest.raises(error) as info:
            call()
        messages.append((expected, str(info.value)))
    t = torch.ones(2)
    s.allreduce(t).wait()  # still usable, and still in step: nothing was launched
    assert t.tolist() == [2.0, 2.0]
    return messages


def test_bad_inputs_fail_before_launch() -> None:
    for rank, messages in enumerate(spawn(_bad_inputs, 2, timeout=20)):
        assert len(messages) == 16
        for expected, message in messages:
            # each names the op and the offending argument or value, on this rank
            assert re.search(expected, message), f"rank {rank}: {message!r} !~ {expected!r}"


def test_allreduce_coalesced_sends_one_buffer_per_dtype(tmp_path: Path) -> None:
    # The session's trace records one event per launched collective, with its bytes.
    with DistSession(trace=tmp_path / "t.json") as s:
        tensors = [torch.ones(2), torch.ones(4, dtype=torch.int64), torch.ones(2, 2)]
        assert s.allreduce_coalesced(tensors).wait() is tensors
    doc = json.loads((tmp_path / "t.rank0.json").read_text())
    launched = [(e["name"], e["args"]["bytes"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(launched) == [("allreduce_coalesced", 24), ("allreduce_coalesced", 32)], (
        "one flat float32 buffer (2 + 4 elements), one int64 (4)"
    )


# -- strided inputs (issue 23, item 1) -------------------------------------------------


def _strided(rank: int, offset: int = 0) -> dict[str, torch.Tensor]:
    """Non-contiguous views of this rank's values, by kind (numel even, so
    that each also splits in two blocks for reduce_scatter)."""
    base = torch.arange(24.0).view(4, 6) + 100 * rank + offset
    strided = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "sliced": base[:, 1:5],
        "stepped_1d": base.reshape(-1)[::4],
        "expanded": base[0, :3].expand(4, 3),
        "complex_t": torch.complex(base, -base).t(),
    }
    assert not any(t.is_contiguous() for t in strided.values())
    return strided


def _values(result: Any) -> Any:
    """A result as plain values (complex as pairs), for comparing across processes."""
    if isinstance(result, torch.Tensor):
        as_real = torch.view_as_real(result) if result.is_complex() else result
        return [list(result.shape), as_real.tolist()]
    if isinstance(result, list):
        return [_values(item) for item in result]
    return result


def _read_only_inputs(s: DistSession) -> dict[str, Any]:
    """Every call that only reads its tensors, with a strided input and with its
    contiguous copy: (got, reference) pairs by call and kind."""
    r, w = s.rank, s.world_size
    out: dict[str, Any] = {}
    for kind, t in _strided(r).items():
        dense = t.contiguous()
        out[f"all_gather/{kind}"] = (s.all_gather(t).wait(), s.all_gather(dense).wait())
        rows = t[: r + 2]  # two rows on rank 0, three on rank 1
        assert not rows.is_contiguous()
        out[f"all_gather_uneven/{kind}"] = (
            s.all_gather(rows, uneven=True).wait(),
            s.all_gather(rows.contiguous(), uneven=True).wait(),
        )
        out[f"gather/{kind}"] = (s.gather(t, dst=1).wait(), s.gather(dense, dst=1).wait())
        # both directions; each rank receives into a fresh contiguous tensor
        received = []
        for source in t, dense:
            inbox = torch.empty(t.shape, dtype=t.dtype)
            sent = s.send(source, dst=(r + 1) % w)
            received.append(s.recv(inbox, src=(r - 1) % w).wait())
            sent.wait()
        out[f"send/{kind}"] = tuple(received)
        chunks = list(_strided(0, 1000 * j)[kind] for j in range(w))
        scattered = [
            s.scatter(torch.empty(t.shape, dtype=t.dtype), pieces, src=0).wait()
            for pieces in (chunks, [c.contiguous() for c in chunks])
        ]
        out[f"scatter/{kind}"] = tuple(scattered)
        inputs = [_strided(r, 1000 * j)[kind] for j in range(w)]
        out[f"all_to_all/{kind}"] = (
            s.all_to_all(inputs).wait(),
            s.all_to_all([x.contiguous() for x in inputs]).wait(),
        )
        out[f"reduce_scatter/{kind}"] = (
            s.reduce_scatter(t).wait(),
            s.reduce_scatter(dense).wait(),
        )
        out[f"all_gather_object/{kind}"] = (
            s.all_gather_object(t).wait(),
            s.all_gather_object(dense).wait(),
        )
        assert torch.equal(t, _strided(r)[kind]), f"{kind}: an input was written to"
    return {call: (_values(got), _values(ref)) for call, (got, ref) in out.items()}


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_read_only_inputs_may_be_strided(debug: bool) -> None:
    results = spawn(_read_only_inputs, 2, debug=debug, timeout=60)
    calls = {call.partition("/")[0] for call in results[0]}
    assert calls == {
        "all_gather",
        "all_gather_uneven",
        "gather",
        "send",
        "scatter",
        "all_to_all",
        "reduce_scatter",
        "all_gather_object",
    }
    for rank, out in enumerate(results):
        for call, (got, ref) in out.items():
            assert got == ref, f"rank {rank}, {call}: the strided input gave other values"
    # and the reference is right: rank j's own values, in rank order
    for rank, out in enumerate(results):
        for kind in _strided(0):
            mine = [_values(_strided(j)[kind]) for j in range(2)]
            assert out[f"all_gather/{kind}"][0] == mine
            assert out[f"gather/{kind}"][0] == (mine if rank == 1 else None)
            assert out[f"send/{kind}"][0] == mine[1 - rank]


def _written_in_place(s: DistSession) -> list[str]:
    """Calls that write into a strided tensor refuse it, before launch."""
    r = s.rank
    t = torch.arange(12.0).view(4, 3).t()
    chunks = [torch.ones(3, 4)] * 2 if r == 0 else None
    refused = []
    for name, call in [
        ("allreduce", lambda: s.allreduce(t)),
        ("broadcast", lambda: s.broadcast(t)),
        ("reduce", lambda: s.reduce(t, dst=0)),
        ("recv", lambda: s.recv(t, src=1 - r)),
        ("scatter", lambda: s.scatter(t, chunks)),
        ("allreduce_coalesced", lambda: s.allreduce_coalesced([torch.ones(2), t])),
        ("allreduce_tree", lambda: s.allreduce_tree({"loss": t})),
    ]:
        with pytest.raises(ValueError, match=rf"^{name}: .* is not contiguous") as info:
            call()
        refused.append(str(info.value))
    ok = torch.ones(2)
    s.allreduce(ok).wait()  # still in step: nothing was launched
    assert ok.tolist() == [2.0, 2.0]
    return refused


def test_tensors_written_in_place_must_be_contiguous() -> None:
    for messages in spawn(_written_in_place, 2, timeout=30):
        assert len(messages) == 7
        for message in messages:
            assert "call .contiguous() and" in message, message
            assert "read the result from it" in message, message


def _read_only_call(s: DistSession, name: str, t: torch.Tensor) -> list[Handle[Any]]:
    """Issue ``name`` with ``t`` as its read-only input (the source's chunks
    for scatter); recv pairs with send."""
    r, w = s.rank, s.world_size
    if name == "all_gather":
        return [s.all_gather(t)]
    if name == "gather":
        return [s.gather(t, dst=0)]
    if name == "send":
        return [s.send(t, dst=1 - r), s.recv(torch.empty(3, 4), src=1 - r)]
    if name == "scatter":
        return [s.scatter(torch.empty(3, 4), [t] * w if r == 0 else None)]
    if name == "all_to_all":
        return [s.all_to_all([t] * w)]
    assert name == "reduce_scatter"
    return [s.reduce_scatter(t)]


READ_ONLY = ("all_gather", "gather", "send", "scatter", "all_to_all", "reduce_scatter")


def _what_travels(s: DistSession) -> dict[str, list[bool]]:
    """For each read-only call, with a contiguous and a strided input: whether
    the tensor launched shares the input's memory (intercepting the lane's
    launch in this rank's process)."""
    from asyncdist import _lane

    launched: list[Any] = []
    original = _lane.Lane.launch

    def recording(comm: Any, spec: Any) -> Any:
        launched.append(spec)
        return original(comm, spec)

    _lane.Lane.launch = recording  # type: ignore[method-assign]
    shared: dict[str, list[bool]] = {}
    try:
        for t in torch.arange(12.0).view(3, 4), torch.arange(12.0).view(4, 3).t():
            for name in READ_ONLY:
                launched.clear()
                for handle in _read_only_call(s, name, t):
                    handle.wait()
                inputs = launched[0].inputs
                shared.setdefault(name, []).append(
                    bool(inputs) and inputs[0].data_ptr() == t.data_ptr()
                )
    finally:
        _lane.Lane.launch = original  # type: ignore[method-assign]
    return shared


def test_a_contiguous_read_only_input_is_not_copied() -> None:
    results = spawn(_what_travels, 2, timeout=30)
    for rank, shared in enumerate(results):
        for name, (contiguous, strided) in shared.items():
            if name == "scatter" and rank != 0:
                continue  # only the source sends chunks
            assert contiguous, f"rank {rank}: {name} copied a contiguous input"
            assert not strided, f"rank {rank}: {name} sent a strided input without a copy"


def _requiring_grad(s: DistSession) -> dict[str, Any]:
    """Every read-only call with a model output as its input (a tensor that
    requires grad), then a plain allreduce: is the session still usable?"""
    weight = torch.nn.Parameter(torch.ones(3, 4))
    out: dict[str, Any] = {}
    for name in READ_ONLY:
        t = weight * (s.rank + 1)  # requires grad, as a model's output does
        handles = _read_only_call(s, name, t)
        results = [handle.wait() for handle in handles]
        if name == "all_gather":
            out[name] = [float(x.sum()) for x in results[0]]
        elif name == "reduce_scatter":
            out[name] = results[0].tolist()
        else:
            out[name] = "ok"
    out["after"] = s.allreduce(torch.ones(1)).wait().tolist()
    return out


def test_read_only_inputs_may_require_grad() -> None:
    """As with torch: gathering predictions or embeddings that require grad.
    all_gather and reduce_scatter used to fail in the backend and break the
    session."""
    for r in spawn(_requiring_grad, 2, timeout=30):
        assert r["all_gather"] == [12.0, 24.0]
        # the sum is 3 * ones(3, 4); 3 rows do not split over 2 ranks, so each
        # gets 6 of the 12 elements
        assert r["reduce_scatter"] == [3.0] * 6
        others = [name for name in READ_ONLY if name not in ("all_gather", "reduce_scatter")]
        assert all(r[name] == "ok" for name in others), r
        assert r["after"] == [2.0]


def test_lazy_conjugate_and_negative_views_are_refused_before_launch() -> None:
    """A ``.conj()`` view's memory holds the unconjugated values: broadcast
    into one used to leave the receiver's tensor unchanged, silently."""
    z = torch.full((2,), complex(1, 1), dtype=torch.complex64)
    with DistSession() as s:
        for call in (
            lambda: s.broadcast(z.conj(), src=0),
            lambda: s.allreduce(z.conj()),
            lambda: s.all_gather(z.conj()),
            lambda: s.allreduce_coalesced([z, z.conj()]),
        ):
            with pytest.raises(ValueError, match=r"lazy conjugate view .*resolve_conj\(\)"):
                call()
        with pytest.raises(ValueError, match=r"lazy negative view .*resolve_neg\(\)"):
            s.allreduce(z.conj().imag)
        assert s.broadcast(z.conj().resolve_conj(), src=0).wait().tolist() == [1 - 1j] * 2


def _big_ints(s: DistSession) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        s.allreduce_tree({"tokens": [1, 2**62]}).wait()
        out["sum"] = "no error"
    except ValueError as exc:
        out["sum"] = str(exc)
    out["max"] = s.allreduce_tree({"tokens": 2**62 + s.rank}, op="max").wait()
    out["fits"] = s.allreduce_tree({"tokens": 2**61}).wait()
    return out


def test_allreduce_tree_refuses_ints_whose_sum_could_wrap() -> None:
    """int64 sums wrap around in the backend: 2**62 on each of 2 ranks came
    back as -2**63."""
    for r in spawn(_big_ints, 2, timeout=30):
        assert "tree['tokens'][1] = 4611686018427387904 is too large to sum" in r["sum"], r
        assert r["max"] == {"tokens": 2**62 + 1}
        assert r["fits"] == {"tokens": 2**62}
