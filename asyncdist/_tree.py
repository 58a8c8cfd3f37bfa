"""Nested structures of tensors and numbers, flattened for one coalesced reduction.

Pure: ``flatten`` walks mappings, lists and tuples (named tuples too) down
to their leaves, checks each leaf, and returns the leaves with their paths
plus a function that builds the same structure around new leaf values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

Leaf = torch.Tensor | int | float
Rebuild = Callable[[list[Any]], Any]


def flatten(tree: Any, *, collective: str) -> tuple[list[tuple[str, Leaf]], Rebuild]:
    """The leaves of ``tree`` in order, each with its path (``tree['loss'][0]``),
    and how to rebuild ``tree`` from a list of new leaf values.

    Raises:
        TypeError: a leaf that is neither a tensor nor an ``int``/``float``
            (a ``bool`` is refused: summing flags is rarely meant).
    """
    leaves: list[tuple[str, Leaf]] = []
    build = _walk(tree, "tree", leaves, collective)

    def rebuild(values: list[Any]) -> Any:
        return build(iter(values))

    return leaves, rebuild


def _walk(
    node: Any, path: str, leaves: list[tuple[str, Leaf]], collective: str
) -> Callable[[Any], Any]:
    if isinstance(node, torch.Tensor) or (
        isinstance(node, (int, float)) and not isinstance(node, bool)
    ):
        leaves.append((path, node))
        return next
    if isinstance(node, Mapping):
        keys = list(node)
        builds = [_walk(node[k], f"{path}[{k!r}]", leaves, collective) for k in keys]

        def mapping(values: Any) -> Any:
            out: MutableMapping[Any, Any] = (
                copy.copy(node) if isinstance(node, MutableMapping) else {}
            )
            for key, build in zip(keys, builds, strict=True):
                out[key] = build(values)
            return out

        return mapping
    if isinstance(node, (list, tuple)):
        builds = [_walk(item, f"{path}[{i}]", leaves, collective) for i, item in enumerate(node)]

        def sequence(values: Any) -> Any:
            items = [build(values) for build in builds]
            if isinstance(node, list):
                return items
            if hasattr(node, "_fields"):  # a named tuple
                return type(node)(*items)
            return tuple(items)

        return sequence
    hint = "; convert it with int(...)" if isinstance(node, bool) else ""
    raise TypeError(
        f"{collective}: {path} is a {type(node).__name__}; the leaves must be tensors, "
        f"ints or floats (inside dicts, lists and tuples){hint}"
    )
