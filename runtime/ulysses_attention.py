"""Ulysses attention (DeepSpeed-Ulysses): sequence-split q/k/v turned head-split around the core.

q, k and v arrive split on the sequence (``Shard(2)`` of ``[B, H, S, D]``) on one mesh axis of
``p`` ranks. One all-to-all each moves them to ``Shard(1)``: every rank then holds the whole
sequence for ``H / p`` of the heads (``H_kv / p`` of the key/value heads), runs ordinary
attention on them (causal masks and mask tensors need nothing special: the sequence is whole),
and one more all-to-all returns the output to the sequence split. Backward runs the same four
all-to-alls on the gradients, in reverse. Per attention call and step: 4 all-to-alls forward
(q, k, v in, the output back) and 4 backward, each of the local buffer (the payload the
``all_to_all`` reshard counts): ``B H S D / p`` elements for q and the output, ``B H_kv S D / p``
for k and v (divided further by the other axes' splits).

The moves are :class:`runtime.collectives.Reshard` modules, so they are autograd functions,
counted and timed out like every reshard. Heads must divide by ``p`` (query and key/value
heads alike): checked when planning and again here, with an error naming both.
"""

from __future__ import annotations

import torch

from passes.placements import Shard
from runtime.collectives import MeshComm, Reshard
from runtime.ring_attention import sdpa_layout

__all__ = ["UlyssesAttention"]


class UlyssesAttention(torch.nn.Module):
    def __init__(self, comm: MeshComm, axis: int, spec, *, causal: bool, scale=None):
        super().__init__()
        self.comm, self.axis, self.causal, self.scale = comm, axis, causal, scale
        seq = tuple(spec)
        heads = seq[:axis] + (Shard(1),) + seq[axis + 1 :]
        self.to_heads = torch.nn.ModuleList(Reshard(comm, seq, heads, heads) for _ in range(3))
        self.to_sequence = Reshard(comm, heads, seq, seq)

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
        q, k, v = (move(t) for move, t in zip(self.to_heads, (q, k, v)))
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] > 1:  # per-head mask: ours
            size = attn_mask.shape[1] // p
            attn_mask = attn_mask.narrow(1, self.comm.coords[self.axis] * size, size)
        out = torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, 0.0, self.causal, scale=self.scale, enable_gqa=enable_gqa
        )
        return sdpa_layout(self.to_sequence(out))

    def extra_repr(self):
        return f"Ulysses all-to-alls on mesh axis {self.comm.axis_names[self.axis]}"
