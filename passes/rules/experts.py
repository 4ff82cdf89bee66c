"""partita.moe_experts(hidden[T,H], top_k_index[T,k], top_k_weights[T,k], gate_up[E,2I,H], down[E,H,I]).

One node per mixture-of-experts layer (:mod:`passes.capture.experts_op`). Per mesh axis the
candidates are:

* replicated;
* tokens split (``Shard(0)`` of hidden, index and weights), experts replicated: data parallel;
* **expert parallel by all-to-all** (note ``experts``): tokens split and the stacked expert
  weights ``Shard(0)`` on the same axis; the op dispatches each (token, expert) pair's row to
  the rank holding its expert and combines the results back
  (:mod:`runtime.expert_dispatch`). Its own collectives, per rank: the per-expert counts
  (``E`` int64, forward), and four all-to-alls of the local pairs' rows (``T k H / split``
  elements each: dispatch and combine, forward and backward), so ``4 T k H`` elements per layer
  and step, ``(n - 1) / n`` of them on the wire;
* **hidden split** (note ``hidden_split_experts``; EP x TP), only beside an expert-parallel
  axis: the tokens' hidden dim and the experts' ``H`` dim split (``Shard(1)`` of hidden,
  ``Shard(2)`` of ``gate_up_proj``, ``Shard(1)`` of ``down_proj``), the routing whole, the
  output ``Shard(1)``; inside the op one all-reduce of ``N x 2I`` forward (the partial gate/up
  products) and one of ``N x I`` backward (the activation's gradient), ``N`` the rows the rank's
  experts compute (:func:`runtime.expert_dispatch._expert_products`);
* **local experts** (note ``experts_local``): the experts split, the tokens whole on the axis;
  each rank computes the pairs routed to its experts and the output is ``Partial`` (the
  all-reduce after it is the edge's, priced like any reshard; the hidden gradient is partial
  too), no all-to-all.

The experts may be split on one mesh axis at most; the other axes split the tokens or nothing.
Compute is priced at the routed load: ``6 T k H I`` FLOPs forward (a contraction: backward
twice that), over the work split, times the *imbalance* on an expert axis of ``n`` ranks: the
most-loaded rank's share of the routed pairs over the mean, measured from the router on the
example batch (:mod:`passes.analysis.expert_routing`; 1.0 where none was measured).

With an expert capacity (``op.options.expert_capacity``: tokens beyond it were dropped before the
op, :mod:`partitioner.moe_capacity`) every count above is taken at the pairs kept: each expert's
load capped at ``C`` (:func:`kept_loads`; uniform loads where none was measured), so the
compute, the all-to-all rows (``4 K H`` for ``K`` pairs kept), the imbalance and the routed
rows' buffers all shrink with the dropping.

Whether expert splits are offered is a planning setting (``op.options.expert_parallel``, from
``partitioner.plan(..., expert_parallel=...)``): ``"auto"`` offers them beside the rest (the
solver chooses by time and memory), ``"on"`` only candidates with the experts split over a mesh
axis of more than one device (over ``op.options.expert_axis`` when given: the configuration
search's ``ep``), ``"off"`` none.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch

from passes.capture.experts_op import MOE_OP
from passes.core.node_info import Saves, info
from passes.core.placements import P, R, Shard
from passes.core.plan_records import NodeRecord
from passes.core.rule_options import EXPERT_PARALLEL_MODES
from passes.rules.base import AxisStrategy, OpRule, OpView, register
from runtime.expert_dispatch import expert_capacity

logger = logging.getLogger(__name__)

__all__ = [
    "ExpertsRule",
    "EXPERT_PARALLEL_MODES",
    "EXPERT_NOTES",
    "check_forced",
    "experts_lines",
    "imbalance",
    "kept_loads",
]

EXPERT_NOTES = ("experts", "experts_local")
HIDDEN_NOTE = "hidden_split_experts"  # EP x TP: the experts' H dim split on this axis
ROUTING_KEY = "partita.routing"
KEPT_KEY = "partita.kept"  # the routed pairs per expert that are computed (capped at the capacity)


def check_forced(graph, mode: str, mesh_shape, axis: int | None = None) -> None:
    """For ``mode="on"``: raise naming the first experts node whose expert count no mesh axis of
    more than one device (``axis`` alone, when given) divides (it could not be expert parallel)."""
    if mode != "on":
        return
    axes = [n for i, n in enumerate(mesh_shape) if n > 1 and axis in (None, i)]
    for node in graph.nodes:
        if node.op == "call_function" and node.target is MOE_OP:
            experts = info(node.args[3]).shape[0]
            if not any(experts % n == 0 for n in axes):
                which = (
                    f"mesh axis {axis} of {tuple(mesh_shape)} does not divide"
                    if axis is not None
                    else f"no mesh axis of {tuple(mesh_shape)} with more than one device divides"
                )
                raise ValueError(
                    f"expert_parallel='on': experts node {node.name} ({info(node).module_path}) has {experts} "
                    f"experts, which {which}; use a mesh axis dividing {experts}, or expert_parallel='auto'"
                )


def imbalance(loads, n: int) -> float:
    """Max over mean of the routed pairs per group of ``E / n`` consecutive experts (rank ``c``'s
    group under expert parallelism over ``n`` ranks); 1.0 without loads."""
    if not loads or n <= 1 or len(loads) % n:
        return 1.0
    size = len(loads) // n
    groups = [sum(loads[c * size : (c + 1) * size]) for c in range(n)]
    mean = sum(groups) / n
    return max(groups) / mean if mean > 0 else 1.0


def kept_loads(op: OpView) -> list:
    """The pairs each expert computes: the routed loads (measured, else uniform) capped at the
    expert capacity when ``op.options.expert_capacity`` drops tokens (``min(load, C)``)."""
    tokens, k = op.in_shapes[1]
    experts = op.in_shapes[4][0]
    loads = op.node.meta.get(ROUTING_KEY)
    if not loads or len(loads) != experts or sum(loads) != tokens * k:
        loads = [tokens * k / experts] * experts
    factor = op.options.expert_capacity
    return capped(loads, None if factor is None else expert_capacity(tokens, k, experts, factor))


def capped(loads, capacity: int | None) -> list:
    """Each expert's load capped at ``capacity`` (None: as routed)."""
    return list(loads) if capacity is None else [min(load, capacity) for load in loads]


