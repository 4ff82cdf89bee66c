"""Local kernels for ops whose sharded form needs more than the same op on local tensors.

Each is an ``nn.Module`` (so lowered programs print them readably) called by the lowered
graph; the op rules in :mod:`passes.rules` decide when to use them, and the collectives they
issue are the ones the rules priced (``AxisStrategy.extra``):

* :class:`VocabParallelEmbedding`: rows of the table split over ranks; ids outside this
  rank's range look up zeros, so the output is partial (no collective here).
* :class:`ShardedSoftmax`: softmax / log_softmax over a sharded dim: all-reduce the row max
  and the row sum of exponentials forward, one row sum backward.
* :class:`ShardedCrossEntropy`: class-sharded logits (all-reduce row max, sum of exponentials
  and target logit) and/or batch-sharded rows (all-reduce the (loss sum, target count) pair
  once, so means over ``ignore_index``-masked targets stay exact).
* :class:`SyncBatchNorm`: batch-sharded training batch norm: all-gather each rank's per-channel
  mean and variance and combine them (Chan's parallel combination: stable where the mean is
  large beside the spread), forward; all-reduce the two gradient sums backward.
* :class:`RankDropout`: dropout whose mask depends on the step, the node, and this rank's
  coordinates on the axes where the tensor is sharded (Megatron's RNG-tracker rule: ranks
  holding the same data draw the same mask).
* :class:`RankAttention`: ``scaled_dot_product_attention`` with ``dropout_p > 0``, its dropout
  drawn by the same rule (and off in ``eval()``, although capture baked ``dropout_p`` in).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.collectives import MeshComm, all_gather_stacked, all_reduce_

__all__ = [
    "VocabParallelEmbedding",
    "ShardedSoftmax",
    "ShardedCrossEntropy",
    "SyncBatchNorm",
    "RankDropout",
    "RankAttention",
    "shard_offset",
    "scale_to_share",
]


def shard_offset(comm: MeshComm, spec, dim: int, local_size: int) -> int:
    """Where this rank's block of ``dim`` starts (mixed radix over the axes sharding it, outer
    axis first, an :class:`~passes.core.placements.InnerShard` axis last)."""
    axes = [a for a, p in enumerate(spec) if getattr(p, "dim", None) == dim and type(p).__name__ in _SHARDS]
    index = 0
    for axis in sorted(axes, key=lambda a: type(spec[a]).__name__ == "InnerShard"):
        index = index * comm.shape[axis] + comm.coords[axis]
    return index * local_size


def scale_to_share(local_mean: torch.Tensor, x: torch.Tensor, dims, total: int) -> torch.Tensor:
    """A mean over dims cut into unequal pieces: this rank's mean of its piece of ``x``, weighed
    by its share of the ``total`` elements reduced (the partial sums then add to the mean)."""
    held = 1
    for d in dims:
        held *= x.shape[d]
    return local_mean * (held / total)


_SHARDS = ("Shard", "_StridedShard", "InnerShard")


def _all_reduce_axes(t, comm, axes, phase, op=dist.ReduceOp.SUM):
    for axis in axes:
        all_reduce_(t, comm, axis, phase, op)
    return t


class VocabParallelEmbedding(torch.nn.Module):
    uneven_pieces_ok = True  # a lookup per id: any number of ids per rank

    def __init__(self, comm: MeshComm, weight_spec, padding_idx: int = -1):
        super().__init__()
        self.comm, self.weight_spec, self.padding_idx = comm, tuple(weight_spec), padding_idx

    def forward(self, weight, ids):
        lo = shard_offset(self.comm, self.weight_spec, 0, weight.shape[0])
        outside = (ids < lo) | (ids >= lo + weight.shape[0])
        local_ids = (ids - lo).masked_fill(outside, 0)
        pad = self.padding_idx - lo if 0 <= self.padding_idx - lo < weight.shape[0] else -1
        out = torch.ops.aten.embedding.default(weight, local_ids, pad)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self):
        return f"vocabulary split by {self.weight_spec}"


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, log, comm, axes):
        m = x.amax(dim, keepdim=True)
        _all_reduce_axes(m, comm, axes, "fwd", dist.ReduceOp.MAX)
        e = torch.exp(x - m)
        s = e.sum(dim, keepdim=True)
        _all_reduce_axes(s, comm, axes, "fwd")
        y = (x - m - torch.log(s)) if log else e / s
        ctx.save_for_backward(y)
        ctx.dim, ctx.log, ctx.comm, ctx.axes = dim, log, comm, axes
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        if ctx.log:
            total = g.sum(ctx.dim, keepdim=True)
            _all_reduce_axes(total, ctx.comm, ctx.axes, "bwd")
            return g - torch.exp(y) * total, None, None, None, None
        total = (g * y).sum(ctx.dim, keepdim=True)
        _all_reduce_axes(total, ctx.comm, ctx.axes, "bwd")
        return y * (g - total), None, None, None, None


class ShardedSoftmax(torch.nn.Module):
    def __init__(self, comm: MeshComm, dim: int, axes, log: bool):
        super().__init__()
        self.comm, self.dim, self.axes, self.log = comm, dim, list(axes), log

    def forward(self, x, *unused):
        return _SoftmaxFn.apply(x, self.dim, self.log, self.comm, self.axes)

    def extra_repr(self):
        return f"{'log_' if self.log else ''}softmax over dim {self.dim}, sharded on axes {self.axes}"


class _SumCountFn(torch.autograd.Function):
    """(local loss sum, local count) -> global pair; the sum's gradient passes through."""

    @staticmethod
    def forward(ctx, total, count, comm, axes):
        pair = torch.stack([total.detach(), count.to(total.dtype)])
        _all_reduce_axes(pair, comm, axes, "fwd")
        return pair[0].clone(), pair[1].clone()

    @staticmethod
    def backward(ctx, g_total, g_count):
        return g_total, None, None, None


