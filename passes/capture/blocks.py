"""Repeated-block detection: transformer layers that are the same program.

Nodes are grouped by the outermost module path of the form ``prefix.<index>`` in their
``nn_module_stack`` (``model.layers.7``); parameters by their FQN. For each prefix with
several indices, a block's signature lists, in graph order, each node's op, output shapes,
and arguments written relative to the block (``local i``, ``param suffix``, ``outside``, or
the literal). When every index has the same signature the blocks are one program: node i of
block k is represented by node i of the first block, and the planner decides once for all
of them (decision 5: depth is nearly free). Blocks whose signatures differ are planned node
by node, which is slower but equally correct.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx as fx

from passes.analysis.analyze import info

__all__ = ["BlockGroup", "Blocks", "find_blocks"]

_INDEXED = re.compile(r"^(.*)\.(\d+)$")
_LIFTED = re.compile(r"lifted_tensor_\d+")
"""Constants a layer creates in its forward are lifted by export with one global counter
(``h.0.attn.lifted_tensor_0``, ``h.1.attn.lifted_tensor_2``): compared without the number."""


def _local_name(name: str, head: str) -> str:
    return _LIFTED.sub("lifted_tensor", name[len(head) :])


@dataclass
class BlockGroup:
    prefix: str
    indices: list
    members: list
    """members[k] = the nodes of block indices[k], in graph order (params first)."""

    @property
    def label(self) -> str:
        return f"{self.prefix}.[{self.indices[0]}-{self.indices[-1]}]"


@dataclass
class Blocks:
    rep: dict = field(default_factory=dict)
    """node -> the node that decides for it (itself outside repeated blocks)."""
    count: dict = field(default_factory=dict)
    """representative -> how many nodes it decides for."""
    groups: list = field(default_factory=list)
    block_of: dict = field(default_factory=dict)
    """node -> (BlockGroup, position k) for nodes inside a repeated block."""

    def represent(self, node):
        return self.rep.get(node, node)


def _block_key(node: fx.Node, prefixes=None):
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in stack.values():
        path = path if isinstance(path, str) else str(path)
        m = _INDEXED.match(path)
        if m:
            return m.group(1), int(m.group(2))
    return None


def _signature(members: list, prefix: str, index: int):
    position = {n: i for i, n in enumerate(members)}
    head = f"{prefix}.{index}."

    def ref(a):
        if isinstance(a, fx.Node):
            if a in position:
                return ("local", position[a])
            return ("outside",)
        if isinstance(a, (list, tuple)):
            return tuple(ref(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, ref(v)) for k, v in a.items())
        return repr(a)

    sig: list[tuple] = []
    for n in members:
        i = info(n)
        if n.op == "placeholder":
            sig.append(("param", _local_name(i.name, head), i.out_shapes))
        else:
            sig.append((str(n.target), i.out_shapes, ref(n.args), ref(n.kwargs)))
    return tuple(sig)


def _in_layer_order(nodes: list, head: str, order: dict) -> list:
    """One layer's parameter placeholders, by their name inside the layer (then graph order)."""
    return sorted(nodes, key=lambda n: (_local_name(info(n).name, head), order[n]))


def find_blocks(graph: fx.Graph, *, enabled: bool = True) -> Blocks:
    blocks = Blocks()
    if enabled:
        by_key = defaultdict(list)
        for node in graph.nodes:
            if node.op == "call_function":
                key = _block_key(node)
                if key:
                    by_key[key].append(node)
        prefixes = defaultdict(list)
        for prefix, index in by_key:
            prefixes[prefix].append(index)
        params = defaultdict(list)
        for node in graph.nodes:
            if node.op == "placeholder" and info(node).kind in ("param", "buffer"):
                for prefix in prefixes:
                    m = re.match(re.escape(prefix) + r"\.(\d+)\.", info(node).name)
                    if m:
                        params[(prefix, int(m.group(1)))].append(node)
                        break
        for prefix, indices in prefixes.items():
            indices = sorted(indices)
            if len(indices) < 2:
                continue
            order = {n: i for i, n in enumerate(graph.nodes)}
            members = [
                _in_layer_order(params[(prefix, k)], f"{prefix}.{k}.", order) + by_key[(prefix, k)] for k in indices
            ]
            sigs = [_signature(m, prefix, k) for m, k in zip(members, indices)]
            if any(s != sigs[0] for s in sigs[1:]):
                continue
            group = BlockGroup(prefix, indices, members)
            blocks.groups.append(group)
            for k, nodes in enumerate(members):
                for i, node in enumerate(nodes):
                    blocks.rep[node] = members[0][i]
                    blocks.block_of[node] = (group, k)
    for node in graph.nodes:
        r = blocks.represent(node)
        blocks.count[r] = blocks.count.get(r, 0) + 1
    return blocks
