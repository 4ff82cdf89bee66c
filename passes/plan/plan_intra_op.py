"""Intra-op planning: build the space, solve the ILP, write the decision on every node.

``plan_intra_op`` runs blocks -> strategy space -> ILP and returns an :class:`IntraOpResult`
whose ``records`` describe every node of the real graph (its placements, local shapes,
compute time, the collectives on its incoming edges in both directions, memory) as plain
JSON-ready dicts, together with the solver's alternatives for each decision (for
``explain``). Each node also gets ``node.meta["partita.choice"]`` (its NodeChoice).

The per-record costs add up to the ILP objective exactly: the plan's estimate is the same
arithmetic the solver optimised.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch.fx as fx

from passes.analysis.analyze import info
from passes.analysis.mutated_aliases import mutated_alias_pins
from passes.capture.blocks import find_blocks
from passes.capture.capture import tied_placeholders
from passes.core.node_info import grad_flows
from passes.core.placements import format_spec, local_shape, zero1_grad_spec
from passes.core.plan_records import NodeRecord
from passes.lower.prefetch_gathers import credit_prefetch
from passes.plan.activation_regather import regathers_activation
from passes.plan.bucket_overlap import credit_bucket_overlap
from passes.plan.budget_fit import fit_peak
from passes.plan.collective_calls import StepLatencies, step_latencies
from passes.plan.cost_model import (
    collective_time,
    dtype_bytes,
    grad_accumulate_time,
    grad_held_back,
    host_copy_time,
    local_bytes,
    optimizer_step_time,
    own_collectives,
)
from passes.plan.edge_costs import edge_collectives
from passes.plan.ilp_solver import NODE_LIMIT, TIME_LIMIT_S, min_memory, problem_key, solve_ilp
from passes.plan.memory_accounting import memory_fields
from passes.plan.memory_peak import memory_breakdown
from passes.plan.output_placement import required_output_spec
from passes.plan.peak_floor import PeakFloor, peak_floor
from passes.plan.recompute import (
    RecomputeChoice,
    add_recompute_options,
    check_recompute_mode,
    least_memory,
)
from passes.plan.strategy_space import build_space
from passes.plan.zero_storage import regathers, zero1_collectives
from passes.rules import REPLICATE_FALLBACK, multidim_tp, op_name, rule_for, tensor_input_nodes

__all__ = ["InfeasibleBudgetError", "IntraOpResult", "plan_intra_op"]

CHOICE_KEY = "partita.choice"


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget. ``by_bound``: refused by the least memory of the decisions'
    own terms, before solving (what no edge's buffer, kept or not, changes). ``floor``: refused by
    the floor of every plan's walked peak (:mod:`passes.plan.peak_floor`), which keeping
    activations as shards does not lower either."""

    by_bound = False
    floor: PeakFloor | None = None


@dataclass
class IntraOpResult:
    records: list
    alternatives: dict
    blocks: list
    stats: dict = field(default_factory=dict)
    latencies: StepLatencies = field(default_factory=StepLatencies)
    """The step's latency prices the records' entries leave out (flat calls, arrival waits)."""


def _fmt_specs(specs):
    return [None if s is None else format_spec(s) for s in specs]


def _collective_dicts(collectives, phase, input_index, mesh_shape, cluster, axis_names):
    return [
        {
            "kind": c.kind,
            "axis": axis_names[c.axis],
            "bytes": float(c.payload_bytes),
            "phase": phase,
            "input": input_index,
            "time_s": collective_time(c, mesh_shape, cluster),
            **({"bucketed": True} if c.bucketed else {}),
        }
        for c in collectives
        if mesh_shape[c.axis] > 1  # a one-device axis sends nothing
    ]


