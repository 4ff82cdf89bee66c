"""Activations gathered for an op that keeps them: keep the shard, gather again in backward.

Megatron's sequence parallelism (Korthikanti et al. 2022) keeps a layer's normalised input cut
over the sequence on the tensor axis and all-gathers it before each column-parallel matmul. The
matmul keeps its input for the weight gradient; kept as gathered, that copy is ``t`` times the
shard, for every layer and every microbatch in flight (at 405B with TP8 on a 16-stage pipeline,
about 60 GB of the 89 GB a device needs). Megatron instead saves the shard and all-gathers it
again in backward. Partita does the same for any activation edge that qualifies
(:func:`regathers_activation`):

* the value is an op's output (an *activation*; weights have ZeRO-3, :mod:`runtime.regather`);
* the edge's forward moves only gather (``Shard -> Replicate``) or cut locally
  (``Replicate -> Shard``) on axes of more than one device, at least one gathering: the shard is
  smaller than the copy, and the moves can run again from it (no partial sums);
* the consumer keeps that input for backward (:meth:`passes.rules.base.OpRule.keeps_saved_input`);
* outside recomputed layers (whose checkpoint holds its own saved-tensor hooks: the caller
  decides, as for ZeRO-3 weights).

Priced and run as planned: the edge's buffer is not kept (a forward transient); the shard is
kept (a saved activation of the producer, counted once with any other save of it); backward
runs the edge's forward moves once more (collectives of phase ``bwd`` marked ``regather``,
alive as a backward transient while the consumer's backward runs); the runtime's
:class:`runtime.reshard.Reshard` registers the copy with :mod:`runtime.regather`, whose
saved-tensor hooks keep the recipe instead of the copy.

When: only where it is needed. :func:`partitioner.intra_op.plan_captured` plans without it
first and, when no plan fits the memory budget, plans again with it (the extra gathers only add
time). The plan's records name the inputs so kept (``regather_inputs``), which the lowering
reads.
"""

from __future__ import annotations

import logging

from passes.analysis.analyze import info
from passes.core.placements import is_shard, transition_steps
from passes.rules import rule_for

__all__ = ["regathers_activation"]

logger = logging.getLogger(__name__)


def regathers_activation(consumer, k: int, producer, src, dst, mesh_shape) -> bool:
    """Whether input ``k`` of ``consumer``, ``producer``'s value moving ``src -> dst``, is kept as
    its shard and gathered again in backward (the module docstring's conditions, recomputation
    aside)."""
    if src is None or dst is None or info(producer).kind != "op":
        return False
    saves = info(consumer).saves
    if saves is None or k not in saves.inputs or not rule_for(consumer).keeps_saved_input(consumer, k, dst):
        return False
    moves = [(p, q) for a, p, q in transition_steps(tuple(src), tuple(dst)) if mesh_shape[a] > 1]
    gathers = [is_shard(p) and not is_shard(q) and not q.is_partial() for p, q in moves]
    slices = [not is_shard(p) and not p.is_partial() and is_shard(q) for p, q in moves]
    return any(gathers) and all(g or s for g, s in zip(gathers, slices))
