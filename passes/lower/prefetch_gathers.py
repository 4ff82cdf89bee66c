"""Prefetching the gathers of weights stored sharded: the lowering pass and its price.

**The pass** (:func:`prefetch_gathers`, run on each rank's lowered program). The places that
gather weights for use are listed in program order as *sites* ``s_0, s_1, ...``: a top-level edge
that gathers a weight (a :class:`runtime.reshard.Reshard` reading a parameter placeholder whose
first move that sends data is an all-gather) is a site of one gather; a recomputed layer (a
:class:`runtime.recompute.CheckpointRegion`) is one site holding every such edge of its body that
reads a parameter the layer is called with. Then:

* ``s_0``'s gathers are started right after the placeholders (they overlap whatever comes first);
* ``s_{k+1}``'s gathers are started as ``s_k`` begins computing: right after ``s_k``'s edge (once
  its gather has been waited for, before its consumer runs), or right before ``s_k``'s layer is
  called;
* each edge waits for its own gather where it stands (right before its consumer).

So the gathered copies of site ``k + 1`` exist while site ``k`` computes: one more gathered
weight (or layer of weights) than without prefetching. In backward, :mod:`runtime.regather`
does the mirror image for ZeRO-3 copies (unpacking one starts the regather of the copy saved just
before it in forward), and a recomputed layer's rerun starts the gathers of the layer before it
(the next to rerun; :class:`runtime.recompute.CheckpointRegion`), as FSDP prefetches in backward:
each layer's rerun then finds its weights gathered, except the last layer's (the first rerun).

**The price** (:func:`credit_prefetch`, on a solved plan's records, in graph order). Gathers
started ahead overlap the compute between their start and their use: site ``k + 1``'s forward
gathers overlap the forward compute of the ops from ``s_k``'s first consumer up to (not
including) their own site's first (``s_0``'s: every op before it); a prefetched regather of copy
``j`` overlaps the backward compute of the ops after its consumer up to and including the
consumer of copy ``j + 1`` (whose backward unpack started it); a recomputed layer's rerun gathers
overlap the backward compute (rerun included) of the ops after the layer up to the end of the
next recomputed layer (whose rerun started them). The gathers of one site share its window, one
after the other on the link: together they are exposed ``total - f min(total, overlapped
compute)`` (each its share in proportion to its time; the full time stays as ``gather_s``), ``f`` the
cluster's ``prefetch_overlap``: the fraction of the shorter of the two that running them
together hides (1.0 on the GPU presets, ``max(0, gather - compute)``; measured by ``partitioner
calibrate`` on CPUs, where the gather's threads and the compute share the cores), and its output
buffer is alive beside each op of its window: :mod:`passes.plan.memory_accounting` adds it to their
transients (``transient_fwd`` / ``transient_bwd``), so the budgeted solve's peak check sees
it. Other collectives in the window are not taken into account (the link is assumed free for
the gather). The solver prices the gathers without this credit (an upper bound); the plan's
estimate, made from the records, has it.
"""

from __future__ import annotations

import torch.fx as fx

from passes.plan.cost_model import reshard

__all__ = [
    "prefetch_gathers",
    "credit_prefetch",
    "first_gather",
    "forward_windows",
    "backward_windows",
    "gather_sites",
    "rerun_windows",
    "prefetch_transients",
]


def prefetch_gathers(gm: fx.GraphModule) -> int:
    """Start each site's weight gathers one site ahead (see the module docstring), and link each
    recomputed layer to the one before it for its rerun's gathers; returns how many edges are
    prefetched."""
    from runtime.prefetch import PrefetchGather

    graph = gm.graph
    sites = _gather_sites(gm)
    if not sites:
        return 0
    after = next(iter(reversed(graph.find_nodes(op="placeholder"))))
    count = 0
    previous = None
    for node, edges, region in sites:
        for k, (edge, source) in enumerate(edges):
            name = f"prefetch_{node.target}" if region is None else f"prefetch_{node.target}_{k}"
            gm.add_submodule(name, PrefetchGather(edge))
            with graph.inserting_after(after):
                after = graph.call_module(name, (source,))
            count += 1
        # the next site starts as this one computes: after its edge, or before its layer's call
        after = node if region is None else node.prev
        if region is not None:  # its rerun starts the gathers of the layer rerun after it
            region.set_rerun_next(previous)
            previous = region
    graph.lint()
    gm.recompile()
    return count


