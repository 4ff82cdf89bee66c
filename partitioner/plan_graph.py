"""A plan as a drawable graph: the boxes, edges and layer clusters both pictures draw.

``plan_graph(plan)`` decides *what* is drawn; :mod:`partitioner.plan_dot` writes it as Graphviz
source (``graph.svg`` in a dump) and :mod:`partitioner.report` lays it out in the HTML report.
The graph shows the rows the plan table shows (:func:`partitioner.plan_table.shown_rows`):

* a block of identical layers is drawn once, as a cluster for its first layer labelled with
  the layers it stands for ("h.1-h.11 same as h.0"). An edge from a later layer to a node
  outside the block (the last layer into the final norm) is drawn from the first layer's
  counterpart, dashed, and labelled with the layer it comes from; edges into later layers are
  not drawn (the first layer's show them). So a 12-layer model draws as many boxes as a
  one-layer one;
* views and getitems are bridged: an edge from one starts at the node the view reads;
* mask and index rows are left out; the box of the node that uses them counts them, and a
  dotted edge joins it to the model inputs they are computed from (labels, token ids).

Each box is coloured by its output placement (one colour per distinct placement, in order of
first appearance: ``legend``); an edge that communicates carries its collectives
(``AR@tp(bwd)``). ``verbose=True`` draws every node of the first layer of each block, views and
mask rows included.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from partitioner.plan_table import SHORT, block_first_index, hidden_view, mask_index_rows, shown_rows
from passes.core.plan_records import NodeRecord

__all__ = ["PALETTE", "GraphNode", "GraphEdge", "PlanGraph", "plan_graph", "counterparts", "layers_note"]

PALETTE = [
    "#cfe2f3",
    "#d9ead3",
    "#fff2cc",
    "#f4cccc",
    "#d9d2e9",
    "#fce5cd",
    "#d0e0e3",
    "#ead1dc",
    "#b6d7a8",
    "#a4c2f4",
    "#ffe599",
    "#ea9999",
]


@dataclass
class GraphNode:
    name: str
    """The record's node name (the output node is ``"output"``)."""
    title: str
    """What the box says first: a parameter's or input's FQN, else the node name."""
    op: str
    placement: str
    colour: str
    block: str | None = None
    folded_rows: int = 0
    """Mask/index rows folded into this node (not drawn)."""


@dataclass
class GraphEdge:
    src: str
    dst: str
    collectives: list = field(default_factory=list)
    """``["AR@tp(bwd)", ...]``: what the edge sends."""
    from_layer: str | None = None
    """The later layer of a block the value comes from (drawn from the first layer's node)."""
    mask_index: bool = False
    """A dotted edge standing for folded mask/index rows."""


@dataclass
class PlanGraph:
    nodes: list
    edges: list
    clusters: dict
    """Block label -> its note (``"h.0: 12 identical blocks; h.1-h.11 same as h.0"``)."""
    legend: dict
    """Placement -> colour, in order of first appearance."""
    folded: int = 0
    """Mask/index rows left out."""


def counterparts(records: Sequence[NodeRecord]) -> dict:
    """Each node of a later layer of a block -> the node at the same position in its first layer."""
    layers = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.block is not None:
            layers[r.block][r.block_index].append(r.name)
    out = {}
    for label, by_index in layers.items():
        first = by_index.get(block_first_index(label), [])
        for index, names in by_index.items():
            if index != block_first_index(label) and len(names) == len(first):
                out.update(zip(names, first, strict=True))
    return out


def layers_note(block: dict) -> str:
    """``"h.[0-11]"`` -> ``"h.0: 12 identical blocks; h.1-h.11 same as h.0"``."""
    prefix, label = block["prefix"], block["label"]
    first = block_first_index(label)
    last = label.rsplit("[", 1)[1].rstrip("]").split("-")[-1]
    rest = f"{prefix}.{first + 1}" + (f"-{prefix}.{last}" if int(last) > first + 1 else "")
    return f"{prefix}.{first}: {block['count']} identical blocks; {rest} same as {prefix}.{first}"


def _nodes(plan, rows, folded) -> tuple:
    legend, nodes = {}, []
    folded_into = Counter(folded.values())
    for r in rows:
        placement = r.out[0] if r.out else "-"
        colour = legend.setdefault(placement, PALETTE[len(legend) % len(PALETTE)])
        title = r.fqn if r.kind in ("param", "input", "buffer") and r.fqn else r.name
        nodes.append(
            GraphNode(
                r.name,
                title,
                r.target.replace("aten.", ""),
                placement,
                colour,
                r.block,
                folded_into.get(r.name, 0),
            )
        )
    return nodes, legend


def plan_graph(plan, *, include_params: bool = True, verbose: bool = False) -> PlanGraph:
    """What to draw for ``plan`` (see the module docstring)."""
    by_name = plan.node_by_name
    rows = [r for r in shown_rows(plan, verbose=verbose) if include_params or r.kind != "param"]
    shown = {r.name for r in rows}
    folded = {} if verbose else mask_index_rows(plan.node_records)
    counterpart = counterparts(plan.node_records)
    blocks = {b["label"]: b for b in plan.data.get("blocks", [])}

    def inputs_behind(name) -> set:
        """The drawn model inputs (token ids, labels) a folded mask/index row is computed from."""
        found, stack, seen = set(), [name], set()
        while stack:
            n = stack.pop()
            for src in by_name[n].inputs:
                if src in shown and by_name[src].kind == "input":
                    found.add(src)
                elif src in folded and src not in seen:
                    seen.add(src)
                    stack.append(src)
        return found

    def source(name, seen=()):
        """(node drawn for the value ``name``, the later layer it comes from or None)."""
        if name in shown:
            return name, None
        if name in folded or name in seen or name not in by_name:
            return None, None
        r = by_name[name]
        if name in counterpart:
            drawn, _ = source(counterpart[name], seen + (name,))
            return drawn, f"{r.block.rsplit('.[', 1)[0]}.{r.block_index}"
        if hidden_view(r) and r.inputs:
            return source(r.inputs[0], seen + (name,))
        return None, None

    nodes, legend = _nodes(plan, rows, folded)
    edges, seen_edges = [], set()

    def add(edge: GraphEdge) -> None:
        key = (edge.src, edge.dst, tuple(edge.collectives), edge.from_layer, edge.mask_index)
        if key not in seen_edges:
            seen_edges.add(key)
            edges.append(edge)

    for r in rows + [r for r in plan.node_records if r.kind == "output"]:
        dst = r.name if r.kind != "output" else "output"
        for k, src in enumerate(r.inputs):
            if src in folded:  # the inputs the folded rows read, drawn dotted
                for drawn in sorted(inputs_behind(src)):
                    add(GraphEdge(drawn, dst, mask_index=True))
                continue
            drawn, layer = source(src)
            if drawn is None:
                continue
            comm = [f"{SHORT.get(c.kind, c.kind)}@{c.axis}({c.phase})" for c in r.comm if c.input == k]
            add(GraphEdge(drawn, dst, comm, layer))
    clusters = {}
    for node in nodes:
        if node.block is not None and node.block not in clusters:
            block = blocks.get(node.block, {"label": node.block, "prefix": node.block.rsplit(".[", 1)[0], "count": "?"})
            clusters[node.block] = layers_note(block)
    return PlanGraph(nodes, edges, clusters, legend, 0 if verbose else len(folded))
