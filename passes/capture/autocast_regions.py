"""Regions a model runs under another autocast state, made ordinary nodes of the graph.

Captured under ``torch.autocast`` (mixed precision), a region the model runs with autocast
switched off or set otherwise (Nemotron's ``LayerNorm1P``: ``with autocast(enabled=False):
layer_norm(...)``) is exported as one ``wrap_with_autocast`` call of a sub-graph: an op no rule
knows, whose body is a module attribute lowering cannot place. :func:`inline_autocast_regions`
copies each body into the graph in place of its call (bodies inside bodies first), and marks every
copied node with the region's state (``node.meta[AUTOCAST_KEY]``: device type, dtype, enabled,
cache), so the planner sees plain aten ops, with the dtypes export computed them in, and lowering
runs each marked node inside that state (:mod:`runtime.autocast_state` entered before it and left
after it, :mod:`passes.lower.lower_to_local`). An inner region's mark wins over an outer one's.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from passes.capture.errors import CaptureError

__all__ = ["AUTOCAST_KEY", "inline_autocast_regions"]

AUTOCAST_KEY = "partita.autocast"
"""node meta: ``(device type, dtype, enabled, cache enabled)`` of the region the node runs in"""

_WRAP = torch.ops.higher_order.wrap_with_autocast


def inline_autocast_regions(gm: fx.GraphModule) -> None:
    """Replace every ``wrap_with_autocast`` call of ``gm`` by its body's nodes, marked (in place)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _WRAP:
            _inline(gm, node)
    gm.graph.lint()
    gm.recompile()


def _inline(gm: fx.GraphModule, call: fx.Node) -> None:
    device_type, dtype, enabled, cache, body_node, *operands = call.args
    assert isinstance(body_node, fx.Node) and isinstance(body_node.target, str), body_node
    body = getattr(gm, body_node.target)
    inline_autocast_regions(body)
    state = (device_type, dtype, enabled, cache)
    stack = call.meta.get("nn_module_stack")
    env: dict = {}
    inputs = iter(operands)
    outputs: Any = None
    with gm.graph.inserting_before(call):
        for n in body.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(inputs)
            elif n.op == "output":
                outputs = fx.map_arg(n.args[0], env.__getitem__)
            elif n.op == "call_function":
                copy = gm.graph.node_copy(n, env.__getitem__)
                copy.meta.setdefault(AUTOCAST_KEY, state)
                if stack is not None:
                    copy.meta.setdefault("nn_module_stack", stack)
                env[n] = copy
            else:
                raise CaptureError(
                    f"the autocast region {call.name} (a `with torch.autocast(...)` block in the model) holds a "
                    f"{n.op} node ({n.name}); only ops are inlined: capture without autocast (precision='fp32') "
                    "or move that module call out of the block"
                )
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
    if call.users:
        raise CaptureError(
            f"the autocast region {call.name} (a `with torch.autocast(...)` block in the model) is read other "
            f"than by its outputs' getitems ({[u.name for u in call.users]}); capture without autocast "
            "(precision='fp32')"
        )
    gm.graph.erase_node(call)
    if not body_node.users:
        gm.graph.erase_node(body_node)
        delattr(gm, body_node.target)
