"""Activation checkpointing as a decision of the intra-op solver: recompute a repeated block or not.

For each repeated block kind (:class:`passes.blocks.BlockGroup`) the solver chooses, once for
all its layers, whether the lowered program keeps the block's saved activations for backward
or recomputes them (the block runs in a checkpointed region that saves only its inputs, and
backward reruns its forward). The choice is made inside the ILP, jointly with the placements:

* every decision group inside the block's representative layer (its op groups; parameters
  keep their state either way) gets each option twice, *kept* and *recomputed*;
* a recomputed option costs its kept cost plus one more forward of every member (compute and
  the member's own forward collectives), for every layer of the block, and the forward
  resharding on every edge into the block (including parameter gathers) runs again: those edge
  terms are added as edges priced only on the recomputed options;
* a recomputed option's memory is one layer's activations (alive while that layer is recomputed
  in backward) plus, per layer, the outputs that leave the layer (the next layer's checkpoint
  input, or what the code after the block uses);
* *link* rows make every group of one block kind choose the same way (``sum of its recomputed
  options' x`` equal across the groups).

``mode``: ``"auto"`` (the solver decides), ``"all"`` (only recomputed options: every block is
recomputed) or ``"none"`` (no recomputation, the space is unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from passes.analyze import info
from passes.cost_model import collective_time, dtype_bytes, local_bytes
from passes.rules import tensor_input_nodes
from passes.strategy_space import EdgeCost, StrategySpace, edge_collectives

__all__ = ["RECOMPUTE_MODES", "RecomputeChoice", "add_recompute_options", "check_recompute_mode", "least_memory"]

RECOMPUTE_MODES = ("auto", "all", "none")


def check_recompute_mode(mode) -> str:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {RECOMPUTE_MODES} ('auto': the solver recomputes repeated blocks when "
            f"the memory budget needs it; 'all': every repeated block; 'none': never), got {mode!r}"
        )
    return mode


@dataclass
class RecomputeChoice:
    """What :func:`add_recompute_options` added to a space (to link in the ILP and to decode)."""

    recomputed: dict = field(default_factory=dict)
    """group index -> bool array over its options (True: the option recomputes its block)."""
    block_of_group: dict = field(default_factory=dict)
    """group index -> the BlockGroup label it belongs to."""
    links: list = field(default_factory=list)
    """(group a, group b): their recomputed options are chosen together (both or neither)."""

    def rows(self) -> list:
        """Link rows for :func:`passes.ilp_solver.solve_ilp`: (g_a, options_a, g_b, options_b)."""
        return [(a, np.flatnonzero(self.recomputed[a]), b, np.flatnonzero(self.recomputed[b])) for a, b in self.links]

    def decode(self, choice: list) -> dict:
        """Block label -> recomputed, for a solved choice."""
        out: dict = {}
        for g, label in self.block_of_group.items():
            out[label] = bool(self.recomputed[g][choice[g]])
        return out


def _forward_edge_time(space: StrategySpace, producer, src, dst) -> float:
    i = info(producer)
    shape = i.out_shapes[0] if i.out_shapes else ()
    fwd, _ = edge_collectives(
        src,
        dst,
        None,
        shape,
        dtype_bytes(i.dtype),
        space.mesh_shape,
        i.requires_grad,
        from_param=i.kind == "param",
        grad_reduce_bytes=space.grad_reduce_bytes,
    )
    return sum(collective_time(c, space.mesh_shape, space.cluster) for c in fwd)


def boundary_bytes(node, choice, instance: set, copies: int, mesh_shape) -> float:
    """Bytes of ``node``'s output kept under recomputation: it leaves its layer (``instance``)."""
    if not any(u not in instance for u in node.users) or choice is None:
        return 0.0
    i = info(node)
    return copies * sum(
        local_bytes(s, spec, mesh_shape, dtype_bytes(i.dtype))
        for s, spec in zip(i.out_shapes, choice.out)
        if s is not None and spec is not None
    )


def _classes(rows) -> tuple:
    index: dict = {}
    classes = [index.setdefault(tuple(r), len(index)) for r in rows]
    return list(index), np.array(classes, dtype=np.int64)


def _factor(src: int, dst: int, full: np.ndarray) -> EdgeCost:
    """An edge whose cost matrix is ``full`` (options x options), through placement classes."""
    row_values, row_cls = _classes(full)
    col_values, col_cls = _classes(full.T)
    first_row = [int(np.flatnonzero(row_cls == r)[0]) for r in range(len(row_values))]
    first_col = [int(np.flatnonzero(col_cls == c)[0]) for c in range(len(col_values))]
    return EdgeCost(src, dst, row_cls, col_cls, full[np.ix_(first_row, first_col)])


