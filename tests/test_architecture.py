"""The package's shape: no module reaches into another's privates, no import cycle.

Read from the source with ``ast``; nothing is imported or run.

Privacy rule. An underscored name (one leading underscore, not a dunder)
belongs to the module that defines it: as a class, function, method,
``__slots__`` entry, a name assigned there, or an attribute assigned there
on ``self``/``cls``. In every module
of ``asyncdist/`` (``compat/`` included):

* ``x._name`` is flagged unless ``x`` is ``self`` or ``cls``, or ``_name``
  is defined in the same module (objects of a module's own classes may use
  each other's privates: ``other._name`` in ``_grad``, ``handle._op`` in
  ``_handle``);
* ``from .mod import _name`` is flagged (importing a private module itself,
  ``from . import _ops``, is the package's layout, not a reach).

What one module needs of another is given a public-internal name (no
leading underscore) or offered through a small documented seam
(``_handle.op_of``, ``_collectives.lane_of``). The only exemptions are
privates of torch and the standard library, listed in ``OUTSIDE_PRIVATES``
with the reason for each.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "asyncdist"

# (module, expression): torch and standard-library privates asyncdist must
# use, each for a reason its module explains.
OUTSIDE_PRIVATES = {
    # name_groups_afresh: torch has no public way to reset the counter that
    # names the default group (see the _groups module docstring)
    ("asyncdist._groups", "distributed_c10d._world"),
    # LeaveNotices.for_world: the default group's store, which torch does not
    # expose publicly, carries the leave notices
    ("asyncdist._store", "dist.distributed_c10d._get_default_store"),
    # SideGroup: a side group is a ProcessGroupGloo built on the default
    # group's store with its lane's gloo devices (or ones it names itself);
    # torch's options type, its fields, a group's backend and that store
    # have no public spelling
    ("asyncdist._groups", "gloo._Options"),
    ("asyncdist._groups", "options._devices"),
    ("asyncdist._groups", "options._threads"),
    ("asyncdist._groups", "options._timeout"),
    ("asyncdist._groups", "distributed_c10d._get_default_store"),
    ("asyncdist._groups", "group._get_backend"),
    # GradientSync._untouched: whether a .grad was written in place since the
    # last finished step (zero_grad(set_to_none=False) keeps the tensor and
    # bumps its version); torch's version counter has no public spelling
    ("asyncdist._grad", "grad._version"),
    # issuer_key, on every launch: asyncio's running loop or None, without the
    # exception the public get_running_loop raises in plain code (listed in
    # asyncio.events.__all__)
    ("asyncdist._wakeup", "asyncio._get_running_loop"),
}


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = ast.parse(path.read_text(), filename=str(path))
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.Module) -> set[str]:
    """Every name the module defines (see the module docstring)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and ast.unparse(node.value) in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__slots__" for target in node.targets
        ):
            names |= {
                each.value
                for each in ast.walk(node.value)
                if isinstance(each, ast.Constant) and isinstance(each.value, str)
            }
    return names


def _package_of(module: str, tree: ast.Module) -> str:
    """The package a module's relative imports start from."""
    is_package = any(module == name for name in ("asyncdist", "asyncdist.compat"))
    return module if is_package else module.rpartition(".")[0]


def _resolve(module: str, tree: ast.Module, node: ast.ImportFrom) -> str:
    """The absolute name of the module a ``from ... import`` reads."""
    if node.level == 0:
        return node.module or ""
    base = _package_of(module, tree).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def test_no_module_reaches_into_another_modules_privates() -> None:
    modules = _modules()
    reaches = []
    for module, tree in modules.items():
        own = _defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                base = ast.unparse(node.value)
                if base in ("self", "cls") or node.attr in own:
                    continue
                if (module, f"{base}.{node.attr}") in OUTSIDE_PRIVATES:
                    continue
                reaches.append(f"{module}:{node.lineno}: {base}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                source = _resolve(module, tree, node)
                for alias in node.names:
                    if _is_private(alias.name) and f"{source}.{alias.name}" not in modules:
                        reaches.append(f"{module}:{node.lineno}: from {source} import {alias.name}")
    assert not reaches, "\n".join(reaches)


def _imports(module: str, tree: ast.Module, modules: dict[str, ast.Module]) -> set[str]:
    """The package's modules ``module`` imports, anywhere in it (under ``if
    TYPE_CHECKING:`` and inside functions included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, tree, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:  # a submodule
                    found.add(f"{source}.{alias.name}")
                elif source in modules:
                    found.add(source)
    found.discard(module)
    return found


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(name, tree, modules) for name, tree in modules.items()}
    # the package re-exports its modules; a module importing the package itself
    # (``from asyncdist import X``) would close a cycle through it
    done: set[str] = set()
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append(" -> ".join([*path[path.index(name) :], name]))
            return
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "\n".join(cycles)


def test_the_checks_see_a_reach_and_a_cycle() -> None:
    """The walks above find what they look for (a check that sees nothing
    would pass as well)."""
    reach = ast.parse("def f(handle):\n    return handle._settle\n")
    assert "_settle" not in _defined(reach)
    attribute = next(n for n in ast.walk(reach) if isinstance(n, ast.Attribute))
    assert _is_private(attribute.attr)
    assert ast.unparse(attribute.value) == "handle"
    modules = {
        "asyncdist._a": ast.parse("from ._b import X"),
        "asyncdist._b": ast.parse("if TYPE_CHECKING:\n    from ._a import Y\n"),
    }
    graph = {name: _imports(name, tree, modules) for name, tree in modules.items()}
    assert graph == {"asyncdist._a": {"asyncdist._b"}, "asyncdist._b": {"asyncdist._a"}}
