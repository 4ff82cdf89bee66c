"""Contractions: linear, addmm, mm, bmm, baddbmm, matmul, conv2d.

Every contraction is written as an einsum over named dims: each operand lists its dims,
the output lists its own, and a dim missing from the output is summed over. Per mesh axis:

* a dim kept in the output (batch, rows, columns, heads) sharded in every operand that has
  it and in the output: data parallel on batch dims, Megatron *column* parallel on a
  weight's output dim;
* a summed dim sharded in every operand that has it, output ``Partial``: Megatron *row*
  parallel, and the eager attention's ``p @ v`` over a sharded key axis;
* one operand ``Partial`` and the other replicated, output ``Partial`` (bilinearity);
* all replicated.

An operand broadcast on a dim (size 1) stays replicated when that dim is sharded. A bias
is aligned with the output's trailing dims; it is ``Partial`` whenever the output is (it is
added once overall, on one rank's share).
"""

from __future__ import annotations

import math

import torch

from passes.core.placements import P, Placement, R, Shard
from passes.rules.base import AxisStrategy, OpRule, OpView, register

aten = torch.ops.aten

__all__ = ["Contraction", "einsum_strategies"]


def _placement_for(labels, shape, label):
    if label in labels:
        pos = labels.index(label)
        if shape[pos] > 1:
            return Shard(pos)
    return R


def einsum_strategies(operands, out_labels, out_shape, bias=None, n_inputs=None, extra_label_sizes=None) -> list:
    """``operands``: list of (input index, labels, shape); bias: (input index, shape) or None."""
    n_inputs = n_inputs if n_inputs is not None else len(operands) + (bias is not None)
    sizes = {}
    for _, labels, shape in operands:
        for lab, s in zip(labels, shape):
            sizes[lab] = max(sizes.get(lab, 1), s)

    def build(per_operand, out, bias_p):
        ins = [None] * n_inputs
        for (idx, _, _), p in zip(operands, per_operand):
            ins[idx] = p
        if bias is not None:
            ins[bias[0]] = bias_p
        return AxisStrategy(out=(out,), ins=tuple(ins))

    def bias_placement(out_p):
        if bias is None:
            return None
        if isinstance(out_p, Shard):
            b_shape = bias[1]
            d = out_p.dim - (len(out_shape) - len(b_shape))
            return Shard(d) if d >= 0 and b_shape[d] == out_shape[out_p.dim] else R
        return out_p

    strategies = [build([R] * len(operands), R, bias_placement(R))]
    for lab, size in sizes.items():
        if size <= 1:
            continue
        per = [_placement_for(labels, shape, lab) for _, labels, shape in operands]
        out_p: Placement = Shard(out_labels.index(lab)) if lab in out_labels else P
        strategies.append(build(per, out_p, bias_placement(out_p)))
    for k in range(len(operands)):
        per = [P if i == k else R for i in range(len(operands))]
        strategies.append(build(per, P, bias_placement(P)))
    return strategies


def _batch_labels(n):
    return [f"b{i}" for i in range(n)]


class Contraction(OpRule):
    """Operands described by ``layout(op) -> (operands, out_labels, bias)``."""

    contraction = True
    saves_inputs = True
    follower = False

    def __init__(self, layout, flops):
        self.layout = layout
        self._flops = flops

    def axis_strategies(self, op: OpView) -> list:
        operands, out_labels, bias = self.layout(op)
        return einsum_strategies(operands, out_labels, op.out_shape, bias, n_inputs=len(op.in_shapes))

    def flops(self, op: OpView) -> float:
        return float(self._flops(op))


# -- layouts ------------------------------------------------------------------------------
def _linear(op):
    x, w = op.in_shapes[0], op.in_shapes[1]
    lead = _batch_labels(len(x) - 1)
    operands = [(0, lead + ["k"], x), (1, ["n", "k"], w)]
    bias = (2, op.in_shapes[2]) if len(op.in_shapes) > 2 and op.in_shapes[2] is not None else None
    return operands, lead + ["n"], bias


