"""Pickling for object collectives, with an optional allow-list on the receiving side.

Unpickling runs code chosen by whoever produced the bytes, so an object
collective trusts every peer of the session. Passing ``allowed=`` to an
object collective restricts what may be rebuilt to plain data (numbers,
strings, bytes, lists, tuples, dicts, sets) plus the classes and functions
named there; anything else raises ``pickle.UnpicklingError`` on the receiving
rank before it is constructed.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from typing import Any

# Globals plain data needs (containers and scalars referenced by name).
_PLAIN = frozenset(
    {
        "builtins.set",
        "builtins.frozenset",
        "builtins.complex",
        "builtins.bytearray",
        "builtins.range",
        "builtins.slice",
        "collections.OrderedDict",
        "collections.defaultdict",
        "collections.deque",
        "copyreg._reconstructor",
        "builtins.object",
    }
)

# What a torch tensor's pickle refers to; allowed by naming torch.Tensor.
_TENSOR = frozenset(
    {
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch.storage._load_from_bytes",
        "torch._tensor._rebuild_from_type_v2",
        "torch.Tensor",
        "torch.Size",
        "torch.FloatStorage",
        "torch.DoubleStorage",
        "torch.LongStorage",
        "torch.IntStorage",
        "torch.HalfStorage",
        "torch.BFloat16Storage",
        "torch.ByteStorage",
        "torch.BoolStorage",
        "torch.storage.UntypedStorage",
        "torch.storage.TypedStorage",
        "torch.float32",
        "torch.float64",
        "torch.int64",
        "torch.device",
        "collections.OrderedDict",
    }
)


def qualified(item: Any) -> str:
    """``"module.QualName"`` for a class or function; strings pass through."""
    if isinstance(item, str):
        return item
    module = getattr(item, "__module__", None)
    name = getattr(item, "__qualname__", None)
    if module is None or name is None:
        raise TypeError(f"allowed= takes classes, functions or 'module.Name' strings, not {item!r}")
    return f"{module}.{name}"


def allow_list(allowed: Iterable[Any] | None) -> frozenset[str] | None:
    """Normalise ``allowed=`` (``None``: no restriction)."""
    if allowed is None:
        return None
    if isinstance(allowed, (str, bytes)):
        raise TypeError("allowed= takes an iterable of classes or names, not a single string")
    names = {qualified(item) for item in allowed}
    if "torch.Tensor" in names:
        names |= _TENSOR
    return frozenset(names | _PLAIN)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in self._allowed:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: not in the allow-list given to the "
                "object collective (add it to allowed= if the peers are trusted)"
            )
        return super().find_class(module, name)


def dumps(obj: Any, *, op: str) -> bytes:
    """Pickle ``obj`` now, on the calling rank (a later mutation is not sent).

    Raises:
        TypeError: ``obj`` cannot be pickled.
    """
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"{op}: the object cannot be pickled: {exc}") from exc


def loads(data: bytes, allowed: frozenset[str] | None) -> Any:
    """Unpickle ``data``, refusing globals outside ``allowed`` when one is given."""
    if allowed is None:
        return pickle.loads(data)
    return _RestrictedUnpickler(data, allowed).load()


def loads_gathered(
    received: Iterable[bytes], allowed: frozenset[str] | None, rank: int, own: Any
) -> list[Any]:
    """Every rank's object, by rank, from the payloads an object gather
    received; ``rank``'s entry is ``own`` itself, not a copy unpickled."""
    return [own if r == rank else loads(data, allowed) for r, data in enumerate(received)]
