"""The public collective methods: check the arguments, describe the op, launch it.

``Collectives`` is the whole collective surface of a lane. Each method
keeps its explicit signature, docstring and ``Handle`` type, checks its
arguments on the calling rank (raising before anything is launched), builds
a ``Spec`` and hands it to the lane's
``launch``. Nothing here calls
``torch.distributed``; tracing and debug verification happen in the layer,
alike for every op.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, TextIO, TypeVar

import torch

from . import _mainrank, _ops, _pickle, _tree
from ._debug import describe
from ._handle import Handle, combined
from ._lane import Lane
from ._mainrank import MainFirst
from ._wire import Route, Spec
from .errors import SessionClosed

T = TypeVar("T")


_INT64_MAX = 2**63 - 1


class Collectives:
    """Every collective, issued at once on this object's lane (``_lane``),
    and the properties every lane has.

    The lane decides whether it is usable (``Lane.check``); a session not
    yet entered has no lane (``_usable`` then says so).
    """

    __slots__ = ("_lane",)

    _lane: Lane | None

    def _usable(self, op: str) -> Lane:
        """The lane to issue ``op`` on.

        Raises:
            SessionClosed, SessionBroken: the lane is not usable.
        """
        lane = self._lane
        if lane is None:
            raise SessionClosed(
                f"{op}: the session is unopened; issue collectives inside "
                "`with DistSession() as s:` (or `async with`)"
            )
        return lane.check(op)

    # -- what every lane has ----------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank on this lane (a channel's is its session's)."""
        return 0 if self._lane is None else self._lane.rank

    @property
    def world_size(self) -> int:
        """The number of ranks on this lane (a channel's is its session's)."""
        return 1 if self._lane is None else self._lane.world_size

    @property
    def backend(self) -> str:
        """``"gloo"`` or ``"nccl"`` (empty before the session is entered)."""
        return "" if self._lane is None else self._lane.backend

    @property
    def device(self) -> torch.device:
        """The device collectives on this lane run on."""
        return torch.device("cpu") if self._lane is None else self._lane.device

    @property
    def group(self) -> Any:
        """This lane's own ``torch.distributed`` process group (``None`` unless open)."""
        return None if self._lane is None else self._lane.group

    # -- argument checks (on the calling rank, before launch) -------------------------

    @staticmethod
    def _tensor(
        comm: Lane, tensor: Any, op: str, what: str = "tensor", *, read_only: bool = False
    ) -> torch.Tensor:
        Collectives._routed(comm, tensor, op, what, read_only=read_only)
        assert isinstance(tensor, torch.Tensor)  # checked
        return tensor

    @staticmethod
    def _routed(
        comm: Lane, tensor: Any, op: str, what: str = "tensor", *, read_only: bool = False
    ) -> Route:
        """``_tensor``'s checks; the route ``tensor`` travels on."""
        route = comm.route(tensor, collective=op, what=what)
        _ops.check_tensor(
            tensor,
            collective=op,
            backend=route.backend,
            device=route.device,
            what=what,
            read_only=read_only,
        )
        return route

    @staticmethod
    def _tensors(
        comm: Lane,
        tensors: Any,
        op: str,
        what: str,
        *,
        per_rank: bool = False,
        read_only: bool = False,
    ) -> list[torch.Tensor]:
        # the first tensor's route; launching refuses a call that mixes routes
        first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else None
        route = comm.route(first, collective=op, what=f"{what}[0]")
        return _ops.tensor_list(
            tensors,
            collective=op,
            backend=route.backend,
            device=route.device,
            what=what,
            length=comm.world_size if per_rank else None,
            read_only=read_only,
        )

    @staticmethod
    def _rank(comm: Lane, value: Any, op: str, what: str) -> int:
        return _ops.check_rank(value, world_size=comm.world_size, collective=op, what=what)

    @staticmethod
    def _reduction(comm: Lane, op: Any, tensor: torch.Tensor, name: str) -> _ops.Reduction:
        backend = comm.route(tensor, collective=name).backend
        return _ops.reduction(op, tensor.dtype, backend=backend, collective=name)

    # -- tensor collectives ----------------------------------------------------------

    def allreduce(
        self, tensor: torch.Tensor, op: _ops.ReduceOpLike = "sum"
    ) -> Handle[torch.Tensor]:
        """Reduce ``tensor`` across all ranks, in place.

        Args:
            tensor: a contiguous tensor, the same shape and dtype on every rank.
            op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"``, ``"product"``, or a
                ``torch.distributed.ReduceOp``.

        Returns:
            A handle whose result is ``tensor``, reduced.

        Raises:
            TypeError, ValueError: bad tensor or op (nothing is launched).
            SessionClosed, SessionBroken: the session is not usable.
        """
        name = "allreduce"
        comm = self._usable(name)
        route = self._routed(comm, tensor, name)  # the hot path: the route is resolved once
        reduction = _ops.reduction(op, tensor.dtype, backend=route.backend, collective=name)
        finish = _ops.averaged(tensor, reduction, comm.world_size)
        return comm.launch_allreduce(name, tensor, reduction, route, finish)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle[torch.Tensor]:
        """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank.

        Returns:
            A handle whose result is ``tensor``.

        Raises:
            TypeError, ValueError: bad tensor, or ``src`` not a rank of the group.
        """
        name = "broadcast"
        comm = self._usable(name)
        self._tensor(comm, tensor, name)
        self._rank(comm, src, name, "src")
        return comm.launch(Spec(name, "broadcast", lambda: tensor, inputs=(tensor,), root=src))

    def all_gather(
        self, tensor: torch.Tensor, *, uneven: bool = False
    ) -> Handle[list[torch.Tensor]]:
        """Gather ``tensor`` from every rank.

        Args:
            tensor: the same shape and dtype on every rank; with ``uneven``,
                only the first dimension may differ. It is only read, so it
                may be non-contiguous (copied where the backend needs it).
            uneven: the first dimension differs between ranks (the last batch
                of an epoch, say): the row counts are exchanged first, then
                every rank's rows travel padded to the longest and come back
                trimmed. This takes two steps, which run in program order on
                the session's object thread and side group, so the call still
                returns at once. On CUDA the rows are copied to host memory
                at the call (the side group is gloo) and back to the device
                in the result. Every rank must pass the same ``uneven``.

        Returns:
            A handle whose result is a list with one tensor per rank (element
            ``j`` came from rank ``j``); they are views of one buffer. With
            ``uneven``, element ``j`` has rank ``j``'s number of rows.

        Raises:
            TypeError, ValueError: bad tensor (it must have the same shape and
                dtype on every rank), or a 0-d tensor with ``uneven``.
            ValueError: (from the handle, on every rank, with ``uneven``) the
                ranks' tensors differ beyond the first dimension.
        """
        name = "all_gather"
        comm = self._usable(name)
        self._tensor(comm, tensor, name, read_only=True)
        if not isinstance(uneven, bool):
            raise TypeError(f"{name}: uneven must be a bool, not {type(uneven).__name__}")
        if uneven:
            return self._all_gather_uneven(comm, tensor, name)
        world, shape = comm.world_size, tensor.shape
        out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        return comm.launch(
            Spec(
                name,
                "all_gather",
                lambda: list(out.view(world, *shape).unbind(0)),
                # detached: only read, and autograd must not see the backend's
                # use of it; a copy only if tensor is strided
                inputs=(tensor.detach().reshape(-1),),
                outputs=(out,),
                described=(tensor,),
            )
        )

    @staticmethod
    def _all_gather_uneven(
        comm: Lane, tensor: torch.Tensor, name: str
    ) -> Handle[list[torch.Tensor]]:
        if tensor.dim() == 0:
            raise ValueError(
                f"{name}: uneven=True gathers along the first dimension, which a 0-d tensor "
                "lacks; pass tensor.reshape(1)"
            )
        if tensor.dtype not in _ops.GLOO_DTYPES:  # the side group is gloo
            raise ValueError(f"{name}: uneven=True cannot carry dtype {tensor.dtype}")
        device = tensor.device
        # (strided rows are fine: the exchange copies them into a padded buffer)
        staged = tensor if device.type == "cpu" else tensor.cpu()

        def finish(received: tuple[list[torch.Tensor], str]) -> list[torch.Tensor]:
            rows, problem = received
            if problem:
                raise ValueError(problem)
            return rows if device.type == "cpu" else [r.to(device) for r in rows]

        return comm.launch(
            Spec(
                name,
                "all_gather_rows",
                finish,
                inputs=(staged,),
                # what every rank agrees on (debug mode): dtype and the other dimensions
                described=(tensor.narrow(0, 0, 0),),
            )
        )

    def reduce_scatter(
        self, tensor: torch.Tensor, op: _ops.ReduceOpLike = "sum"
    ) -> Handle[torch.Tensor]:
        """Reduce ``tensor`` across ranks and give each rank its block of the result.

        ``tensor.numel()`` must be divisible by the world size. Rank ``r`` gets
        block ``r``: rows ``r*n/W .. (r+1)*n/W`` when the first dimension ``n``
        divides, else the same slice of the flattened tensor. ``tensor`` is
        only read, and may be non-contiguous.

        Returns:
            A handle whose result is this rank's block (a new tensor).

        Raises:
            TypeError, ValueError: bad tensor or op, or a size that does not divide.
        """
        name = "reduce_scatter"
        comm = self._usable(name)
        self._tensor(comm, tensor, name, read_only=True)
        world = comm.world_size
        if tensor.numel() % world:
            raise ValueError(
                f"{name}: tensor of {tensor.numel()} elements does not split into "
                f"{world} equal blocks"
            )
        reduction = self._reduction(comm, op, tensor, name)
        if tensor.dim() > 0 and tensor.shape[0] % world == 0:
            shape = (tensor.shape[0] // world, *tensor.shape[1:])
        else:
            shape = (tensor.numel() // world,)
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        return comm.launch(
            Spec(
                name,
                "reduce_scatter",
                _ops.averaged(out, reduction, world),
                # detached (only read); .contiguous(): a no-op unless strided
                # (which view_as_real refuses)
                inputs=(_ops.wire(tensor.detach().contiguous()).reshape(-1),),
                outputs=(_ops.wire(out).reshape(-1),),
                reduce=reduction,
                described=(tensor,),
            )
        )

    def all_to_all(self, inputs: Sequence[torch.Tensor]) -> Handle[list[torch.Tensor]]:
        """Send ``inputs[j]`` to rank ``j``; receive one tensor from every rank.

        Element ``j`` of the result came from rank ``j`` and has the shape and
        dtype of ``inputs[j]`` (every rank sends rank ``j`` a tensor shaped like
        the one it receives from it). NCCL allows the shapes to differ pair by
        pair; gloo needs one shape and dtype for every tensor. The inputs are
        only read, and may be non-contiguous.

        Raises:
            TypeError, ValueError: not a list of one tensor per rank, or (gloo)
                tensors of different shapes or dtypes.
        """
        name = "all_to_all"
        comm = self._usable(name)
        chunks = [  # gloo and NCCL read contiguous memory: copy only what is strided
            chunk.contiguous()
            for chunk in self._tensors(comm, inputs, name, "inputs", per_rank=True, read_only=True)
        ]
        if comm.route(chunks[0], collective=name).backend == "gloo":
            kinds = {describe(t) for t in chunks}
            if len(kinds) > 1:
                raise ValueError(
                    f"{name} on rank {comm.rank}: gloo needs every tensor in inputs to "
                    f"have one shape and dtype, got {', '.join(sorted(kinds))}"
                )
        outputs = [torch.empty_like(t) for t in chunks]
        return comm.launch(
            Spec(name, "all_to_all", lambda: outputs, inputs=chunks, outputs=outputs, pairwise=True)
        )

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: _ops.ReduceOpLike = "sum"
    ) -> Handle[torch.Tensor]:
        """Reduce ``tensor`` across ranks into ``tensor`` on rank ``dst``.

        Returns:
            A handle whose result is ``tensor`` (meaningful on ``dst`` only;
            other ranks' tensors may have been used as scratch).
        """
        name = "reduce"
        comm = self._usable(name)
        self._tensor(comm, tensor, name)
        self._rank(comm, dst, name, "dst")
        reduction = self._reduction(comm, op, tensor, name)
        finish = _ops.averaged(tensor, reduction, comm.world_size, here=comm.rank == dst)
        return comm.launch(
            Spec(
                name,
                "reduce",
                finish,
                inputs=(_ops.wire(tensor),),
                reduce=reduction,
                root=dst,
                described=(tensor,),
            )
        )

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> Handle[list[torch.Tensor] | None]:
        """Collect every rank's ``tensor`` on rank ``dst`` (it is only read, and
        may be non-contiguous).

        Returns:
            A handle whose result is the list of tensors by rank on ``dst``,
            ``None`` on every other rank.
        """
        name = "gather"
        comm = self._usable(name)
        self._tensor(comm, tensor, name, read_only=True)
        self._rank(comm, dst, name, "dst")
        sent = tensor.contiguous()  # the same tensor unless strided
        gathered = (
            [torch.empty_like(sent) for _ in range(comm.world_size)] if comm.rank == dst else None
        )
        return comm.launch(
            Spec(
                name,
                "gather",
                lambda: gathered,
                # complex as pairs of reals: gloo's gather has no complex types
                inputs=(_ops.wire(sent),),
                outputs=None if gathered is None else [_ops.wire(g) for g in gathered],
                root=dst,
                described=(tensor,),
            )
        )

    def scatter(
        self,
        out: torch.Tensor,
        chunks: Sequence[torch.Tensor] | None = None,
        src: int = 0,
    ) -> Handle[torch.Tensor]:
        """Fill ``out`` on every rank with its chunk of ``chunks`` from rank ``src``.

        Args:
            out: receives this rank's chunk (contiguous: it is written in place).
            chunks: on ``src``, one tensor per rank, each shaped like ``out``
                (non-contiguous ones are copied); ignored elsewhere.

        Returns:
            A handle whose result is ``out``.
        """
        name = "scatter"
        comm = self._usable(name)
        self._tensor(comm, out, name, "out")
        self._rank(comm, src, name, "src")
        pieces: list[torch.Tensor] = []
        if comm.rank == src:
            if chunks is None:
                raise ValueError(f"{name}: rank {src} is the source and must pass chunks")
            pieces = self._tensors(comm, chunks, name, "chunks", per_rank=True, read_only=True)
            # gloo reads a strided chunk as if it were contiguous (wrong values): copy it
            pieces = [piece.contiguous() for piece in pieces]
            for piece in pieces:
                if piece.shape != out.shape or piece.dtype != out.dtype:
                    raise ValueError(
                        f"{name}: every chunk must be shaped like out ({describe(out)}), "
                        f"got {describe(piece)}"
                    )
        return comm.launch(
            Spec(
                name,
                "scatter",
                lambda: out,
                inputs=pieces,
                outputs=(out,),
                root=src,
                described=(out,),
            )
        )

    def send(self, tensor: torch.Tensor, dst: int) -> Handle[None]:
        """Send ``tensor`` to rank ``dst`` (which must ``recv`` it). It is only
        read, and may be non-contiguous (a contiguous copy is sent).

        Point-to-point ops involve two ranks only, so debug mode does not
        fingerprint them.

        Returns:
            A handle whose result is ``None`` once the tensor was sent.
        """
        name = "send"
        comm = self._usable(name)
        self._tensor(comm, tensor, name, read_only=True)
        _ops.check_peer(
            dst, rank=comm.rank, world_size=comm.world_size, collective=name, what="dst"
        )
        # gloo refuses a strided tensor to send: copy it (a contiguous one is sent as is)
        sent = tensor.contiguous()
        return comm.launch(
            Spec(name, "send", lambda: None, inputs=(sent,), root=dst, described=(tensor,))
        )

    def recv(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        """Receive into ``tensor`` what rank ``src`` sends.

        Returns:
            A handle whose result is ``tensor``, filled.
        """
        name = "recv"
        comm = self._usable(name)
        self._tensor(comm, tensor, name)
        _ops.check_peer(
            src, rank=comm.rank, world_size=comm.world_size, collective=name, what="src"
        )
        return comm.launch(
            Spec(name, "recv", lambda: tensor, outputs=(tensor,), root=src, described=(tensor,))
        )

    def barrier(self) -> Handle[None]:
        """Complete once every rank has reached this barrier.

        Returns:
            A handle whose result is ``None``.
        """
        name = "barrier"
        return self._usable(name).launch(Spec(name, "barrier", lambda: None))

    def allreduce_coalesced(
        self, tensors: Sequence[torch.Tensor], op: _ops.ReduceOpLike = "sum"
    ) -> Handle[list[torch.Tensor]]:
        """Reduce many tensors in place with one collective per dtype.

        The tensors of each dtype are packed into one flat buffer, reduced
        together, and copied back: for many small tensors this costs a
        fraction of one allreduce each.

        Returns:
            A handle whose result is ``tensors`` (the same list), reduced.
        """
        name = "allreduce_coalesced"
        comm = self._usable(name)
        items = self._tensors(comm, tensors, name, "tensors")
        _ops.reduction_name(op, collective=name)  # a bad op fails even for an empty list
        parts = self._coalesced(comm, items, op, name)
        result = tensors if isinstance(tensors, list) else items
        return combined(name, parts, lambda _: result)

    def _coalesced(
        self, comm: Lane, items: list[torch.Tensor], op: _ops.ReduceOpLike, name: str
    ) -> list[Handle[None]]:
        """Launch one allreduce per dtype of ``items`` (checked), each over a
        flat buffer that is copied back into the tensors on completion."""
        groups = _ops.by_dtype(items)
        reductions = [self._reduction(comm, op, group[0], name) for group in groups.values()]
        parts = []
        for group, reduction in zip(groups.values(), reductions, strict=True):
            flat = _ops.pack(group)
            averaged = _ops.averaged(flat, reduction, comm.world_size)

            def unpack(averaged: Any = averaged, flat: Any = flat, group: Any = group) -> None:
                _ops.unpack(averaged(), group)

            spec = Spec(
                name,
                "allreduce",
                unpack,
                inputs=(_ops.wire(flat),),
                reduce=reduction,
                described=group,
            )
            parts.append(comm.launch(spec))
        return parts

    def allreduce_tree(self, tree: T, op: _ops.ReduceOpLike = "sum") -> Handle[T]:
        """Reduce a nested structure of tensors and Python numbers (metrics,
        say) with one collective per dtype.

        ``tree`` nests dicts (any mapping), lists and tuples (named tuples
        too) around leaves that are tensors, ``int`` or ``float``. Tensors
        are reduced in place, as by
        [allreduce_coalesced][asyncdist.DistSession.allreduce_coalesced];
        numbers travel in the same buffers (floats as float64, ints as
        int64, or float64 for ``"mean"``) and come back as numbers: an
        ``int`` stays an ``int`` except under ``"mean"``, which gives a
        ``float``. Every rank must pass the same structure.

        Returns:
            A handle whose result is a new structure of the same shape and
            container types, holding the reduced tensors and numbers.

        Raises:
            TypeError: a leaf that is neither a tensor nor a number (a
                ``bool`` included), or a bad op; the path of the leaf is named.
            ValueError: a tensor or op a collective refuses (``"mean"`` of an
                integer tensor, say), or an ``int`` too large for int64 (for
                ``"sum"``: larger than int64's maximum over the world size,
                so that the sum cannot wrap around).
        """
        name = "allreduce_tree"
        comm = self._usable(name)
        reduction = _ops.reduction_name(op, collective=name)
        mean = reduction == "mean"
        # an int travels as int64: a sum of world_size of them must fit too
        # (gloo's would wrap around silently)
        limit = _INT64_MAX // comm.world_size if reduction == "sum" else _INT64_MAX
        leaves, rebuild = _tree.flatten(tree, collective=name)
        tensors: list[torch.Tensor] = []
        numbers: dict[torch.dtype, list[tuple[int, float | int]]] = {}
        for index, (path, leaf) in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                tensors.append(self._tensor(comm, leaf, name, path))
            else:
                wide = torch.float64 if mean or isinstance(leaf, float) else torch.int64
                if wide is torch.int64 and not -limit <= leaf <= limit:
                    raise ValueError(
                        f"{name}: {path} = {leaf} is too large to {reduction} exactly as an "
                        f"int64 across {comm.world_size} ranks (at most {limit} in magnitude); "
                        "pass it as a float, or split it"
                    )
                numbers.setdefault(wide, []).append((index, leaf))
        carriers = {
            dtype: torch.tensor([v for _, v in found], dtype=dtype, device=comm.device)
            for dtype, found in numbers.items()
        }
        parts = self._coalesced(comm, tensors + list(carriers.values()), op, name)

        def finish(done: list[None]) -> T:
            values: list[Any] = [leaf for _, leaf in leaves]
            for dtype, found in numbers.items():
                for (index, _), value in zip(found, carriers[dtype].tolist(), strict=True):
                    values[index] = value
            rebuilt: T = rebuild(values)
            return rebuilt

        return combined(name, parts, finish)

    # -- object collectives ----------------------------------------------------------

    def broadcast_object(
        self, obj: Any, src: int = 0, *, allowed: Iterable[Any] | None = None
    ) -> Handle[Any]:
        """Send a picklable object from rank ``src`` to every rank.

        Object traffic runs on a side group, in program order, on one thread
        per session; the call itself only pickles (on ``src``) and queues.

        Args:
            allowed: restrict what receivers may unpickle to plain data plus
                these classes/functions (or ``"module.Name"`` strings); ``None``
                trusts every peer. See the security page.

        Returns:
            A handle whose result is the object (unpickled on every rank but ``src``).

        Raises:
            TypeError: ``obj`` cannot be pickled (on ``src``).
            pickle.UnpicklingError: (from the handle) a refused global.
        """
        return self._broadcast_object("broadcast_object", obj, src, allowed)

    def _broadcast_object(
        self, name: str, obj: Any, src: int, allowed: Iterable[Any] | None
    ) -> Handle[Any]:
        comm = self._usable(name)
        self._rank(comm, src, name, "src")
        allow = _pickle.allow_list(allowed)
        mine = comm.rank == src
        payload = _pickle.dumps(obj, op=name) if mine else b""

        def finish(data: bytes) -> Any:
            return obj if mine else _pickle.loads(data, allow)

        return comm.launch(Spec(name, "broadcast_object", finish, root=src, payload=payload))

    def all_gather_object(
        self, obj: Any, *, allowed: Iterable[Any] | None = None
    ) -> Handle[list[Any]]:
        """Gather a picklable object from every rank.

        Returns:
            A handle whose result is the list of every rank's object, by rank
            (this rank's own entry is ``obj`` itself).

        Raises:
            TypeError: ``obj`` cannot be pickled.
            pickle.UnpicklingError: (from the handle) a refused global.
        """
        name = "all_gather_object"
        comm = self._usable(name)
        allow = _pickle.allow_list(allowed)
        payload = _pickle.dumps(obj, op=name)
        me = comm.rank

        def finish(received: list[bytes]) -> list[Any]:
            return _pickle.loads_gathered(received, allow, me, obj)

        return comm.launch(Spec(name, "all_gather_object", finish, payload=payload))

    def gather_object(
        self, obj: Any, dst: int = 0, *, allowed: Iterable[Any] | None = None
    ) -> Handle[list[Any] | None]:
        """Collect a picklable object from every rank on rank ``dst``.

        Like ``torch.distributed.gather_object``; unlike
        [all_gather_object][asyncdist.DistSession.all_gather_object], only
        ``dst`` receives (and unpickles) the objects.

        Returns:
            A handle whose result is the list of every rank's object, by rank,
            on ``dst`` (its own entry is ``obj`` itself), ``None`` elsewhere.

        Raises:
            TypeError: ``obj`` cannot be pickled, or ``dst`` is not an int.
            ValueError: ``dst`` is not a rank of the group.
            pickle.UnpicklingError: (from the handle, on ``dst``) a refused global.
        """
        name = "gather_object"
        comm = self._usable(name)
        self._rank(comm, dst, name, "dst")
        allow = _pickle.allow_list(allowed)
        payload = _pickle.dumps(obj, op=name)
        me = comm.rank

        def finish(received: list[bytes] | None) -> list[Any] | None:
            if received is None:
                return None
            return _pickle.loads_gathered(received, allow, me, obj)

        return comm.launch(Spec(name, "gather_object", finish, root=dst, payload=payload))

    # -- the main rank -----------------------------------------------------------------

    def print(
        self,
        *values: object,
        sep: str | None = " ",
        end: str | None = "\n",
        file: TextIO | None = None,
        flush: bool = False,
    ) -> None:
        """``print(*values)`` on rank 0 only (of this session, or of the
        sub-session after ``split``); nothing on the other ranks. Waits for
        no one, and works before entry and after the session ended."""
        _mainrank.print_on_main(self, *values, sep=sep, end=end, file=file, flush=flush)

    def logger(
        self, name: str | logging.Logger, *, main_only: bool = True
    ) -> logging.LoggerAdapter[logging.Logger]:
        """A logger adapter over ``logging.getLogger(name)`` (or the logger given).

        With ``main_only`` (the default) it emits on rank 0 only; the other
        ranks drop every record, whatever the level. Every record it emits
        carries this rank as ``%(rank)s`` for formats to show. Configure
        handlers and levels on the logger itself, as usual.

        Raises:
            TypeError: ``name`` is neither a string nor a ``logging.Logger``.
        """
        return _mainrank.logger(self, name, main_only=main_only)

    def main_first(self) -> MainFirst:
        """A block that rank 0 runs first and the other ranks after it (to
        download a data set, or build a cache, once).

        ``with s.main_first():`` in sync code, ``async with s.main_first():``
        in async code (the other ranks then wait for rank 0 without blocking
        the event loop). Every rank must enter the block. If rank 0's block
        raises, the other ranks do not run theirs: they raise ``PeerFailure``
        naming rank 0's error. Rank 0 waits for no one.

        Raises:
            SessionClosed, SessionBroken: (on entry) the session is not usable.
            PeerFailure: (on entry, ranks but 0) rank 0's block raised.
        """
        return MainFirst(self, self._usable, self._broadcast_object)


def lane_of(target: Collectives) -> Lane | None:
    """The lane a session or a channel issues on (``None`` before the session
    is entered).

    A seam for tests and tools, not API: read a lane's routes, give it a
    routing key, launch a ``Spec`` directly, or look at its sub-lanes.
    """
    return target._lane
