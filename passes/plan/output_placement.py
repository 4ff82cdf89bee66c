"""The placement each program output must leave in (the loss replicated; a pipeline stage's
outputs as placed for the next stage)."""

from __future__ import annotations

import logging

import torch.fx as fx

from passes.analysis.analyze import info
from passes.core.placements import dual_spec, replicated
from passes.rules import tensor_input_nodes

logger = logging.getLogger(__name__)


STAGE_BOUNDARY = "partita_stage_boundary"
"""Key set (True) in the output node's meta of a pipeline stage whose outputs feed later stages."""


def required_output_spec(graph: fx.Graph, index: int, placed):
    """The placement output ``index`` (among the output node's tensor inputs) must leave the
    program in, given the placement ``placed`` its producer has; ``None``: it leaves as placed.

    Every rank must see the same loss, so scalar outputs are always replicated. When the model
    returns a scalar (a training loss), its other outputs (logits, hidden states) are left where
    the plan puts them, as Megatron leaves vocab-parallel logits: gathering them every step would
    cost more than the rest of the step. A model with no scalar output has all its outputs
    replicated, except a pipeline stage (:data:`STAGE_BOUNDARY`): its outputs go to the next
    stage as placed, partial sums reduced first (:func:`passes.core.placements.dual_spec`), so a rank
    sends its own piece to the rank at the same sub-mesh coordinates of the next stage.
    """
    out = next(n for n in graph.nodes if n.op == "output")
    values = tensor_input_nodes(out)
    if info(values[index]).shape == ():
        return replicated(len(placed))
    if out.meta.get(STAGE_BOUNDARY):
        return dual_spec(placed)
    if any(info(n).shape == () for n in values):
        return None
    return replicated(len(placed))
