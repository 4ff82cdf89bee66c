"""Ring attention: ``scaled_dot_product_attention`` with the sequence split over one mesh axis.

Each of the ``p`` ranks of the axis holds one contiguous block of the sequence of q, k and v
(``Shard(2)`` of ``[B, H, S, D]``; other mesh axes may split the batch). The rank keeps its
queries; the key/value blocks travel around the ring (rank ``c`` sends to ``c+1`` and receives
from ``c-1``), ``p - 1`` hops, each posted (``isend`` / ``irecv``) before the block in hand is
computed, so the transfer overlaps the computation. Blocks are computed with explicit math
(``q k^T``, a log-sum-exp softmax, ``p v``), so the op runs on any device, and merged by the
online softmax: with ``l`` the running log-sum-exp of a row and ``o`` its normalised output,
a block with ``(o_b, l_b)`` gives ``l' = log(e^l + e^l_b)``, ``o' = o e^(l - l') + o_b e^(l_b - l')``.

Backward is exact and needs no recomputation of the forward merge: with the final ``(o, l)``
saved, ``P = exp(q k_j^T s - l)`` is the true probability of every block, ``Δ = rowsum(dO ∘ O)``,
``dS = P ∘ (dO v_j^T - Δ)``; ``dq += dS k_j s``, ``dk_j += dS^T q s``, ``dv_j += P^T dO``. The
key/value blocks go around the ring again (``p - 1`` hops) and so do the accumulators of
their gradients: block ``j``'s accumulator starts on rank ``j + 1`` with that rank's share and
travels ``j+1 -> ... -> j`` (``p - 1`` hops, the last delivering it home), where the owner adds
its own share. Per attention call: ``p - 1`` k/v transfers forward, ``2 (p - 1)`` backward (k/v
and their gradients), counted as ``send_recv`` (the bytes this rank sends).

Causal masks and load balance: with contiguous blocks, rank ``c``'s queries see ``c + 1`` key
blocks (the last rank does ``p`` times the work of the first). So for ``is_causal`` the query
block is cut in two and the ``2p`` query chunks are dealt zig-zag: rank ``c`` computes chunks
``c`` and ``2p - 1 - c`` (one early, one late), which makes every rank's work equal
(``2p - 1`` full chunk pairs and 2 diagonal ones). The permutation is applied **inside the
op, to the queries only**: q is exchanged into the zig-zag layout by one all-to-all, the output
comes back by another (the backward exchanges q, dO and the row sums ``Δ`` in and dq out, so the
op keeps what ``scaled_dot_product_attention`` keeps: q as given, the output as returned, the
log-sum-exp); keys and values stay in their
contiguous blocks, whose positions each rank knows. Everything outside the op (positions,
RoPE, learned embeddings, the loss) sees the ordinary contiguous sequence split, so absolute
positions stay correct with nothing to permute at the model's input. Chunk pairs wholly above
the diagonal are skipped, which is where causal attention saves half of its work.

Dtypes (mixed precision): under ``torch.autocast`` the op computes as the fused one does: q, k
and v are cast to the autocast dtype (what travels around the ring, and what is kept), the
block products run in it, while the scores' softmax statistics (log-sum-exp, row sums), the
running output and the gradient accumulators are fp32 (cast to the autocast dtype for the
``P v`` / ``dS k`` products and for each hop of an accumulator); the output is returned in the
autocast dtype and each gradient in its input's dtype (HF models feed fp32 q/k from their
autocast-off rotary embeddings). The block math itself runs with autocast off.

Other masks: a boolean or additive mask tensor arrives split on its query dim with all of its
key columns; each block uses its columns. Grouped-query attention (k/v with ``H / g`` heads)
sends the small k/v blocks and repeats their heads for the block products only.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from runtime.collectives import MeshComm, record_collective

__all__ = ["RingAttention", "ring_chunks", "sdpa_layout", "P2P_TIMEOUT", "SCORES_PER_PRODUCT"]

P2P_TIMEOUT = datetime.timedelta(seconds=300)
"""The longest a rank waits for one ring transfer before failing (a peer has died or hung)."""

SCORES_PER_PRODUCT = 1 << 20
"""Scores one block product holds at most (batch x heads x query rows x keys; 4 MiB in fp32):
the query rows of a chunk are taken that many at a time, so a step's transient memory does not
grow with the square of the block."""


def ring_chunks(coord: int, p: int, local: int, balanced: bool) -> list:
    """The query chunks rank ``coord`` computes: ``[(local offset, length, global start)]``.

    Contiguous: one chunk, its own block. ``balanced`` (zig-zag): the block is in halves and
    rank ``c`` computes global chunks ``c`` and ``2p - 1 - c`` (in that order, each ``local / 2``
    long)."""
    if not balanced:
        return [(0, local, coord * local)]
    half = local // 2
    return [(0, half, coord * half), (half, half, (2 * p - 1 - coord) * half)]


def _split_rows(chunks, rows: int) -> list:
    """``chunks`` cut into pieces of at most ``rows`` queries (rows are independent: this bounds
    the score block a step materialises, ``rows x block``, without changing any result)."""
    out = []
    for off, n, start in chunks:
        for i in range(0, n, rows):
            out.append((off + i, min(rows, n - i), start + i))
    return out


def _zigzag_owner(chunk: int, p: int) -> int:
    return chunk if chunk < p else 2 * p - 1 - chunk


def _exchange(x: torch.Tensor, comm: MeshComm, axis: int, phase: str, to_zigzag: bool) -> torch.Tensor:
    """Move the sequence dim (2) of ``x`` between the contiguous and the zig-zag layouts with one
    all-to-all on ``axis`` (counted as an ``all_to_all`` of the local buffer, like a reshard's)."""
    p, me = comm.shape[axis], comm.coords[axis]
    half = x.shape[2] // 2

    def held(rank, zig):  # the global chunks a rank holds, in local order
        return [rank, 2 * p - 1 - rank] if zig else [2 * rank, 2 * rank + 1]

    def owner(chunk, zig):
        return _zigzag_owner(chunk, p) if zig else chunk // 2

    mine = held(me, not to_zigzag)
    pieces = x.movedim(2, 0).chunk(2, 0)
    outgoing = sorted(range(2), key=lambda i: (owner(mine[i], to_zigzag), mine[i]))
    send = torch.cat([pieces[i] for i in outgoing]).contiguous()
    in_splits = [half * sum(1 for c in mine if owner(c, to_zigzag) == r) for r in range(p)]
    wanted = held(me, to_zigzag)
    incoming = sorted(wanted, key=lambda c: (owner(c, not to_zigzag), c))
    out_splits = [half * sum(1 for c in wanted if owner(c, not to_zigzag) == r) for r in range(p)]
    recv = torch.empty_like(send)
    record_collective("all_to_all", comm.axis_names[axis], send.numel() * send.element_size(), phase)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=comm.groups[axis])
    got = dict(zip(incoming, recv.chunk(2, 0)))
    return torch.cat([got[c] for c in wanted]).movedim(0, 2)