class _ClassShardedNll(torch.autograd.Function):
    """Per-row -log softmax(x)[target] with the class dim split over ``axes``."""

    @staticmethod
    def forward(ctx, x, target, lo, ignore_index, comm, axes):
        m = x.amax(1, keepdim=True)
        _all_reduce_axes(m, comm, axes, "fwd", dist.ReduceOp.MAX)
        e = torch.exp(x - m)
        s = e.sum(1, keepdim=True)
        _all_reduce_axes(s, comm, axes, "fwd")
        local_t = target - lo
        mine = (local_t >= 0) & (local_t < x.shape[1])
        picked = x.gather(1, local_t.clamp(0, x.shape[1] - 1).unsqueeze(1)).squeeze(1) * mine
        _all_reduce_axes(picked, comm, axes, "fwd")
        counted = target != ignore_index
        loss = (torch.log(s.squeeze(1)) + m.squeeze(1) - picked) * counted
        ctx.save_for_backward(e / s, local_t, mine & counted, counted)
        return loss

    @staticmethod
    def backward(ctx, g):
        probs, local_t, hit, counted = ctx.saved_tensors
        grad = probs * (g * counted).unsqueeze(1)
        rows = torch.arange(grad.shape[0], device=grad.device)[hit]
        grad[rows, local_t[hit]] -= g[hit]
        return grad, None, None, None, None, None


