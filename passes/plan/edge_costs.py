"""Costs between decision groups: the collectives a tensor moving along an edge runs, and the
edge matrices over (producer placement, consumer placement) classes (step 3 of
:mod:`passes.plan.strategy_space`). An edge whose cost depends on one side only is folded
into that group's node cost."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING

import numpy as np

from passes.analysis.analyze import info
from passes.core.node_info import grad_flows
from passes.core.placements import dual_spec, zero1_grad_spec
from passes.plan.cost_model import (
    reshard,
)
from passes.plan.output_placement import required_output_spec
from passes.plan.space_types import EdgeCost, NodeChoice
from passes.rules import tensor_input_nodes

if TYPE_CHECKING:
    from passes.plan.node_options import SpaceBuilder

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1 << 16)
def edge_collectives(
    src_spec,
    dst_spec,
    grad_spec,
    shape,
    elem,
    mesh_shape,
    requires_grad,
    from_param=False,
    grad_reduce_bytes=None,
    grad_dst=None,
):
    """(forward collectives, backward collectives) for a tensor moving along one edge.

    Backward collectives on an edge leaving a parameter are its gradient synchronisation,
    marked ``bucketed``, sent in ``grad_reduce_bytes`` per element when given (a reduce dtype).
    ``grad_dst``: where the gradient must arrive (default: the dual of ``src_spec``; a ZeRO-1
    weight's edges leave it ``Partial`` on the axes its optimizer shard is cut on).
    """
    fwd = reshard(src_spec, dst_spec, shape, mesh_shape, elem)
    grad_elem = grad_reduce_bytes if from_param and grad_reduce_bytes else elem
    bwd = (
        reshard(grad_spec, grad_dst or dual_spec(src_spec), shape, mesh_shape, grad_elem)
        if requires_grad and grad_spec is not None
        else []
    )
    if from_param:
        bwd = [dataclasses.replace(c, bucketed=True) for c in bwd]
    return tuple(fwd), tuple(bwd)


def grad_destination(choice: NodeChoice, mesh_shape):
    """Where gradients along the edges leaving a node so placed arrive (None: the dual of its
    placement); a ZeRO-1 weight's stay ``Partial`` on its shard's axes (:func:`zero1_grad_spec`)."""
    held = choice.stored is not None or choice.offload
    return zero1_grad_spec(choice.out[0], mesh_shape) if held else None


def _classes(values):
    index, classes = {}, []
    for v in values:
        if v not in index:
            index[v] = len(index)
        classes.append(index[v])
    return list(index), np.array(classes, dtype=np.int64)


def build_edges(graph, b: SpaceBuilder, groups, group_of) -> list:
    rep = b.blocks.represent
    pending: dict = {}  # (rep_u, rep_v, k) -> occurrences
    for node in graph.nodes:
        i = info(node)
        if i.kind in ("ignored",) or node.op == "placeholder":
            continue
        rv = rep(node)
        if node.op != "output" and group_of.get(rv) is not None and groups[group_of[rv]].leader is not rv:
            continue  # follower: its input edges are inside its group
        inputs = tensor_input_nodes(node)
        for k, u in enumerate(inputs):
            if info(u).kind == "ignored" or group_of.get(rep(u)) is None:
                continue
            key = (rep(u), rv, k)
            pending[key] = pending.get(key, 0) + 1

    by_pair: dict = {}
    for (u, v, k), occurrences in pending.items():
        gu = group_of[u]
        again_u = b.regather_activations and info(u).kind == "op"  # else: a ZeRO-3 parameter option's
        src_specs = [
            (opt[u].out[0], opt[u].regather or again_u, grad_destination(opt[u], b.mesh)) for opt in groups[gu].options
        ]
        if v.op == "output":
            wanted = [required_output_spec(b.graph, k, s) for s, _, _ in src_specs]
            if all(w is None for w in wanted):
                continue
            costs = np.array(
                [0.0 if w is None else b.edge_time(s, w, None, u) for (s, _, _), w in zip(src_specs, wanted)]
            )
            groups[gu].cost = groups[gu].cost + costs * occurrences
            continue
        gv = group_of[v]
        stops = info(u).requires_grad and not grad_flows(u, v)  # v passes no gradient back
        dst = [
            (opt[v].ins[k], opt[v].strategy.grad_spec(k) if opt[v].strategy is not None and not stops else None)
            for opt in groups[gv].options
        ]
        if all(d[0] is None for d in dst):
            continue
        src_vals, src_cls = _classes(src_specs)
        dst_vals, dst_cls = _classes(dst)
        m = (
            np.array(
                [
                    [
                        0.0
                        if d is None
                        else b.edge_time(s, d, gspec, u, grad_dst=gdst)
                        + (b.regather_time(u, s, d, v, k) if again else 0.0)
                        for (d, gspec) in dst_vals
                    ]
                    for s, again, gdst in src_vals
                ]
            )
            * occurrences
        )
        mem = (
            np.array(
                [[b.edge_memory(u, s, d, gspec, v, k, again) for (d, gspec) in dst_vals] for s, again, _ in src_vals]
            )
            * occurrences
        )
        if gu == gv:
            groups[gu].cost = groups[gu].cost + np.diag(m[np.ix_(src_cls, dst_cls)])
            groups[gu].memory = groups[gu].memory + np.diag(mem[np.ix_(src_cls, dst_cls)])
            continue
        pair = (gu, gv)
        if pair in by_pair:
            prev = by_pair[pair]
            combined = prev.full() + m[np.ix_(src_cls, dst_cls)]
            by_pair[pair] = _factor(gu, gv, combined, prev.full_memory() + mem[np.ix_(src_cls, dst_cls)])
        else:
            by_pair[pair] = EdgeCost(gu, gv, src_cls, dst_cls, m, mem if np.any(mem) else None)
    edges = []
    for e in by_pair.values():
        if not np.any(e.matrix) and e.memory is None:
            continue
        full, full_mem = e.full(), e.full_memory()
        # A cost that depends on one side only is a node cost, not an edge.
        if (full == full[:, :1]).all() and (full_mem == full_mem[:, :1]).all():
            groups[e.src].cost = groups[e.src].cost + full[:, 0]
            groups[e.src].memory = groups[e.src].memory + full_mem[:, 0]
        elif (full == full[:1, :]).all() and (full_mem == full_mem[:1, :]).all():
            groups[e.dst].cost = groups[e.dst].cost + full[0, :]
            groups[e.dst].memory = groups[e.dst].memory + full_mem[0, :]
        else:
            edges.append(e)
    return edges


def _factor(src, dst, full, full_memory=None) -> EdgeCost:
    """An edge from its option x option matrices (seconds; bytes kept), through classes."""
    both = full if full_memory is None else np.concatenate([full, full_memory], axis=1)
    both_t = full.T if full_memory is None else np.concatenate([full.T, full_memory.T], axis=1)
    rows, row_cls = _classes([tuple(r) for r in both])
    cols, col_cls = _classes([tuple(c) for c in both_t])
    pick = np.ix_(
        [list(row_cls).index(i) for i in range(len(rows))], [list(col_cls).index(j) for j in range(len(cols))]
    )
    memory = full_memory[pick] if full_memory is not None and np.any(full_memory) else None
    return EdgeCost(src, dst, row_cls, col_cls, full[pick], memory)
