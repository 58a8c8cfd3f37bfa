"""The public collective methods: check the arguments, describe the op, launch it.

:class:`Collectives` is the whole collective surface of a lane. Each method
keeps its explicit signature, docstring and ``Handle`` type, checks its
arguments on the calling rank (raising before anything is launched), builds
a :class:`~asyncdist._comm.Spec` and hands it to the lane's
:meth:`~asyncdist._comm.Comm.launch`. Nothing here calls
``torch.distributed``; tracing and debug verification happen in the layer,
alike for every op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import _ops, _pickle
from ._comm import Comm, Spec
from ._debug import describe
from ._handle import Handle, combined


class Collectives:
    """Every collective, issued at once on this object's lane.

    Subclasses provide :meth:`_lane`, which checks that the lane is usable.
    """

    __slots__ = ()

    def _lane(self, op: str) -> Comm:
        """The lane to issue ``op`` on.

        Raises:
            SessionClosed, SessionBroken: the lane is not usable.
        """
        raise NotImplementedError

    # -- argument checks (on the calling rank, before launch) -------------------------

    @staticmethod
    def _tensor(comm: Comm, tensor: Any, op: str, what: str = "tensor") -> torch.Tensor:
        return _ops.check_tensor(
            tensor, collective=op, backend=comm.backend, device=comm.device, what=what
        )

    @staticmethod
    def _tensors(
        comm: Comm, tensors: Any, op: str, what: str, *, per_rank: bool = False
    ) -> list[torch.Tensor]:
        return _ops.tensor_list(
            tensors,
            collective=op,
            backend=comm.backend,
            device=comm.device,
            what=what,
            length=comm.world_size if per_rank else None,
        )

    @staticmethod
    def _rank(comm: Comm, value: Any, op: str, what: str) -> int:
        return _ops.check_rank(value, world_size=comm.world_size, collective=op, what=what)

    @staticmethod
    def _reduction(comm: Comm, op: Any, tensor: torch.Tensor, name: str) -> _ops.Reduction:
        return _ops.reduction(op, tensor.dtype, backend=comm.backend, collective=name)

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
        comm = self._lane(name)
        self._tensor(comm, tensor, name)
        reduction = self._reduction(comm, op, tensor, name)
        return comm.launch(
            Spec(
                name,
                "allreduce",
                _ops.averaged(tensor, reduction, comm.world_size),
                inputs=(_ops.wire(tensor),),
                reduce=reduction,
                shown=(tensor,),
            )
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle[torch.Tensor]:
        """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank.

        Returns:
            A handle whose result is ``tensor``.

        Raises:
            TypeError, ValueError: bad tensor, or ``src`` not a rank of the group.
        """
        name = "broadcast"
        comm = self._lane(name)
        self._tensor(comm, tensor, name)
        self._rank(comm, src, name, "src")
        return comm.launch(Spec(name, "broadcast", lambda: tensor, inputs=(tensor,), root=src))

    def all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        """Gather ``tensor`` from every rank.

        Returns:
            A handle whose result is a list with one tensor per rank (element
            ``j`` came from rank ``j``); they are views of one buffer.

        Raises:
            TypeError, ValueError: bad tensor (it must have the same shape and
                dtype on every rank).
        """
        name = "all_gather"
        comm = self._lane(name)
        self._tensor(comm, tensor, name)
        world, shape = comm.world_size, tensor.shape
        out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        return comm.launch(
            Spec(
                name,
                "all_gather",
                lambda: list(out.view(world, *shape).unbind(0)),
                inputs=(tensor.reshape(-1),),
                outputs=(out,),
                shown=(tensor,),
            )
        )

    def reduce_scatter(
        self, tensor: torch.Tensor, op: _ops.ReduceOpLike = "sum"
    ) -> Handle[torch.Tensor]:
        """Reduce ``tensor`` across ranks and give each rank its block of the result.

        ``tensor.numel()`` must be divisible by the world size. Rank ``r`` gets
        block ``r``: rows ``r*n/W .. (r+1)*n/W`` when the first dimension ``n``
        divides, else the same slice of the flattened tensor.

        Returns:
            A handle whose result is this rank's block (a new tensor).

        Raises:
            TypeError, ValueError: bad tensor or op, or a size that does not divide.
        """
        name = "reduce_scatter"
        comm = self._lane(name)
        self._tensor(comm, tensor, name)
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
                inputs=(_ops.wire(tensor).reshape(-1),),
                outputs=(_ops.wire(out).reshape(-1),),
                reduce=reduction,
                shown=(tensor,),
            )
        )

    def all_to_all(self, inputs: Sequence[torch.Tensor]) -> Handle[list[torch.Tensor]]:
        """Send ``inputs[j]`` to rank ``j``; receive one tensor from every rank.

        Element ``j`` of the result came from rank ``j`` and has the shape and
        dtype of ``inputs[j]`` (every rank sends rank ``j`` a tensor shaped like
        the one it receives from it). NCCL allows the shapes to differ pair by
        pair; gloo needs one shape and dtype for every tensor.

        Raises:
            TypeError, ValueError: not a list of one tensor per rank, or (gloo)
                tensors of different shapes or dtypes.
        """
        name = "all_to_all"
        comm = self._lane(name)
        chunks = self._tensors(comm, inputs, name, "inputs", per_rank=True)
        if comm.backend == "gloo":
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
        comm = self._lane(name)
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
                shown=(tensor,),
            )
        )

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> Handle[list[torch.Tensor] | None]:
        """Collect every rank's ``tensor`` on rank ``dst``.

        Returns:
            A handle whose result is the list of tensors by rank on ``dst``,
            ``None`` on every other rank.
        """
        name = "gather"
        comm = self._lane(name)
        self._tensor(comm, tensor, name)
        self._rank(comm, dst, name, "dst")
        gathered = (
            [torch.empty_like(tensor) for _ in range(comm.world_size)] if comm.rank == dst else None
        )
        return comm.launch(
            Spec(name, "gather", lambda: gathered, inputs=(tensor,), outputs=gathered, root=dst)
        )

    def scatter(
        self,
        out: torch.Tensor,
        chunks: Sequence[torch.Tensor] | None = None,
        src: int = 0,
    ) -> Handle[torch.Tensor]:
        """Fill ``out`` on every rank with its chunk of ``chunks`` from rank ``src``.

        Args:
            out: receives this rank's chunk.
            chunks: on ``src``, one tensor per rank, each shaped like ``out``;
                ignored elsewhere.

        Returns:
            A handle whose result is ``out``.
        """
        name = "scatter"
        comm = self._lane(name)
        self._tensor(comm, out, name, "out")
        self._rank(comm, src, name, "src")
        pieces: list[torch.Tensor] = []
        if comm.rank == src:
            if chunks is None:
                raise ValueError(f"{name}: rank {src} is the source and must pass chunks")
            pieces = self._tensors(comm, chunks, name, "chunks", per_rank=True)
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
                shown=(out,),
            )
        )

    def send(self, tensor: torch.Tensor, dst: int) -> Handle[None]:
        """Send ``tensor`` to rank ``dst`` (which must ``recv`` it).

        Point-to-point ops involve two ranks only, so debug mode does not
        fingerprint them.

        Returns:
            A handle whose result is ``None`` once the tensor was sent.
        """
        name = "send"
        comm = self._lane(name)
        self._tensor(comm, tensor, name)
        _ops.check_peer(
            dst, rank=comm.rank, world_size=comm.world_size, collective=name, what="dst"
        )
        return comm.launch(Spec(name, "send", lambda: None, inputs=(tensor,), root=dst))

    def recv(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        """Receive into ``tensor`` what rank ``src`` sends.

        Returns:
            A handle whose result is ``tensor``, filled.
        """
        name = "recv"
        comm = self._lane(name)
        self._tensor(comm, tensor, name)
        _ops.check_peer(
            src, rank=comm.rank, world_size=comm.world_size, collective=name, what="src"
        )
        return comm.launch(
            Spec(name, "recv", lambda: tensor, outputs=(tensor,), root=src, shown=(tensor,))
        )

    def barrier(self) -> Handle[None]:
        """Complete once every rank has reached this barrier.

        Returns:
            A handle whose result is ``None``.
        """
        name = "barrier"
        return self._lane(name).launch(Spec(name, "barrier", lambda: None))

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
        comm = self._lane(name)
        items = self._tensors(comm, tensors, name, "tensors")
        _ops.reduction_name(op, collective=name)  # a bad op fails even for an empty list
        groups = _ops.by_dtype(items)
        reductions = [self._reduction(comm, op, group[0], name) for group in groups.values()]
        parts = []
        for group, reduction in zip(groups.values(), reductions, strict=True):
            flat = _ops.pack(group)
            averaged = _ops.averaged(flat, reduction, comm.world_size)

            def unpack(averaged: Any = averaged, flat: Any = flat, group: Any = group) -> None:
                _ops.unpack(averaged(), group)

            spec = Spec(
                name, "allreduce", unpack, inputs=(_ops.wire(flat),), reduce=reduction, shown=group
            )
            parts.append(comm.launch(spec))
        result = tensors if isinstance(tensors, list) else items
        return combined(name, parts, lambda _: result)

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
        name = "broadcast_object"
        comm = self._lane(name)
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
        comm = self._lane(name)
        allow = _pickle.allow_list(allowed)
        payload = _pickle.dumps(obj, op=name)
        me = comm.rank

        def finish(received: list[bytes]) -> list[Any]:
            return [
                obj if rank == me else _pickle.loads(data, allow)
                for rank, data in enumerate(received)
            ]

        return comm.launch(Spec(name, "all_gather_object", finish, payload=payload))