def _node_record(node, choice, space, axis_names, rep_node):
    i = info(node)
    mesh = space.mesh_shape
    cluster = space.cluster
    rec = {
        "name": node.name,
        "kind": i.kind,
        "module": i.module_path,
        "target": op_name(node.target) if node.op == "call_function" else node.op,
        "fqn": i.name if i.kind in ("param", "buffer", "input") else None,
        "shapes": [list(s) if s is not None else None for s in i.out_shapes],
        "dtype": str(i.dtype).replace("torch.", "") if i.dtype is not None else None,
        "inputs": [a.name for a in tensor_input_nodes(node)],
        "rep": rep_node.name,
    }
    if choice is None:
        rec.update(out=[], ins=[], local_shapes=[], comm=[], compute_s=0.0, memory=0.0)
        return rec
    rec["out"] = _fmt_specs(choice.out)
    rec["ins"] = _fmt_specs(choice.ins)
    if choice.strategy is not None:
        inputs = tensor_input_nodes(node)
        # None where the input needs a gradient this op does not pass back (it leads to no output)
        stops = [
            k < len(inputs) and info(inputs[k]).requires_grad and not grad_flows(inputs[k], node)
            for k in range(len(choice.ins))
        ]
        rec["grads"] = _fmt_specs([None if stop else choice.strategy.grad_spec(k) for k, stop in enumerate(stops)])
    rec["local_shapes"] = [
        list(local_shape(s, sp, mesh)) if s is not None and sp is not None else None
        for s, sp in zip(i.out_shapes, choice.out)
    ]
    rec["compute_s"] = float(choice.compute_s)
    if choice.forward_s:
        rec["forward_s"] = float(choice.forward_s)
    if choice.regather:
        rec["regather"] = True  # ZeRO-3: gathered copies freed after forward, gathered again for backward
    comm = []
    if choice.stored is not None or choice.offload:  # a compute copy: its reduction (and gather) once per step
        stored = choice.stored or choice.out[0]
        if choice.stored is not None:  # ZeRO-1: the optimizer's shard
            rec["stored"] = format_spec(choice.stored)
        rs, ag = zero1_collectives(choice.out[0], stored, i.shape, dtype_bytes(i.dtype), mesh, space.grad_reduce_bytes)
        comm += _collective_dicts(rs, "bwd", None, mesh, cluster, axis_names)
        comm += _collective_dicts(ag, "fwd", None, mesh, cluster, axis_names)
        if choice.offload:  # optimizer state and step on the host: the gradient there and the tensor back
            rec["offload"] = True
            rec["host_transfer_s"] = host_copy_time(local_bytes(i.shape, stored, mesh, dtype_bytes(i.dtype)), cluster)
    if i.kind == "param" and i.requires_grad and space.optimizer is not None:
        # the optimizer's step over the tensor it steps (the stored piece, or its ZeRO-1 shard)
        numel = local_bytes(i.shape, choice.stored or choice.out[0], mesh, 1)
        rec["optimizer_step_s"] = optimizer_step_time(
            numel, dtype_bytes(i.dtype), space.optimizer, cluster, offloaded=bool(choice.offload)
        )
    weight_grad_s = float(choice.weight_grad_s)
    if i.kind == "param" and i.requires_grad and node.users:
        # summing the microbatches' gradients into .grad: backward work, done by the W pass
        accumulate = grad_accumulate_time(
            local_bytes(i.shape, choice.out[0], mesh, dtype_bytes(i.dtype)), space.microbatches, cluster
        )
        if accumulate:
            rec["grad_accumulate_s"] = accumulate
            rec["compute_s"] += accumulate
            weight_grad_s += accumulate
    if weight_grad_s:
        rec["weight_grad_s"] = weight_grad_s
    rec["memory"] = float(choice.memory)
    roles = multidim_tp.classify(node, choice.strategy)
    if roles is not None:  # a weight contraction: its per-axis roles (the algorithm: label_records)
        rec["tp_roles"], rec["tp_weight"] = roles, multidim_tp.weight_input(node).name
    strategy = choice.strategy
    if strategy is not None:
        split = strategy.compute_split(mesh)
        for ax, a in enumerate(strategy.axes):
            if a.note:
                rec.setdefault("notes", {})[axis_names[ax]] = a.note
        backward_s = choice.compute_s - choice.forward_s
        axes = strategy.axes if rep_node is node else rule_for(node).own_axes_of_instance(node, rep_node, strategy.axes)
        for c, phase, t in own_collectives(
            axes, dtype_bytes(i.dtype), mesh, cluster, split, choice.forward_s, backward_s
        ):
            if (phase == "bwd" and not i.requires_grad) or mesh[c.axis] <= 1:
                continue
            (entry,) = _collective_dicts([c], phase, None, mesh, cluster, axis_names)
            entry["time_s"] = t
            comm.append(entry)
    rec["comm"] = comm
    return rec


def _edge_comm(node, choices, space, axis_names):
    """Collectives on the edges into ``node`` (forward and backward)."""
    mesh = space.mesh_shape
    out = []
    mine = choices.get(node)
    for k, u in enumerate(tensor_input_nodes(node)):
        if info(u).kind == "ignored" or choices.get(u) is None:
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            continue
        if node.op == "output":
            dst, grad = required_output_spec(node.graph, k, choices[u].out[0]), None
            if dst is None:
                continue
        else:
            if mine is None or mine.ins[k] is None:
                continue
            dst = mine.ins[k]
            grad = mine.strategy.grad_spec(k) if mine.strategy is not None and grad_flows(u, node) else None
        ui = info(u)
        held = choices[u].stored is not None or choices[u].offload  # a compute copy: its gradient stays Partial
        fwd, bwd = edge_collectives(
            choices[u].out[0],
            dst,
            grad,
            ui.shape or (),
            dtype_bytes(ui.dtype),
            mesh,
            ui.requires_grad,
            from_param=ui.kind == "param",
            grad_reduce_bytes=space.grad_reduce_bytes,
            grad_dst=zero1_grad_spec(choices[u].out[0], mesh) if held else None,
        )
        out += _collective_dicts(fwd, "fwd", k, mesh, space.cluster, axis_names)
        synced = _collective_dicts(bwd, "bwd", k, mesh, space.cluster, axis_names)
        if ui.kind == "param" and synced and grad_held_back(choices[u].out[0], grad, mesh):
            synced = [dict(c, held=True) for c in synced]  # a pipeline stage sends it once per step
        out += synced
        if ui.kind == "op":  # an activation kept as its shard (passes/plan/activation_regather.py)
            again = space.regather_activations and regathers_activation(node, k, u, choices[u].out[0], dst, mesh)
        else:  # a ZeRO-3 parameter: its gathered copy is freed after forward
            again = choices[u].regather and regathers(node, k, choices[u].out[0], dst, mesh)
        if again:  # ... and gathered again here
            out += [dict(c, regather=True) for c in _collective_dicts(fwd, "bwd", k, mesh, space.cluster, axis_names)]
    return out


