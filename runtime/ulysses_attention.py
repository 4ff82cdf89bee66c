"""Ulysses attention (DeepSpeed-Ulysses): sequence-split q/k/v turned head-split around the core.

q, k and v arrive split on the sequence (``Shard(2)`` of ``[B, H, S, D]``) on one mesh axis of
``p`` ranks. One all-to-all each moves them to ``Shard(1)``: every rank then holds the whole
sequence for ``H / p`` of the heads (``H_kv / p`` of the key/value heads) and attends over it
(causal masks and mask tensors need nothing special: the sequence is whole); one more
all-to-all returns the output to the sequence split. Per attention call and step: 4
all-to-alls forward (q, k, v in, the output back), each of the local buffer (the payload the
``all_to_all`` reshard counts: ``B H S D / p`` elements for q and the output, ``B H_kv S D / p``
for k and v, divided further by the other axes' splits), and backward the same 4 on the
gradients (dO in; dq, dk, dv back) plus one of the row sums ``Δ = rowsum(dO ∘ O)``
(``1 / D`` of dO's size).

The whole op is one autograd function, so it keeps exactly what ``scaled_dot_product_attention``
keeps, at the same sizes: the head-split q, k and v it attends with (together the size of the
sequence-split ones), the output it returns (not a head-split copy: ``Δ`` is computed from the
returned output and moved, which is why backward moves the row sums) and the log-sum-exp. The
core is the exact block math of :mod:`runtime.ring_attention` (one block, the query rows taken
a bounded number at a time), so it runs on any device and its backward needs only those.

Dtypes: as ring attention's (q, k, v cast to the autocast dtype before their all-to-alls,
statistics and sums in fp32, the row sums moved in fp32, gradients returned in the inputs'
dtypes).

Heads must divide by ``p`` (query and key/value heads alike): checked when planning and again
here, with an error naming both.
"""

from __future__ import annotations

import math

import torch

from passes.core.placements import Shard, transition_steps
from runtime.collectives import MeshComm, run_steps
from runtime.ring_attention import (
    SCORES_PER_PRODUCT,
    _Block,
    _expand_heads,
    _fold_heads,
    _mask_rows,
    _no_autocast,
    _split_rows,
    compute_dtype,
    sdpa_layout,
    stats_dtype,
)

__all__ = ["UlyssesAttention"]


def _attend(q, k, v, mask, causal, scale, chunks):
    """Exact attention of q over the whole of k/v: (output in sdpa's layout and q's dtype,
    log-sum-exp in the statistics' dtype)."""
    heads, s_len = q.shape[1], k.shape[2]
    k_e, v_e = _expand_heads(k, heads), _expand_heads(v, heads)
    out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)
    lse = q.new_empty(q.shape[:-1], dtype=stats_dtype(q.dtype))
    for off, n, start in chunks:
        blk = _Block(start, n, 0, s_len, causal, _mask_rows(mask, off, n))
        o, row = blk.forward(q[:, :, off : off + n], k_e, v_e, scale)
        out[:, :, off : off + n] = o
        lse[:, :, off : off + n] = row
    return out, lse


def _attend_backward(q, k, v, mask, causal, scale, chunks, d_out, delta, lse):
    """(dq, dk, dv) in q's dtype (summed in the statistics' dtype)."""
    heads, s_len = q.shape[1], k.shape[2]
    k_e, v_e = _expand_heads(k, heads), _expand_heads(v, heads)
    dq, dk, dv = (torch.zeros_like(t, dtype=lse.dtype) for t in (q, k_e, v_e))
    for off, n, start in chunks:
        blk = _Block(start, n, 0, s_len, causal, _mask_rows(mask, off, n))
        rows = slice(off, off + n)
        g_q, g_k, g_v = blk.backward(
            q[:, :, rows], k_e, v_e, scale, d_out[:, :, rows], delta[:, :, rows], lse[:, :, rows]
        )
        dq[:, :, rows] = g_q
        dk[:, :, : blk.cols] += g_k
        dv[:, :, : blk.cols] += g_v
    return tuple(g.to(q.dtype) for g in (dq, _fold_heads(dk, k.shape[1]), _fold_heads(dv, v.shape[1])))


