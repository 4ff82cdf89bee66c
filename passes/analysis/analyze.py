"""Analysis pass: what each node is, its shapes, FLOPs and bytes, and its module path.

Writes ``node.meta["partita.info"]`` (a :class:`NodeInfo`) on every node of a captured graph:
the node's kind (parameter, buffer, input, op, output, or an ignored assertion), the
parameter / buffer / argument name, the innermost module path from ``nn_module_stack`` (so
plans read in the user's terms), output shapes and dtype, forward FLOPs from the op's rule,
whether a gradient flows through it (forward: an input needs one; backward: its value reaches an
output, :mod:`passes.analysis.gradient_reach`), and what backward keeps: each op's saved inputs, outputs
and buffers (:mod:`passes.analysis.saved_tensors`, found by running the op on fake tensors), and on each
value whose storage some op keeps (following views to the value that owns the storage), ``saved``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from passes.analysis.gradient_reach import prune_unreached_gradients
from passes.analysis.mutated_aliases import alias_classes
from passes.analysis.saved_tensors import saves_of
from passes.capture.capture import CapturedGraph
from passes.core.node_info import META_KEY, NodeInfo, info
from passes.rules import IGNORED_OPS, op_view, rate_key, rule_for, tensor_input_nodes

__all__ = ["NodeInfo", "analyze", "info", "storage_owner"]


def _shapes(val):
    vals = val if isinstance(val, (list, tuple)) else [val]
    return tuple(tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in vals)


def _dtype(val):
    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor):
            return v.dtype
    return None


def module_path_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else str(path)


def analyze(cap: CapturedGraph) -> None:
    """Annotate every node of ``cap.graph`` in place."""
    for node in cap.graph.nodes:
        val = node.meta.get("val")
        shapes, dtype = _shapes(val), _dtype(val)
        if node.op == "placeholder":
            if node.name in cap.params:
                fqn = cap.params[node.name]
                frozen = not getattr(val, "requires_grad", True)  # requires_grad=False: no gradient, no training
                node.meta[META_KEY] = NodeInfo(
                    "param", fqn, fqn.rpartition(".")[0], shapes, dtype, requires_grad=not frozen
                )
            elif node.name in cap.buffers:
                fqn = cap.buffers[node.name]
                node.meta[META_KEY] = NodeInfo("buffer", fqn, fqn.rpartition(".")[0], shapes, dtype)
            else:
                name = cap.input_names.get(node.name, node.name)
                node.meta[META_KEY] = NodeInfo("input", name, "", shapes, dtype)
        elif node.op == "output":
            node.meta[META_KEY] = NodeInfo("output", "output", "", (), None)
        elif node.op == "call_function" and (node.target in IGNORED_OPS or val is None):
            node.meta[META_KEY] = NodeInfo("ignored", node.name, module_path_of(node), (), None)
        else:
            rule = rule_for(node)
            node.meta[META_KEY] = NodeInfo(
                "op",
                node.name,
                module_path_of(node),
                shapes,
                dtype,
                flops=rule.flops(op_view(node)),
                requires_grad=_gets_grad(node, dtype),
                rate_key=rate_key(node),
            )
    _grads_through_writes(cap.graph)
    prune_unreached_gradients(cap.graph)
    autocast = getattr(cap, "autocast_dtype", None)
    for node in cap.graph.nodes:
        i = info(node)
        if node.op == "call_function" and i.kind == "op":  # an op no gradient reaches keeps nothing
            input_grads = [i.requires_grad and info(a).requires_grad for a in tensor_input_nodes(node)]
            i.saves = saves_of(node, input_grads, autocast)
    for node in cap.graph.nodes:
        saves = info(node).saves
        if saves is None:
            continue
        inputs = tensor_input_nodes(node)
        for k in saves.inputs:
            info(storage_owner(inputs[k])).saved = True
        if saves.outputs:
            info(node).saved = True


def _floating(dtype) -> bool:
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)  # fft: complex grads


def _gets_grad(node: fx.Node, dtype) -> bool:
    """Autograd records ``node``: an input it reads data from needs a gradient (not one it reads
    only the metadata of, ``OpRule.metadata_inputs``), its output is floating point, its rule
    passes one back."""
    rule = rule_for(node)
    if rule.metadata_inputs:
        data = [a for k, a in enumerate(tensor_input_nodes(node)) if k not in rule.metadata_inputs]
    else:
        data = [a for a in node.all_input_nodes if isinstance(a, fx.Node)]
    grads = any(info(a).requires_grad for a in data)
    return grads and _floating(dtype) and rule.differentiable


def _grads_through_writes(graph: fx.Graph) -> None:
    """A value that needs a gradient written in place into another tensor (RecurrentGemma's scan:
    ``out = zeros_like(x)``, ``out[:, t] = h``) makes that tensor and every alias of it carry
    one, though it was made from nothing that needs one; so do, in turn, the ops reading them.
    Without this the edges out of ``out`` carry no gradient and a partial one sent back along
    them is never summed: a silently wrong gradient upstream. Repeated until nothing changes."""
    classes, writers = alias_classes(graph)
    if not writers:  # nothing written in place: the forward walk in analyze() already settled every node
        return
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            i = info(node)
            if i.kind == "op" and not i.requires_grad and _gets_grad(node, i.dtype):
                i.requires_grad = changed = True
        for writer in writers:
            if info(writer).requires_grad:
                for member in classes[writer]:
                    m = info(member)
                    if m.kind == "op" and not m.requires_grad and _floating(m.dtype):
                        m.requires_grad = changed = True


def storage_owner(node: fx.Node) -> fx.Node:
    """The node whose output storage ``node``'s value lives in (itself unless it is a view)."""
    while True:
        saves = info(node).saves
        if saves is None or saves.alias is None:
            return node
        node = tensor_input_nodes(node)[0 if node.target is operator.getitem else saves.alias]