def _gather_sites(gm: fx.GraphModule) -> list:
    """``(node, [(edge, source placeholder)], region or None)`` per gather site, program order: a
    top-level weight edge, or a recomputed layer's call with the weight edges of its body that read
    a parameter placeholder the layer is called with (recording, on the region, which of its
    arguments each reads: ``prefetch_sources``)."""
    from runtime.recompute import CheckpointRegion
    from runtime.reshard import Reshard

    sites: list = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not node.args:
            continue
        module = gm.get_submodule(str(node.target))
        if isinstance(module, Reshard):
            if getattr(node.args[0], "op", None) == "placeholder" and _weight_edge(module):
                sites.append((node, [(module, node.args[0])], None))
        elif isinstance(module, CheckpointRegion):
            inputs = {n: k for k, n in enumerate(module.body.graph.find_nodes(op="placeholder"))}
            found = []
            for inner in module.body.graph.nodes:
                if inner.op != "call_module" or not inner.args or inner.args[0] not in inputs:
                    continue
                edge = module.body.get_submodule(str(inner.target))
                k = inputs[inner.args[0]]
                outer = node.args[k]
                if isinstance(edge, Reshard) and _weight_edge(edge) and getattr(outer, "op", None) == "placeholder":
                    found.append((k, edge, outer))
            module.prefetch_sources = [(k, edge) for k, edge, _ in found]
            if found:
                sites.append((node, [(edge, outer) for _, edge, outer in found], module))
    return sites


def _weight_edge(edge) -> bool:
    return edge.param_edge is not None and edge.prefetchable


def first_gather(src, dst, shape, mesh_shape, elem: int):
    """The collective a weight's edge ``src -> dst`` starts ahead: its first, when that is an
    all-gather (the runtime's ``Reshard.prefetchable``); None otherwise."""
    moves = reshard(src, dst, shape, mesh_shape, elem)
    return moves[0] if moves and moves[0].kind == "all_gather" else None


def forward_windows(positions: list) -> list:
    """For forward gathers used at op ``positions`` (program order): the ops each one overlaps,
    as ranges (from the previous gather's consumer, or the first op, to its own, excluded)."""
    return [range(positions[k - 1] if k else 0, j) for k, j in enumerate(positions)]


def backward_windows(positions: list) -> list:
    """For regathers of copies used at op ``positions`` (forward order): the ops whose backward
    each one overlaps (after its consumer, up to the next copy's consumer included; the last
    copy's regather, the first in backward, is not prefetched: an empty range)."""
    return [range(j + 1, positions[k + 1] + 1) if k + 1 < len(positions) else range(0) for k, j in enumerate(positions)]


def _gathers(rec: dict, by_name: dict, regather: bool) -> list:
    """The prefetched collectives of ``rec``'s edges: per parameter input, its first collective of
    the phase (forward gathers, or ZeRO-3 regathers in backward), when that is an all-gather."""
    phase = "bwd" if regather else "fwd"
    out, seen = [], set()
    for c in rec.get("comm", []):
        k = c.get("input")
        if k is None or c["phase"] != phase or bool(c.get("regather")) != regather or k in seen:
            continue
        source = by_name.get(rec["inputs"][k])
        if source is None or source["kind"] != "param" or source.get("stored") or source.get("offload"):
            continue
        seen.add(k)
        if c["kind"] == "all_gather":
            out.append(c)
    return out


def credit_prefetch(records: list, overlap: float = 1.0) -> float:
    """Credit the overlap of prefetched gathers on ``records`` (a solved plan's, graph order; see
    the module docstring): each one's ``time_s`` becomes its exposed part, ``overlap`` being the
    cluster's ``prefetch_overlap``. Returns the seconds credited. (Their bytes in flight are
    counted by :func:`passes.plan.memory_accounting.memory_fields`.)"""
    by_name = {r["name"]: r for r in records}
    ops = [r for r in records if r.get("kind") == "op"]
    fwd_s = [r.get("forward_s", 0.0) for r in ops]
    bwd_s = [r.get("compute_s", 0.0) - r.get("forward_s", 0.0) for r in ops]
    sites = gather_sites([(r.get("region") if r.get("recompute") else None, _gathers(r, by_name, False)) for r in ops])
    credited = 0.0
    for (_, gathers, _), window in zip(sites, forward_windows([start for start, _, _ in sites])):
        credited += _credit(gathers, sum(fwd_s[i] for i in window), overlap)
    found = [(j, c) for j, r in enumerate(ops) for c in _gathers(r, by_name, True)]
    for (_, c), window in zip(found, backward_windows([j for j, _ in found])):
        credited += _credit([c], sum(bwd_s[i] for i in window), overlap)
    for layer, window in rerun_windows(sites):
        reruns = [c for i in layer for c in _rerun_gathers(ops[i], by_name)]
        credited += _credit(reruns, sum(bwd_s[i] for i in window), overlap)
    return credited


