"""A plan as a Graphviz picture (``graph.dot``, drawn to ``graph.svg`` by ``partitioner.dump``).

One box per node, coloured by its output placement, with a legend of colour swatches; every
edge that communicates is red and labelled with its collectives (``AR@tp(bwd)``). What is drawn
(repeated layers once, views bridged, mask and index rows folded) is decided by
:func:`partitioner.plan_graph.plan_graph`; this module only writes it as Graphviz source. The
title names the mesh axes with their roles (:func:`partitioner.axis_roles.axis_roles`).
"""

from __future__ import annotations

import html

from partitioner.axis_roles import axis_roles
from partitioner.plan_graph import plan_graph

__all__ = ["plan_to_dot"]


def _legend(graph) -> str:
    """An HTML-like Graphviz table: one colour swatch per placement."""
    rows = "".join(
        f'<TR><TD BGCOLOR="{colour}" WIDTH="18"> </TD><TD ALIGN="LEFT">{html.escape(placement)}</TD></TR>'
        for placement, colour in graph.legend.items()
    )
    if graph.folded:
        rows += (
            f'<TR><TD COLSPAN="2" ALIGN="LEFT">{graph.folded} mask/index rows not drawn<BR ALIGN="LEFT"/>'
            f'(counted on the node using them)<BR ALIGN="LEFT"/></TD></TR>'
        )
    return (
        '  legend [shape=plaintext, style="", label=<<TABLE BORDER="1" CELLBORDER="0" CELLSPACING="2" '
        f'BGCOLOR="white"><TR><TD COLSPAN="2"><B>placements (colours)</B></TD></TR>{rows}</TABLE>>];'
    )


def plan_to_dot(plan, *, include_params: bool = True, verbose: bool = False) -> str:
    """Graphviz source for ``plan`` (see the module docstring)."""
    graph = plan_graph(plan, include_params=include_params, verbose=verbose)
    lines = [
        "digraph partita_plan {",
        '  rankdir=TB; node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        f'  label="{html.escape(plan.data.get("model", "?"))} on mesh {plan.mesh_shape} '
        f'({html.escape(axis_roles(plan))})"; labelloc=t;',
    ]
    by_block: dict = {}
    for node in graph.nodes:
        label = f"{node.title}\\n{node.op}\\n{node.placement}"
        if node.folded_rows:
            label += f"\\n(+{node.folded_rows} mask/index rows)"
        by_block.setdefault(node.block, []).append(
            f'"{node.name}" [label="{html.escape(label)}", fillcolor="{node.colour}"];'
        )
    for i, (label, nodes) in enumerate(by_block.items()):
        if label is None:
            lines += [f"  {n}" for n in nodes]
            continue
        lines.append(
            f'  subgraph cluster_{i} {{ label="{html.escape(graph.clusters[label])}"; style="rounded,dashed"; '
            f'color="#666666"; fontname="Helvetica";'
        )
        lines += [f"    {n}" for n in nodes]
        lines.append("  }")
    for edge in graph.edges:
        attrs = []
        if edge.mask_index:
            attrs = ["style=dotted", 'label="mask/index"']
        elif edge.collectives:
            where = f" from {html.escape(edge.from_layer)}" if edge.from_layer else ""
            attrs = (["style=dashed"] if edge.from_layer else []) + [
                "color=red",
                "penwidth=2",
                "fontcolor=red",
                f'label="{" ".join(edge.collectives)}{where}"',
            ]
        elif edge.from_layer:
            attrs = ["style=dashed", f'label="from {html.escape(edge.from_layer)}"']
        lines.append(f'  "{edge.src}" -> "{edge.dst}"' + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    lines.append('  "output" [shape=doubleoctagon, fillcolor="#eeeeee"];')
    lines.append(_legend(graph))
    lines.append("}")
    return "\n".join(lines)
