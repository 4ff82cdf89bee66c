"""Normalisations and softmax: layer_norm, rms_norm, batch_norm, softmax, log_softmax.

The normalised dims must be whole on a rank, so only the other dims may be sharded; the
weight and bias stay replicated (their gradients come back partial and are summed, which is
how data- and sequence-parallel runs keep LayerNorm weights in sync). Two exceptions carry
their own collectives:

* softmax / log_softmax over a sharded dim: all-reduce the row max and the row sum of
  exponentials forward (vocab-parallel softmax), all-reduce one row sum backward;
* layer_norm / rms_norm over a sharded last dim (the hidden split of 2D / 2.5D / 3D tensor
  parallelism): all-reduce the row statistics forward and the gradient row sums backward,
  weight and bias sharded like the hidden dim;
* batch_norm with the batch dim sharded: all-gather each rank's per-channel (mean, variance)
  pair forward (the ranks' gathered pairs: ``"gathered"``) and all-reduce the two gradient sums
  backward (SyncBatchNorm), so results match one device. These per-channel buffers shrink with
  the channels other mesh axes cut, not with the batch they cut (the ``"work"`` scalings' rule
  for axes cutting the same dim).
"""

from __future__ import annotations

import math

import torch

from passes.core.placements import R, Shard, is_shard
from passes.rules.base import AxisStrategy, OpRule, OpView, register

aten = torch.ops.aten

__all__ = ["LayerNormRule", "SoftmaxRule", "BatchNormRule"]


class LayerNormRule(OpRule):
    """layer_norm(x, normalized_shape, w, b, eps) and rms_norm(x, normalized_shape, w, eps).

    Over one normalised dim, that dim may be sharded too (on one mesh axis: the hidden split of
    the 2D / 2.5D / 3D layouts), weight and bias sharded alike: the row statistics are
    all-reduced (layer_norm: the row sum, then the row sum of squared deviations, forward; the
    pair of gradient row sums, backward; rms_norm: one row sum each way; see
    :mod:`runtime.sharded_norm`)."""

    saves_inputs = True
    follower = False

    def axis_strategies(self, op: OpView) -> list:
        x = op.in_shapes[0]
        k = len(op.arg(1, "normalized_shape"))
        params = tuple(R if s is not None else None for s in op.in_shapes[1:])
        strategies = [AxisStrategy(out=(R,), ins=(R,) + params)]
        for d in range(len(x) - k):
            if x[d] > 1:
                strategies.append(AxisStrategy(out=(Shard(d),), ins=(Shard(d),) + params))
        if k == 1 and x[-1] > 1:
            rows = math.prod(x) // x[-1]
            rms = op.node.target is aten.rms_norm.default
            fwd = (("all_reduce", "fwd", rows, "work"),) * (1 if rms else 2)
            bwd = (("all_reduce", "bwd", rows * (1 if rms else 2), "work"),)
            sharded = tuple(Shard(0) if s is not None else None for s in op.in_shapes[1:])
            strategies.append(
                AxisStrategy(out=(Shard(len(x) - 1),), ins=(Shard(len(x) - 1),) + sharded, extra=fwd + bwd)
            )
        return strategies

    def combination_ok(self, axes, op) -> bool:
        # the normalised dim sharded on one axis at most (the row statistics' payload assumes it)
        return sum(1 for a in axes if a.extra) <= 1

    def keeps_saved_input(self, node, k: int, spec) -> bool:
        # the normalised dim split (weight and bias split with it) lowers to runtime.sharded_norm,
        # whose backward keeps x-hat, rstd and the weight, not the bias (aten's keeps the bias)
        if k == 2 and node.target is not aten.rms_norm.default and any(is_shard(p) for p in spec):
            return False
        return True

    def lower(self, call):
        x = call.view.in_shapes[0]
        axes = call.sharded_axes(call.in_specs[0], len(x) - 1)
        if not axes or len(call.view.arg(1, "normalized_shape")) != 1:
            return call.emit()
        from runtime.sharded_norm import ShardedNorm

        rms = call.node.target is aten.rms_norm.default
        a = call.args
        eps = call.view.arg(3 if rms else 4, "eps", None if rms else 1e-5)
        weight = a[2] if len(a) > 2 else call.kwargs.get("weight")
        bias = None if rms else (a[3] if len(a) > 3 else call.kwargs.get("bias"))
        return call.call_module(ShardedNorm(call.comm, axes, x[-1], eps, rms), (a[0], weight, bias))

    def flops(self, op: OpView) -> float:
        return 8.0 * math.prod(op.out_shape)


