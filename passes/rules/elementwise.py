"""Elementwise ops with broadcasting, unary activations, comparisons, dropout and casts.

Per mesh axis: all ``Replicate``; ``Shard(d)`` of the output for every output dim of size > 1,
each input sharded on its aligned dim unless it broadcasts there (size 1 or missing: that
input stays replicated); and ``Partial`` where the op is linear in its operands:

* ``sum``: every operand is a tensor and every one partial (``add``, ``sub``);
* ``one``: exactly one operand partial, the rest replicated (``mul``);
* ``first``: the numerator partial (``div``);
* ``unary``: a single tensor operand; scalars only scale it (``neg``, ``dropout``, casts,
  ``mul`` by a Python number).
"""

from __future__ import annotations

import dataclasses

import torch

from passes.core.placements import P, R, Shard
from passes.rules.base import AxisStrategy, OpRule, OpView, register

aten = torch.ops.aten

__all__ = ["Elementwise", "elementwise_strategies"]


def _aligned_placement(in_shape, out_shape, dim):
    """Placement of an input for output dim ``dim`` sharded: Shard on its aligned dim or R."""
    offset = len(out_shape) - len(in_shape)
    d = dim - offset
    if d < 0 or in_shape[d] != out_shape[dim]:
        return R
    return Shard(d)


def elementwise_strategies(op: OpView, partial: str | None) -> list:
    out_shape = op.out_shape
    n_out = len(op.out_shapes)
    strategies = [OpRule.replicate_all(op)]
    for dim, size in enumerate(out_shape):
        if size <= 1:
            continue
        ins = tuple(None if s is None else _aligned_placement(s, out_shape, dim) for s in op.in_shapes)
        strategies.append(AxisStrategy(out=(Shard(dim),) * n_out, ins=ins))
    tensors = [i for i, s in enumerate(op.in_shapes) if s is not None]
    scalar_operands = any(
        not isinstance(a, torch.fx.Node) and isinstance(a, (int, float, bool)) for a in op.node.args[1:2]
    )
    if partial == "sum" and tensors and not scalar_operands:
        strategies.append(AxisStrategy(out=(P,) * n_out, ins=tuple(None if s is None else P for s in op.in_shapes)))
    elif partial in ("one", "first") and len(tensors) >= 1:
        choices = tensors if partial == "one" else tensors[:1]
        for k in choices:
            ins = tuple(None if s is None else (P if i == k else R) for i, s in enumerate(op.in_shapes))
            strategies.append(AxisStrategy(out=(P,) * n_out, ins=ins))
    elif partial == "unary" and len(tensors) == 1:
        strategies.append(AxisStrategy(out=(P,) * n_out, ins=tuple(None if s is None else P for s in op.in_shapes)))
    return strategies


class Elementwise(OpRule):
    def __init__(self, partial: str | None = None, saves_inputs: bool = False):
        self.partial = partial
        self.linear = partial is not None
        self.saves_inputs = saves_inputs

    def axis_strategies(self, op: OpView) -> list:
        return elementwise_strategies(op, self.partial)


register(aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor)(
    Elementwise("sum")
)
register(aten.mul.Tensor, aten.mul.Scalar)(Elementwise("one", saves_inputs=True))
register(aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar, aten.div.Tensor_mode)(
    Elementwise("first", saves_inputs=True)
)


class TypeAs(Elementwise):
    """``x.type_as(other)``: a cast of ``x``; ``other`` gives only its dtype, so no data moves
    on its edge and no gradient comes back on it (its placement is ``None``)."""

    metadata_inputs = (1,)

    def __init__(self):
        super().__init__("unary")

    def axis_strategies(self, op: OpView) -> list:
        return elementwise_strategies(dataclasses.replace(op, in_shapes=(op.in_shapes[0], None)), self.partial)


register(aten.type_as.default)(TypeAs())


class Dropout(Elementwise):
    """Linear in its input given the mask, so Partial passes; a decision of its own (not a
    follower) because where it runs decides the size of the mask kept for backward and
    whether the region after a row-parallel matmul is sharded (Megatron-SP)."""

    follower = False

    def __init__(self):
        super().__init__("unary", saves_inputs=False)  # it keeps a 1-byte mask, not its input

    def lower(self, call):
        p, train = call.view.arg(1, "p", 0.5), call.view.arg(2, "train", True)
        if not train or p == 0.0:
            return call.args[0]
        from runtime.local_ops import RankDropout

        sharded = [
            a for a, pl in enumerate(call.out_spec) if getattr(pl, "dim", None) is not None and call.comm.shape[a] > 1
        ]
        index = list(call.node.graph.nodes).index(call.node)
        return call.call_module(RankDropout(call.comm, p, sharded, index), (call.args[0],))


register(aten.dropout.default)(Dropout())
register(
    aten.neg.default,
    aten.clone.default,
    aten.alias.default,
    aten.contiguous.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.lift_fresh_copy.default,
    aten.detach.default,
)(Elementwise("unary"))
_nonlinear = Elementwise(None, saves_inputs=True)
register(
    aten.gelu.default,
    aten.silu.default,
    aten.relu.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.exp.default,
    aten.log.default,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor,
    aten.cos.default,
    aten.sin.default,
    aten.erf.default,
    aten.abs.default,
    aten.reciprocal.default,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
    aten.softplus.default,
    aten.hardtanh.default,
    aten.leaky_relu.default,
    aten.elu.default,
    aten.gelu_.default,
    aten.relu_.default,
    aten.silu_.default,
    aten.maximum.default,
    aten.minimum.default,
    aten.min.other,
    aten.max.other,
    aten.where.self,
    aten.where.ScalarSelf,
    aten.where.ScalarOther,
    aten.where.Scalar,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.square.default,
    aten.log1p.default,
    aten.expm1.default,
    aten.sign.default,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.trunc.default,
)(_nonlinear)
_compare = Elementwise(None)
register(
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.bitwise_not.default,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_not.default,
    aten.isnan.default,
    aten.isinf.default,
)(_compare)