def plan_intra_op(
    cap,
    mesh_shape,
    axis_names,
    cluster,
    *,
    budget=None,
    pins=None,
    objective="time",
    optimizer="adam",
    share_blocks=True,
    time_limit=TIME_LIMIT_S,
    max_options="auto",
    activation_copies=1,
    grad_reduce_bytes=None,
    recompute="auto",
    log=None,
    zero="auto",
    zero1=True,
    host_budget=None,
    microbatches=1,
    holds_gradient_sums=False,
    rule_options=None,
    regather_activations=False,
) -> IntraOpResult:
    """``recompute``: activation checkpointing of repeated blocks, ``"auto"`` (kept, selective or
    full, chosen by the solver when the budget needs it), ``"selective"``, ``"all"`` or ``"none"``
    (:mod:`passes.plan.recompute`). ``zero1``: offer ZeRO-1 weights.
    ``host_budget``: host-memory bytes per device for offloaded optimizer state (None: nothing is
    offloaded); offloading only adds time, so it is chosen when the device budget needs it.
    ``holds_gradient_sums``: a pipeline stage, which holds its parameter-gradient sums over the
    microbatches of a step (counted in its memory: :func:`passes.plan.memory_accounting.memory_fields`).
    ``rule_options``: the algorithm modes forced on the rules (:class:`passes.core.rule_options.RuleOptions`
    for ``mesh_shape``); None: none.
    ``regather_activations``: activations gathered for an op that keeps them are kept as their
    shard and gathered again in backward (:mod:`passes.plan.activation_regather`; the records name
    those inputs, ``regather_inputs``)."""
    log = log or (lambda msg: None)
    check_recompute_mode(recompute)
    graph: fx.Graph = cap.graph
    REPLICATE_FALLBACK.warned.clear()  # each plan names every op it could not shard, once
    t0 = time.perf_counter()
    blocks = find_blocks(graph, enabled=share_blocks)
    _tie_aliases(cap, blocks)
    # tensors written in place through views stay replicated (a user's pin wins)
    pins = {**mutated_alias_pins(graph, len(mesh_shape)), **(pins or {})}
    space = build_space(
        graph,
        blocks,
        mesh_shape,
        cluster,
        pins=_representative_pins(pins, blocks),
        optimizer=optimizer,
        max_options=max_options,
        activation_copies=activation_copies,
        grad_reduce_bytes=grad_reduce_bytes,
        zero=zero,
        zero1=zero1,
        offload=host_budget is not None,
        microbatches=microbatches,
        rule_options=rule_options,
        regather_activations=regather_activations,
    )
    t1 = time.perf_counter()
    n_opts = _log_space(log, space, t1 - t0)

    floor = _floor_within(budget, graph, space, cap, recompute, activation_copies)
    solve = _Solves(space, objective=objective, zero=zero, time_limit=time_limit, host_budget=host_budget)
    result, redo, peak_of, least, least_kept = _solve_within_budget(
        solve, cap, budget, recompute, activation_copies, holds_gradient_sums, mesh_shape
    )
    t2 = time.perf_counter()
    if result.choice is None:
        _no_plan(result, space, budget, host_budget, redo, time_limit, least)
    if budget is not None:
        result, t2 = _fit_budget(result, budget, solve, redo, peak_of, least), time.perf_counter()
    recomputed = redo.decode(result.choice)  # block label -> "kept" / "selective" / "full"
    regions = redo.regions(blocks, recomputed)
    if regions:
        log(f"recomputed in backward: {', '.join(f'{b} ({m})' for b, m in recomputed.items() if m != 'kept')}")
    log(f"solve: {t2 - t1:.2f} s, objective {result.objective * 1e3:.3f} ms{_proven(result)}")

    records, (overlap, hidden) = _decoded_records(
        cap, space, result.choice, axis_names, redo, regions, optimizer, activation_copies, holds_gradient_sums
    )

    alternatives = _alternatives(space, result.choice, axis_names, redo)
    t3 = time.perf_counter()
    stats = _stats(space, result, (t0, t1, t2, t3), n_opts, (overlap, hidden), records, (least, least_kept, floor))
    stats["ilp_solves"], stats["ilp_asked"] = len(solve.known), solve.asked  # distinct problems solved, and asked
    typed = [NodeRecord.from_dict(r) for r in records]
    latencies = step_latencies(typed, mesh_shape, axis_names, cluster)
    return IntraOpResult(
        records=records,
        alternatives=alternatives,
        blocks=_block_summaries(blocks, recomputed),
        stats=stats,
        latencies=latencies,
    )


