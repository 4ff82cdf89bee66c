"""Tensors written in place, with every view of them: kept replicated, so the writes land.

A captured graph keeps in-place ops where the model writes through a view and then reads the
base (BART's and T5's ``shift_tokens_right``: ``shifted = labels.new_zeros(...)``,
``shifted[:, 1:] = labels[:, :-1]``, ``shifted[:, 0] = start``, ``shifted.masked_fill_(...)``,
``return shifted``). The lowered program gives every edge whose placements differ a copy of
its own, so a view planned in another placement than its base is a copy, the write goes to the
copy, and the base is read unwritten: a silently wrong loss.

Algorithm: aliases are found from the op schemas (a result with alias information is a view of,
or the in-place result of, the schema argument that shares its alias set); they join into alias
classes (union-find). Every class holding a node that writes one of its tensor arguments in
place is pinned whole, output by output, to ``Replicate`` on every axis: then no edge inside it
moves anything, views stay views, and each rank writes its own whole copy the same way. The
tensors such writes touch are small in practice (labels, masks, a step counter); a user pin on
one of them wins.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from passes.core.placements import replicated

logger = logging.getLogger(__name__)

__all__ = ["alias_classes", "mutated_alias_pins"]


def _schema(node: fx.Node):
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return node.target._schema


def _aliased_argument(node: fx.Node, schema) -> fx.Node | None:
    """The argument node ``node``'s result aliases (a view or an in-place result), if any."""
    ret = schema.returns[0].alias_info if schema.returns else None
    if ret is None:
        return None
    for k, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and set(arg.alias_info.before_set) & set(ret.before_set):
            value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, fx.Node) else None
    return None


def _written_arguments(node: fx.Node, schema) -> list:
    """The argument nodes ``node`` writes in place."""
    out = []
    for k, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                out.append(value)
    return out


def _observed(writer: fx.Node, aliases: list, order: dict) -> bool:
    """True when a node after ``writer`` reads its write through another of its ``aliases`` than
    ``writer``'s own result (``x += y; return x`` reads the result: a copy does no harm)."""
    return any(order[user] > order[writer] for member in aliases if member is not writer for user in member.users)


def alias_classes(graph: fx.Graph) -> tuple[dict, list]:
    """``({node: the nodes sharing its storage, in graph order}, [nodes writing an argument in place])``."""
    parent: dict = {}

    def find(n):
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    writers = []
    for node in graph.nodes:
        schema = _schema(node)
        if schema is None:
            continue
        base = _aliased_argument(node, schema)
        if base is not None:
            parent[find(node)] = find(base)
        if _written_arguments(node, schema):
            writers.append(node)
    by_root: dict = {}
    for node in graph.nodes:
        by_root.setdefault(find(node), []).append(node)
    return {node: by_root[find(node)] for node in graph.nodes}, writers


def mutated_alias_pins(graph: fx.Graph, mesh_ndim: int) -> dict:
    """``{node: replicated spec}`` for every node aliasing a tensor some op writes in place."""
    classes, writers = alias_classes(graph)
    order = {n: k for k, n in enumerate(graph.nodes)}
    pinned: dict = {}
    for w in writers:
        if _observed(w, classes[w], order):
            pinned.update({id(n): n for n in classes[w]})
    members = [n for n in graph.nodes if id(n) in pinned and isinstance(n.meta.get("val"), torch.Tensor)]
    if members:
        logger.info("kept replicated, written in place through aliases: %s", ", ".join(n.name for n in members))
    return {n: replicated(mesh_ndim) for n in members}
