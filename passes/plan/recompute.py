"""Activation checkpointing as a decision of the intra-op solver: kept, selective or full.

For each repeated block kind (:class:`passes.capture.blocks.BlockGroup`) the solver chooses, once for
all its layers, one of three ways to get what backward needs:

* **kept**: the layer's ops keep their saved activations (no recomputation);
* **selective** (Korthikanti et al. 2022): only the *attention core* of each layer is
  recomputed: the ops from the score contraction ``q @ k^T`` through the softmax (scale, mask,
  dropout) to the contraction with ``v``, or one ``scaled_dot_product_attention`` op. A
  checkpoint keeps the core's inputs (q, k, v, a mask) and backward reruns the core, so its
  O(s^2) scores, probabilities and dropout masks (or an attention kernel's output and
  statistics) are never kept; every other op keeps what it keeps;
* **full**: the whole layer runs in a checkpointed region that keeps only its inputs.

The choice is made inside the ILP, jointly with the placements:

* every decision group of the block's representative layer that holds an op gets its options
  again per mode (parameters keep their state either way): ``[kept | full]`` and, for groups
  holding a node of an attention core, ``[kept | full | selective]``;
* a recomputed option costs its kept cost plus one more forward (compute, the member's own
  forward collectives, the resharding into followers) of the members it reruns (every op for
  full, the core's ops for selective), for every layer; the forward resharding on every edge
  into those leaders (parameter gathers included) runs again: edges priced on those options;
* a recomputed option's memory is what the rerun rebuilds for one layer (alive while that layer
  is recomputed in backward) plus, per layer, the outputs that leave the rerun range (the next
  layer's checkpoint input, what the code after it reads) and, for a core, the inputs its
  checkpoint keeps (once for a value made outside the layer, e.g. a mask every layer reads);
* *link* rows make every group of one block kind choose the same mode (the sums of its full
  options' ``x`` are equal across the groups, and likewise the sums of the selective options'
  ``x`` across the groups holding a core; a group without a core node takes a kept option when
  the block is selective).

The attention core is found in the representative layer's graph (:func:`attention_cores`) and
mapped to every layer by node position (the layers are one program). Each core's nodes are a
range of the graph in order, from its first to its last node: the range the lowering moves into
a :class:`runtime.recompute.CheckpointRegion`, so what is priced is what reruns.

``mode``: ``"auto"`` (the solver decides among the three), ``"selective"`` (every block kind
with an attention core recomputes its core; others keep), ``"all"`` (every block kind recomputed
in full) or ``"none"`` (no recomputation, the space is unchanged).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from passes.analysis.analyze import info, storage_owner
from passes.plan.cost_model import collective_time, dtype_bytes, local_bytes
from passes.plan.edge_costs import edge_collectives
from passes.plan.space_types import EdgeCost, StrategySpace
from passes.rules import op_name, rule_for, tensor_input_nodes

__all__ = [
    "MODES",
    "RECOMPUTE_MODES",
    "RecomputeChoice",
    "add_recompute_options",
    "attention_cores",
    "check_recompute_mode",
    "eager_attention_contractions",
    "is_softmax",
    "least_memory",
    "mark_recomputed",
]

RECOMPUTE_MODES = ("auto", "selective", "all", "none")
MODES = ("kept", "selective", "full")
"""What a block kind gets: its activations kept, its attention core recomputed, or all of it."""

_ATTENTION_KERNELS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_SOFTMAX = ("softmax", "_softmax", "_safe_softmax")


def check_recompute_mode(mode) -> str:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {RECOMPUTE_MODES} ('auto': the solver chooses per repeated block kind "
            f"between keeping, recomputing the attention core and recomputing the whole block when the memory "
            f"budget needs it; 'selective': every block's attention core; 'all': every repeated block; "
            f"'none': never), got {mode!r}"
        )
    return mode


# ----------------------------------------------------------------------------- attention cores


def _short(node) -> str:
    return op_name(node.target).split(".")[-2 if op_name(node.target).count(".") >= 2 else -1]


def _is_kernel(node) -> bool:
    return node.op == "call_function" and any(k in op_name(node.target) for k in _ATTENTION_KERNELS)


def is_softmax(node) -> bool:
    return node.op == "call_function" and _short(node) in _SOFTMAX


def _activation_contraction(node) -> bool:
    """A contraction of two activations (``q @ k^T``, ``p @ v``): no parameter among its inputs."""
    if node.op != "call_function" or info(node).kind != "op" or not rule_for(node).contraction:
        return False
    ins = tensor_input_nodes(node)
    return len(ins) >= 2 and not any(info(u).kind == "param" for u in ins)


def _reach(start, step, inside) -> list:
    """Contractions reached from ``start`` walking ``step`` through non-contraction ops of ``inside``."""
    found, seen, todo = [], set(), list(step(start))
    while todo:
        n = todo.pop()
        if n in seen or n not in inside:
            continue
        seen.add(n)
        if n.op == "call_function" and rule_for(n).contraction:
            found.append(n)
        else:
            todo += step(n)
    return found


def eager_attention_contractions(softmax, inside) -> tuple:
    """The eager attention pattern around ``softmax`` among the nodes ``inside``: the
    contractions of two activations reached from it backwards through non-contraction ops
    (``q @ k^T``; scale, mask) and forwards (``p @ v``; casts, dropout). Both lists non-empty:
    the softmax is an attention core's."""
    before = [c for c in _reach(softmax, tensor_input_nodes, inside) if _activation_contraction(c)]
    after = [c for c in _reach(softmax, lambda m: list(m.users), inside) if _activation_contraction(c)]
    return before, after