def _decoded_records(cap, space, choice, axis_names, redo, regions, optimizer, activation_copies, holds_gradient_sums):
    """The plan's records under the solver's ``choice``, with each node's exact memory fields
    (:func:`passes.plan.memory_accounting.memory_fields`), its grid labels, and the prefetched gathers'
    credit: (records, (seconds of gathers overlapped, seconds of gradient reductions hidden by
    backward's compute))."""
    graph, blocks = cap.graph, space.blocks
    choices = _choices(graph, space, blocks, choice)
    records = _records(cap, space, blocks, choices, axis_names, redo, regions, activation_copies)

    exact = memory_fields(
        graph,
        choices,
        space.mesh_shape,
        optimizer=optimizer,
        activation_copies=activation_copies,
        tied=tied_placeholders(cap),
        recomputed=regions,
        holds_gradient_sums=holds_gradient_sums,
        regather_activations=space.regather_activations,
    )
    for rec in records:
        rec.update(exact.get(rec["name"], {}))
    multidim_tp.label_records(records, space.mesh_shape)
    # weight gathers started ahead of their use (passes/lower/prefetch_gathers.py), at the measured overlap
    overlap = credit_prefetch(records, getattr(space.cluster, "prefetch_overlap", 1.0))
    hidden = 0.0
    if not holds_gradient_sums:  # buckets reduced beside backward (a pipeline stage holds its syncs)
        reductions = credit_bucket_overlap(records, space.mesh_shape, axis_names)
        hidden = reductions.total_s - reductions.exposed_s
    return records, (overlap, hidden)


def _log_space(log, space, seconds: float) -> int:
    """Log the strategy space's size; returns its number of options."""
    n_opts = sum(len(g.options) for g in space.groups)
    log(
        f"strategy space: {len(space.groups)} decisions, {n_opts} options, {len(space.edges)} edges, "
        f"{len(space.blocks.groups)} repeated block kind(s) ({seconds:.2f} s)"
        + (f"; {space.pruned} high-compute options pruned" if space.pruned else "")
    )
    return n_opts


def _fit_budget(result, budget, solve: _Solves, redo, peak_of, least: float):
    """``result`` re-solved until its exact peak memory fits ``budget`` (:func:`_fit_peak`);
    ``least``: the least of the ILP's row."""
    return _fit_peak(
        result,
        budget,
        lambda limit: solve(limit, redo, nodes=RETRY_NODES),
        peak_of,
        lambda: solve(None, redo, "memory"),
        lambda limit, cap: solve(limit, redo, "memory", nodes=RETRY_NODES, time_cap=cap),
        least,
    )


def _proven(result) -> str:
    """How far from optimal a solve stopped, when it stopped before proving its plan optimal."""
    gap = 100 * (result.gap or 0)
    return "" if result.optimal else f" (search stopped at its node limit, within {gap:.2f}% of optimal)"


def _no_plan(result, space, budget, host_budget, redo, time_limit, least) -> NoReturn:
    """Raise for a solve that found no plan: naming the host budget when it is what is short,
    else the least memory any plan needs."""
    if host_budget is not None:
        _check_host_budget(space, budget, host_budget, redo, time_limit)
    raise InfeasibleBudgetError(
        f"the solver found no plan within the budget ({result.message}); the least memory "
        f"any plan needs is {least / 2**30:.3f} GiB"
    )


def _stats(space, result, times, n_opts, credits, records, floors) -> dict:
    """The plan's ``stats``: phase times (``times``: start, space built, solved, decoded), the
    space's size, the solver's objective and gap, the overlap credits (``credits``: prefetched
    gathers, gradient reductions) and the memory floors (``floors``: the least-memory plans'
    peaks with and without recomputation, and the peak floor or None)."""
    t0, t1, t2, t3 = times
    overlap, hidden = credits
    least, least_kept, floor = floors
    stats = {
        "build_s": t1 - t0,
        "solve_s": t2 - t1,
        "ilp_gap": 0.0 if result.optimal else result.gap,
        "decode_s": t3 - t2,
        "decisions": len(space.groups),
        "options": n_opts,
        "edges": len(space.edges),
        "objective_s": result.objective,
        "prefetch_overlap_s": overlap,
        "bucket_overlap_s": hidden,
        "optimizer_step_s": sum(r.get("optimizer_step_s", 0.0) for r in records),
        "pruned_options": space.pruned,
        "least_memory": least,
        "least_memory_without_recompute": least_kept,
    }
    if floor is not None:
        stats["peak_floor"] = floor.total
    return stats


