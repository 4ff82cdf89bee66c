"""Embedding lookup and the classification losses (cross_entropy, nll_loss).

embedding(weight[V, H], ids[...]) per mesh axis: ids sharded on a batch dim (data parallel),
weight sharded on hidden (output sharded on its last dim), weight sharded on vocabulary
(vocab-parallel: each rank looks up the ids in its range, output ``Partial``), replicated.

cross_entropy(logits[N, C, ...], target[N, ...]) and nll_loss(logp[N, C], target[N]):
batch-sharded (a mean all-reduces the local loss sum and the local count of counted targets
together, so ``ignore_index`` stays exact and the loss comes out replicated; a sum comes out
``Partial``), class-sharded
(vocab-parallel loss: all-reduce the row max, the row sum of exponentials and the target
logit, each N elements, forward; the loss comes out replicated; nll_loss over class-split
log-probabilities comes out ``Partial``), replicated. With ``reduction="none"`` the per-sample loss
keeps the batch sharding.
"""

from __future__ import annotations

import torch

from passes.core.placements import P, R, Shard
from passes.rules.base import AxisStrategy, OpRule, OpView, register

aten = torch.ops.aten

__all__ = ["EmbeddingRule", "ClassificationLossRule"]


class EmbeddingRule(OpRule):
    follower = False
    saves_inputs = False

    def axis_strategies(self, op: OpView) -> list:
        ids = op.in_shapes[1]
        out_rank = op.out_rank
        strategies = [
            AxisStrategy(out=(R,), ins=(R, R)),
            AxisStrategy(out=(Shard(out_rank - 1),), ins=(Shard(1), R)),
            AxisStrategy(out=(P,), ins=(Shard(0), R)),
        ]
        for d, size in enumerate(ids):
            if size > 1:
                strategies.append(AxisStrategy(out=(Shard(d),), ins=(R, Shard(d))))
        return strategies

    def flops(self, op: OpView) -> float:
        return 0.0

    def lower(self, call):
        weight_spec = call.in_specs[0]
        if not call.sharded_axes(weight_spec, 0):
            return call.emit()
        from runtime.local_ops import VocabParallelEmbedding

        padding_idx = call.view.arg(2, "padding_idx", -1)
        return call.call_module(VocabParallelEmbedding(call.comm, weight_spec, padding_idx), call.args[:2])


class ClassificationLossRule(OpRule):
    """cross_entropy_loss(x, target, weight, reduction, ignore_index, label_smoothing) / nll_loss."""

    saves_inputs = True
    follower = False

    def __init__(self, fused_softmax: bool):
        self.fused_softmax = fused_softmax

    def axis_strategies(self, op: OpView) -> list:
        x = op.in_shapes[0]
        rest = tuple(None if s is None else R for s in op.in_shapes[2:])
        reduction = op.arg(3, "reduction", 1)  # 0 none, 1 mean, 2 sum
        reduced_out = P if reduction != 0 else Shard(0)
        n_out = len(op.out_shapes)
        outs = lambda p: (p,) + (R,) * (n_out - 1)  # noqa: E731
        strategies = [AxisStrategy(out=outs(R), ins=(R, R) + rest)]
        if x[0] > 1:
            if reduction == 1:
                # mean over the batch: all-reduce (sum of losses, count of counted targets) in
                # one collective, so ignore_index is exact and the loss comes out replicated
                strategies.append(
                    AxisStrategy(
                        out=outs(R), ins=(Shard(0), Shard(0)) + rest, extra=(("all_reduce", "fwd", 2, "none"),)
                    )
                )
            else:
                strategies.append(AxisStrategy(out=outs(reduced_out), ins=(Shard(0), Shard(0)) + rest))
        smoothing = op.arg(5, "label_smoothing", 0.0)
        if (
            len(x) >= 2
            and x[1] > 1
            and reduction != 0
            and not smoothing
            and (len(op.in_shapes) < 3 or op.in_shapes[2] is None)
        ):
            rows = 1
            for d, s in enumerate(x):
                if d != 1:
                    rows *= s
            if self.fused_softmax:  # the three row all-reduces leave every rank the full loss
                extra = (("all_reduce", "fwd", rows, "work"),) * 3
                strategies.append(AxisStrategy(out=outs(R), ins=(Shard(1), R) + rest, extra=extra))
            else:  # each rank picks the targets in its class range
                strategies.append(AxisStrategy(out=outs(P), ins=(Shard(1), R) + rest))
        return strategies

    def lower(self, call):
        spec = call.in_specs[0]
        class_axes, batch_axes = call.sharded_axes(spec, 1), call.sharded_axes(spec, 0)
        if not class_axes and not batch_axes:
            return call.emit()
        from runtime.local_ops import ShardedCrossEntropy

        module = ShardedCrossEntropy(
            call.comm,
            class_axes=class_axes,
            batch_axes=batch_axes,
            class_spec=spec,
            reduction=call.view.arg(3, "reduction", 1),
            ignore_index=call.view.arg(4, "ignore_index", -100),
            label_smoothing=call.view.arg(5, "label_smoothing", 0.0) if self.fused_softmax else 0.0,
            from_log_probs=not self.fused_softmax,
        )
        return call.call_module(module, call.args[:2])

    def flops(self, op: OpView) -> float:
        n = 1
        for s in op.in_shapes[0]:
            n *= s
        return 5.0 * n if self.fused_softmax else float(n)


register(aten.embedding.default)(EmbeddingRule())
register(aten.cross_entropy_loss.default)(ClassificationLossRule(fused_softmax=True))
register(aten.nll_loss.default, aten.nll_loss_nd.default)(ClassificationLossRule(fused_softmax=False))
