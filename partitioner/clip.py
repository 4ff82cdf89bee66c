"""Gradient clipping by the global norm of a parallel model's gradients.

``clip_grad_norm_(model, max_norm, norm_type)`` gives what ``torch.nn.utils.clip_grad_norm_``
gives on the single-device model, for a ``ParallelModule`` or a pipeline runner whose
gradients are spread over ranks.

The p-norm of all gradients is ``(sum over every element of |g|^p)^(1/p)``. Each rank holds
pieces of the gradients, and a piece stored ``Replicate`` on some mesh axes is held, identical,
by every rank along them: its elements appear ``replicas`` times over the job, the product of
the sizes of the axes where its placement is not ``Shard``. A weight that several pipeline
stages hold (tied embeddings) appears once more per stage, each copy with the whole gradient
after the runner's step. So each rank sums ``|g|^p / (replicas * copies)`` over its pieces,
one SUM all-reduce over the job's ranks adds the sums up, and every rank takes the p-th root:
every element counted once, the same norm on every rank. The inf-norm is the largest ``|g|``:
the local maximum, one MAX all-reduce (replicas change nothing). Sums are taken in fp32 or
wider.

Then every local gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))``, the factor
``torch.nn.utils.clip_grad_norm_`` uses, so the clipped gradients are the single-device ones.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.distributed as dist

from passes.core.placements import is_shard

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    model: torch.nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of ``model`` (a ``ParallelModule`` from ``auto_parallelize``, or a
    pipeline runner) so that their global ``norm_type``-norm is at most ``max_norm``; returns
    that norm (before clipping) as a tensor, equal on every rank. A collective: every rank of
    the model calls it. ``error_if_nonfinite``: raise (on every rank) when the norm is nan or
    inf, as ``torch.nn.utils.clip_grad_norm_`` does."""
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or inf; got {norm_type!r}")
    pieces, reduce_over = _grad_pieces(model)
    device = next((g.device for g, _ in pieces), torch.device("cpu"))
    dtype = torch.promote_types(torch.float32, next((g.dtype for g, _ in pieces), torch.float32))
    local = torch.zeros((), dtype=dtype, device=device)
    for grad, copies in pieces:
        g = grad.detach().to(dtype)
        if math.isinf(p):
            local = torch.maximum(local, g.abs().max()) if g.numel() else local
        else:
            local = local + (g.abs().pow(p).sum() if p != 2 else g.pow(2).sum()) / copies
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    for group in reduce_over:
        dist.all_reduce(local, op=op, group=group)
    total = local if math.isinf(p) else local.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite "
            f"({total.item()}), so it cannot be clipped; pass error_if_nonfinite=False to skip this check"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad, _ in pieces:
            grad.mul_(coef.to(grad.dtype))
    return total


def _replicas(spec, mesh_shape) -> int:
    return math.prod(n for p, n in zip(spec, mesh_shape) if not is_shard(p))


def _grad_pieces(model) -> tuple[list, list]:
    """This rank's gradients with the number of times each element appears over the job, and the
    process groups whose all-reduces, in turn, span every rank of the model once."""
    from runtime.parallel_module import ParallelModule
    from runtime.pipeline import PipelineRunner, StageProgram

    if isinstance(model, ParallelModule):
        placements = model.stored_placements()
        shape = model.comm.shape
        pieces = [
            (param.grad, _replicas(placements[fqn], shape))
            for fqn, param in model.named_parameters()
            if param.grad is not None
        ]
        return pieces, _groups(model.comm, math.prod(shape))
    if isinstance(model, PipelineRunner):
        pieces = []
        stages = [cast(StageProgram, stage) for stage in model.stages.values()]
        for stage in stages:
            for placeholder, param, spec in stage.placed_parameters():
                if param.grad is not None:
                    copies = model.stages_holding(placeholder)
                    pieces.append((param.grad, _replicas(spec, stage.comm.shape) * copies))
        comm = stages[0].comm  # every stage of a rank runs on the same stage mesh
        pp_group, _, pp_size = model.comm_pp
        return pieces, _groups(comm, pp_size * math.prod(comm.shape), extra=pp_group)
    raise TypeError(
        f"clip_grad_norm_(model=...) takes a ParallelModule (from partitioner.auto_parallelize) or a "
        f"pipeline runner; got {type(model).__name__}. For a model on one device use "
        f"torch.nn.utils.clip_grad_norm_"
    )


def _groups(comm, ranks: int, extra=None) -> list:
    """One all-reduce over the whole job when the model spans every rank, else one per mesh axis
    (and ``extra``, the pipeline's group): the same sum, in more steps."""
    if ranks == dist.get_world_size():
        return [None]
    axes = [g for g, n in zip(comm.groups, comm.shape) if n > 1]
    return axes + ([extra] if extra is not None else [])