def _representative_pins(pins, blocks) -> dict:
    """The pins by the representative node of each (repeated blocks share one decision); raises
    naming the parameter when two layers are pinned apart."""
    rep_pins = {}
    for node, spec in (pins or {}).items():
        r = blocks.represent(node)
        if r in rep_pins and rep_pins[r] != spec:
            raise ValueError(
                f"conflicting pins for {info(node).name}: {format_spec(rep_pins[r])} and "
                f"{format_spec(spec)} (repeated blocks share one decision; pin all layers alike)"
            )
        rep_pins[r] = spec
    return rep_pins


class _Solves:
    """The ILP over ``space`` (:func:`passes.plan.ilp_solver.solve_ilp`), with the options it may
    leave out: ZeRO-3's regathering twins and ZeRO-1's shards (``twins``, ``shards``)."""

    def __init__(self, space, *, objective, zero, time_limit, host_budget):
        self.space, self.objective, self.time_limit, self.host_budget = space, objective, time_limit, host_budget
        groups = space.groups
        self.twins = [(gi, i) for gi, g in enumerate(groups) for i, o in enumerate(g.options) if o[g.leader].regather]
        # ZeRO-1 weights cost what replicated ones do (a reduce-scatter and an all-gather instead of an
        # all-reduce) and only save memory: outside a forced ``zero=1`` they are left out of the solves
        # made before the budget needs them, so a plan that fits without them has none
        forced1 = 1 in (zero.values() if isinstance(zero, dict) else [zero])
        self.shards = (
            []
            if forced1
            else [
                (gi, i)
                for gi, g in enumerate(groups)
                for i, o in enumerate(g.options)
                if o[g.leader].stored is not None
            ]
        )
        self.forced3 = 3 in (zero.values() if isinstance(zero, dict) else [zero])  # some weight must regather
        # each distinct problem is solved once (HiGHS is deterministic: the same problem, the same plan); the
        # budget fitting asks some again (a tightening whose next limit is one it has solved)
        self.known: dict = {}
        self.asked = 0

    def __call__(self, limit, redo, objective=None, zero3=True, nodes=NODE_LIMIT, zero1=True, time_cap=None):
        space, host_budget = self.space, self.host_budget
        forbidden = ([] if zero3 else self.twins) + ([] if zero1 else self.shards)
        problem = (
            [g.cost for g in space.groups],
            [g.memory for g in space.groups],
            [(e.src, e.dst, e.src_class, e.dst_class, e.matrix, e.memory) for e in space.edges],
        )
        options = dict(
            budget=limit,
            links=redo.rows(),
            objective=objective or self.objective,
            time_limit=self.time_limit,
            forbidden=forbidden or None,
            node_limit=nodes,
            host=([g.host_memory for g in space.groups], host_budget) if host_budget is not None else None,
            time_cap=time_cap,
        )
        self.asked += 1
        key = problem_key(*problem, **options)
        if key in self.known:
            return self.known[key]
        result = solve_ilp(*problem, **options)
        if result.choice is not None:  # the memory row's value (the budget fitting tightens below it)
            result.row = _row_of(space, result.choice)
        self.known[key] = result
        return result


def _row_of(space, choice: list) -> float:
    """The ILP's memory row at ``choice``: each decision's option and each edge's kept buffers."""
    row = sum(float(g.memory[i]) for g, i in zip(space.groups, choice))
    for e in space.edges:
        if e.memory is not None:
            row += float(e.memory[e.src_class[choice[e.src]], e.dst_class[choice[e.dst]]])
    return row


