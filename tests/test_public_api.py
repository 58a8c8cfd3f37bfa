"""The public surface: what __all__ promises exists, and nothing private leaks."""

from __future__ import annotations

import inspect

import asyncdist
import asyncdist.compat
import asyncdist.errors

EXPECTED = {
    "AsyncDistError",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DistSession",
    "GradientSync",
    "Handle",
    "InitError",
    "PeerFailure",
    "SessionBroken",
    "SessionClosed",
    "State",
    "__version__",
    "spawn",
    "wait_all",
}


def test_all_is_exactly_the_contract() -> None:
    assert set(asyncdist.__all__) == EXPECTED
    assert asyncdist.__all__ == sorted(asyncdist.__all__)


def test_every_name_exists_and_is_public() -> None:
    for name in asyncdist.__all__:
        obj = getattr(asyncdist, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__.startswith("asyncdist")
    public = {n for n in vars(asyncdist) if not n.startswith("_")}
    # submodules are importable attributes, not API names
    public -= {"compat", "errors"}
    assert public <= set(asyncdist.__all__), f"leaked: {public - set(asyncdist.__all__)}"


def test_compat_surface() -> None:
    assert set(asyncdist.compat.__all__) == {
        "DistContext",
        "allgather",
        "allreduce",
        "broadcast",
        "dist_finalize",
        "dist_init",
        "dist_mode",
        "error_wrapper",
        "get_group",
        "get_rank",
        "get_world_size",
        "simple_group_split",
    }
    for name in asyncdist.compat.__all__:
        assert callable(getattr(asyncdist.compat, name))


def test_session_surface() -> None:
    for name in (
        "rank",
        "world_size",
        "local_rank",
        "backend",
        "device",
        "group",
        "is_main",
        "closed",
    ):
        assert isinstance(inspect.getattr_static(asyncdist.DistSession, name), property)
    params = inspect.signature(asyncdist.DistSession).parameters
    assert list(params) == [
        "backend",
        "init_method",
        "rank",
        "world_size",
        "master_addr",
        "master_port",
        "timeout",
        "device",
        "debug",
        "trace",
        "channels",
    ]


COLLECTIVES = (
    "allreduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
    "broadcast_object",
    "all_gather_object",
    "gather_object",
    "allreduce_coalesced",
    "allreduce_tree",
)


def test_every_collective_is_a_plain_method_and_every_wait_has_an_async_form() -> None:
    session = asyncdist.DistSession
    for name in COLLECTIVES:
        method = getattr(session, name)
        assert not inspect.iscoroutinefunction(method), f"{name} must launch on the call"
        assert inspect.signature(method).return_annotation.startswith("Handle["), name
    for sync, async_form in (
        (session.split, session.split_async),
        (session.close, session.aclose),
        (
            asyncdist.GradientSync.broadcast_parameters,
            asyncdist.GradientSync.broadcast_parameters_async,
        ),
    ):
        assert not inspect.iscoroutinefunction(sync)
        assert inspect.iscoroutinefunction(async_form), async_form.__name__


def test_version_is_a_string() -> None:
    assert isinstance(asyncdist.__version__, str)
    assert asyncdist.__version__.count(".") >= 2


def test_session_state_type_is_exported() -> None:
    import typing

    assert typing.get_type_hints(asyncdist.DistSession.state.fget)["return"] is asyncdist.State
    assert asyncdist.DistSession().state is asyncdist.State.UNOPENED
    assert [s.name for s in asyncdist.State] == ["UNOPENED", "OPEN", "BROKEN", "CLOSED"]


def test_training_loop_conveniences() -> None:
    session = asyncdist.DistSession
    assert "uneven" in inspect.signature(session.all_gather).parameters
    assert list(inspect.signature(session.gather_object).parameters) == [
        "self",
        "obj",
        "dst",
        "allowed",
    ]
    for name in ("print", "logger", "main_first"):
        assert not inspect.iscoroutinefunction(getattr(session, name)), name
    block = session().main_first()  # the sync and the async form are one object
    for method in ("__enter__", "__exit__", "__aenter__", "__aexit__"):
        assert hasattr(block, method), method