def attention_cores(layer: list) -> list:
    """The attention cores of one layer (its nodes): a list of node ranges, each the layer's
    nodes in graph order from the core's first node to its last.

    A core is a fused attention op (``scaled_dot_product_attention`` and its kernels, with the
    ``getitem`` nodes reading its outputs), or the eager pattern: a softmax between a
    contraction of two activations (``q @ k^T``, reached backwards through elementwise ops:
    scale, mask) and another (``p @ v``, reached forwards: casts, dropout)."""
    ops = [n for n in layer if n.op == "call_function"]
    order = {n: i for i, n in enumerate(ops)}
    inside = set(ops)
    spans = []
    for n in ops:
        if _is_kernel(n):
            last = max(
                [n] + [u for u in n.users if u in inside and u.target is operator.getitem], key=order.__getitem__
            )
            spans.append((order[n], order[last]))
        elif is_softmax(n):
            before, after = eager_attention_contractions(n, inside)
            if before and after:
                spans.append((min(order[c] for c in before), max(order[c] for c in after)))
    merged: list = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [[m for m in ops[a : b + 1] if info(m).kind != "ignored"] for a, b in merged]


def block_cores(blocks) -> dict:
    """Block label -> per layer k, its cores (lists of nodes), mapped from the first layer."""
    out = {}
    for bg in blocks.groups:
        first = bg.members[0]
        cores = attention_cores(first)
        if not cores:
            continue
        position = {n: i for i, n in enumerate(first)}
        out[bg.label] = [[[members[position[n]] for n in core] for core in cores] for members in bg.members]
    return out


# ----------------------------------------------------------------------------------- the choice


