"""What crosses a pipeline stage boundary: the placement a stage sends each activation in, and
the weights several stages use.

Both the pipeline builder (:mod:`partitioner.pipeline_parallelize`) and the configuration
search (:mod:`partitioner.config_search`, which plans pipelined candidates stage by stage) read
them, so they live here, below both.
"""

from __future__ import annotations

import torch.fx as fx

from passes.capture.capture import tied_placeholders
from passes.core.placements import dual_spec, format_spec, parse_spec

__all__ = ["sent_placements", "shared_weights"]


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