class _UlyssesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, module):
        dtype = compute_dtype(q)
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype)
        with _no_autocast(q):  # q, k, v cast as the fused op under autocast casts them
            return _UlyssesFn._forward(ctx, *(t.to(dtype) for t in (q, k, v)), mask, module)

    @staticmethod
    def _forward(ctx, q, k, v, mask, module):
        to_heads, to_seq, comm = module.to_heads, module.to_sequence, module.comm
        qh, kh, vh = (run_steps(t, to_heads, comm, "fwd") for t in (q, k, v))
        scale = module.scale if module.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        rows = max(1, SCORES_PER_PRODUCT // (qh.shape[0] * qh.shape[1] * qh.shape[2]))
        chunks = _split_rows([(0, qh.shape[2], 0)], rows)
        out_h, lse = _attend(qh, kh, vh, mask, module.causal, scale, chunks)
        out = sdpa_layout(run_steps(out_h, to_seq, comm, "fwd"))
        ctx.save_for_backward(qh, kh, vh, out, lse, mask if mask is not None else torch.empty(0))
        ctx.module, ctx.has_mask, ctx.scale, ctx.chunks = module, mask is not None, scale, chunks
        return out

    @staticmethod
    def backward(ctx, d_out):
        qh, kh, vh, out, lse, mask = ctx.saved_tensors
        module, comm = ctx.module, ctx.module.comm
        with _no_autocast(qh):
            d_out = d_out.to(qh.dtype)
            delta = (d_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # in the statistics' dtype
            d_out_h, delta_h = (run_steps(t, module.to_heads, comm, "bwd") for t in (d_out, delta))
            grads = _attend_backward(
                qh, kh, vh, mask if ctx.has_mask else None, module.causal, ctx.scale, ctx.chunks, d_out_h, delta_h, lse
            )
            dq, dk, dv = (run_steps(g, module.to_sequence, comm, "bwd").to(t) for g, t in zip(grads, ctx.in_dtypes))
        return dq, dk, dv, None, None


class UlyssesAttention(torch.nn.Module):
    def __init__(self, comm: MeshComm, axis: int, spec, *, causal: bool, scale=None):
        super().__init__()
        self.comm, self.axis, self.causal, self.scale = comm, axis, causal, scale
        seq = tuple(spec)
        heads = seq[:axis] + (Shard(1),) + seq[axis + 1 :]
        self.to_heads = transition_steps(seq, heads)
        self.to_sequence = transition_steps(heads, seq)

    def forward(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p and self.training:
            raise NotImplementedError(
                "Ulysses attention with attention dropout is not supported: set the model's attention dropout to 0"
            )
        p, name = self.comm.shape[self.axis], self.comm.axis_names[self.axis]
        if q.shape[1] % p or k.shape[1] % p:
            raise ValueError(
                f"Ulysses attention on mesh axis {name} ({p} ranks) needs the query heads ({q.shape[1]}) and the "
                f"key/value heads ({k.shape[1]}) divisible by {p}; plan with sequence_parallel='ring' instead"
            )
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] > 1:  # per-head mask: ours
            size = attn_mask.shape[1] // p
            attn_mask = attn_mask.narrow(1, self.comm.coords[self.axis] * size, size)
        if p == 1:
            return torch.ops.aten.scaled_dot_product_attention.default(
                q, k, v, attn_mask, 0.0, self.causal, scale=self.scale, enable_gqa=enable_gqa
            )
        return _UlyssesFn.apply(q, k, v, attn_mask, self)

    def extra_repr(self):
        return f"Ulysses all-to-alls on mesh axis {self.comm.axis_names[self.axis]}"