class SoftmaxRule(OpRule):
    """softmax / log_softmax(x, dim, ...)."""

    saves_inputs = True

    def axis_strategies(self, op: OpView) -> list:
        x = op.in_shapes[0]
        dim = op.arg(1, "dim")
        dim = dim + len(x) if dim < 0 else dim
        rest = tuple(None for _ in op.in_shapes[1:])
        strategies = [AxisStrategy(out=(R,), ins=(R,) + rest)]
        for d in range(len(x)):
            if x[d] <= 1:
                continue
            if d != dim:
                strategies.append(AxisStrategy(out=(Shard(d),), ins=(Shard(d),) + rest))
            else:
                rows = math.prod(x) // x[d]
                extra = (
                    ("all_reduce", "fwd", rows, "work"),
                    ("all_reduce", "fwd", rows, "work"),
                    ("all_reduce", "bwd", rows, "work"),
                )
                strategies.append(AxisStrategy(out=(Shard(d),), ins=(Shard(d),) + rest, extra=extra))
        return strategies

    def lower(self, call):
        x = call.view.in_shapes[0]
        dim = call.node.args[1] + len(x) if call.node.args[1] < 0 else call.node.args[1]
        axes = call.sharded_axes(call.in_specs[0], dim)
        if not axes:
            return call.emit()
        from runtime.local_ops import ShardedSoftmax

        log = call.node.target in (aten.log_softmax.int, aten._log_softmax.default)
        module = ShardedSoftmax(call.comm, dim, axes, log)
        # the ranks of ``axes`` differ only in their coordinates there, which cut ``dim``: they hold
        # the same rows however unequal the rows' pieces are (a batch cut unevenly on another axis);
        # the reduced dim itself must be cut evenly
        module.uneven_pieces_ok = dim not in call.uneven_in(0)
        return call.call_module(module, (call.args[0],))

    def flops(self, op: OpView) -> float:
        return 5.0 * math.prod(op.out_shape)


class BatchNormRule(OpRule):
    """batch_norm(x, w, b, running_mean, running_var, training, momentum, eps, cudnn)."""

    saves_inputs = True
    follower = False

    def axis_strategies(self, op: OpView) -> list:
        x = op.in_shapes[0]
        n_out = len(op.out_shapes)
        channel_inputs = tuple(R if s is not None else None for s in op.in_shapes[1:])
        strategies = [AxisStrategy(out=(R,) * n_out, ins=(R,) + channel_inputs)]
        if x[1] > 1:
            sharded = tuple(Shard(0) if s is not None else None for s in op.in_shapes[1:])
            strategies.append(AxisStrategy(out=(Shard(1),) + (Shard(0),) * (n_out - 1), ins=(Shard(1),) + sharded))
        if x[0] > 1 and n_out == 1 and op.arg(5, "training", False):
            c = x[1]
            # every rank's (mean, variance) pair (forward); the two gradient sums (backward)
            extra = (("all_gather", "fwd", 2 * c, "gathered"), ("all_reduce", "bwd", 2 * c, "work"))
            strategies.append(AxisStrategy(out=(Shard(0),), ins=(Shard(0),) + channel_inputs, extra=extra))
        if x[0] > 1 and n_out == 1 and not op.arg(5, "training", False):
            strategies.append(AxisStrategy(out=(Shard(0),), ins=(Shard(0),) + channel_inputs))  # eval: per sample
        return strategies

    def lower(self, call):
        training = call.view.arg(5, "training", False)
        axes = call.sharded_axes(call.in_specs[0], 0)
        if not (training and axes):
            return call.emit()
        from runtime.local_ops import SyncBatchNorm

        a = call.args
        module = SyncBatchNorm(call.comm, axes, momentum=a[6], eps=a[7])
        return call.call_module(module, (a[0], a[1], a[2], a[3], a[4]))

    def flops(self, op: OpView) -> float:
        return 8.0 * math.prod(op.out_shapes[0])


register(aten.layer_norm.default, aten.rms_norm.default)(LayerNormRule())
register(
    aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default, aten._safe_softmax.default
)(SoftmaxRule())
register(aten.batch_norm.default)(BatchNormRule())
