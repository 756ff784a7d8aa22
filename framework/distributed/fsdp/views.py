"""What torch sees of a sharded parameter: a 1-D piece that knows whose piece it is.

[Note: pieces that describe themselves]
The optimizer's parameters and their gradients are this rank's contiguous pieces of the unit's
flat shard buffer (see [Note: flat storage] in flat.py): 1-D views, copied nowhere. Each is a
`ShardPiece`, a `torch.Tensor` subclass made over the same storage (`Tensor._make_subclass`, as
`nn.Parameter` is), whose `piece_spec` names its unit, its entry, the parameter's full shape and
how many ranks hold an identical copy of it. Every torch operation runs on the plain data (the
subclass adds one Python call per op, no copy); what the piece changes is only what a piece's
*norm* means:
  * `torch.linalg.vector_norm` / `Tensor.norm` / `torch._foreach_norm` of a piece give a
    `PartialNorm`: this rank's share of a norm, not yet summed over the ranks (DTensor's
    `Partial` placement, for the one reduction torch's tools take of gradients);
  * `torch.stack` of partial norms stays partial (plain norms beside them count as replicated),
    `.to()` keeps it partial, and the `vector_norm` of a partial vector is the global norm: one
    all-reduce (SUM of the p-th powers, each divided by its copies; MAX for inf) over the default
    group, the world every rank of a sharded model is in;
  * any other use of a partial norm (`.item()`, arithmetic, printing) first completes it the same
    way.
So torch's own, unmodified `clip_grad_norm_` / `get_total_norm` return the global norm on our
gradients and scale each piece by the global factor (which is the right clipping), as they do
on FSDP2's DTensors; and, as there, a norm of a sharded gradient is a collective: every rank
asks for it. Elementwise results that keep a piece's shape (`zeros_like`, `.to()`, `.detach()`,
the optimizer's state) are pieces of the same parameter, so the description follows the data
through `module.to()`, `to_empty()` and `torch.utils.swap_tensors`, with nothing recorded about
the tensor anywhere else. Pickling a piece saves its plain local data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class PieceSpec:
    """Whose piece a `ShardPiece` is."""

    # weak reference to the owning unit: a ShardUnit (unit.py builds the spec; this module knows no
    # more of it than that it is the unit's)
    unit_ref: Callable[[], Any]
    index: int  # the unit's entry (one distinct parameter)
    full_shape: torch.Size  # the parameter's shape in the model (global over tensor parallel)
    copies: int  # ranks holding an identical copy of this piece (replicas x unsplit tp)

    def owner(self) -> Optional[Tuple[Any, int]]:
        """(unit, entry index), or None once the unit is gone."""
        unit = self.unit_ref()
        return None if unit is None else (unit, self.index)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class ShardPiece(torch.Tensor):
    """A rank's 1-D piece of one sharded parameter (or of its gradient or optimizer state)."""

    piece_spec: PieceSpec

    @staticmethod
    def __new__(cls, data: torch.Tensor, spec: PieceSpec, requires_grad: bool = False):
        t = torch.Tensor._make_subclass(cls, data, requires_grad)
        t.piece_spec = spec
        return t

    def to_local(self) -> torch.Tensor:
        """The plain local data (same storage)."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.view_as(self)

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter this is a piece of (or its whole gradient, or optimizer state), as
        a plain tensor of the parameter's full shape, like a DTensor's `full_tensor()`. Collective
        over the unit's shard group (and the tp group under tensor parallel): every rank calls it
        for the same parameter. It gathers the unit's shard: for checks and tests, not the step."""
        from . import collectives as C

        owner = self.piece_spec.owner()
        if owner is None:
            raise RuntimeError("full_tensor: the sharded module this piece belongs to no longer exists")
        unit, index = owner
        e, L = unit.entries[index], unit.layout
        local = self.to_local().detach()
        send = torch.zeros(L.shard_numel, dtype=local.dtype, device=unit.compute_device)
        send[L.shard_slice(e)] = local.to(unit.compute_device)
        flat = torch.empty(L.padded_total, dtype=local.dtype, device=unit.compute_device)
        C.all_gather_object_free(flat, send, unit.shard_group)
        full = flat[e.offset : e.offset + e.numel].view(e.shape)
        if e.tp is not None:  # the TP-local value, gathered over tp too
            from torch.distributed.tensor import DTensor

            tp = e.tp
            full = DTensor.from_local(full, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride)
            full = full.full_tensor()
        return full

    @staticmethod
    def map_whole(updates: list, fn: Callable[[torch.Tensor], torch.Tensor]) -> list:
        """This rank's piece of `fn(full matrix)` for each piece in `updates`, each matrix made
        whole where it is transformed: [Note: whole matrices from pieces] in whole.py. Collective."""
        from .whole import map_whole

        return map_whole(updates, fn)

    def __reduce_ex__(self, proto):
        return self.to_local().detach().__reduce_ex__(proto)

    def __repr__(self) -> str:
        return f"ShardPiece({self.to_local()!r}, of shape {tuple(self.piece_spec.full_shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMS:
            return _norm_of_pieces(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if func in _PLAIN_RESULTS or out is None or type(out) is cls:  # e.g. an in-place op's self
                return out
            piece = _first_piece(args)
            if piece is None:
                piece = _first_piece(kwargs.values())
            if piece is None:
                return out
            return _as_pieces(out, piece.piece_spec, piece.numel())


class PartialNorm(torch.Tensor):
    """This rank's share of a norm over sharded data: see [Note: pieces that describe themselves]."""

    norm_type: float
    copies: Any  # identical copies in the world: a number for every element, or a tensor per element

    @staticmethod
    def __new__(cls, data: torch.Tensor, norm_type: float, copies):
        t = torch.Tensor._make_subclass(cls, data, False)
        t.norm_type = float(norm_type)
        t.copies = copies
        return t

    def complete(self) -> torch.Tensor:
        """The global norm(s): one all-reduce. Collective."""
        with torch._C.DisableTorchFunctionSubclass():
            return _reduce_powers(self.view_as(self), self.norm_type, self.copies, elementwise=True)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.detach) and isinstance(args[0], PartialNorm):
            me = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
                if out is me:  # `.to()` of what is already there
                    return me
                copies = me.copies.to(out.device) if isinstance(me.copies, torch.Tensor) else me.copies
                return PartialNorm(out, me.norm_type, copies)
        if func is torch.stack:
            return _stack_partials(args, kwargs)
        if func in _VECTOR_NORMS and isinstance(args[0], PartialNorm) and _whole_norm(args, kwargs, args[0].norm_type):
            me = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                total = _reduce_powers(me.view_as(me), me.norm_type, me.copies, elementwise=False)
            return total.to(kwargs.get("dtype") or me.dtype)
        if func in _PLAIN_RESULTS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        done = lambda t: t.complete() if isinstance(t, PartialNorm) else t  # noqa: E731
        args = [[done(t) for t in a] if isinstance(a, (list, tuple)) else done(a) for a in args]
        return func(*args, **{k: done(v) for k, v in kwargs.items()})


