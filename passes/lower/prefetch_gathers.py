"""Prefetching the gathers of weights stored sharded: the lowering pass and its price.

**The pass** (:func:`prefetch_gathers`, run on each rank's lowered program). The edges that
gather a weight for use (a :class:`runtime.reshard.Reshard` reading a parameter placeholder
whose first move that sends data is an all-gather) are listed in program order ``g_0, g_1, ...``
(those at the program's top level: a recomputed layer's gathers run again in its rerun and stay
synchronous). Then:

* ``g_0``'s gather is started right after the placeholders (it overlaps whatever comes first);
* ``g_{k+1}``'s gather is started right after ``g_k``'s edge, i.e. once ``g_k``'s gather has been
  waited for and before ``g_k``'s consumer runs;
* each edge waits for its own gather where it stands (right before its consumer).

So at most one prefetched gather is in flight, and the gathered copy of layer ``k + 1`` exists
while layer ``k`` computes: one more gathered weight than without prefetching. In backward,
:mod:`runtime.regather` does the mirror image for ZeRO-3 copies: unpacking one starts the
regather of the copy saved just before it in forward.

**The price** (:func:`credit_prefetch`, on a solved plan's records, in graph order). A gather
started ahead overlaps the compute between its start and its use: ``g_{k+1}``'s forward gather
overlaps the forward compute of the ops from ``g_k``'s consumer up to (not including) its own
(``g_0``'s: every op before its consumer); a prefetched regather of copy ``j`` overlaps the
backward compute of the ops after its consumer up to and including the consumer of copy ``j + 1``
(whose backward unpack started it). The collective's time becomes its exposed part,
``gather - f min(gather, overlapped compute)`` (the full time stays as ``gather_s``), ``f`` the
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

__all__ = ["prefetch_gathers", "credit_prefetch", "first_gather", "forward_windows", "backward_windows"]


def prefetch_gathers(gm: fx.GraphModule) -> int:
    """Start each top-level weight gather one gather ahead (see the module docstring); returns
    how many edges are prefetched."""
    from runtime.prefetch import PrefetchGather
    from runtime.reshard import Reshard

    graph = gm.graph
    edges = []
    for node in graph.nodes:
        if node.op != "call_module" or not node.args or getattr(node.args[0], "op", None) != "placeholder":
            continue
        module = gm.get_submodule(str(node.target))
        if isinstance(module, Reshard) and module.param_edge is not None and module.prefetchable:
            edges.append((node, module))
    if not edges:
        return 0
    last_placeholder = next(iter(reversed(graph.find_nodes(op="placeholder"))))
    after = last_placeholder
    for node, module in edges:
        name = f"prefetch_{node.target}"
        gm.add_submodule(name, PrefetchGather(module))
        with graph.inserting_after(after):
            graph.call_module(name, (node.args[0],))
        after = node  # the next gather starts once this one has been waited for
    graph.lint()
    gm.recompile()
    return len(edges)


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
    credited = 0.0
    for regather, seconds, windows in ((False, fwd_s, forward_windows), (True, bwd_s, backward_windows)):
        # forward: the edges at the top level (a recomputed layer's gathers stay synchronous)
        found = [
            (j, c)
            for j, r in enumerate(ops)
            if regather or not r.get("recompute")
            for c in _gathers(r, by_name, regather)
        ]
        for (_, c), window in zip(found, windows([j for j, _ in found])):
            full = c.setdefault("gather_s", c["time_s"])
            c["time_s"] = full - overlap * min(full, sum(seconds[i] for i in window))
            credited += full - c["time_s"]
    return credited
