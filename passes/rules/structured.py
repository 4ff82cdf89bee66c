"""Ops that assemble or create tensors: cat, stack, gather, pad, index, tril/triu, pooling,
and the factories (arange, full, zeros, ones, new_*, *_like).

* ``cat``/``stack``: every piece sharded on the same non-joined dim, or all partial.
* ``gather(x, dim, index)``, ``pad``, ``tril``/``triu``: the dims the op reads across
  (the gathered dim, padded dims, the last two) stay whole; other dims may be sharded.
* pooling: batch or channel sharded (spatial dims stay whole; no halo exchange).
* factories have no data inputs: every rank can make its own slice, so any placement is
  free; ``new_*`` and ``*_like`` read only their input's metadata.
* ``index`` (advanced indexing) runs replicated: its index tensors may point anywhere.
"""

from __future__ import annotations

import torch

from passes.core.placements import P, R, Shard
from passes.rules.base import AxisStrategy, OpRule, OpView, register

aten = torch.ops.aten

__all__ = ["JoinRule", "KeepDimsRule", "FactoryRule", "ReplicatedRule", "PoolRule"]


class JoinRule(OpRule):
    """cat(tensors, dim) / stack(tensors, dim)."""

    linear = True

    def __init__(self, new_dim: bool):
        self.new_dim = new_dim

    def axis_strategies(self, op: OpView) -> list:
        out_rank = op.out_rank
        dim = op.arg(1, "dim", 0)
        dim = dim + out_rank if dim < 0 else dim
        n = len(op.in_shapes)
        strategies = [AxisStrategy(out=(R,), ins=(R,) * n), AxisStrategy(out=(P,), ins=(P,) * n)]
        for d_out in range(out_rank):
            if d_out == dim or op.out_shape[d_out] <= 1:
                continue
            d_in = d_out if not self.new_dim or d_out < dim else d_out - 1
            strategies.append(AxisStrategy(out=(Shard(d_out),), ins=(Shard(d_in),) * n))
        return strategies


class KeepDimsRule(OpRule):
    """Shard any dim except those ``whole(op)`` names; every tensor input aligned on it."""

    def __init__(self, whole, linear=False, saves_inputs=False):
        self.whole = whole
        self.linear = linear
        self.saves_inputs = saves_inputs

    def axis_strategies(self, op: OpView) -> list:
        x = op.in_shapes[0]
        keep = self.whole(op)
        strategies = [self.replicate_all(op)]
        if self.linear:
            strategies.append(
                AxisStrategy(out=(P,), ins=(P,) + tuple(None if s is None else R for s in op.in_shapes[1:]))
            )
        for d in range(len(x)):
            if d in keep or x[d] <= 1 or d >= op.out_rank or op.out_shape[d] != x[d]:
                continue
            ins = tuple(None if s is None else (Shard(d) if len(s) > d and s[d] == x[d] else R) for s in op.in_shapes)
            strategies.append(AxisStrategy(out=(Shard(d),) * len(op.out_shapes), ins=ins))
        return strategies


class FactoryRule(OpRule):
    """No data inputs: any placement of the output costs nothing."""

    follower = False
    differentiable = False

    def axis_strategies(self, op: OpView) -> list:
        ins = tuple(None for _ in op.in_shapes)
        strategies = [AxisStrategy(out=(R,), ins=ins)]
        for d, size in enumerate(op.out_shape):
            if size > 1:
                strategies.append(AxisStrategy(out=(Shard(d),), ins=ins))
        return strategies

    def flops(self, op: OpView) -> float:
        return 0.0

    def lower(self, call):
        """Make the whole (small) tensor, then keep this rank's piece."""
        from passes.core.placements import replicated

        target = call.node.target
        if target in _LIKE_FILL:
            like = call.args[0]
            fill = call.args[1] if target is aten.full_like.default else _LIKE_FILL[target]
            dtype = call.kwargs.get("dtype") or call.view.out_dtypes[0]
            whole = call.emit(
                aten.full.default, (list(call.view.out_shape), fill), {"dtype": dtype, "device": call.builder.device}
            )
            del like
        else:
            whole = call.emit()
        return call.reshard(whole, replicated(call.comm.ndim), call.out_spec)


_LIKE_FILL = {
    aten.zeros_like.default: 0,
    aten.ones_like.default: 1,
    aten.empty_like.default: 0,
    aten.full_like.default: None,
}


class ReplicatedRule(OpRule):
    """Deliberately replicated (its semantics need every element everywhere)."""

    saves_inputs = True

    def axis_strategies(self, op: OpView) -> list:
        return [self.replicate_all(op)]


class PoolRule(OpRule):
    saves_inputs = True

    def __init__(self, linear: bool):
        self.linear = linear

    def axis_strategies(self, op: OpView) -> list:
        n_out = len(op.out_shapes)
        strategies = [AxisStrategy(out=(R,) * n_out, ins=(R,))]
        if self.linear:
            strategies.append(AxisStrategy(out=(P,) * n_out, ins=(P,)))
        for d in range(len(op.in_shapes[0]) - 2):
            if op.in_shapes[0][d] > 1:
                strategies.append(AxisStrategy(out=(Shard(d),) * n_out, ins=(Shard(d),)))
        return strategies


def _norm_dim(op, index, name, default=0):
    rank = len(op.in_shapes[0])
    d = op.arg(index, name, default)
    return {d + rank if d < 0 else d}


def _padded_dims(op):
    pad = op.arg(1, "pad")
    rank = len(op.in_shapes[0])
    return {rank - 1 - i // 2 for i, amount in enumerate(pad) if amount}


register(aten.cat.default)(JoinRule(new_dim=False))
register(aten.stack.default)(JoinRule(new_dim=True))
register(aten.gather.default)(KeepDimsRule(lambda op: _norm_dim(op, 1, "dim")))
register(aten.pad.default, aten.constant_pad_nd.default)(KeepDimsRule(_padded_dims))
register(aten.tril.default, aten.triu.default)(
    KeepDimsRule(lambda op: {len(op.in_shapes[0]) - 2, len(op.in_shapes[0]) - 1})
)
register(aten.repeat_interleave.self_int, aten.roll.default, aten.flip.default)(
    KeepDimsRule(lambda op: _norm_dim(op, 2 if op.node.target != aten.flip.default else 1, "dim", -1))
)
register(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.rand.default,
    aten.randn.default,
)(FactoryRule())
register(
    aten.index.Tensor,
    aten.index_select.default,
    aten.nonzero.default,
    aten.sort.default,
    aten.topk.default,
    aten.nll_loss_forward.default,
    # in-place buffer updates (BatchNorm's num_batches_tracked += 1): every rank keeps the same copy
    aten.add_.Tensor,
    aten.add_.Scalar,
    aten.copy_.default,
    aten.fill_.Scalar,
)(ReplicatedRule())
register(aten.max_pool2d.default, aten.max_pool2d_with_indices.default, aten.adaptive_max_pool2d.default)(
    PoolRule(linear=False)
)
register(aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default)(PoolRule(linear=True))
