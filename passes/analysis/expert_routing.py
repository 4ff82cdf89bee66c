"""The router's load on the example batch: routed (token, expert) pairs per expert, per MoE layer.

Expert parallelism computes, on each rank, the pairs routed to its experts, so its busiest rank
does ``imbalance`` times the mean work, ``imbalance = max / mean`` of the pairs per group of
experts a rank holds (:func:`passes.rules.experts.imbalance`). Routing depends on the weights
and the data, not on shapes, so it is measured: the model runs forward once on the example
batch (``torch.no_grad``) with a hook on each experts module the capture turned into
``partita.moe_experts`` (:mod:`passes.capture.experts_op`), counting its ``top_k_index`` per
expert, and each experts node of the graph gets its module's counts in
``node.meta["partita.routing"]`` (and the pairs computed, capped at the expert capacity, in
``node.meta["partita.kept"]``). The random number generators are restored afterwards, so the
measurement draws nothing from the caller's streams (dropout masks). A model on ``meta`` has
no values to route: nothing is measured and the imbalance is taken as 1.0 (the plan says so).
A capture made with an expert capacity is measured with the same token dropping (so each layer's
router sees the hidden states the run computes); the counts are the pairs routed, before dropping.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from passes.analysis.analyze import module_path_of
from passes.capture.capture import _split_inputs, training_configs
from passes.capture.experts_op import MOE_OP, experts_as_ops, why_not_op
from passes.rules.experts import KEPT_KEY, ROUTING_KEY, measured_kept

logger = logging.getLogger(__name__)

__all__ = ["measure_routing", "routing_of"]


def _experts_nodes(graph) -> list:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is MOE_OP]


def measure_routing(model: torch.nn.Module, example_inputs, cap) -> dict:
    """Annotate ``cap``'s experts nodes with their routed pairs per expert on ``example_inputs``
    (module docstring); returns ``{node name: [pairs per expert]}`` (empty: nothing measured)."""
    nodes = _experts_nodes(cap.graph)
    params = list(model.parameters())
    if not nodes or not params or params[0].is_meta:
        return {}
    loads: dict = {}

    def hook_for(path, experts):
        def record(_module, args):
            index = args[1] if len(args) > 1 else None
            if isinstance(index, torch.Tensor):
                counts = torch.bincount(index.reshape(-1).to("cpu"), minlength=experts)
                loads[path] = [a + int(b) for a, b in zip(loads.get(path, [0] * experts), counts.tolist())]

        return record

    hooks = [
        module.register_forward_pre_hook(hook_for(path, module.gate_up_proj.shape[0]))
        for path, module in model.named_modules()
        if hasattr(module, "gate_up_proj") and why_not_op(module) is None
    ]
    args, kwargs = _split_inputs(example_inputs)
    try:
        # under the capture's token dropping, so later layers see the hidden states the run computes
        capacity = getattr(cap, "expert_capacity", None)
        dropping = experts_as_ops(model, capacity) if capacity is not None else contextlib.nullcontext()
        with torch.no_grad(), training_configs(model), torch.random.fork_rng(), dropping:
            model(*args, **kwargs)  # the caller's random streams (dropout) are left as they were
    finally:
        for h in hooks:
            h.remove()
    found = {}
    for node in nodes:
        path = module_path_of(node)
        if path in loads:
            node.meta[ROUTING_KEY] = loads[path]
            node.meta[KEPT_KEY] = measured_kept(loads[path], capacity)
            found[node.name] = loads[path]
    logger.info("routing measured on the example batch for %d of %d MoE layers", len(found), len(nodes))
    return found


def routing_of(graph) -> dict:
    """``{node name: [pairs per expert]}`` of the experts nodes measured in ``graph``."""
    return {n.name: n.meta[ROUTING_KEY] for n in _experts_nodes(graph) if ROUTING_KEY in n.meta}
