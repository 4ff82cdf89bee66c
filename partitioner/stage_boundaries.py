"""What crosses a pipeline stage boundary: the placement a stage sends each activation in, the
weights several stages use, and the one loop that plans stages in turn across their boundaries.

Both the pipeline builder (:mod:`partitioner.pipeline_parallelize`, every stage in order) and the
configuration search (:mod:`partitioner.search`, which plans a pipelined candidate's stage
classes: the middle ones first, then the first and the last) plan stages with
:func:`plan_stages_in_turn`, so they live here, below both.
"""

from __future__ import annotations

import torch.fx as fx

from passes.capture.capture import tied_placeholders
from passes.core.placements import dual_spec, format_spec, parse_spec

__all__ = ["sent_placements", "shared_weights", "plan_stages_in_turn"]


def sent_placements(graph, plan, ndim) -> dict:
    """Activation name (as later stages call it) -> the placement this stage sends it in: where
    its plan put the value, partial sums reduced (what lowering does at a stage boundary)."""
    records = plan.node_by_name
    returned = graph.captured.graph.find_nodes(op="output")[0].args[0]
    returned = returned if isinstance(returned, (list, tuple)) else [returned]
    out = {}
    for node, name in zip(returned, graph.outputs):
        record = records.get(node.name) if isinstance(node, fx.Node) else None
        if name is not None and record is not None and record.out:
            out[name] = format_spec(dual_spec(parse_spec(record.out[0], ndim)))
    return out


def shared_weights(cap, graphs) -> list:
    """Weights used by several stages (one placeholder used twice, or tied names of one tensor),
    as sets of placeholder names."""
    tied = [set(names) for names in tied_placeholders(cap)]
    for name in cap.params:
        if sum(name in g.inputs for g in graphs) > 1 and not any(name in t for t in tied):
            tied.append({name})
    return tied


def plan_stages_in_turn(graphs, order, ndim: int, tied_names: set, plan_one, more_pins=None) -> tuple:
    """Plan the stage graphs ``graphs[k]`` for ``k`` in ``order``: each with its shared weights
    (``tied_names``) pinned replicated, ``more_pins(k, plans so far)``'s pins (a user's, or what
    the next stage takes), and its activation inputs pinned to the placement the stage that
    produces them sends them in, when that stage was planned before it. ``plan_one(k, graph,
    pins)`` plans one. Returns (plans by ``k``, activation name -> the placement it is sent in)."""
    plans: dict = {}
    sent_as: dict = {}
    for k in order:
        g = graphs[k]
        pins = {name: ["R"] * ndim for name in g.inputs if name in tied_names}
        if more_pins is not None:
            pins.update(more_pins(k, plans))
        pins.update({name: sent_as[name] for name in g.activation_inputs if name in sent_as})
        plans[k] = plan_one(k, g, pins)
        sent_as.update(sent_placements(g, plans[k], ndim))
    return plans, sent_as
