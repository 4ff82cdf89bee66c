"""View and layout ops: where a sharded input dim lands in the output, if anywhere.

Each rule computes a map ``input dim -> output dim`` for the dims whose sharding survives
the op; ``Shard(d)`` in becomes ``Shard(map[d])`` out, ``Replicate`` and ``Partial`` pass
through (views are linear). A dim with no image (flattened behind another dim, sliced,
selected) is not offered: the solver reshards before the op instead.

Reshape follows the grouping of dims with equal products: in each group only the outermost
non-trivial dim can carry a shard, because a contiguous block of the flattened group is a
block of its first dim on either side (``[b, s, h] -> [b, s, nh, hd]`` maps ``h`` to ``nh``).
``split``/``chunk`` of a sharded dim into equal pieces is offered with the note ``strided``:
each rank then holds its slice of every piece, and lowering lays the producer's weight out
to match (Megatron's fused QKV; :mod:`passes.lower.strided_layout`). ``view_as`` /
``reshape_as`` / ``expand_as`` lower to ``reshape`` / ``expand`` to the rank's own output piece.
"""

from __future__ import annotations

import torch

from passes.core.placements import P, R, Shard
from passes.rules.base import AxisStrategy, OpRule, OpView, register
from runtime.uneven_views import reshape_by_groups

aten = torch.ops.aten

__all__ = ["view_dim_map", "view_groups", "DimMapRule"]


def view_dim_map(in_shape, out_shape) -> dict:
    mapping, i, j = {}, 0, 0
    while i < len(in_shape) and j < len(out_shape):
        si, sj = i, j
        pi, pj = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(in_shape):
                pi *= in_shape[i]
                i += 1
            elif j < len(out_shape):
                pj *= out_shape[j]
                j += 1
            else:
                return mapping
        fi = next((k for k in range(si, i) if in_shape[k] > 1), None)
        fj = next((k for k in range(sj, j) if out_shape[k] > 1), None)
        if fi is not None and fj is not None:
            mapping[fi] = fj
    return mapping


def view_groups(in_shape, out_shape) -> list:
    """The runs of dims a reshape ``in_shape -> out_shape`` maps onto each other: ``[(input dims,
    output dims)]`` with equal products, covering every dim of both (size-1 dims join the run
    before them, or the first): ``[B, kv, rep, S, D] -> [B, kv * rep, S, D]`` is ``[((0,), (0,)),
    ((1, 2), (1,)), ((3,), (2,)), ((4,), (3,))]``."""
    groups: list = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        ins, outs, pi, pj = [], [], 1, 1
        while True:
            balanced = bool(ins) and bool(outs) and pi == pj
            if balanced:  # a run is closed; size-1 dims next to it join it, nothing else
                if i < len(in_shape) and in_shape[i] == 1:
                    ins.append(i)
                    i += 1
                elif j < len(out_shape) and out_shape[j] == 1:
                    outs.append(j)
                    j += 1
                else:
                    break
            elif i < len(in_shape) and (not ins or pi < pj or j >= len(out_shape)):
                ins.append(i)
                pi *= in_shape[i]
                i += 1
            elif j < len(out_shape):
                outs.append(j)
                pj *= out_shape[j]
                j += 1
            else:
                break
        groups.append((tuple(ins), tuple(outs)))
    return groups


def _norm(dim, rank):
    return dim + rank if dim < 0 else dim


# ops that take their output's shape from another tensor -> the op taking it as sizes
_SHAPED_AS = {
    aten.view_as.default: aten.reshape.default,
    aten.reshape_as.default: aten.reshape.default,
    aten.expand_as.default: aten.expand.default,
}


class DimMapRule(OpRule):
    """A view-like op described by ``dim_map(op) -> {in_dim: out_dim}``."""

    linear = True
    is_view = True

    def __init__(self, dim_map, *, strided_dim=None, broadcast_out=None):
        self.dim_map = dim_map
        self.strided_dim = strided_dim
        self.broadcast_out = broadcast_out

    def flops(self, op: OpView) -> float:
        return 0.0

    def lower(self, call):
        """Rewrite size arguments to this rank's local sizes."""
        target, args = call.node.target, list(call.args)
        if target in _SHAPED_AS:
            # the shape comes from the rank's own output piece, not from the other tensor's, which
            # may be placed otherwise (RoFormer reshapes to a value cut on other mesh axes)
            target, args = _SHAPED_AS[target], [args[0], None]
        if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default):
            args[1] = list(call.local_out_shape)
            if target is not aten.expand.default and args[1].count(-1) > 1:
                # pieces of unequal size on several dims: each unknown size from its own run of dims
                groups = view_groups(call.view.in_shapes[0], call.view.out_shapes[0])
                return call.emit(target=reshape_by_groups, args=(args[0], args[1], groups))
            if target is aten.view.default:
                # capture saw one device's strides (export drops a .contiguous() it found
                # redundant there); a rank's local input may come from a collective or a kernel
                # laid out otherwise, so reshape (a view whenever the strides allow one)
                return call.emit(target=aten.reshape.default, args=args)
            return call.emit(target=target, args=args)
        elif target is aten.unflatten.int:
            dim = _norm(args[1], len(call.view.in_shapes[0]))
            args[2] = list(call.local_out_shape[dim : dim + len(args[2])])
        elif target in (aten.split.Tensor, aten.split_with_sizes.default):
            dim = _norm(
                call.node.args[2] if len(call.node.args) > 2 else call.node.kwargs.get("dim", 0),
                len(call.view.in_shapes[0]),
            )
            degree = 1
            for axis in call.sharded_axes(call.in_specs[0], dim):
                degree *= call.comm.shape[axis]
            args[1] = args[1] // degree if isinstance(args[1], int) else [s // degree for s in args[1]]
        return call.emit(args=args)

    def axis_strategies(self, op: OpView) -> list:
        n_out = len(op.out_shapes)
        rest = tuple(None for _ in op.in_shapes[1:])
        strategies = [AxisStrategy(out=(R,) * n_out, ins=(R,) + rest), AxisStrategy(out=(P,) * n_out, ins=(P,) + rest)]
        for d_in, d_out in self.dim_map(op).items():
            if op.in_shapes[0][d_in] > 1:
                strategies.append(AxisStrategy(out=(Shard(d_out),) * n_out, ins=(Shard(d_in),) + rest))
        if self.strided_dim is not None:
            d = self.strided_dim(op)
            sizes = {s[d] for s in op.out_shapes}
            if d is not None and len(sizes) == 1 and len(op.out_shapes) > 1:
                strategies.append(AxisStrategy(out=(Shard(d),) * n_out, ins=(Shard(d),) + rest, note="strided"))
        if self.broadcast_out is not None:
            for d_out in self.broadcast_out(op):
                strategies.append(AxisStrategy(out=(Shard(d_out),) * n_out, ins=(R,) + rest))
        return strategies


