"""layer_norm and rms_norm over a hidden dim split across mesh axes (2D / 2.5D / 3D layouts).

Each rank holds ``x[..., C / n]`` and the matching slice of the weight and bias. Per row:

* layer_norm forward: all-reduce the row sum (the mean), then the row sum of squared deviations
  from it (the variance; two passes, as exact as one device's); ``xhat = (x - mean) * rstd``.
  Backward, with ``g = dy * w``: all-reduce the pair (row sum of ``g``, row sum of ``g * xhat``)
  in one collective; ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``.
* rms_norm forward: all-reduce the row sum of squares; backward: all-reduce the row sum of
  ``g * xhat``; ``dx = rstd * (g - xhat * mean(g * xhat))``.

The weight and bias gradients are this rank's slice, summed over its local rows (the rows split
on other axes make them partial there, which the gradient synchronisation sums). The
collectives are the ones :class:`passes.rules.normalization.LayerNormRule` prices.
"""

from __future__ import annotations

import torch

from runtime.collectives import MeshComm, all_reduce_

__all__ = ["ShardedNorm"]


def _all_reduce(t, comm, axes, phase):
    for axis in axes:
        all_reduce_(t, comm, axis, phase)
    return t


def _row_sum(t):
    return t.sum(-1, keepdim=True)


def _param_grad(t, like):
    return t.reshape(-1, t.shape[-1]).sum(0).reshape(like.shape)


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, width, rms, comm, axes):
        if rms:
            s = _row_sum(x * x)
            _all_reduce(s, comm, axes, "fwd")
            rstd = torch.rsqrt(s / width + eps)
            xhat = x * rstd
        else:
            mean = _row_sum(x)
            _all_reduce(mean, comm, axes, "fwd")
            xc = x - mean / width
            var = _row_sum(xc * xc)
            _all_reduce(var, comm, axes, "fwd")
            rstd = torch.rsqrt(var / width + eps)
            xhat = xc * rstd
        y = xhat if weight is None else xhat * weight
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.has_bias, ctx.width, ctx.rms, ctx.comm, ctx.axes = bias is not None, width, rms, comm, axes
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, rstd, weight = ctx.saved_tensors
        g = dy if weight is None else dy * weight
        if ctx.rms:
            sums = _row_sum(g * xhat)
            _all_reduce(sums, ctx.comm, ctx.axes, "bwd")
            dx = rstd * (g - xhat * (sums / ctx.width))
        else:
            sums = torch.cat([_row_sum(g), _row_sum(g * xhat)], dim=-1)
            _all_reduce(sums, ctx.comm, ctx.axes, "bwd")
            mean_g, mean_gx = (sums / ctx.width).split(1, dim=-1)
            dx = rstd * (g - mean_g - xhat * mean_gx)
        dw = _param_grad(dy * xhat, weight) if weight is not None and ctx.needs_input_grad[1] else None
        db = _param_grad(dy, dy[..., :1].new_empty(dy.shape[-1])) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None


class ShardedNorm(torch.nn.Module):
    """``layer_norm(x, [C], w, b, eps)`` / ``rms_norm(x, [C], w, eps)`` with C split over ``axes``."""

    # Rows cut into unequal pieces (a batch the data axes do not divide) are fine: the statistics
    # are reduced over ``axes``, whose ranks differ only in their coordinates on ``axes``, which
    # cut C, so they hold the same rows.
    uneven_pieces_ok = True

    def __init__(self, comm: MeshComm, axes, width: int, eps, rms: bool):
        super().__init__()
        self.comm, self.axes, self.width, self.eps, self.rms = comm, list(axes), int(width), eps, rms

    def forward(self, x, weight=None, bias=None):
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _NormFn.apply(x, weight, bias, eps, self.width, self.rms, self.comm, self.axes)

    def extra_repr(self):
        kind = "rms_norm" if self.rms else "layer_norm"
        return f"{kind} over {self.width} features split on axes {self.axes}"