@dataclass
class RecomputeChoice:
    """What :func:`add_recompute_options` added to a space (to link in the ILP and to decode)."""

    recomputed: dict = field(default_factory=dict)
    """group index -> bool array over its options (True: the option recomputes its whole block)."""
    selective: dict = field(default_factory=dict)
    """group index -> bool array over its options (True: the option recomputes the attention core)."""
    block_of_group: dict = field(default_factory=dict)
    """group index -> the BlockGroup label it belongs to."""
    links: list = field(default_factory=list)
    """(group a, group b): their full options are chosen together (both or neither)."""
    selective_links: list = field(default_factory=list)
    """(group a, group b): their selective options are chosen together."""
    cores: dict = field(default_factory=dict)
    """Block label -> per layer, its attention cores (lists of nodes): see :func:`block_cores`."""

    def rows(self) -> list:
        """Link rows for :func:`passes.plan.ilp_solver.solve_ilp`: (g_a, options_a, g_b, options_b)."""
        full = [(a, np.flatnonzero(self.recomputed[a]), b, np.flatnonzero(self.recomputed[b])) for a, b in self.links]
        return full + [
            (a, np.flatnonzero(self.selective[a]), b, np.flatnonzero(self.selective[b]))
            for a, b in self.selective_links
        ]

    def mode_of(self, g: int, i: int) -> str:
        """``"kept"``, ``"selective"`` or ``"full"`` for option ``i`` of group ``g``."""
        if self.recomputed.get(g) is not None and self.recomputed[g][i]:
            return "full"
        if self.selective.get(g) is not None and self.selective[g][i]:
            return "selective"
        return "kept"

    def decode(self, choice: list) -> dict:
        """Block label -> ``"kept"`` / ``"selective"`` / ``"full"``, for a solved choice."""
        rank = {m: k for k, m in enumerate(MODES)}
        out: dict = {}
        for g, label in self.block_of_group.items():
            mode = self.mode_of(g, choice[g])
            if rank[mode] > rank[out.get(label, "kept")]:
                out[label] = mode
            out.setdefault(label, mode)
        return out

    def regions(self, blocks, modes: dict) -> dict:
        """node -> its recomputed region's key, for the nodes ``modes`` recompute: ``(label, k)`` for a
        whole layer k, ``(label, k, j)`` for attention core j of layer k."""
        out: dict = {}
        for n, (grp, k) in blocks.block_of.items():
            if modes.get(grp.label) == "full":
                out[n] = (grp.label, k)
        for label, layers in self.cores.items():
            if modes.get(label) == "selective":
                for k, cores in enumerate(layers):
                    for j, core in enumerate(cores):
                        out.update({n: (label, k, j) for n in core})
        return out

    def mark(self, rec: dict, node, choice, blocks, regions: dict, copies: int, mesh_shape) -> None:
        """Mark ``node``'s record as recomputed in its region (``regions``: from :meth:`regions`)."""
        key = regions[node]
        members = getattr(self, "_members", None)
        if members is None or members[0] is not regions:
            by_key: dict = {}
            for n, k in regions.items():
                by_key.setdefault(k, set()).add(n)
            members = self._members = (regions, by_key)
        grp = next(g for g in blocks.groups if g.label == key[0])
        rec["region"] = region_name(key, blocks)
        mark_recomputed(
            rec,
            node,
            choice,
            key,
            members[1][key],
            key[1] == 0,
            copies,
            mesh_shape,
            layer=set(grp.members[key[1]]),
            count=len(grp.indices),
        )


def region_name(key, blocks) -> str:
    """A region key's name in the plan's records (``h.[0-1][3].attention0``)."""
    label, k = key[0], key[1]
    grp = next(g for g in blocks.groups if g.label == label)
    base = f"{label}[{grp.indices[k]}]"
    return base if len(key) == 2 else f"{base}.attention{key[2]}"


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
    """Bytes of ``node``'s output kept under recomputation: it leaves its rerun range (``instance``)."""
    if not any(u not in instance for u in node.users) or choice is None:
        return 0.0
    i = info(node)
    return copies * sum(
        local_bytes(s, spec, mesh_shape, dtype_bytes(i.dtype))
        for s, spec in zip(i.out_shapes, choice.out)
        if s is not None and spec is not None
    )


