"""Reductions (sum, mean, amax, var), histograms (histc) and scans (cumsum, diff).

A reduction over a sharded dim leaves each rank a partial result: ``Partial("sum")`` for sum
and mean (the mean of equal shards is the mean of their means), ``Partial("max")`` for amax.
Kept dims map to their new positions; partial inputs stay partial for sum and mean. A
histogram over a fixed range (``histc(x, bins, min, max)`` with ``min < max``: the router's
auxiliary loss counts tokens per expert so) of a sharded input is the sum of the pieces'
histograms: ``Partial("sum")``. Scans and differences run along a dim that must be whole; the
other dims may be sharded.
"""

from __future__ import annotations

import math

import torch

from passes.core.placements import P, Partial, R, Shard
from passes.rules.base import AxisStrategy, OpRule, OpView, register

aten = torch.ops.aten

__all__ = ["ReductionRule", "HistogramRule", "ScanRule"]


def _reduced_dims(op: OpView):
    rank = len(op.in_shapes[0])
    dims = op.arg(1, "dim", None)
    if dims is None or dims == [] or isinstance(dims, torch.dtype):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d + rank if d < 0 else d for d in dims)


class ReductionRule(OpRule):
    def __init__(self, reduce_op: str | None):
        self.reduce_op = reduce_op  # "sum", "max", or None (not decomposable)
        self.linear = reduce_op == "sum"
        self.saves_inputs = reduce_op != "sum"

    def axis_strategies(self, op: OpView) -> list:
        x = op.in_shapes[0]
        reduced = _reduced_dims(op)
        keepdim = len(op.out_shape) == len(x)
        n_out = len(op.out_shapes)
        strategies = [AxisStrategy(out=(R,) * n_out, ins=(R,))]
        if self.linear:
            strategies.append(AxisStrategy(out=(P,) * n_out, ins=(P,)))
        for d in range(len(x)):
            if x[d] <= 1:
                continue
            if d in reduced:
                if self.reduce_op is not None:
                    strategies.append(AxisStrategy(out=(Partial(self.reduce_op),) * n_out, ins=(Shard(d),)))
            else:
                d_out = d if keepdim else d - sum(1 for r in reduced if r < d)
                strategies.append(AxisStrategy(out=(Shard(d_out),) * n_out, ins=(Shard(d),)))
        return strategies

    def lower(self, call):
        """A mean over a sharded dim: each rank's mean counts its share of the elements (1/n of
        the whole for equal pieces; its own count over the whole count for uneven ones)."""
        out = call.emit()
        if call.node.target in (aten.mean.dim, aten.mean.default):
            reduced = _reduced_dims(call.view)
            degree = 1
            for d in reduced:
                for axis in call.sharded_axes(call.in_specs[0], d):
                    degree *= call.comm.shape[axis]
            if call.uneven_in(0) & set(reduced):  # unequal pieces: the share is counted as it runs
                from runtime.local_ops import scale_to_share

                total = math.prod(call.view.in_shapes[0][d] for d in reduced)
                out = call.emit(scale_to_share, (out, call.args[0], tuple(reduced), total), {})
            elif degree > 1:
                out = call.emit(aten.div.Tensor, (out, degree), {})
        return out

    def flops(self, op: OpView) -> float:
        n = 1
        for s in op.in_shapes[0]:
            n *= s
        return float(n)


class HistogramRule(OpRule):
    """histc(x, bins, min, max): any split of ``x`` gives partial counts, when the range is fixed
    (``min == max`` takes each rank's own data range: only replicated)."""

    def axis_strategies(self, op: OpView) -> list:
        strategies = [AxisStrategy(out=(R,), ins=(R,))]
        if op.arg(2, "min", 0) >= op.arg(3, "max", 0):
            return strategies
        x = op.in_shapes[0]
        return strategies + [AxisStrategy(out=(P,), ins=(Shard(d),)) for d in range(len(x)) if x[d] > 1]


class ScanRule(OpRule):
    """cumsum(x, dim) / diff(x, n, dim, prepend, append): the scanned dim stays whole; a split of
    another dim splits ``prepend`` / ``append`` the same way (they match ``x`` off the scanned dim)."""

    def __init__(self, dim_index: int, default: int = 0):
        self.dim_index = dim_index
        self.default = default

    def axis_strategies(self, op: OpView) -> list:
        x = op.in_shapes[0]
        dim = op.arg(self.dim_index, "dim", self.default)
        dim = dim + len(x) if dim < 0 else dim
        others = op.in_shapes[1:]
        strategies = [AxisStrategy(out=(R,), ins=(R,) + tuple(None if s is None else R for s in others))]
        for d in range(len(x)):
            if d != dim and x[d] > 1 and x[d] == op.out_shape[d]:
                rest = tuple(None if s is None else Shard(d) for s in others)
                strategies.append(AxisStrategy(out=(Shard(d),), ins=(Shard(d),) + rest))
        return strategies


register(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default)(ReductionRule("sum"))
register(aten.amax.default, aten.max.dim)(ReductionRule("max"))
register(aten.amin.default, aten.min.dim)(ReductionRule("min"))
register(
    aten.var.correction,
    aten.var.dim,
    aten.std.correction,
    aten.std.dim,
    aten.argmax.default,
    aten.argmin.default,
    aten.all.dim,
    aten.any.dim,
)(ReductionRule(None))
register(aten.histc.default)(HistogramRule())
register(aten.cumsum.default)(ScanRule(1))
register(aten.diff.default)(ScanRule(2, -1))
