"""Collectives on tensors made under ``torch.inference_mode()`` and ``torch.no_grad()``.

The step that finishes a collective on the host (the divide of "mean", the
copy back of a reduce_scatter block, the unpacking of a coalesced buffer)
runs on whichever thread settles the handle: the waiter, a gloo worker
thread, the completer, the watchdog. Inference mode and grad mode are
thread-local in torch, so that step must re-enter the mode the caller
issued in; a failure in it is the caller's own (the session stays usable).

One spawn per world size and waiting style (sync ``.wait()``, asyncio, trio)
runs every case, many rounds each so the settling thread varies; the tests
then check one part each.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import pytest
import torch

from asyncdist import DistSession, Handle, spawn

pytestmark = pytest.mark.timeout(180)

ROUNDS = 30
OPS = ("allreduce", "reduce", "reduce_scatter", "allreduce_coalesced", "allreduce_tree")
REDUCTIONS = ("mean", "sum")
MODES = ("no_grad", "inference")  # no_grad first: before the fix, inference broke sessions
KEPT = 8  # problems reported in full; the rest are counted

Check = Callable[[Any], str | None]


def _mode(mode: str) -> contextlib.AbstractContextManager[Any]:
    return torch.inference_mode() if mode == "inference" else torch.no_grad()


def _made(value: torch.Tensor, mode: str) -> torch.Tensor:
    """``value`` as a caller in ``mode`` holds it: an inference tensor (made
    inside the mode), or under no_grad a parameter (a leaf that requires grad,
    which may only be updated in place with grad off)."""
    return value if mode == "inference" else torch.nn.Parameter(value)


def _expect(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or not torch.equal(got.detach(), want):
        return f"got {got.tolist()}, expected {want.tolist()}"
    return None


def _issue(
    lane: Any, op: str, reduction: str, mode: str, rank: int, world: int, round_: int
) -> tuple[Handle[Any], Check]:
    """Launch one reducing collective inside ``mode`` (the caller's ``with``
    is open), and how to check its result."""
    scale = 1 + round_ % 4
    mine = float((rank + 1) * scale)  # rank r holds (r + 1) * scale
    summed = float(world * (world + 1) // 2 * scale)
    want = summed / world if reduction == "mean" else summed  # exact in float32
    f32 = torch.float32
    if op == "allreduce":
        t = _made(torch.full((3,), mine), mode)
        return (
            lane.allreduce(t, op=reduction),
            lambda got: (
                "not the same tensor" if got is not t else _expect(got, torch.full((3,), want))
            ),
        )
    if op == "reduce":
        dst = round_ % world
        t = _made(torch.full((3,), mine), mode)
        if rank != dst:
            return lane.reduce(t, dst=dst, op=reduction), lambda got: None
        return lane.reduce(t, dst=dst, op=reduction), lambda got: _expect(
            got, torch.full((3,), want)
        )
    if op == "reduce_scatter":
        # row j holds (j + 1) * mine; rank r gets row r, reduced
        rows = torch.arange(1, world + 1, dtype=f32).repeat_interleave(2).reshape(world, 2)
        t = _made(rows * mine, mode)
        return lane.reduce_scatter(t, op=reduction), lambda got: _expect(
            got, torch.full((1, 2), (rank + 1) * want)
        )
    if op == "allreduce_coalesced":
        a = _made(torch.full((2,), mine), mode)
        b = _made(torch.full((3,), 2 * mine, dtype=torch.float64), mode)
        tensors = [a, b]

        def coalesced(got: Any) -> str | None:
            if got is not tensors:
                return "not the same list"
            return _expect(a, torch.full((2,), want)) or _expect(
                b, torch.full((3,), 2 * want, dtype=torch.float64)
            )

        return lane.allreduce_coalesced(tensors, op=reduction), coalesced
    assert op == "allreduce_tree"
    loss = _made(torch.full((2,), mine), mode)
    tree = {"loss": loss, "acc": [_made(torch.full((1,), 2 * mine, dtype=torch.float64), mode)]}
    tree["n"] = mine  # a Python number travels in the float64 buffer

    def reduced(got: Any) -> str | None:
        if got["loss"] is not loss:
            return "loss not reduced in place"
        if got["n"] != want:
            return f"n: got {got['n']}, expected {want}"
        return _expect(got["loss"], torch.full((2,), want)) or _expect(
            got["acc"][0], torch.full((1,), 2 * want, dtype=torch.float64)
        )

    return lane.allreduce_tree(tree, op=reduction), reduced


def _rounds() -> Iterator[tuple[str, int, bool]]:
    """(mode, round, wait inside the mode), one mode after the other."""
    for mode in MODES:
        for round_ in range(ROUNDS):
            yield mode, round_, round_ % 2 == 0


class _Tally:
    def __init__(self) -> None:
        self.checked = 0
        self.problems: list[str] = []

    def record(self, where: str, problem: str | None) -> None:
        self.checked += 1
        if problem is not None:
            self.problems.append(f"{where}: {problem}")

    def failed(self, where: str, exc: BaseException) -> None:
        self.record(where, f"raised {type(exc).__name__}: {exc}")

    def report(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "failed": len(self.problems),
            "problems": self.problems[:KEPT],
        }


def _lanes_sync(s: DistSession) -> list[tuple[str, Any]]:
    return [("session", s), ("channel", s.channel("eval")), ("split", s.split(s.world_size))]


async def _lanes_async(s: DistSession) -> list[tuple[str, Any]]:
    return [
        ("session", s),
        ("channel", await s.channel_async("eval")),
        ("split", await s.split_async(s.world_size)),
    ]


def _launch_round(
    lane: Any, mode: str, rank: int, world: int, round_: int, tally: _Tally, where: str
) -> list[tuple[str, Handle[Any], Check]]:
    """Every reducing op and reduction, launched back to back (inside ``mode``)."""
    issued = []
    for op in OPS:
        for reduction in REDUCTIONS:
            what = f"{where} {op} {reduction}"
            try:
                issued.append((what, *_issue(lane, op, reduction, mode, rank, world, round_)))
            except Exception as exc:  # noqa: BLE001 - reported, and the sweep goes on
                tally.failed(what, exc)
    return issued


def _issued_rounds(
    s: DistSession, lanes: list[tuple[str, Any]], tallies: dict[str, _Tally], waited: str
) -> Iterator[tuple[_Tally, list[tuple[str, Handle[Any], Check]]]]:
    """Each round's launched ops, handed out for waiting inside the round's
    mode (the generator is suspended inside ``with _mode``) or after it."""
    for mode, round_, inside in _rounds():
        name, lane = lanes[round_ % len(lanes)]
        where = f"{name} round {round_} {waited} {'in' if inside else 'after'}"
        with _mode(mode):
            issued = _launch_round(lane, mode, s.rank, s.world_size, round_, tallies[mode], where)
            if inside:
                yield tallies[mode], issued
        if not inside:
            yield tallies[mode], issued


def _sweep_sync(s: DistSession, lanes: list[tuple[str, Any]]) -> dict[str, Any]:
    tallies = {mode: _Tally() for mode in MODES}
    for tally, issued in _issued_rounds(s, lanes, tallies, "waited"):
        for what, handle, check in issued:
            try:
                tally.record(what, check(handle.wait()))
            except Exception as exc:  # noqa: BLE001 - reported, and the sweep goes on
                tally.failed(what, exc)
    return {mode: tally.report() for mode, tally in tallies.items()}


async def _sweep_async(s: DistSession, lanes: list[tuple[str, Any]]) -> dict[str, Any]:
    tallies = {mode: _Tally() for mode in MODES}
    for tally, issued in _issued_rounds(s, lanes, tallies, "awaited"):
        for what, handle, check in issued:
            try:
                tally.record(what, check(await handle))
            except Exception as exc:  # noqa: BLE001 - reported, and the sweep goes on
                tally.failed(what, exc)
    return {mode: tally.report() for mode, tally in tallies.items()}


# -- a Lightning-style evaluation loop ------------------------------------------------

BATCHES = 2
BATCH = 8


def _model() -> torch.nn.Linear:
    """Integer weights and data: every per-rank metric is a multiple of 1/16,
    so sums over ranks are exact and the mean is one rounding of that sum."""
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0, 0.0, 3.0]]))
        model.bias.fill_(1.0)
    return model


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234 + rank)
    return [
        (
            torch.randint(-2, 3, (BATCH, 4), generator=generator).float(),
            torch.randint(-3, 4, (BATCH,), generator=generator).float(),
        )
        for _ in range(BATCHES)
    ]


@torch.inference_mode()
def _validation(
    s: DistSession, model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, float], Handle[torch.Tensor], Handle[dict[str, Any]]]:
    """The per-rank metrics of an evaluation pass, and their reductions
    (launched here, under inference mode, as a Lightning ``validation_step``
    with ``sync_dist=True`` would)."""
    model.eval()
    loss = torch.zeros(())
    correct = torch.zeros(())
    for x, y in batches:
        out = model(x).squeeze(-1)
        loss += torch.nn.functional.l1_loss(out, y, reduction="sum")
        correct += ((out > 0) == (y > 0)).sum()
    seen = BATCHES * BATCH
    metrics = {"loss": loss / seen, "acc": correct / seen}
    local = {name: value.item() for name, value in metrics.items()}
    loss_handle = s.allreduce(metrics["loss"].clone(), op="mean")
    tree_handle = s.allreduce_tree({**metrics, "batches": float(len(batches))}, op="mean")
    return local, loss_handle, tree_handle


def _train_step(s: DistSession, model: torch.nn.Module) -> list[float]:
    """A training-mode allreduce of real gradients (grad mode on)."""
    model.train()
    x = torch.full((2, 4), float(s.rank + 1))
    model(x).sum().backward()
    grad = model.weight.grad
    assert grad is not None
    return list(s.allreduce(grad, op="mean").wait().tolist()[0])


def _evaluate_sync(s: DistSession) -> dict[str, Any]:
    model = _model()
    out: dict[str, Any] = {}
    try:
        local, loss, tree = _validation(s, model, _batches(s.rank))
        out["local"] = local
        out["loss"] = loss.wait().item()  # waited outside inference mode
        reduced = tree.wait()
        out["tree"] = {name: float(value) for name, value in reduced.items()}
        out["train"] = _train_step(s, model)
    except Exception as exc:  # noqa: BLE001 - reported
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


async def _evaluate_async(s: DistSession) -> dict[str, Any]:
    model = _model()
    out: dict[str, Any] = {}
    try:
        local, loss, tree = _validation(s, model, _batches(s.rank))
        out["local"] = local
        out["loss"] = (await loss).item()
        reduced = await tree
        out["tree"] = {name: float(value) for name, value in reduced.items()}
        model.train()
        x = torch.full((2, 4), float(s.rank + 1))
        model(x).sum().backward()
        assert model.weight.grad is not None
        out["train"] = list((await s.allreduce(model.weight.grad, op="mean")).tolist()[0])
    except Exception as exc:  # noqa: BLE001 - reported
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# -- a local failure in a finishing step ----------------------------------------------


def _described(exc: BaseException) -> dict[str, Any]:
    cause = exc.__cause__
    return {
        "type": type(exc).__name__,
        "mro": [cls.__name__ for cls in type(exc).__mro__],
        "message": str(exc),
        "op": getattr(exc, "op", None),
        "rank": getattr(exc, "rank", None),
        "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
    }


def _leaf(rank: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((2,), float(rank + 1)))


def _failing_calls(s: DistSession) -> dict[str, Callable[[], Handle[Any]]]:
    return {
        "allreduce": lambda: s.allreduce(_leaf(s.rank), op="mean"),
        "allreduce_coalesced": lambda: s.allreduce_coalesced([_leaf(s.rank)], op="sum"),
    }


def _failing_sync(s: DistSession) -> dict[str, Any]:
    """In grad mode, dividing a parameter in place is refused by autograd (as
    ``p.div_(2)`` is): the collective went fine, its local finish did not."""
    out: dict[str, Any] = {}
    for name, call in _failing_calls(s).items():
        try:
            call().wait()
            out[name] = {"type": "no error"}
        except Exception as exc:  # noqa: BLE001 - described for the test
            out[name] = _described(exc)
    try:
        s.all_gather_object(Fraction(s.rank, 7), allowed=[]).wait()
        out["unpickle"] = "accepted"
    except pickle.UnpicklingError as exc:
        out["unpickle"] = f"UnpicklingError: {exc}"
    try:  # later collectives on the same session, every kind of completion
        out["after"] = s.allreduce(torch.ones(2)).wait().tolist()
        out["after_mean"] = s.reduce_scatter(torch.ones(s.world_size), op="mean").wait().tolist()
        with torch.no_grad():
            leaf = _leaf(s.rank)
            out["after_leaf"] = s.allreduce(leaf, op="mean").wait().tolist()
    except Exception as exc:  # noqa: BLE001 - reported
        out["after_error"] = f"{type(exc).__name__}: {exc}"
    return out


async def _failing_async(s: DistSession) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, call in _failing_calls(s).items():
        try:
            await call()
            out[name] = {"type": "no error"}
        except Exception as exc:  # noqa: BLE001 - described for the test
            out[name] = _described(exc)
    try:
        await s.all_gather_object(Fraction(s.rank, 7), allowed=[])
        out["unpickle"] = "accepted"
    except pickle.UnpicklingError as exc:
        out["unpickle"] = f"UnpicklingError: {exc}"
    try:
        out["after"] = (await s.allreduce(torch.ones(2))).tolist()
        out["after_mean"] = (await s.reduce_scatter(torch.ones(s.world_size), op="mean")).tolist()
        with torch.no_grad():
            leaf = _leaf(s.rank)
            out["after_leaf"] = (await s.allreduce(leaf, op="mean")).tolist()
    except Exception as exc:  # noqa: BLE001 - reported
        out["after_error"] = f"{type(exc).__name__}: {exc}"
    return out


# -- one spawn per world size and waiting style ---------------------------------------


def _everything_sync(s: DistSession) -> dict[str, Any]:
    failing = _failing_sync(s)
    evaluation = _evaluate_sync(s)
    sweep = _sweep_sync(s, _lanes_sync(s))
    return {"failing": failing, "evaluation": evaluation, **sweep}


async def _everything_async(s: DistSession) -> dict[str, Any]:
    failing = await _failing_async(s)
    evaluation = await _evaluate_async(s)
    sweep = await _sweep_async(s, await _lanes_async(s))
    return {"failing": failing, "evaluation": evaluation, **sweep}


@pytest.fixture(
    scope="module",
    params=[(2, "sync"), (3, "sync"), (2, "asyncio"), (3, "asyncio"), (2, "trio"), (3, "trio")],
    ids=lambda p: f"{p[0]}ranks-{p[1]}",
)
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world, style = request.param
    if style == "sync":
        return world, spawn(_everything_sync, world, timeout=60)
    return world, spawn(_everything_async, world, timeout=60, async_backend=style)


def _sweep_ok(results: tuple[int, list[dict[str, Any]]], mode: str) -> None:
    world, ranks = results
    for rank, out in enumerate(ranks):
        report = out[mode]
        # every round, mode, op and reduction was checked, none failed
        assert report["checked"] == ROUNDS * len(OPS) * len(REDUCTIONS), report
        assert report["failed"] == 0, f"rank {rank} of {world}: {report}"


def test_every_reducing_op_under_inference_mode(results: Any) -> None:
    _sweep_ok(results, "inference")


def test_every_reducing_op_under_no_grad_on_parameters(results: Any) -> None:
    _sweep_ok(results, "no_grad")


def test_an_inference_mode_evaluation_loop_reduces_exact_averages(results: Any) -> None:
    world, ranks = results
    for out in ranks:
        assert "error" not in out["evaluation"], out["evaluation"]
    locals_ = [out["evaluation"]["local"] for out in ranks]
    for name in ("loss", "acc"):
        # every local metric is a multiple of 1/16: the sum is exact in any order
        total = sum(local[name] for local in locals_)
        assert all((local[name] * 16).is_integer() for local in locals_)
        want32 = (torch.tensor(total, dtype=torch.float32) / world).item()
        for out in ranks:
            assert out["evaluation"]["tree"][name] == want32, (name, out["evaluation"])
            if name == "loss":
                assert out["evaluation"]["loss"] == want32
    for out in ranks:
        assert out["evaluation"]["tree"]["batches"] == float(BATCHES)
        # the session is still usable: a training-mode allreduce of gradients
        # (rank r's weight grad is 2 * (r + 1) * [1, 1, 1, 1])
        assert out["evaluation"]["train"] == [float(world + 1)] * 4


def test_a_local_failure_in_a_finishing_step_leaves_the_session_usable(results: Any) -> None:
    world, ranks = results
    for rank, out in enumerate(ranks):
        failing = out["failing"]
        for op, cause in (
            ("allreduce", "a leaf Variable that requires grad"),
            ("allreduce_coalesced", "a leaf Variable that requires grad"),
        ):
            error = failing[op]
            # an asyncdist error (not a bare RuntimeError) naming op, rank and cause
            assert error["type"] == "FinishError", error
            assert "CollectiveError" in error["mro"]
            assert error["op"] == op
            assert error["rank"] == rank
            assert error["message"].startswith(f"{op} on rank {rank}: "), error["message"]
            assert cause in error["message"]
            assert error["cause"].startswith("RuntimeError: "), error
        # a refused unpickle keeps its own type (documented), and is local too
        assert failing["unpickle"].startswith("UnpicklingError: refusing to unpickle")
        assert "after_error" not in failing, failing["after_error"]
        assert failing["after"] == [float(world)] * 2
        assert failing["after_mean"] == [1.0]
        assert failing["after_leaf"] == [(world + 1) / 2] * 2


# -- debug mode: the launch is deferred to the lane's debug thread --------------------


def _debug_mode(s: DistSession) -> dict[str, Any]:
    r, w = s.rank, s.world_size
    tally = _Tally()
    for round_ in range(6):
        for op in OPS:
            where = f"round {round_} {op}"
            try:
                with torch.inference_mode():
                    handle, check = _issue(s, op, "mean", "inference", r, w, round_)
                tally.record(where, check(handle.wait()))
            except Exception as exc:  # noqa: BLE001 - reported
                tally.failed(where, exc)
    return tally.report()


def test_debug_mode_finishes_in_the_callers_mode() -> None:
    for report in spawn(_debug_mode, 2, timeout=60, debug=True):
        assert report["checked"] == 6 * len(OPS)
        assert report["failed"] == 0, report


def test_an_unobserved_finish_error_is_logged_at_exit_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A FinishError is local (the session is fine): leaving the session
    logs it, as other local errors, instead of raising it."""
    weight = torch.nn.Parameter(torch.ones(3))
    with DistSession() as s:
        s.allreduce(weight, op="mean")  # grad mode: the divide is refused; never awaited
    assert "unobserved failure at session exit" in caplog.text
    assert "the step that finishes it" in caplog.text
