"""Which ops backward reaches: a gradient flows into an op only if its output leads to an output.

Forward analysis marks an op ``requires_grad`` when one of its inputs needs a gradient and its
output is floating point: what autograd records. Backward runs only where a gradient arrives, so
an op whose value no output of the graph depends on (DeiT's averaged logits, computed and never
returned when the training loss differentiates the two heads separately), and an op read only by
ops that pass no gradient back (a comparison, an ``argmax``), never runs its backward: pricing
one, or the moves of the gradients it would send, over-counts what the step sends and computes.

Algorithm: one walk over the nodes in reverse order (users before producers). An op keeps
``requires_grad`` when it has it from the forward analysis and some user either is the graph's
output node, keeps ``requires_grad`` itself, or may have effects beyond its result (it writes an
argument in place, e.g. ``copy_`` into a slice of a tensor read later, or it is not an aten op
with a schema): the conservative side, since a write's effect reaches the output through the
tensor it writes, not through users. Parameters and inputs keep their flags (the runtime syncs
a parameter's gradient whether or not one arrives). An edge ``u -> v`` carries a gradient when
:func:`passes.core.node_info.grad_flows` says so: both ends need one.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from passes.core.node_info import info

__all__ = ["prune_unreached_gradients"]

logger = logging.getLogger(__name__)


def _may_write(node: fx.Node) -> bool:
    """Whether ``node`` may have effects beyond its result (an in-place write, an unknown op)."""
    if node.op != "call_function":
        return node.op != "output"
    target = node.target
    if target.__module__ == "_operator":  # getitem and friends: plain Python, no effects
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return target._schema.is_mutable


def prune_unreached_gradients(graph: fx.Graph) -> list:
    """Clear ``requires_grad`` on every op whose value reaches no output of ``graph`` through ops
    that pass a gradient back (module docstring); returns the names of the ops cleared."""
    cleared = []
    for node in reversed(graph.nodes):
        i = info(node)
        if i.kind != "op" or not i.requires_grad or _may_write(node):
            continue
        reached = any(u.op == "output" or info(u).requires_grad or _may_write(u) for u in node.users)
        if not reached:
            i.requires_grad = False
            cleared.append(node.name)
    if cleared:
        logger.debug("no gradient reaches %d ops: %s", len(cleared), ", ".join(cleared[:20]))
    return cleared