def measured_kept(loads, factor: float | None) -> list:
    """The measured ``loads`` (one call's ``T k`` pairs per expert) capped at the capacity of ``factor``."""
    return capped(loads, None if factor is None else expert_capacity(sum(loads), 1, len(loads), factor))


def expert_axis(axes) -> int | None:
    """The mesh axis whose candidate splits the experts (None: none)."""
    return next((ax for ax, a in enumerate(axes) if a.note in EXPERT_NOTES), None)


def experts_lines(records: Sequence[NodeRecord], data) -> list:
    """The summary's lines on MoE layers: per layer kind, the axis carrying the experts (or that
    none does) and the routed imbalance at that axis's size (measured, or assumed 1.0);
    ``records``: the plan's, typed."""
    moe = [r for r in records if str(r.target).startswith("partita.moe_experts")]
    if not moe:
        return []
    mesh = dict(zip(data["mesh"]["axis_names"], data["mesh"]["shape"]))
    routing = data.get("routing") or {}
    by_axis: dict = {}
    for r in moe:
        split = [(axis, note) for axis, note in (r.notes or {}).items() if note in EXPERT_NOTES]
        by_axis.setdefault(split[0] if split else None, []).append(r.name)
    mode = data.get("expert_parallel", "auto")
    lines = []
    for key, names in by_axis.items():
        if key is None:
            lines.append(f"experts (expert_parallel={mode!r}): replicated on every axis in {len(names)} MoE layer(s)")
            continue
        axis, note = key
        how = "tokens dispatched and combined by all-to-all" if note == "experts" else "tokens whole, partial sums"
        ratios = [
            imbalance(measured_kept(routing[n], data.get("expert_capacity")), mesh[axis]) for n in names if n in routing
        ]
        load = (
            f"routed imbalance (max/mean pairs per rank) {max(ratios):.2f}, measured on the example batch"
            if ratios
            else "routed imbalance not measured (taken as 1.00)"
        )
        lines.append(
            f"experts (expert_parallel={mode!r}): split over mesh axis {axis} ({mesh[axis]} ranks) in "
            f"{len(names)} MoE layer(s), {how}; {load}"
        )
    hidden = [axis for r in moe for axis, note in (r.notes or {}).items() if note == HIDDEN_NOTE]
    for axis in sorted(set(hidden)):
        lines.append(
            f"experts: hidden dim split over mesh axis {axis} ({mesh[axis]} ranks) inside the experts in "
            f"{hidden.count(axis)} MoE layer(s) (EP x TP: gate/up partial sums all-reduced)"
        )
    factor = data.get("expert_capacity")
    if factor is not None:
        lines.append(_capacity_line(factor, [routing[r.name] for r in moe if r.name in routing]))
    return lines