class ShardedCrossEntropy(torch.nn.Module):
    """cross_entropy / nll_loss with batch rows and/or classes split over mesh axes."""

    # a mean all-reduces (sum, count) over the row axes, and the class axes' groups hold equal
    # rows, so rows cut into unequal pieces (an uneven last batch) give the exact loss
    uneven_pieces_ok = True

    def __init__(
        self,
        comm: MeshComm,
        *,
        class_axes,
        batch_axes,
        class_spec,
        reduction: int,
        ignore_index: int,
        label_smoothing: float,
        from_log_probs: bool,
    ):
        super().__init__()
        self.comm = comm
        self.class_axes, self.batch_axes = list(class_axes), list(batch_axes)
        self.class_spec = tuple(class_spec)
        self.reduction, self.ignore_index = reduction, ignore_index
        self.label_smoothing, self.from_log_probs = label_smoothing, from_log_probs

    def forward(self, x, target, *unused):
        if x.dim() > 2:  # [N, C, d...] -> rows
            x = x.movedim(1, -1).reshape(-1, x.shape[1])
            target = target.reshape(-1)
        if self.class_axes and not self.from_log_probs:
            lo = shard_offset(self.comm, self.class_spec, 1, x.shape[1])
            per_row = _ClassShardedNll.apply(x, target, lo, self.ignore_index, self.comm, self.class_axes)
        elif self.class_axes:  # nll over class-split log-probs: each rank picks its own targets
            lo = shard_offset(self.comm, self.class_spec, 1, x.shape[1])
            local_t = target - lo
            mine = (local_t >= 0) & (local_t < x.shape[1]) & (target != self.ignore_index)
            per_row = -x.gather(1, local_t.clamp(0, x.shape[1] - 1).unsqueeze(1)).squeeze(1) * mine
        else:
            fn = F.nll_loss if self.from_log_probs else F.cross_entropy
            extra = {} if self.from_log_probs else {"label_smoothing": self.label_smoothing}
            per_row = fn(x, target, ignore_index=self.ignore_index, reduction="none", **extra)
        if self.reduction == 0:
            return per_row
        total = per_row.sum()
        if self.reduction == 2:
            return total
        count = (target != self.ignore_index).sum()
        if self.batch_axes:
            total, count = _SumCountFn.apply(total, count, self.comm, self.batch_axes)
        return total / count.to(total.dtype)

    def extra_repr(self):
        return f"classes split on axes {self.class_axes}, rows split on axes {self.batch_axes}"


def _channel_sums(t, dims):
    """``t`` summed over ``dims`` per channel, accumulated as one device's batch norm accumulates
    (ATen's CPU kernels in float64, CUDA's in float32), in that accumulation dtype."""
    return t.sum(dims, dtype=torch.float64 if t.device.type == "cpu" else torch.promote_types(t.dtype, torch.float32))


def combined_moments(mean, var, comm: MeshComm, axes, phase: str = "fwd") -> tuple:
    """The mean and (biased) variance per channel over every rank's piece on ``axes``, from each
    rank's own of equally many values (Chan et al.'s parallel combination): one all-gather of the
    (mean, variance) pairs per axis, then ``mean = avg(mean_i)`` and ``var = avg(var_i) +
    avg((mean_i - mean)^2)``. Each term is a deviation or a variance, never a difference of two
    large sums of squares, so no digits cancel where the mean is large beside the spread."""
    for axis in axes:
        means, variances = all_gather_stacked(torch.cat([mean, var]), comm, axis, phase).chunk(2, dim=1)
        mean = means.mean(0)
        var = variances.mean(0) + (means - mean).square().mean(0)
    return mean, var