def kept_after(node, instance: set) -> bool:
    """Whether an op outside ``instance`` saves ``node``'s storage (directly or through views)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            saves = info(u).saves
            if saves is None:
                continue
            ins = tensor_input_nodes(u)
            if u not in instance and any(k < len(ins) and ins[k] is n for k in saves.inputs):
                return True
            if saves.alias is not None and storage_owner(u) is node:
                todo.append(u)
    return False


def checkpoint_input_bytes(node, choice, instance: set, layer: set, copies: int, mesh_shape, count: int) -> float:
    """Bytes of the values ``node`` reads from before its rerun range (``instance``) that the
    range's checkpoint keeps and no op's row counts (their storage is saved by no op: a rotated
    query, a mask): ``count`` times (once per layer) for a value made inside the layer, once for
    one made outside it (every layer reads the same tensor)."""
    if choice is None:
        return 0.0
    total = 0.0
    for u, spec in zip(tensor_input_nodes(node), choice.ins):
        owner = storage_owner(u) if u.op == "call_function" else u
        oi = info(owner)
        if u in instance or spec is None or oi.kind != "op" or oi.saved or info(u).shape is None:
            continue
        nbytes = copies * local_bytes(info(u).shape, spec, mesh_shape, dtype_bytes(info(u).dtype))
        total += nbytes * (count if u in layer else 1)
    return total


def _core_memory(m, opt, instance: set, layer: set, copies: int, mesh_shape, count: int) -> float:
    """A core member's row: what its rerun rebuilds, once; per layer, its output when an op after
    the core saves it, and what its checkpoint keeps that no row counts."""
    out = 0.0
    if kept_after(m, instance):
        i = info(m)
        out = copies * sum(
            local_bytes(sh, spec, mesh_shape, dtype_bytes(i.dtype))
            for sh, spec in zip(i.out_shapes, opt.out)
            if sh is not None and spec is not None
        )
    return (
        opt.memory / copies + count * out + checkpoint_input_bytes(m, opt, instance, layer, copies, mesh_shape, count)
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


def _rerun(g, ops: list) -> np.ndarray:
    """Seconds per option of one more forward of ``ops`` (members of ``g``), for every layer."""
    return np.array([sum(opt[m].forward_s + opt[m].forward_comm_s for m in ops) for opt in g.options]) * g.count


def _rerun_memory(g, instance: set, layer: set, copies: int, mesh_shape, core: bool) -> np.ndarray:
    """Bytes per option when the members of ``g`` in ``instance`` (one layer's rerun range) are
    recomputed: what the rerun rebuilds, once (one microbatch's: an option's memory counts
    ``copies`` microbatches, and only one layer of one microbatch reruns at a time), and per layer what
    stays: for a whole layer, the outputs that leave it (the next checkpoint's input, what the
    code after the block reads); for an attention core, what its checkpoint keeps (its outputs
    are counted by the ops outside that save them). Other members keep theirs."""
    out = []
    for opt in g.options:
        total = 0.0
        for m in g.members:
            if m.op != "call_function" or m not in instance:
                total += opt[m].memory * g.count
            elif core:
                total += _core_memory(m, opt[m], instance, layer, copies, mesh_shape, g.count)
            else:
                total += opt[m].memory / copies + g.count * boundary_bytes(m, opt[m], instance, copies, mesh_shape)
        out.append(total)
    return np.array(out)


def add_recompute_options(space: StrategySpace, graph, mode: str, activation_copies: int = 1) -> RecomputeChoice:
    """Give the op groups of every repeated block their kept / selective / full options (see
    the module docstring); modifies ``space`` in place. ``mode="none"`` leaves it unchanged."""
    result = RecomputeChoice()
    if check_recompute_mode(mode) == "none":
        return result
    groups = space.groups
    copies = activation_copies
    base_size: dict = {}
    if mode in ("auto", "selective"):
        result.cores = block_cores(space.blocks)
        if mode == "selective" and not result.cores:
            labels = ", ".join(bg.label for bg in space.blocks.groups) or "none"
            raise ValueError(
                f"recompute='selective' recomputes the attention core of repeated blocks, but no repeated block "
                f"(found: {labels}) holds a scaled_dot_product_attention op or a softmax between two activation "
                f"matmuls; use recompute='all' (whole blocks) or 'auto'"
            )
    for bg in space.blocks.groups:
        first = set(bg.members[0])
        core = {n for c in (result.cores.get(bg.label) or [[]])[0] for n in c}
        mine = [
            gi for gi, g in enumerate(groups) if g.leader in first and any(m.op == "call_function" for m in g.members)
        ]
        if not mine:
            continue
        with_core = [gi for gi in mine if any(m in core for m in groups[gi].members)]
        for gi in mine:
            g = groups[gi]
            n = len(g.options)
            base_size[gi] = n
            ops = [m for m in g.members if m.op == "call_function"]
            kept_cost, kept_memory = g.cost, g.memory
            full_cost = kept_cost + _rerun(g, ops)
            full_memory = _rerun_memory(g, first, first, copies, space.mesh_shape, core=False)
            sel_cost = kept_cost + _rerun(g, [m for m in ops if m in core])
            sel_memory = _rerun_memory(g, core, first, copies, space.mesh_shape, core=True)
            result.block_of_group[gi] = bg.label
            if mode == "all":
                g.cost, g.memory = full_cost, full_memory
                result.recomputed[gi] = np.ones(n, dtype=bool)
            elif mode == "selective":
                if gi in with_core:
                    g.cost, g.memory = sel_cost, sel_memory
                    result.selective[gi] = np.ones(n, dtype=bool)
            else:
                copies_of = 3 if gi in with_core else 2
                g.options = g.options * copies_of
                g.cost = np.concatenate([kept_cost, full_cost] + ([sel_cost] if copies_of == 3 else []))
                g.memory = np.concatenate([kept_memory, full_memory] + ([sel_memory] if copies_of == 3 else []))
                which = np.repeat(np.arange(copies_of), n)
                result.recomputed[gi] = which == 1
                if copies_of == 3:
                    result.selective[gi] = which == 2
        if mode == "auto":
            result.links += [(mine[0], other) for other in mine[1:]]
            result.selective_links += [(with_core[0], other) for other in with_core[1:]]
    if not result.block_of_group:
        return result
    for e in space.edges:  # repeated options keep their placement class
        for end in ("src", "dst"):
            g = getattr(e, end)
            cls = getattr(e, f"{end}_class")
            if g in base_size and len(groups[g].options) != len(cls):
                setattr(e, f"{end}_class", np.tile(cls, len(groups[g].options) // len(cls)))
    _add_forward_edges(space, graph, result.recomputed, base_size)
    if result.selective:
        cores = {n for layers in result.cores.values() for core in layers[0] for n in core}
        _add_forward_edges(space, graph, result.selective, base_size, cores)
    return result


def _add_forward_edges(space: StrategySpace, graph, masks: dict, base_size: dict, only=None) -> None:
    """The forward resharding into recomputed leaders runs again: priced on the options of the
    consumer that ``masks`` marks (edges inside one group are in ``forward_comm_s``). ``only``:
    the representative nodes whose input edges rerun (None: every leader of a masked group)."""
    blocks, groups, group_of = space.blocks, space.groups, space.group_of
    rep = blocks.represent
    pending: dict = {}
    prices: dict = {}  # (what the price reads of the producer, its options, the consumer's) -> matrix

    def distinct(specs) -> tuple:  # (the distinct specs, each entry's index among them)
        seen: dict = {}
        index = np.array([seen.setdefault(sp, len(seen)) for sp in specs], dtype=np.int64)
        return list(seen), index

    src_specs: dict = {}  # (group, representative) -> distinct output specs of its options
    dst_specs: dict = {}  # (group, representative, input index) -> distinct input specs

    for node in graph.nodes:
        if node.op != "call_function" or info(node).kind != "op":
            continue
        rv = rep(node)
        gv = group_of.get(rv)
        if gv is None or gv not in masks or groups[gv].leader is not rv or (only is not None and rv not in only):
            continue
        for k, u in enumerate(tensor_input_nodes(node)):
            gu = group_of.get(rep(u))
            if gu is None or info(u).kind == "ignored":
                continue
            ru = rep(u)
            i = info(u)
            key = (i.out_shapes[0] if i.out_shapes else (), i.dtype, i.requires_grad, i.kind, gu, ru, gv, rv, k)
            if key not in prices:  # repeated layers share groups: priced once for all of them
                src_options = groups[gu].options[: base_size.get(gu, len(groups[gu].options))]
                dst_options = groups[gv].options[: base_size[gv]]
                if (gu, ru) not in src_specs:
                    src_specs[(gu, ru)] = distinct([s[ru].out[0] for s in src_options])
                if (gv, rv, k) not in dst_specs:
                    dst_specs[(gv, rv, k)] = distinct([d[rv].ins[k] for d in dst_options])
                (srcs, si), (dsts, di) = src_specs[(gu, ru)], dst_specs[(gv, rv, k)]
                # once per distinct pair of placements, then spread over the options
                small = [[0.0 if b is None else _forward_edge_time(space, u, a, b) for b in dsts] for a in srcs]
                prices[key] = np.array(small).reshape(len(srcs), len(dsts))[np.ix_(si, di)]
            m = prices[key]
            pending[(gu, gv)] = pending.get((gu, gv), 0.0) + m
    for (gu, gv), m in pending.items():
        if not np.any(m):
            continue
        rows = np.tile(m, (len(groups[gu].options) // m.shape[0], len(groups[gv].options) // m.shape[1]))
        full = np.where(masks[gv][None, :], rows, 0.0)
        if gu == gv:
            groups[gv].cost = groups[gv].cost + np.diag(full)
        elif (full == full[:, :1]).all():
            groups[gu].cost = groups[gu].cost + full[:, 0]
        elif (full == full[:1, :]).all():
            groups[gv].cost = groups[gv].cost + full[0, :]
        else:
            space.edges.append(_factor(gu, gv, full))


def least_memory(space: StrategySpace, result: RecomputeChoice) -> float:
    """The least memory any plan of ``space`` needs, each block kind kept, selective or full as a whole."""
    total = 0.0
    by_block: dict = {}
    for gi, g in enumerate(space.groups):
        label = result.block_of_group.get(gi)
        if label is None:
            total += float(np.min(g.memory))
            continue
        modes = np.array([result.mode_of(gi, i) for i in range(len(g.options))])
        sums = by_block.setdefault(label, {m: 0.0 for m in MODES})
        for m in MODES:
            # a group without a core option takes a kept one when its block is selective
            pick = modes == m if (modes == m).any() or m != "selective" else modes == "kept"
            sums[m] += float(np.min(g.memory[pick])) if pick.any() else np.inf
    return total + sum(min(s.values()) for s in by_block.values())


def mark_recomputed(rec, node, choice, key, members, first: bool, copies: int, mesh_shape, layer=(), count=1) -> None:
    """A node of a recomputed region (a whole layer: ``key`` (label, k); an attention core:
    (label, k, j)): backward reruns its forward (compute and forward collectives again) and only
    stays saved (what leaves a layer; what a core's checkpoint keeps) plus, for the first layer,
    what one region's rerun rebuilds: the terms the solver priced.
    ``members``: the region's nodes; ``layer``: the nodes of the region's layer."""
    rec["recompute"] = True
    if choice is None:
        return
    rec["recompute_s"] = float(choice.forward_s)
    rec["compute_s"] += float(choice.forward_s)
    rec["comm"] = rec["comm"] + [dict(c, recompute=True) for c in rec["comm"] if c["phase"] == "fwd"]
    rebuilt = choice.memory / copies  # one microbatch's, alive while one region reruns
    if len(key) == 3:  # an attention core: the row of _core_memory, per layer
        kept = (_core_memory(node, choice, members, layer, copies, mesh_shape, count) - rebuilt) / count
    else:
        kept = boundary_bytes(node, choice, members, copies, mesh_shape)
    rec["memory"] = float(kept + (rebuilt if first else 0.0))