def _identity(op):
    return {d: d for d in range(len(op.in_shapes[0]))}


def _reshape(op):
    return view_dim_map(op.in_shapes[0], op.out_shape)


def _transpose(op):
    rank = len(op.in_shapes[0])
    if rank < 2:
        return _identity(op)
    d0, d1 = (
        (_norm(op.arg(1, "dim0", 0), rank), _norm(op.arg(2, "dim1", 1), rank))
        if op.node.target != aten.t.default
        else (0, 1)
    )
    m = _identity(op)
    m[d0], m[d1] = d1, d0
    return m


def _reverse_dims(op):
    """``x.T`` on any rank (``aten.numpy_T``): dim d becomes dim rank-1-d."""
    rank = len(op.in_shapes[0])
    return {d: rank - 1 - d for d in range(rank)}


def _permute(op):
    rank = len(op.in_shapes[0])
    dims = [_norm(d, rank) for d in op.arg(1, "dims")]
    return {d_in: d_out for d_out, d_in in enumerate(dims)}


def _unsqueeze(op):
    rank = len(op.out_shape)
    d = _norm(op.arg(1, "dim"), rank)
    return {k: (k if k < d else k + 1) for k in range(len(op.in_shapes[0]))}


def _squeeze(op):
    in_shape = op.in_shapes[0]
    rank = len(in_shape)
    dims = op.arg(1, "dim", None)
    if dims is None:
        dims = [k for k, s in enumerate(in_shape) if s == 1]
    elif isinstance(dims, int):
        dims = [dims]
    removed = {_norm(d, rank) for d in dims if in_shape[_norm(d, rank)] == 1}
    mapping, j = {}, 0
    for k in range(rank):
        if k in removed:
            continue
        mapping[k] = j
        j += 1
    return mapping


def _drop_dim(op, dim_index=1, name="dim"):
    rank = len(op.in_shapes[0])
    d = _norm(op.arg(dim_index, name, 0), rank)
    return {k: (k if k < d else k - 1) for k in range(rank) if k != d}


def _keep_all_but(op, dim_index=1, name="dim", default=0):
    rank = len(op.in_shapes[0])
    d = _norm(op.arg(dim_index, name, default), rank)
    return {k: k for k in range(rank) if k != d}


def _slice(op):
    rank = len(op.in_shapes[0])
    d = _norm(op.arg(1, "dim", 0), rank)
    if op.in_shapes[0][d] == op.out_shape[d]:
        return _identity(op)
    return {k: k for k in range(rank) if k != d}


def _split_dim(op):
    return _norm(op.arg(2, "dim", 0), len(op.in_shapes[0]))


def _expand(op):
    in_shape, out_shape = op.in_shapes[0], op.out_shape
    offset = len(out_shape) - len(in_shape)
    return {k: k + offset for k in range(len(in_shape)) if in_shape[k] == out_shape[k + offset]}


def _expand_broadcast_dims(op):
    in_shape, out_shape = op.in_shapes[0], op.out_shape
    offset = len(out_shape) - len(in_shape)
    return [d for d in range(len(out_shape)) if out_shape[d] > 1 and (d < offset or in_shape[d - offset] == 1)]


register(
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.view_as.default,
    aten.reshape_as.default,
)(DimMapRule(_reshape))
register(aten.transpose.int, aten.t.default)(DimMapRule(_transpose))
register(aten.permute.default)(DimMapRule(_permute))
register(aten.numpy_T.default)(DimMapRule(_reverse_dims))
register(aten.unsqueeze.default)(DimMapRule(_unsqueeze))
register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)(DimMapRule(_squeeze))
register(aten.select.int)(DimMapRule(_drop_dim))
register(aten.slice.Tensor, aten.narrow.default)(DimMapRule(_slice))
register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)(
    DimMapRule(lambda op: _keep_all_but(op, 2, "dim", 0), strided_dim=_split_dim)
)
register(aten.unbind.int)(DimMapRule(_drop_dim))
register(aten.expand.default, aten.expand_as.default)(DimMapRule(_expand, broadcast_out=_expand_broadcast_dims))
