"""Which dims of each value carry the pieces of an input dim cut unevenly (the batch, mostly).

A batch that does not divide the data axes is cut into unequal pieces; the values computed from
it hold their own pieces of it on the dims that carry it (the batch dim of every activation, a
flattened batch x sequence dim, the rows of a grouped matmul), in sizes only the run knows. The
other dims (heads, features, a sequence that divides) are cut like ``torch.tensor_split``: their
local sizes follow from the shape. Lowering (``_UnevenPieces``) needs the first kind only.

:func:`carried_dims` walks the graph once, from the input dims given, and maps each op's carried
input dims to its output dims:

* reshapes by their runs of dims (:func:`passes.rules.views.view_groups`): an output dim whose run
  holds a carried input dim carries it; ``permute``/``transpose`` by their permutation; an
  ``expand`` by its dims aligned from the right;
* any other op conservatively: an output dim carries where its size equals a carried input dim's
  size (a matmul's rows, an embedding's ids, a reduction keeping the batch), or where it has a
  carried dim's index in an input of the same rank (a slice, a cat, an index along the batch).

Over-marking is safe (a dim marked that is in fact even takes the uneven moves, or a refusal);
the size test guards the dims a rule-free walk could lose.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.core.node_info import META_KEY, info
from passes.rules import tensor_input_nodes
from passes.rules.views import view_groups

__all__ = ["carried_dims"]

aten = torch.ops.aten
_RESHAPES = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unflatten.int,
    aten.flatten.using_ints,
)
_PERMUTES = (aten.permute.default,)
_TRANSPOSES = (aten.transpose.int,)


def carried_dims(graph: fx.Graph, sources: dict) -> dict:
    """Node -> the dims of its (first) output that carry the pieces of ``sources`` (node -> dims
    cut unevenly there: inputs, or values whose dims do not divide), for every node reached."""
    carried: dict = {}
    for node in graph.nodes:
        dims = set(sources.get(node, ()))
        ins = [u for u in tensor_input_nodes(node) if carried.get(u)] if node.op == "call_function" else []
        if ins:
            dims |= _through(node, ins, carried)
        if dims:
            carried[node] = dims
    return carried


def _shape(node: fx.Node):
    shapes = info(node).out_shapes if META_KEY in node.meta else None
    return tuple(shapes[0]) if shapes and shapes[0] is not None else None


def _through(node: fx.Node, ins: list, carried: dict) -> set:
    """The output dims of ``node`` that carry what its inputs ``ins`` carry."""
    out = _shape(node)
    if out is None:
        return set()
    first = tensor_input_nodes(node)[0]
    src = _shape(first)
    if src is not None and first in ins:
        if node.target in _RESHAPES:
            return {o for i_dims, o_dims in view_groups(src, out) if carried[first] & set(i_dims) for o in o_dims}
        if node.target in _PERMUTES:
            order = [int(i) for i in node.args[1]]  # type: ignore[union-attr,arg-type]
            return {o for o, i in enumerate(order) if i % len(src) in carried[first]}
        if node.target in _TRANSPOSES:
            a, b = (int(d) % len(src) for d in node.args[1:3])  # type: ignore[arg-type]
            swap = {a: b, b: a}
            return {swap.get(d, d) for d in carried[first]}
        if node.target is aten.expand.default:
            lead = len(out) - len(src)
            return {d + lead for d in carried[first]}
    dims: set = set()
    for u in ins:
        shape = _shape(u)
        if shape is None:
            continue
        sizes = {shape[d] for d in carried[u] if d < len(shape)}
        dims |= {e for e, size in enumerate(out) if size in sizes}
        if len(shape) == len(out):
            dims |= {d for d in carried[u] if d < len(out)}
    return dims