# Attribute reads and the like: their results never describe a piece.
_PLAIN_RESULTS = {
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.__hash__,
    torch.Tensor.__reduce_ex__,
    torch.Tensor.__getstate__,
    torch.Tensor.__setstate__,
    torch.Tensor.dim,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage,
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
}
_VECTOR_NORMS = (torch.linalg.vector_norm, torch.Tensor.norm, torch.norm, torch.linalg.norm)
_NORMS = set(_VECTOR_NORMS) | {torch._foreach_norm}


def _first_piece(values) -> Optional["ShardPiece"]:
    """The first `ShardPiece` among `values` or one level of lists/tuples inside them (how torch's
    ops take tensors), without the cost of a general tree walk (the optimizer's hot path)."""
    for v in values:
        if isinstance(v, ShardPiece):
            return v
        if isinstance(v, (list, tuple)):
            for w in v:
                if isinstance(w, ShardPiece):
                    return w
    return None


def _as_pieces(out, spec: PieceSpec, numel: int):
    """An elementwise result of a piece is a piece of the same parameter: a plain 1-D tensor of
    the piece's length (a new tensor, or a view like `.detach()`); lists and tuples element-wise."""
    if type(out) is torch.Tensor:
        if out.dim() == 1 and out.numel() == numel:
            return ShardPiece(out, spec, out.requires_grad)
        return out
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(_as_pieces(o, spec, numel) for o in out)
    return out