def _solve_within_budget(solve: _Solves, cap, budget, recompute, activation_copies, holds_gradient_sums, mesh_shape):
    """The cheapest plan, reaching for what only saves memory (recomputation, ZeRO-3, ZeRO-1) only
    when the budget needs it: (result, the recompute choice, the peak-memory function, least
    memory, least memory without recomputation)."""
    space, graph, blocks = solve.space, cap.graph, solve.space.blocks
    twins, shards = solve.twins, solve.shards
    optimizer = space.optimizer
    redo = RecomputeChoice()
    peak_of = _peak_of(space, cap, optimizer, activation_copies, lambda: redo, holds_gradient_sums)
    least_kept = min_memory([g.memory for g in space.groups])
    least = least_kept
    result = None
    if recompute == "auto" and blocks.groups:
        # Recomputation only adds time: when the best plan without it fits, it is the best plan.
        free = solve(None, redo, zero1=False)
        used = free.choice is not None and peak_of(free.choice)[0]
        if free.choice is not None and (budget is None or used <= budget):
            result = free
    forced = solve.forced3
    if result is None and budget is not None and (twins or shards) and not forced and recompute in ("auto", "none"):
        # ZeRO-3 only adds time too (a second gather): the best plan without it, if its peak fits
        result = _without_zero3(budget, solve, redo, peak_of, least_kept)
        chosen = set(zip(range(len(result.choice)), result.choice)) if result is not None else set()
        if chosen & set(shards):  # ZeRO-1 ties replicated: kept only where it saves time
            most = result.objective * (1 + 1e-9)
            plain = _without_zero3(budget, solve, redo, peak_of, least_kept, zero1=False, most=most)
            if plain is not None and plain.objective <= most:
                result = plain
    if result is None:
        # the plan that keeps the least without recomputation (the walked peak is below the ILP's row),
        # solved only where no plain plan fits the row (otherwise the budgeted solve below finds one)
        row_short = budget is not None and least_kept > budget
        least_plain = _least_if_it_fits(solve, redo, budget, peak_of) if row_short else None
        redo = add_recompute_options(space, graph, recompute, activation_copies)
        least = least_memory(space, redo)
        # the ILP's memory row bounds the walked peak from above: where the row leaves no plan, the
        # plan that keeps the least may still fit
        result = solve(budget, redo) if budget is None or least <= budget else None
        if budget is not None and (result is None or result.choice is None):
            fallback = least_plain or _least_if_it_fits(solve, redo, budget, peak_of)
            if fallback is None and least > budget:
                refused = InfeasibleBudgetError(_infeasible(budget, mesh_shape, least_kept, least, recompute, blocks))
                refused.by_bound = True
                raise refused
            result = fallback or result
        assert result is not None  # solved, or the least plan, or refused above
        if result.choice is not None and set(zip(range(len(result.choice)), result.choice)) & set(shards):
            plain = solve(budget, redo, zero1=False)  # ZeRO-1 ties replicated: only where it saves time
            if plain.choice is not None and plain.objective <= result.objective * (1 + 1e-9):
                result = plain
    return result, redo, peak_of, least, least_kept


def _floor_within(budget, graph, space, cap, recompute: str, activation_copies: int) -> PeakFloor | None:
    """The floor of every plan's walked peak under a budget (None without one); a budget under it
    is refused here, before any solve."""
    if budget is None:
        return None
    floor = peak_floor(
        graph, space, tied=tied_placeholders(cap), recompute=recompute, activation_copies=activation_copies
    )
    _refuse_below_floor(floor, space.mesh_shape, budget, recompute)
    return floor


def _refuse_below_floor(floor: PeakFloor, mesh_shape, budget, recompute: str = "auto") -> None:
    """Refuse, before any solve, a budget under the floor of every plan's walked peak."""
    if floor.total <= budget:
        return
    if recompute == "none":  # the floor counts the activations every block keeps
        remedy = "With recompute='none' every block's activations are kept; recompute='auto' or 'all' may lower it."
    else:
        remedy = "Recomputation does not lower this floor."
    refused = InfeasibleBudgetError(
        f"no plan fits {budget / 2**30:.4f} GiB per device ({budget:.0f} bytes) on mesh {tuple(mesh_shape)}: the "
        f"least memory any plan needs is {floor.total / 2**30:.4f} GiB ({floor.total:.0f} bytes) at its peak, at "
        f"least: {floor.explain()}. {remedy} Raise the budget, use a larger mesh "
        f"(more devices to shard over), offload optimizer state to the host (host_memory_budget=...), or a lighter "
        f"optimizer (optimizer='sgd')."
    )
    refused.by_bound, refused.floor = True, floor
    raise refused


def _least_if_it_fits(solve: _Solves, redo, budget, peak_of):
    """The plan that keeps the least (the memory objective, no budget row; with ZeRO-1 on offer and
    without it, as the row ranks them otherwise than the walked peak) if its walked peak fits
    ``budget``, else None."""
    for zero1 in (False, True):
        least = solve(None, redo, "memory", zero1=zero1)
        if least.choice is not None and peak_of(least.choice)[0] <= budget:
            return least
    return None


def _choices(graph, space, blocks, choice: list) -> dict:
    """Node -> its NodeChoice under the solver's ``choice`` (every node of a repeated block takes
    its representative's), also written to ``node.meta[CHOICE_KEY]``."""
    rep_choice = {}
    for g, i in zip(space.groups, choice):
        for m in g.members:
            rep_choice[m] = g.options[i][m]
    choices = {}
    for node in graph.nodes:
        c = rep_choice.get(blocks.represent(node))
        if c is not None:
            choices[node] = c
            node.meta[CHOICE_KEY] = c
    return choices