def _capacity_line(factor: float, measured: list) -> str:
    """The summary's line on token dropping: the pairs kept on the example batch, where measured."""
    if not measured:
        return f"experts: tokens over capacity factor {factor:g} dropped (routing not measured: priced as uniform)"
    routed = sum(sum(loads) for loads in measured)
    kept = sum(sum(measured_kept(loads, factor)) for loads in measured)
    return (
        f"experts: tokens over capacity factor {factor:g} dropped: {kept} of {routed} routed pairs kept "
        f"({100 * (routed - kept) / routed:.1f}% dropped) on the example batch"
    )


class ExpertsRule(OpRule):
    contraction = True
    saves_inputs = True
    follower = False
    unpacks_in_turn = True  # one product per stacked weight (runtime.expert_dispatch._GroupedLinear)

    def axis_strategies(self, op: OpView) -> list:
        tokens, k = op.in_shapes[1]
        experts, hidden = op.in_shapes[4][0], op.in_shapes[0][1]
        mode = op.options.expert_parallel
        out = [AxisStrategy(out=(R,), ins=(R,) * 5)]
        if tokens > 1:
            out.append(AxisStrategy(out=(Shard(0),), ins=(Shard(0),) * 3 + (R, R)))
        if mode == "off" or experts <= 1:
            return out
        dtype = op.out_dtypes[0] or torch.float32
        rows = float(sum(kept_loads(op)) * hidden)
        extra: tuple = (("all_to_all", "fwd", experts * 8.0 / dtype.itemsize, "none"),)
        extra += tuple(("all_to_all", phase, rows, "local") for phase in ("fwd", "fwd", "bwd", "bwd"))
        out.append(AxisStrategy(out=(Shard(0),), ins=(Shard(0),) * 5, extra=extra, note="experts"))
        out.append(AxisStrategy(out=(P,), ins=(R, R, R, Shard(0), Shard(0)), note="experts_local"))
        inner = op.in_shapes[4][2]
        if len(op.options.axis_sizes()) > 1:  # beside expert parallelism on another axis: EP x TP
            kept = float(sum(kept_loads(op)))
            extra = (("all_reduce", "fwd", kept * 2 * inner, "work"), ("all_reduce", "bwd", kept * inner, "work"))
            ins = (Shard(1), R, R, Shard(2), Shard(1))
            out.append(AxisStrategy(out=(Shard(1),), ins=ins, extra=extra, note=HIDDEN_NOTE))
        return out

    def combination_ok(self, axes, op) -> bool:
        """The experts split on one axis at most; under ``"on"`` on exactly one of more than one device."""
        split = [ax for ax, a in enumerate(axes) if a.note in EXPERT_NOTES]
        if len(split) > 1 or sum(a.note == HIDDEN_NOTE for a in axes) > 1:
            return False
        if any(a.note == HIDDEN_NOTE for a in axes) and not split:
            return False  # the hidden split serves expert parallelism on another axis
        if op.options.expert_parallel == "on":
            mesh = op.options.mesh_shape
            return len(split) == 1 and mesh[split[0]] > 1 and op.options.expert_axis in (None, split[0])
        return True

    def own_axes_of_instance(self, node, leader, axes) -> tuple:
        """A repeated MoE layer's all-to-alls (and hidden-split all-reduces) carry its own kept
        pairs (its routing, capped), not its block leader's: the leader's rows scaled by their
        ratio (measured on both, else equal); the counts stay."""
        mine, theirs = node.meta.get(KEPT_KEY), leader.meta.get(KEPT_KEY)
        if not mine or not theirs or sum(mine) == sum(theirs):
            return axes
        return tuple(
            replace(
                a,
                extra=tuple(
                    (kind, phase, e * sum(mine) / sum(theirs) if scaling != "none" else e, scaling)
                    for kind, phase, e, scaling in a.extra
                ),
            )
            for a in axes
        )

    def flops(self, op: OpView) -> float:
        _, hidden, inner = op.in_shapes[4]
        return 6.0 * sum(kept_loads(op)) * hidden * inner

    def work_scale(self, op: OpView, strategy, mesh_shape) -> float:
        """The imbalance of the expert axis (module docstring) over the pairs kept, 1.0 without one."""
        ax = expert_axis(strategy.axes)
        if ax is None or ROUTING_KEY not in op.node.meta:
            return 1.0
        return imbalance(kept_loads(op), mesh_shape[ax])

    @staticmethod
    def _buffers(op: OpView, hidden_share: float = 1.0) -> tuple:
        """(bytes that scale with the rank's tokens, bytes that scale with the rows its experts
        compute), at the graph's shapes: per pair, the row back from its expert (``H``) and two
        int64 indices; per routed row, the dispatched row, the gate/up product, the activation
        and the product fed to ``down_proj`` (``H + 4 I``) and two int64 indices."""
        tokens, k = op.in_shapes[1]
        _, hidden, inner = op.in_shapes[4]
        hidden = hidden * hidden_share
        elem = (op.out_dtypes[0] or torch.float32).itemsize
        pairs, kept = tokens * k, sum(kept_loads(op))
        return float(pairs * (hidden * elem + 16)), float(kept * ((hidden + 4 * inner) * elem + 16))

    def saves(self, op: OpView, grads):
        """What :func:`runtime.expert_dispatch.experts_forward` keeps: the top-k weights and the
        expert weights (inputs 2-4) and its own buffers (:meth:`_buffers`, every routed row
        counted once)."""
        return Saves(inputs=(2, 3, 4), extra_bytes=sum(self._buffers(op)))

    def buffer_share(self, op: OpView, placed: list, mesh_shape) -> float | None:
        """The pairs' buffers follow the rank's share of the tokens; the routed rows' that share
        over the ranks splitting the experts where the tokens are whole (local experts: each
        rank computes ``1 / n`` of the pairs): their mean over the ranks."""
        tokens, rows = self._buffers(op)
        spec, experts = placed[0][1], placed[3][1]
        if spec is None or experts is None:
            return None
        token_share, routed_share, hidden_share = 1.0, 1.0, 1.0
        for p, e, n in zip(spec, experts, mesh_shape):
            if isinstance(p, Shard) and p.dim == 1:  # the hidden split inside the experts
                hidden_share /= n
            elif isinstance(p, Shard):
                token_share /= n
                routed_share /= n
            elif isinstance(e, Shard):
                routed_share /= n
        if hidden_share < 1.0:  # the rows' H elements shrink, their 4 I and indices do not
            tokens_h, rows_h = self._buffers(op, hidden_share)
            return (tokens_h * token_share + rows_h * routed_share) / (tokens + rows)
        return (tokens * token_share + rows * routed_share) / (tokens + rows)

    def lower(self, call):
        from runtime.expert_dispatch import ExpertDispatch

        notes = getattr(call, "notes", None) or {}
        axis, mode, hidden_axis = None, "whole", None
        for name, note in notes.items():
            a = call.comm.axis_names.index(name)
            if note in EXPERT_NOTES and call.comm.shape[a] > 1:
                axis, mode = a, "all_to_all" if note == "experts" else "local"
            if note == HIDDEN_NOTE and call.comm.shape[a] > 1:
                hidden_axis = a
        activation = call.view.arg(5, "activation")
        module = ExpertDispatch(call.comm, activation, axis=axis, mode=mode, hidden_axis=hidden_axis)
        return call.call_module(module, call.args[:5], {})


register(MOE_OP)(ExpertsRule())