def _order(args, kwargs) -> Optional[float]:
    """The order of a `vector_norm`/`norm` call over all elements, None for any other call (along a
    dimension, a matrix order). `Tensor.norm()`'s default "fro" is the 2-norm of a vector."""
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2.0))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is not None or order is None:
        return None
    if order == "fro":
        return 2.0
    return None if isinstance(order, str) else float(order)


def _whole_norm(args, kwargs, norm_type: float) -> bool:
    return _order(args, kwargs) == norm_type


def _norm_of_pieces(func, args, kwargs):
    """`vector_norm`/`norm` of one piece, or `_foreach_norm` of a list of them: partial norms."""
    if func is torch._foreach_norm:
        tensors = list(args[0])
        order = float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
        with torch._C.DisableTorchFunctionSubclass():
            norms = [_local_norm(t, order) for t in tensors]
        return [_partial(n, t, order) for n, t in zip(norms, tensors)]
    piece = args[0]
    order = _order(args, kwargs)
    if order is None:
        # a norm along a dimension of a 1-D piece, or a matrix norm: not a global quantity
        raise NotImplementedError(
            f"{getattr(func, '__name__', func)} of a sharded parameter's piece along a dimension or with "
            "a matrix order: the piece is this rank's 1-D share; take the norm of the whole tensor "
            "(vector_norm(g) / clip_grad_norm_), or of piece.to_local() for a local quantity"
        )
    with torch._C.DisableTorchFunctionSubclass():
        local = _local_norm(piece, order)
    return _partial(local, piece, order)


def _local_norm(t: torch.Tensor, order: float) -> torch.Tensor:
    """This rank's norm of `t`; 0 for an empty piece (a rank may hold none of a parameter), where
    torch refuses the inf norm of an empty tensor."""
    if t.numel() == 0:
        return torch.zeros((), dtype=t.dtype, device=t.device)
    return torch.linalg.vector_norm(t, order)


def _partial(local: torch.Tensor, source, order: float) -> "PartialNorm":
    copies = source.piece_spec.copies if isinstance(source, ShardPiece) else _world()
    return PartialNorm(local, order, float(copies))


def _stack_partials(args, kwargs) -> "PartialNorm":
    tensors = list(args[0])
    rest = args[1:]
    orders = {t.norm_type for t in tensors if isinstance(t, PartialNorm)}
    if len(orders) != 1:
        raise NotImplementedError("torch.stack of partial norms of different orders")
    with torch._C.DisableTorchFunctionSubclass():
        plain = [t.view_as(t) for t in tensors]
        device = plain[0].device
        copies = [t.copies if isinstance(t, PartialNorm) else float(_world()) for t in tensors]
        out = torch.stack(plain, *rest, **kwargs)
        if all(not isinstance(c, torch.Tensor) for c in copies) and out.dim() == 1:
            copies = torch.tensor(copies, dtype=torch.float64, device=device)
        else:
            copies = torch.stack(
                [
                    c.to(device)
                    if isinstance(c, torch.Tensor)
                    else torch.full(t.shape, c, dtype=torch.float64, device=device)
                    for c, t in zip(copies, plain)
                ],
                *rest,
                **kwargs,
            )
    return PartialNorm(out, orders.pop(), copies)


def _reduce_powers(local: torch.Tensor, order: float, copies, elementwise: bool) -> torch.Tensor:
    """Global norm from per-rank partial norms: every element (elementwise) or all together."""
    from . import collectives as C

    acc = local.detach().double()
    if order == float("inf"):
        acc = acc if elementwise else acc.max() if acc.numel() else acc.new_zeros(())
        acc = acc.clone()
        if _world() > 1:
            _all_reduce(acc, dist.ReduceOp.MAX, C)
        return acc.to(local.dtype)
    powers = acc.pow(order) / (copies.to(acc.device) if isinstance(copies, torch.Tensor) else copies)
    if not elementwise:
        powers = powers.sum()
    if _world() > 1:
        _all_reduce(powers, None, C)
    return powers.pow(1.0 / order).to(local.dtype)


def _all_reduce(t: torch.Tensor, op, C) -> None:
    if dist.get_backend() == "nccl" and t.device.type != "cuda":  # e.g. CPU-offloaded grads
        moved = t.to(torch.device("cuda", torch.cuda.current_device()))
        _all_reduce(moved, op, C)
        t.copy_(moved.to(t.device))
        return
    if op is None:
        C.all_reduce_sum_(t, None)
    else:
        dist.all_reduce(t, op=op)