def _records(cap, space, blocks, choices: dict, axis_names, redo, regions, activation_copies) -> list:
    """The plan's record per node (placements, local shapes, collectives, block, decision), in
    graph order."""
    graph = cap.graph
    records = []
    block_label = {}
    for grp in blocks.groups:
        for k, members in enumerate(grp.members):
            for n in members:
                block_label[n] = (grp.label, grp.indices[k])
    leaders = {g.leader for g in space.groups}
    again = {name for names in tied_placeholders(cap) for name in names[1:]}  # one tensor: its step once
    for node in graph.nodes:
        if info(node).kind == "ignored":
            continue
        rep = blocks.represent(node)
        rec = _node_record(node, choices.get(node), space, axis_names, rep)
        if node.name in again:  # a tied weight's ZeRO-1 / offload traffic and its step are its first name's
            rec["comm"] = []
            rec.pop("host_transfer_s", None)
            rec.pop("optimizer_step_s", None)
        rec["comm"] = rec["comm"] + _edge_comm(node, choices, space, axis_names)
        rec["decision"] = "leader" if rep in leaders else ("output" if node.op == "output" else "follower")
        if node in block_label:
            rec["block"], rec["block_index"] = block_label[node]
            if node in regions and node.op == "call_function":
                redo.mark(rec, node, choices.get(node), blocks, regions, activation_copies, space.mesh_shape)
        if rec.get("recompute"):  # its rerun's gathered weights stay until the layer's backward: no regather
            rec["comm"] = [c for c in rec["comm"] if not c.get("regather")]
        from_ops = [k for k, u in enumerate(tensor_input_nodes(node)) if info(u).kind == "op"]
        as_shards = sorted({c["input"] for c in rec["comm"] if c.get("regather") and c["input"] in from_ops})
        if as_shards:  # activations kept as their shard, gathered again in backward (the lowering reads this)
            rec["regather_inputs"] = as_shards
        records.append(rec)

    return records


def _block_summaries(blocks, recomputed: dict) -> list:
    return [
        {
            "label": g.label,
            "count": len(g.indices),
            "prefix": g.prefix,
            "recompute": recomputed.get(g.label, "kept") != "kept",
            "recompute_mode": recomputed.get(g.label, "kept"),
        }
        for g in blocks.groups
    ]


def _check_host_budget(space, budget, host_budget, redo, time_limit) -> None:
    """No plan fits both budgets: when one fits the device budget with more host memory, the host
    budget is what is short; say so, with the host memory the least of those plans needs."""
    groups = space.groups
    least_host = solve_ilp(
        [g.host_memory for g in groups],
        [g.memory for g in groups],
        [(e.src, e.dst, e.src_class, e.dst_class, np.zeros_like(e.matrix), e.memory) for e in space.edges],
        budget=budget,
        links=redo.rows(),
        time_limit=time_limit,
        node_limit=RETRY_NODES,
    )
    if least_host.choice is None:
        return
    need = sum(float(g.host_memory[i]) for g, i in zip(groups, least_host.choice))
    raise InfeasibleBudgetError(
        f"host_memory_budget={host_budget} bytes is too small: the plans that fit the device budget "
        f"({budget} bytes) offload optimizer state: the one with the least keeps {need:.0f} bytes of host "
        f"memory per device (what the device's peak adds may need more offloaded). Raise host_memory_budget "
        f"above that, or the device budget."
    )


def _infeasible(budget, mesh_shape, least_kept, least, recompute, blocks) -> str:
    text = (
        f"no plan fits {budget / 2**30:.3f} GiB per device on mesh {tuple(mesh_shape)}: the least memory any "
        f"plan needs is "
    )
    if recompute == "none" or not blocks.groups:
        text += f"{least / 2**30:.3f} GiB ({least:.0f} bytes) without recomputation"
        if blocks.groups:
            return text + (
                " (recompute='none'). Allow activation checkpointing (recompute='auto'), raise the budget, "
                "use a larger mesh, or a lighter optimizer (optimizer='sgd')."
            )
        return text + (
            " (no repeated blocks to recompute). Raise the budget, use a larger mesh, or a lighter optimizer "
            "(optimizer='sgd')."
        )
    return text + (
        f"{least / 2**30:.3f} GiB ({least:.0f} bytes) with the repeated blocks recomputed in backward "
        f"({least_kept / 2**30:.3f} GiB without). Recomputation is not enough: what is needed next is less "
        f"parameter and optimizer state per device (a larger mesh, or a lighter optimizer: optimizer='sgd'), "
        f"or a larger budget."
    )


def _peak_of(space, cap, optimizer, activation_copies, redo, holds_gradient_sums=False):
    """choice -> (the plan's peak per device, the part of it no ILP row sees: transients). Each
    choice is walked once per recompute choice (a walk of Llama 3 70B's whole model costs seconds;
    the budget fitting asks again for plans it has met, and the least plans with and without ZeRO-1
    on offer are often one)."""
    graph, represent = cap.graph, space.blocks.represent
    tied = tied_placeholders(cap)
    walked: dict = {}  # tuple(choice) -> (peak, transient), under the recompute choice walked["of"]

    def peak(choice):
        if walked.get("of") is not redo():  # a new recompute choice names the space's options anew (it adds them)
            walked.clear()
            walked["of"] = redo()
        key = tuple(choice)
        if key not in walked:
            walked[key] = walk(choice)
        return walked[key]

    def walk(choice):
        picked = {m: g.options[i][m] for g, i in zip(space.groups, choice) for m in g.members}
        choices = {n: picked[represent(n)] for n in graph.nodes if represent(n) in picked}
        fields = memory_fields(
            graph,
            choices,
            space.mesh_shape,
            optimizer=optimizer,
            activation_copies=activation_copies,
            tied=tied,
            recomputed=redo().regions(space.blocks, redo().decode(choice)),
            holds_gradient_sums=holds_gradient_sums,
            regather_activations=space.regather_activations,
        )
        m = memory_breakdown([dict(fields.get(n.name, {}), name=n.name) for n in graph.nodes])
        return m.peak, m.peak - (m.state + m.inputs + m.saved)

    return peak


