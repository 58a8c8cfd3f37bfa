"""The public surface: what __all__ promises exists, and nothing private leaks."""

from __future__ import annotations

import inspect

import asyncdist
import asyncdist.compat
import asyncdist.errors

EXPECTED = {
    "AsyncDistError",
    "Channel",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DistSession",
    "ElasticState",
    "FinishError",
    "GradientSync",
    "Handle",
    "InitError",
    "MainFirst",
    "MembershipChanged",
    "MembershipLost",
    "PeerFailure",
    "SessionBroken",
    "SessionClosed",
    "State",
    "TraceBlock",
    "World",
    "Worlds",
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
        "elastic",
        "min_world_size",
        "max_world_size",
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


def test_every_type_a_public_method_returns_is_exported() -> None:
    """DESIGN: the top level exports "every other type a public method
    returns"; types of the standard library and torch need no export."""
    import importlib
    import pkgutil
    import re

    # every class asyncdist's own modules define, by name (annotations are
    # strings here, and may name TYPE_CHECKING-only imports: read them as text)
    ours: dict[str, type] = {}
    for info in pkgutil.iter_modules(asyncdist.__path__, "asyncdist."):
        if info.name.rpartition(".")[2] in ("__main__", "compat"):
            continue  # the CLI, and compat's own surface
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                ours.setdefault(obj.__name__, obj)
    exported = {getattr(asyncdist, name) for name in asyncdist.__all__}
    missing = set()
    for cls in (c for c in exported if inspect.isclass(c)):
        for name in dir(cls):  # inherited methods too (the collective surface)
            if name.startswith("_") and name not in ("__enter__", "__aenter__"):
                continue
            member = inspect.getattr_static(cls, name)
            function = member.fget if isinstance(member, property) else member
            if not inspect.isfunction(function):
                continue
            returned = str(function.__annotations__.get("return", ""))
            for word in re.findall(r"[A-Za-z_]\w*", returned):
                if word in ours and ours[word] not in exported:
                    missing.add(f"{cls.__name__}.{name} -> {word}")
    assert not missing, sorted(missing)


def test_returned_types_are_the_exported_ones() -> None:
    with asyncdist.DistSession() as s:
        assert type(s.channel("x")) is asyncdist.Channel
        assert type(s.main_first()) is asyncdist.MainFirst
        assert type(s.trace("unused.json")) is asyncdist.TraceBlock


def test_the_api_reference_documents_every_exported_name() -> None:
    from pathlib import Path

    reference = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    errors = set(asyncdist.errors.__all__) if hasattr(asyncdist.errors, "__all__") else set()
    for name in asyncdist.__all__:
        if name == "__version__" or name in errors:
            continue  # the errors are documented with their module
        obj = getattr(asyncdist, name)
        if getattr(obj, "__module__", "") == "asyncdist.errors":
            continue
        assert f"::: asyncdist.{name}\n" in reference, name
