"""A plan as a Graphviz picture (``graph.dot``, drawn to ``graph.svg`` by ``partitioner.dump``).

One box per node, coloured by its output placement; every edge that communicates is red and
labelled with its collectives (``AR@tp(bwd)``). The picture shows the rows the plan table
shows (:func:`partitioner.plan_table.shown_rows`):

* a block of identical layers is drawn once, as a cluster for its first layer labelled with
  the layers it stands for ("h.1-h.11 same as h.0"). An edge from a later layer to a node
  outside the block (the last layer into the final norm) is drawn from the first layer's
  counterpart, dashed, and labelled with the layer it comes from; edges into later layers are
  not drawn (the first layer's show them). So a 12-layer model draws as many boxes as a
  one-layer one;
* views and getitems are bridged: an edge from one starts at the node the view reads;
* mask and index rows are left out; the box of the node that uses them counts them, and a
  dotted edge joins it to the model inputs they are computed from (labels, token ids).

``verbose=True`` draws every node of the first layer of each block, views and mask rows
included.
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict

from partitioner.plan_table import SHORT, block_first_index, hidden_view, mask_index_rows, shown_rows

__all__ = ["plan_to_dot"]

_PALETTE = [
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


def _counterparts(records) -> dict:
    """Each node of a later layer of a block -> the node at the same position in its first layer."""
    layers = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("block") is not None:
            layers[r["block"]][r["block_index"]].append(r["name"])
    out = {}
    for label, by_index in layers.items():
        first = by_index.get(block_first_index(label), [])
        for index, names in by_index.items():
            if index != block_first_index(label) and len(names) == len(first):
                out.update(zip(names, first, strict=True))
    return out


def _layers_note(block: dict) -> str:
    """``"h.[0-11]"`` -> ``"h.0: 12 identical blocks; h.1-h.11 same as h.0"``."""
    prefix, label = block["prefix"], block["label"]
    first = block_first_index(label)
    last = label.rsplit("[", 1)[1].rstrip("]").split("-")[-1]
    rest = f"{prefix}.{first + 1}" + (f"-{prefix}.{last}" if int(last) > first + 1 else "")
    return f"{prefix}.{first}: {block['count']} identical blocks; {rest} same as {prefix}.{first}"


def plan_to_dot(plan, *, include_params: bool = True, verbose: bool = False) -> str:
    """Graphviz source for ``plan`` (see the module docstring)."""
    by_name = {r["name"]: r for r in plan.records}
    rows = [r for r in shown_rows(plan, verbose=verbose) if include_params or r["kind"] != "param"]
    shown = {r["name"] for r in rows}
    folded = {} if verbose else mask_index_rows(plan.records)
    counterpart = _counterparts(plan.records)
    blocks = {b["label"]: b for b in plan.data.get("blocks", [])}

    def inputs_behind(name) -> set:
        """The drawn model inputs (token ids, labels) a folded mask/index row is computed from."""
        found, stack, seen = set(), [name], set()
        while stack:
            n = stack.pop()
            for src in by_name[n].get("inputs", []):
                if src in shown and by_name[src]["kind"] == "input":
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
            return drawn, f"{r['block'].rsplit('.[', 1)[0]}.{r['block_index']}"
        if hidden_view(r) and r.get("inputs"):
            return source(r["inputs"][0], seen + (name,))
        return None, None

    colours, lines = (
        {},
        [
            "digraph partita_plan {",
            '  rankdir=TB; node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
            f'  label="{html.escape(plan.data.get("model", "?"))} on mesh {plan.mesh_shape} '
            f'({", ".join(plan.axis_names)})"; labelloc=t;',
        ],
    )
    folded_into = Counter(folded.values())
    by_block = defaultdict(list)
    for r in rows:
        placement = r["out"][0] if r["out"] else "-"
        colour = colours.setdefault(placement, _PALETTE[len(colours) % len(_PALETTE)])
        title = r["fqn"] if r["kind"] in ("param", "input", "buffer") and r.get("fqn") else r["name"]
        label = f"{title}\\n{r['target'].replace('aten.', '')}\\n{placement}"
        if folded_into.get(r["name"]):
            label += f"\\n(+{folded_into[r['name']]} mask/index rows)"
        by_block[r.get("block")].append(f'"{r["name"]}" [label="{html.escape(label)}", fillcolor="{colour}"];')
    for i, (label, nodes) in enumerate(by_block.items()):
        if label is None:
            lines += [f"  {n}" for n in nodes]
            continue
        note = _layers_note(blocks.get(label, {"label": label, "prefix": label.rsplit(".[", 1)[0], "count": "?"}))
        lines.append(
            f'  subgraph cluster_{i} {{ label="{html.escape(note)}"; style="rounded,dashed"; '
            f'color="#666666"; fontname="Helvetica";'
        )
        lines += [f"    {n}" for n in nodes]
        lines.append("  }")
    drawn_edges = set()
    for r in rows + [r for r in plan.records if r["kind"] == "output"]:
        dst = r["name"] if r["kind"] != "output" else "output"
        for k, src in enumerate(r.get("inputs", [])):
            if src in folded:  # the inputs the folded rows read, drawn dotted
                for drawn in sorted(inputs_behind(src)):
                    edge = f'  "{drawn}" -> "{dst}" [style=dotted, label="mask/index"];'
                    if edge not in drawn_edges:
                        drawn_edges.add(edge)
                        lines.append(edge)
                continue
            drawn, layer = source(src)
            if drawn is None:
                continue
            comm = [c for c in r["comm"] if c.get("input") == k]
            attrs = []
            if layer is not None:
                attrs += ["style=dashed", f'label="from {html.escape(layer)}"']
            if comm:
                text = " ".join(f"{SHORT.get(c['kind'], c['kind'])}@{c['axis']}({c['phase']})" for c in comm)
                attrs = [a for a in attrs if not a.startswith("label=")]
                attrs += [
                    "color=red",
                    "penwidth=2",
                    "fontcolor=red",
                    f'label="{text}' + (f" from {html.escape(layer)}" if layer else "") + '"',
                ]
            edge = f'  "{drawn}" -> "{dst}"' + (f" [{', '.join(attrs)}]" if attrs else "") + ";"
            if edge not in drawn_edges:
                drawn_edges.add(edge)
                lines.append(edge)
    lines.append('  "output" [shape=doubleoctagon, fillcolor="#eeeeee"];')
    legend = "\\l".join(f"{p}" for p in colours) + "\\l"
    if folded and not verbose:
        legend += f"{len(folded)} mask/index rows not drawn\\l(counted on the node using them)\\l"
    lines.append(f'  legend [shape=note, fillcolor=white, label="placements (colours):\\l{html.escape(legend)}"];')
    lines.append("}")
    return "\n".join(lines)