def add_recompute_options(space: StrategySpace, graph, mode: str, activation_copies: int = 1) -> RecomputeChoice:
    """Give the op groups of every repeated block kept and recomputed options (see the module
    docstring); modifies ``space`` in place. ``mode="none"`` leaves it unchanged."""
    result = RecomputeChoice()
    if check_recompute_mode(mode) == "none":
        return result
    blocks = space.blocks
    groups = space.groups
    copies = activation_copies
    base_size: dict = {}
    for bg in blocks.groups:
        first = set(bg.members[0])
        mine = [
            gi for gi, g in enumerate(groups) if g.leader in first and any(m.op == "call_function" for m in g.members)
        ]
        if not mine:
            continue
        for gi in mine:
            g = groups[gi]
            n = len(g.options)
            base_size[gi] = n
            ops = [m for m in g.members if m.op == "call_function"]
            forward = np.array([sum(opt[m].forward_s + opt[m].forward_comm_s for m in ops) for opt in g.options])
            kept_memory = g.memory
            # placeholders (a parameter a view follows) keep their state; ops keep one layer's
            # activations (the one being recomputed) and, per layer, what leaves the layer
            recomputed_memory = np.array(
                [
                    sum(
                        opt[m].memory * g.count
                        if m.op != "call_function"
                        else opt[m].memory + g.count * boundary_bytes(m, opt[m], first, copies, space.mesh_shape)
                        for m in g.members
                    )
                    for opt in g.options
                ]
            )
            forward = forward * g.count
            if mode == "all":
                g.cost = g.cost + forward
                g.memory = recomputed_memory
                result.recomputed[gi] = np.ones(n, dtype=bool)
            else:
                g.options = g.options + g.options
                g.cost = np.concatenate([g.cost, g.cost + forward])
                g.memory = np.concatenate([kept_memory, recomputed_memory])
                result.recomputed[gi] = np.arange(2 * n) >= n
            result.block_of_group[gi] = bg.label
        if mode == "auto":
            result.links += [(mine[0], other) for other in mine[1:]]
    if not result.recomputed:
        return result
    for e in space.edges:  # duplicated options keep their placement class
        if mode == "auto":
            if e.src in result.recomputed:
                e.src_class = np.concatenate([e.src_class, e.src_class])
            if e.dst in result.recomputed:
                e.dst_class = np.concatenate([e.dst_class, e.dst_class])
    _add_forward_edges(space, graph, result, base_size)
    return result


def _add_forward_edges(space: StrategySpace, graph, result: RecomputeChoice, base_size: dict) -> None:
    """The forward resharding into recomputed blocks' leaders runs again: priced on the
    recomputed options of the consumer (edges inside one group are in ``forward_comm_s``)."""
    blocks, groups, group_of = space.blocks, space.groups, space.group_of
    rep = blocks.represent
    pending: dict = {}
    for node in graph.nodes:
        if node.op != "call_function" or info(node).kind != "op":
            continue
        rv = rep(node)
        gv = group_of.get(rv)
        if gv is None or gv not in result.recomputed or groups[gv].leader is not rv:
            continue
        for k, u in enumerate(tensor_input_nodes(node)):
            gu = group_of.get(rep(u))
            if gu is None or info(u).kind == "ignored":
                continue
            src_options = groups[gu].options[: base_size.get(gu, len(groups[gu].options))]
            dst_options = groups[gv].options[: base_size[gv]]
            m = np.array(
                [
                    [
                        0.0 if d[rv].ins[k] is None else _forward_edge_time(space, u, s[rep(u)].out[0], d[rv].ins[k])
                        for d in dst_options
                    ]
                    for s in src_options
                ]
            )
            pending[(gu, gv)] = pending.get((gu, gv), 0.0) + m
    for (gu, gv), m in pending.items():
        if not np.any(m):
            continue
        rows = np.tile(m, (len(groups[gu].options) // m.shape[0], 1))
        on = result.recomputed[gv]
        full = np.zeros((rows.shape[0], len(on)))
        full[:, on] = rows
        if gu == gv:
            groups[gv].cost = groups[gv].cost + np.diag(full)
        elif (full == full[:, :1]).all():
            groups[gu].cost = groups[gu].cost + full[:, 0]
        elif (full == full[:1, :]).all():
            groups[gv].cost = groups[gv].cost + full[0, :]
        else:
            space.edges.append(_factor(gu, gv, full))


def least_memory(space: StrategySpace, result: RecomputeChoice) -> float:
    """The least memory any plan of ``space`` needs, each block kind recomputed or not as a whole."""
    total = 0.0
    by_block: dict = {}
    for gi, g in enumerate(space.groups):
        label = result.block_of_group.get(gi)
        if label is None:
            total += float(np.min(g.memory))
            continue
        on = result.recomputed[gi]
        kept = float(np.min(g.memory[~on])) if (~on).any() else np.inf
        redone = float(np.min(g.memory[on]))
        pair = by_block.setdefault(label, [0.0, 0.0])
        pair[0] += kept
        pair[1] += redone
    return total + sum(min(kept, redone) for kept, redone in by_block.values())
