"""Coordinates for a :class:`partitioner.plan_graph.PlanGraph`: a small layered layout.

The report draws the plan's graph itself (no Graphviz needed to open or to write it):

1. **Layers**: a node's layer is the longest path to it from the graph's sources; a source
   (a parameter, an input) then moves down to just above its first consumer, so weights sit
   beside the op that uses them instead of all in the first row.
2. **Order in a layer**: graph order, then four sweeps of the barycenter heuristic (down by
   the mean position of a node's producers, up by that of its consumers), which removes most
   edge crossings of a transformer layer's chain-with-branches shape.
3. **Coordinates**: boxes sized by their longest text line, packed left to right in each
   layer, each layer centred on the widest; blocks of identical layers get the bounding box
   of their boxes (drawn as a dashed cluster).

Edges run from the bottom of the producer's box to the top of the consumer's. Everything is
plain numbers in the report's JSON; the page's script only draws them.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["layout_graph"]

_ROW = 92  # vertical distance between layers (px)
_GAP = 36  # horizontal gap between boxes (room for the collectives written beside the edges)
_CHAR = 6.6  # px per character at the boxes' font size
_HEIGHT = 50


def _layers(names: list, preds: dict, succs: dict) -> dict:
    layer: dict = {}
    for n in names:  # graph order is a topological order
        layer[n] = 1 + max((layer[p] for p in preds[n]), default=-1)
    for n in names:
        if not preds[n] and succs[n]:
            layer[n] = max(0, min(layer[s] for s in succs[n]) - 1)
    return layer


def _order(names: list, layer: dict, preds: dict, succs: dict) -> dict:
    rows = defaultdict(list)
    for n in names:
        rows[layer[n]].append(n)
    pos = {n: i for row in rows.values() for i, n in enumerate(row)}
    for sweep in range(4):
        neighbours = preds if sweep % 2 == 0 else succs
        for key in sorted(rows, reverse=sweep % 2 == 1):
            row = rows[key]
            bary = {
                n: (sum(pos[m] for m in neighbours[n]) / len(neighbours[n]) if neighbours[n] else pos[n]) for n in row
            }
            row.sort(key=lambda n: (bary[n], pos[n]))
            pos.update({n: i for i, n in enumerate(row)})
    return rows


def layout_graph(graph) -> dict:
    """``{"width", "height", "nodes": [...], "edges": [...], "clusters": [...]}`` in pixels."""
    names = [n.name for n in graph.nodes]
    if any(e.dst == "output" for e in graph.edges):
        names.append("output")
    known = set(names)
    edges = [e for e in graph.edges if e.src in known and e.dst in known and e.src != e.dst]
    preds, succs = defaultdict(list), defaultdict(list)
    for e in edges:
        preds[e.dst].append(e.src)
        succs[e.src].append(e.dst)
    layer = _layers(names, preds, succs)
    rows = _order(names, layer, preds, succs)
    by_name = {n.name: n for n in graph.nodes}

    def width(name) -> float:
        node = by_name.get(name)
        folded = f"  (+{node.folded_rows} mask/index)" if node and node.folded_rows else ""
        lines = [node.title, node.op, node.placement + folded] if node else ["output"]
        return max(70.0, max(len(t) for t in lines) * _CHAR + 16)

    widths = {n: width(n) for n in names}
    row_width = {k: sum(widths[n] for n in row) + _GAP * (len(row) - 1) for k, row in rows.items()}
    total = max(row_width.values(), default=0.0)
    box = {}
    for k, row in rows.items():
        x = 20 + (total - row_width[k]) / 2
        for n in row:
            box[n] = (x, 40 + k * _ROW, widths[n], _HEIGHT)
            x += widths[n] + _GAP
    nodes = [{"name": n, "x": box[n][0], "y": box[n][1], "w": box[n][2], "h": box[n][3]} for n in names]
    clusters = []
    for label, note in graph.clusters.items():
        inside = [box[n.name] for n in graph.nodes if n.block == label]
        x0, y0 = min(b[0] for b in inside) - 10, min(b[1] for b in inside) - 26
        x1, y1 = max(b[0] + b[2] for b in inside) + 10, max(b[1] + b[3] for b in inside) + 10
        clusters.append({"label": label, "note": note, "x": x0, "y": y0, "w": x1 - x0, "h": y1 - y0})
    drawn = []
    for e in edges:
        (sx, sy, sw, sh), (tx, ty, tw, _) = box[e.src], box[e.dst]
        drawn.append(
            {
                "src": e.src,
                "dst": e.dst,
                "x1": sx + sw / 2,
                "y1": sy + sh,
                "x2": tx + tw / 2,
                "y2": ty,
                "collectives": e.collectives,
                "from_layer": e.from_layer,
                "mask_index": e.mask_index,
            }
        )
    height = 40 + (max(layer.values(), default=0) + 1) * _ROW
    return {"width": total + 240, "height": height, "nodes": nodes, "edges": drawn, "clusters": clusters}