class _Ring:
    """The neighbours of this rank on one mesh axis and counted, timed-out transfers."""

    def __init__(self, comm: MeshComm, axis: int):
        self.comm, self.axis = comm, axis
        self.p, self.me = comm.shape[axis], comm.coords[axis]
        group = comm.groups[axis]
        self.group = group
        self.next = dist.get_global_rank(group, (self.me + 1) % self.p)
        self.prev = dist.get_global_rank(group, (self.me - 1) % self.p)
        self.name = comm.axis_names[axis]

    def start(self, tensors, phase: str):
        """Post the send of ``tensors`` to the next rank and the receive of the same shapes from
        the previous one; returns (pending works, receive buffers)."""
        works, bufs = [], []
        for t in tensors:
            t = t.contiguous()
            buf = torch.empty_like(t)
            record_collective("send_recv", self.name, t.numel() * t.element_size(), phase)
            # receive first: with p = 2 the previous and the next rank are the same peer
            works.append(dist.irecv(buf, self.prev, group=self.group))
            works.append(dist.isend(t, self.next, group=self.group))
            bufs.append(buf)
        return works, bufs

    @staticmethod
    def finish(works):
        for w in works:
            if not w.wait(P2P_TIMEOUT):
                raise TimeoutError(f"ring attention: a block transfer did not finish within {P2P_TIMEOUT}")


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k/v with fewer heads (grouped-query) repeated to ``heads``."""
    if t.shape[1] == heads:
        return t
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand_heads`: the repeated heads' gradients summed."""
    if g.shape[1] == kv_heads:
        return g
    b, h, s, d = g.shape
    return g.reshape(b, kv_heads, h // kv_heads, s, d).sum(2)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the op computes in: the autocast dtype where autocast is on for ``t``'s device
    (the fused op is on autocast's lower-precision list, so it casts q, k and v to it), else
    ``t``'s own."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax statistics and accumulators: fp32 at least (as fused kernels)."""
    return torch.promote_types(dtype, torch.float32)


def _no_autocast(t: torch.Tensor):
    """The block math states its dtypes itself: autocast must not re-cast it."""
    return torch.autocast(t.device.type, enabled=False)


class _Block:
    """One (query chunk, key block) pair: which key columns it reads and its mask."""

    def __init__(self, q_start, q_len, k_start, k_len, causal, mask):
        self.cols = k_len
        self.mask = None  # True where a query may attend (boolean), or additive (float)
        if causal:
            last_q = q_start + q_len - 1
            self.cols = max(0, min(k_len, last_q - k_start + 1))
            if self.cols and k_start + self.cols - 1 > q_start:  # crosses the diagonal
                qpos = torch.arange(q_start, q_start + q_len).unsqueeze(1)
                kpos = torch.arange(k_start, k_start + self.cols).unsqueeze(0)
                self.mask = kpos <= qpos
        if mask is not None and self.cols:
            cols = mask[..., k_start : k_start + self.cols]
            if self.mask is None:
                self.mask = cols
            elif cols.dtype == torch.bool:
                self.mask = self.mask & cols
            else:
                self.mask = cols.masked_fill(~self.mask, float("-inf"))

    def scores(self, q, k, scale):
        """``q k^T s`` (the product in q's dtype) with the mask, in the statistics' dtype."""
        s = torch.matmul(q, k[:, :, : self.cols].transpose(-1, -2)).to(stats_dtype(q.dtype)) * scale
        if self.mask is None:
            return s
        if self.mask.dtype == torch.bool:
            return s.masked_fill(~self.mask.to(s.device), float("-inf"))
        return s + self.mask.to(s.dtype)

    def forward(self, q, k, v, scale):
        """This block's (normalised output, log-sum-exp), both in the statistics' dtype; the
        products in q's dtype (the probabilities cast to it for ``P v``, as fused kernels do)."""
        s = self.scores(q, k, scale)
        lse = torch.logsumexp(s, -1)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp(s - safe.unsqueeze(-1)).to(q.dtype)
        return torch.matmul(probs, v[:, :, : self.cols]).to(s.dtype), lse

    def backward(self, q, k, v, scale, d_out, delta, lse):
        """This block's shares of (dq, dk, dv) in the statistics' dtype, from the final
        log-sum-exp ``lse`` and row sums ``delta`` of its query rows (products in q's dtype)."""
        s = self.scores(q, k, scale)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp(s - lse.unsqueeze(-1))
        dv = torch.matmul(probs.to(q.dtype).transpose(-1, -2), d_out).to(s.dtype)
        dp = torch.matmul(d_out, v[:, :, : self.cols].transpose(-1, -2)).to(s.dtype)
        ds = (probs * (dp - delta.unsqueeze(-1))).to(q.dtype)
        dq = torch.matmul(ds, k[:, :, : self.cols]).to(s.dtype) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q).to(s.dtype) * scale
        return dq, dk, dv


def _merge(out, lse, o_b, lse_b):
    """Online-softmax merge of a block's (normalised output, log-sum-exp) into the running pair."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows no key reached yet
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    w_new = torch.exp(lse_b - safe).unsqueeze(-1)
    return out * w_old + o_b * w_new, new


class _RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, module):
        dtype = compute_dtype(q)
        with _no_autocast(q):
            return _RingFn._forward(ctx, q, k, v, mask, module, dtype)

    @staticmethod
    def _forward(ctx, q, k, v, mask, module, dtype):
        ring, comm, axis = module.ring(), module.comm, module.axis
        p, me = ring.p, ring.me
        local = k.shape[2]
        balanced = module.causal and module.balanced
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype)
        q, k, v = (t.to(dtype) for t in (q, k, v))  # as the fused op under autocast casts them
        q_in = q
        if balanced:
            q = _exchange(q, comm, axis, "fwd", to_zigzag=True)
        rows = module.rows or max(1, SCORES_PER_PRODUCT // (q.shape[0] * q.shape[1] * local))
        chunks = _split_rows(ring_chunks(me, p, local, balanced), rows)
        scale = module.scale if module.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        heads = q.shape[1]
        acc = stats_dtype(q.dtype)
        # the output in the memory layout sdpa gives ([B, S, H, D] underneath), which the model's
        # ``transpose(1, 2).view(...)`` after attention relies on
        out = q.new_zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=acc).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = (k, v)
        work = 0.0
        for step in range(p):
            pending = ring.start(kv, "fwd") if step < p - 1 else ([], None)
            src = (me - step) % p
            k_j, v_j = (_expand_heads(t, heads) for t in kv)
            for off, n, start in chunks:
                blk = _Block(start, n, src * local, local, module.causal, _mask_rows(mask, off, n))
                if not blk.cols:
                    continue
                o_b, lse_b = blk.forward(q[:, :, off : off + n], k_j, v_j, scale)
                o, l_ = _merge(out[:, :, off : off + n], lse[:, :, off : off + n], o_b, lse_b)
                out[:, :, off : off + n] = o
                lse[:, :, off : off + n] = l_
                work += 4.0 * q.shape[0] * heads * n * blk.cols * q.shape[-1]
            ring.finish(pending[0])
            if step < p - 1:
                kv = tuple(pending[1])
        module.flops_forward += work
        out = sdpa_layout(out.to(q.dtype))
        if balanced:  # keep what sdpa keeps (q as given, the output returned): backward exchanges again
            out = sdpa_layout(_exchange(out, comm, axis, "fwd", to_zigzag=False))
        ctx.save_for_backward(q_in, k, v, out, lse, mask if mask is not None else torch.empty(0))
        ctx.module, ctx.has_mask, ctx.scale, ctx.chunks = module, mask is not None, scale, chunks
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        with _no_autocast(q):
            return _RingFn._backward(ctx, q, k, v, out, lse, mask, d_out.to(q.dtype))

    @staticmethod
    def _backward(ctx, q, k, v, out, lse, mask, d_out):
        module = ctx.module
        mask = mask if ctx.has_mask else None
        ring, comm, axis = module.ring(), module.comm, module.axis
        p, me = ring.p, ring.me
        balanced = module.causal and module.balanced
        delta = (d_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # in the statistics' dtype
        if balanced:  # q, dO and the row sums into the zig-zag layout (lse was kept in it)
            q, d_out, delta = (_exchange(t, comm, axis, "bwd", to_zigzag=True) for t in (q, d_out, delta))
        local, heads, scale = k.shape[2], q.shape[1], ctx.scale
        dq = torch.zeros_like(q, dtype=lse.dtype)
        kv = (k, v)
        acc = None  # the gradient accumulator of the block in hand (arrives from the previous rank)
        own = None
        for step in range(p):
            src = (me - step) % p
            pending = ring.start(kv, "bwd") if step < p - 1 else ([], None)
            k_j, v_j = (_expand_heads(t, heads) for t in kv)
            dk_j = torch.zeros_like(k_j, dtype=lse.dtype)
            dv_j = torch.zeros_like(v_j, dtype=lse.dtype)
            for off, n, start in ctx.chunks:
                blk = _Block(start, n, src * local, local, module.causal, _mask_rows(mask, off, n))
                if not blk.cols:
                    continue
                rows = slice(off, off + n)
                g_q, g_k, g_v = blk.backward(
                    q[:, :, rows], k_j, v_j, scale, d_out[:, :, rows], delta[:, :, rows], lse[:, :, rows]
                )
                dq[:, :, rows] += g_q
                dk_j[:, :, : blk.cols] += g_k
                dv_j[:, :, : blk.cols] += g_v
            mine = (_fold_heads(dk_j, k.shape[1]), _fold_heads(dv_j, v.shape[1]))
            if step == 0:
                own = mine  # this rank's share of its own block's gradient, added at the end
            else:
                if acc is not None:
                    mine = (mine[0] + acc[0], mine[1] + acc[1])
                # block src's accumulator moves on (after the last step: home to rank src), in the
                # compute dtype (what the plan prices), summed here in the statistics' dtype
                acc_works, acc_bufs = ring.start((mine[0].to(k.dtype), mine[1].to(v.dtype)), "bwd")
                ring.finish(acc_works)
                acc = tuple(b.to(lse.dtype) for b in acc_bufs)
            ring.finish(pending[0])
            if step < p - 1:
                kv = tuple(pending[1])
        dk, dv = own
        if acc is not None:
            dk, dv = dk + acc[0], dv + acc[1]
        dq = dq.to(q.dtype)
        if balanced:
            dq = _exchange(dq, comm, axis, "bwd", to_zigzag=False)
        q_dtype, k_dtype, v_dtype = ctx.in_dtypes
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None, None


def sdpa_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([B, H, S, D]) stored as ``scaled_dot_product_attention`` stores its output: heads
    inside positions, so ``t.transpose(1, 2)`` is contiguous."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _mask_rows(mask, off, n):
    """The rows of the local query block a chunk uses (a mask broadcast over queries as is)."""
    if mask is None or mask.shape[-2] == 1:
        return mask
    return mask[..., off : off + n, :]


class RingAttention(torch.nn.Module):
    """``aten.scaled_dot_product_attention`` as ring attention on mesh ``axis`` (the sequence,
    dim 2, split on it); ``flops_forward`` sums the block products this rank computed (the
    load-balance check reads it). ``rows``: queries per block product, so a step holds at most
    ``rows x block`` scores per head (default: as many as :data:`SCORES_PER_PRODUCT` allows)."""

    def __init__(
        self, comm: MeshComm, axis: int, *, causal: bool, scale=None, balanced: bool = True, rows: int | None = None
    ):
        super().__init__()
        self.comm, self.axis, self.causal, self.scale, self.balanced = comm, axis, causal, scale, balanced
        self.rows = rows  # queries per block product (None: as many as keep SCORES_PER_PRODUCT)
        self.flops_forward = 0.0
        self._ring: _Ring | None = None

    def ring(self) -> _Ring:
        if self._ring is None:
            self._ring = _Ring(self.comm, self.axis)
        return self._ring

    def forward(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p and self.training:
            raise NotImplementedError(
                "ring attention with attention dropout is not supported: set the model's attention dropout "
                "to 0, or plan with sequence_parallel='none' (Ulysses refuses it too)"
            )
        p = self.comm.shape[self.axis]
        if self.causal and self.balanced and k.shape[2] % 2:
            raise ValueError(
                f"causal ring attention on mesh axis {self.comm.axis_names[self.axis]} needs an even block per "
                f"rank (sequence length divisible by 2 x {p}); this rank's block has {k.shape[2]} positions"
            )
        if q.shape[1] % k.shape[1]:
            raise ValueError(
                f"grouped-query attention needs query heads ({q.shape[1]}) divisible by k/v heads ({k.shape[1]})"
            )
        if p == 1:
            return torch.ops.aten.scaled_dot_product_attention.default(
                q, k, v, attn_mask, 0.0, self.causal, scale=self.scale, enable_gqa=enable_gqa
            )
        return _RingFn.apply(q, k, v, attn_mask, self)

    def extra_repr(self):
        layout = "zig-zag balanced causal" if self.causal and self.balanced else ("causal" if self.causal else "full")
        return f"ring on mesh axis {self.comm.axis_names[self.axis]}, {layout}"