def _addmm(op):  # addmm(bias, a[m,k], b[k,n])
    return [(1, ["m", "k"], op.in_shapes[1]), (2, ["k", "n"], op.in_shapes[2])], ["m", "n"], (0, op.in_shapes[0])


def _mm(op):
    return [(0, ["m", "k"], op.in_shapes[0]), (1, ["k", "n"], op.in_shapes[1])], ["m", "n"], None


def _bmm(op):
    return [(0, ["b", "m", "k"], op.in_shapes[0]), (1, ["b", "k", "n"], op.in_shapes[1])], ["b", "m", "n"], None


def _baddbmm(op):
    return (
        [(1, ["b", "m", "k"], op.in_shapes[1]), (2, ["b", "k", "n"], op.in_shapes[2])],
        ["b", "m", "n"],
        (0, op.in_shapes[0]),
    )


def _matmul(op):
    a, b = op.in_shapes[0], op.in_shapes[1]
    if len(a) < 2 or len(b) < 2:
        la = ["k"] if len(a) == 1 else _batch_labels(len(a) - 2) + ["m", "k"]
        lb = ["k"] if len(b) == 1 else ["k", "n"]
        out = [lab for lab in la if lab != "k"] + [lab for lab in lb if lab != "k"]
        return [(0, la, a), (1, lb, b)], out, None
    n_batch = max(len(a), len(b)) - 2
    batch = _batch_labels(n_batch)
    la = batch[n_batch - (len(a) - 2) :] + ["m", "k"]
    lb = batch[n_batch - (len(b) - 2) :] + ["k", "n"]
    return [(0, la, a), (1, lb, b)], batch + ["m", "n"], None


def _flops_from_layout(layout):
    def flops(op):
        operands, out_labels, _ = layout(op)
        sizes = {}
        for _, labels, shape in operands:
            for lab, s in zip(labels, shape):
                sizes[lab] = max(sizes.get(lab, 1), s)
        summed = 1
        for lab, s in sizes.items():
            if lab not in out_labels:
                summed *= s
        return 2 * math.prod(op.out_shape) * summed

    return flops


for _targets, _layout in (
    ((aten.linear.default,), _linear),
    ((aten.addmm.default,), _addmm),
    ((aten.mm.default,), _mm),
    ((aten.bmm.default,), _bmm),
    ((aten.baddbmm.default,), _baddbmm),
    ((aten.matmul.default,), _matmul),
):
    register(*_targets)(Contraction(_layout, _flops_from_layout(_layout)))


# -- convolution ----------------------------------------------------------------------------
class Conv2d(OpRule):
    """conv2d(x[N,C,H,W], w[O,C/g,kh,kw], b[O]): batch, output channels, input channels."""

    contraction = True
    saves_inputs = True
    follower = False

    def axis_strategies(self, op: OpView) -> list:
        n_in = len(op.in_shapes)
        has_bias = n_in > 2 and op.in_shapes[2] is not None
        groups = op.arg(6, "groups", 1)

        def make(x, w, b, out):
            ins = [x, w] + ([b] if has_bias else []) + [None] * (n_in - 2 - has_bias)
            return AxisStrategy(out=(out,), ins=tuple(ins))

        strategies = [make(R, R, R, R), make(Shard(0), R, R, Shard(0)), make(P, R, P, P)]
        if groups == 1:
            strategies.append(make(R, Shard(0), Shard(0), Shard(1)))  # output channels
            strategies.append(make(Shard(1), Shard(1), P, P))  # input channels
        return strategies

    def flops(self, op: OpView) -> float:
        w = op.in_shapes[1]
        return 2.0 * math.prod(op.out_shape) * w[1] * w[2] * w[3]


register(aten.conv2d.default)(Conv2d())