RETRY_NODES = 250
"""Node limit of the re-solves that fit the peak (``_fit_peak``): they only move the budget by
the transient the first solve measured, and branch and bound finds their best plans in the first
nodes (then spends the rest proving them)."""


def _without_zero3(budget, solve, redo, peak_of, least: float, zero1=True, most=None):
    """The best plan under ``budget`` with no ZeRO-3 option (nor recomputation; nor ZeRO-1 unless
    ``zero1``), or None when its peak does not fit; ``least``: the least of the ILP's row. ``most``:
    None too when the plan under the whole budget takes more seconds (fitting its peak only
    tightens the row: no faster plan; Llama 3 70B's stage classes spent 20 CPU-s fitting a plan
    without ZeRO-1 already 8% slower than the one with it)."""
    kept = solve(budget, redo, zero3=False, zero1=zero1)
    if kept.choice is None or (most is not None and kept.objective > most):
        return None
    try:
        return _fit_peak(
            kept,
            budget,
            lambda limit: solve(limit, redo, zero3=False, nodes=RETRY_NODES, zero1=zero1),
            peak_of,
            lambda: solve(None, redo, "memory", zero3=False, zero1=zero1),
            lambda limit, cap: solve(limit, redo, "memory", zero3=False, nodes=RETRY_NODES, zero1=zero1, time_cap=cap),
            least,
        )
    except InfeasibleBudgetError:
        return None


def _fit_peak(result, budget, solve, peak_of, least_peak, least_as_fast=None, least_kept=0.0):
    """``result`` re-solved until its walked peak fits ``budget``: the row's limit tightened by the
    transients seen, then relaxed toward the budget (:func:`passes.plan.budget_fit.fit_peak`)."""
    return fit_peak(
        result,
        budget,
        solve,
        peak_of,
        least_peak,
        InfeasibleBudgetError,
        least_as_fast=least_as_fast,
        least_kept=least_kept,
    )


def _tie_aliases(cap, blocks) -> None:
    """Tied weights are one tensor: its names (separate placeholders) share one decision."""
    from passes.capture.capture import tied_placeholders

    by_name = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
    for names in tied_placeholders(cap):
        first = blocks.represent(by_name[names[0]])
        for name in names[1:]:
            node = by_name[name]
            if blocks.represent(node) is not node or node is first:
                continue  # already decided by a repeated block's representative
            blocks.rep[node] = first
            blocks.count[first] = blocks.count.get(first, 1) + blocks.count.pop(node, 1)


def _alternatives(space, choice, axis_names, redo, keep=6) -> dict:
    """For each decision: its options' cost given its neighbours' chosen options."""
    local = [g.cost.astype(float).copy() for g in space.groups]
    local_mem = [g.memory.astype(float).copy() for g in space.groups]
    for e in space.edges:
        local[e.src] += e.matrix[e.src_class, e.dst_class[choice[e.dst]]]
        local[e.dst] += e.matrix[e.src_class[choice[e.src]], e.dst_class]
        if e.memory is not None:  # buffers kept on the edge (a gathered weight kept for backward)
            local_mem[e.src] += e.memory[e.src_class, e.dst_class[choice[e.dst]]]
            local_mem[e.dst] += e.memory[e.src_class[choice[e.src]], e.dst_class]
    out = {}
    for gi, g in enumerate(space.groups):
        if len(g.options) < 2:
            continue
        order = list(np.argsort(local[gi], kind="stable"))
        picked = order[:keep]
        if choice[gi] not in picked:
            picked.append(choice[gi])
        leader = g.leader
        options = []
        for i in picked:
            c = g.options[i][leader]
            options.append(
                {
                    "out": _fmt_specs(c.out),
                    "ins": _fmt_specs(c.ins),
                    "time_s": float(local[gi][i]),
                    "memory": float(local_mem[gi][i]),
                    "chosen": bool(i == choice[gi]),
                    **({"recompute": redo.mode_of(gi, i)} if gi in redo.block_of_group else {}),
                    **({"zero": 3} if c.regather else {}),
                    **({"zero": 1, "stored": format_spec(c.stored)} if c.stored is not None else {}),
                    **({"offload": True} if c.offload else {}),
                }
            )
        out[leader.name] = {"count": g.count, "members": [m.name for m in g.members], "options": options}
    return out
