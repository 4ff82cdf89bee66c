"""scaled_dot_product_attention(q[B,H,Sq,D], k[B,Hkv,Skv,D], v, attn_mask, dropout, is_causal).

Per mesh axis: batch-sharded (data parallel), head-sharded (Megatron attention: q, k and v
sharded on heads, which needs both head counts divisible, and keeps grouped-query heads
aligned because both are cut into the same number of contiguous blocks), query-sequence
sharded with keys and values whole (sequence parallel attention; not offered with
``is_causal``, whose mask depends on a query's global position), or replicated. A mask that
broadcasts over a sharded dim stays replicated. The eager ``softmax(q @ k^T) @ v`` pattern
needs no rule of its own: the matmul, softmax and elementwise rules reach the same plans.
"""

from __future__ import annotations

import torch

from passes.placements import R, Shard
from passes.rules.base import AxisStrategy, OpRule, OpView, register

aten = torch.ops.aten

__all__ = ["AttentionRule"]


class AttentionRule(OpRule):
    contraction = True
    saves_inputs = True
    follower = False

    def axis_strategies(self, op: OpView) -> list:
        q = op.in_shapes[0]
        n_in = len(op.in_shapes)
        mask = op.in_shapes[3] if n_in > 3 else None
        is_causal = bool(op.arg(5, "is_causal", False))

        def mask_p(dim):
            if mask is None:
                return None
            d = dim - (len(q) - len(mask))
            return Shard(d) if d >= 0 and mask[d] > 1 else R

        def make(qp, kvp, out, mask_dim):
            ins = [qp, kvp, kvp] + ([mask_p(mask_dim) if mask_dim is not None else R] if mask is not None else [])
            ins += [None] * (n_in - len(ins))
            return AxisStrategy(out=(out,) + (R,) * (len(op.out_shapes) - 1), ins=tuple(ins))

        strategies = [make(R, R, R, None)]
        if q[0] > 1:
            strategies.append(make(Shard(0), Shard(0), Shard(0), 0))
        if q[1] > 1:
            strategies.append(make(Shard(1), Shard(1), Shard(1), 1))
        if q[2] > 1 and not is_causal:
            strategies.append(make(Shard(2), R, Shard(2), 2))
        return strategies

    def lower(self, call):
        """The same op; with attention dropout, a :class:`runtime.local_ops.RankAttention`
        (masks by the ranks' data, not one shared random stream; none in ``eval()``)."""
        p = call.view.arg(4, "dropout_p", 0.0)
        if not p:
            return call.emit()
        from runtime.local_ops import RankAttention

        sharded = [
            a for a, pl in enumerate(call.out_spec) if getattr(pl, "dim", None) is not None and call.comm.shape[a] > 1
        ]
        index = list(call.node.graph.nodes).index(call.node)
        return call.call_module(RankAttention(call.comm, p, sharded, index), call.args, call.kwargs)

    def flops(self, op: OpView) -> float:
        b, h, sq, d = op.in_shapes[0]
        skv = op.in_shapes[1][2]
        return 4.0 * b * h * sq * skv * d


register(aten.scaled_dot_product_attention.default)(AttentionRule())