def gather_sites(ops: list) -> list:
    """The gather sites (module docstring) of ops given as ``(recomputed region or None, [what it
    gathers])`` in program order: ``(first op position, [what they gather], range of the region's
    ops or None)``; an op outside a region makes one site per gather, a region one site of all
    its ops' gathers (none when it gathers nothing)."""
    sites: list = []
    spans: dict = {}
    for j, (region, _) in enumerate(ops):
        if region is not None:
            first, _ = spans.get(region, (j, j))
            spans[region] = (first, j)
    for j, (region, gathers) in enumerate(ops):
        if region is None:
            sites += [(j, [g], None) for g in gathers]
        elif gathers:
            first, last = spans[region]
            if sites and sites[-1][2] is not None and sites[-1][2].start == first:
                sites[-1][1].extend(gathers)
            else:
                sites.append((first, list(gathers), range(first, last + 1)))
    return sites


def rerun_windows(sites: list) -> list:
    """Per recomputed layer whose rerun gathers are started ahead: ``(its ops, the ops whose
    backward they overlap)``: each layer site but the last, overlapping the ops after it up to the
    end of the next layer site (whose rerun starts them)."""
    layers = [span for _, _, span in sites if span is not None]
    return [(a, range(a.stop, b.stop)) for a, b in zip(layers, layers[1:])]


def _rerun_gathers(rec: dict, by_name: dict) -> list:
    """A recomputed op's rerun gathers: per parameter input, the rerun's first forward collective
    (marked ``recompute``), when that is an all-gather of a weight stored sharded."""
    first = {id(c): c for c in _gathers(rec, by_name, False)}
    out, seen = [], set()
    for c in rec.get("comm", []):
        k = c.get("input")
        if k is None or not c.get("recompute") or c["phase"] != "fwd" or k in seen:
            continue
        seen.add(k)
        if any(g.get("input") == k for g in first.values()) and c["kind"] == "all_gather":
            out.append(c)
    return out


def _credit(gathers: list, window_s: float, overlap: float) -> float:
    """Make ``gathers`` (one site's, run one after the other) cost their exposed part beside
    ``window_s`` of compute: together ``total - overlap min(total, window_s)``, each its share in
    proportion to its full time (kept as ``gather_s``). Returns the seconds credited."""
    total = sum(c.setdefault("gather_s", c["time_s"]) for c in gathers)
    if total <= 0:
        return 0.0
    exposed = total - overlap * min(total, window_s)
    for c in gathers:
        c["time_s"] = c["gather_s"] * exposed / total
    return total - exposed


def prefetch_transients(entries: list) -> dict:
    """Where prefetched gathers' buffers are alive: ``entries`` per op in program order, ``(recomputed
    region or None, [(bytes gathered ahead, regathered in backward)])``. Returns ``{"transient_fwd":
    [(op position, bytes)], "transient_bwd": [...]}``: a forward site's gathers beside the ops of
    its window; a ZeRO-3 regather beside the backward of the ops of its window; a recomputed
    layer's rerun gathers beside the backward of the ops from the layer's end to the end of the
    next layer (whose rerun starts them)."""
    out: dict = {"transient_fwd": [], "transient_bwd": []}
    sites = gather_sites([(region, [nbytes for nbytes, _ in found]) for region, found in entries])
    for (_, sizes, _), window in zip(sites, forward_windows([start for start, _, _ in sites])):
        out["transient_fwd"] += [(i, sum(sizes)) for i in window]
    regathers = [(j, nbytes) for j, (_, found) in enumerate(entries) for nbytes, again in found if again]
    for (_, nbytes), window in zip(regathers, backward_windows([j for j, _ in regathers])):
        out["transient_bwd"] += [(i, nbytes) for i in window]
    for layer, window in rerun_windows(sites):
        nbytes = sum(n for i in layer for n, _ in entries[i][1])
        out["transient_bwd"] += [(i, nbytes) for i in window]
    return out