class _SyncBatchNormFn(torch.autograd.Function):
    """Batch statistics over every rank's piece: each rank's per-channel mean and variance of its
    own piece (two passes over it: the mean, then the squared deviations from it), combined over
    the ranks by :func:`combined_moments` in one collective per axis. ``E[x^2] - E[x]^2`` from an
    all-reduce of the two sums cancels catastrophically where a channel's mean is large beside its
    spread (its rounding error grows with ``mean^2 / var``). Backward: one all-reduce of the two
    gradient sums (``g`` and ``g * xhat``, both of centred values)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, comm, axes):
        dims = [0] + list(range(2, x.dim()))
        local = x.numel() // x.shape[1]  # values per channel on this rank: equal pieces on every rank
        count = local
        for axis in axes:
            count *= comm.shape[axis]
        shape = [1, -1] + [1] * (x.dim() - 2)
        own_mean = _channel_sums(x, dims) / local
        own_var = _channel_sums((x - own_mean.view(shape)).square(), dims) / local
        # sent in x's dtype: each rank's mean rounded at the mean's magnitude, as one device's is
        mean, var = combined_moments(own_mean.to(x.dtype), own_var.to(x.dtype), comm, axes)
        centred = x - mean.view(shape)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean * momentum)
                running_var.mul_(1 - momentum).add_(var * count / max(count - 1, 1) * momentum)
        inv_std = torch.rsqrt(var + eps)
        xhat = centred * inv_std.view(shape)
        ctx.save_for_backward(xhat, inv_std, weight)
        ctx.count, ctx.comm, ctx.axes, ctx.dims, ctx.shape = count, comm, axes, dims, shape
        out = xhat
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx, g):
        xhat, inv_std, weight = ctx.saved_tensors
        shape, dims = ctx.shape, ctx.dims
        sums = torch.cat([_channel_sums(g, dims), _channel_sums(g * xhat, dims)]).to(g.dtype)
        grad_w = sums[xhat.shape[1] :].clone() if weight is not None else None
        grad_b = sums[: xhat.shape[1]].clone()
        _all_reduce_axes(sums, ctx.comm, ctx.axes, "bwd")
        g_sum, gx_sum = sums.chunk(2)
        scale = inv_std * (weight if weight is not None else 1.0)
        grad_x = scale.view(shape) * (g - (g_sum / ctx.count).view(shape) - xhat * (gx_sum / ctx.count).view(shape))
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(torch.nn.Module):
    """Training-mode batch_norm with the batch split over ``axes`` (weight/bias grads come back
    partial per rank and are summed by the parameters' gradient synchronisation)."""

    def __init__(self, comm: MeshComm, axes, momentum: float, eps: float):
        super().__init__()
        self.comm, self.axes, self.momentum, self.eps = comm, list(axes), momentum, eps

    def forward(self, x, weight=None, bias=None, running_mean=None, running_var=None):
        return _SyncBatchNormFn.apply(
            x, weight, bias, running_mean, running_var, self.momentum, self.eps, self.comm, self.axes
        )

    def extra_repr(self):
        return f"statistics all-reduced on axes {self.axes}"


class RankDropout(torch.nn.Module):
    """Dropout with masks keyed by (seed, call count, node, coordinates on sharded axes)."""

    uneven_pieces_ok = True  # elementwise on whatever piece this rank holds

    def __init__(self, comm: MeshComm, p: float, sharded_axes, node_index: int, seed: int = 0):
        super().__init__()
        self.comm, self.p, self.sharded_axes, self.node_index, self.seed = comm, p, list(sharded_axes), node_index, seed
        self.calls = 0

    def forward(self, x, *unused):
        if not self.training or self.p == 0.0:
            return x
        gen = torch.Generator(device=x.device).manual_seed(self._next_seed())
        keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def _next_seed(self) -> int:
        key = (self.seed, self.calls, self.node_index) + tuple(self.comm.coords[a] for a in self.sharded_axes)
        self.calls += 1
        return hash(key) & ((1 << 62) - 1)

    def extra_repr(self):
        return f"p={self.p}, independent masks along axes {self.sharded_axes}"


class RankAttention(RankDropout):
    """``aten.scaled_dot_product_attention`` whose attention dropout follows :class:`RankDropout`'s
    rule: the kernel draws from the default generator, reseeded (inside ``fork_rng``, so the
    caller's stream is untouched) from (seed, call count, node, coordinates on sharded axes).
    Without it every rank would draw the same stream: data-parallel ranks would drop the same
    positions of different samples, and tensor-parallel ranks the same positions of different
    heads. ``args``/``kwargs`` are the op's; ``dropout_p`` (argument 4) is zeroed in ``eval()``."""

    def forward(self, *args, **kwargs):
        op = torch.ops.aten.scaled_dot_product_attention.default
        if not self.training or self.p == 0.0:
            args = args[:4] + (0.0,) + args[5:] if len(args) > 4 else args
            if "dropout_p" in kwargs:
                kwargs = dict(kwargs, dropout_p=0.0)
            return op(*args, **kwargs)
        device = args[0].device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self._next_seed())
            return op(*args, **kwargs)

    def extra_repr(self):
        return f"dropout_p={self.p}, independent masks along axes {self.sharded_axes}"
