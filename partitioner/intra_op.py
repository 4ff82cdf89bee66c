"""Plan a captured graph on one mesh: the user's pins resolved to nodes, the forced algorithm
modes (pins, and the :class:`passes.core.rule_options.RuleOptions` handed to the rules), the
intra-op solver (:func:`passes.plan.plan_intra_op.plan_intra_op`), and the
:class:`ShardingPlan` record it makes.

``plan_captured`` is the planning step every entry shares: :func:`partitioner.plan` (after it
captures and analyses the model), ``auto_parallelize``, the pipeline builder (once per stage)
and the configuration search (once per candidate). It sits below all of them, so none of them
imports another to reach it.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import time
from dataclasses import replace

import torch

from partitioner.cluster import parse_bytes
from partitioner.core_sharing import shared_cluster
from partitioner.local_cluster import get_cluster
from partitioner.mesh import MeshSpec
from partitioner.options import PlanOptions
from partitioner.plan_format import PlanHeader
from partitioner.precision import Precision
from partitioner.sharding_plan import ShardingPlan
from passes.analysis.analyze import info
from passes.analysis.expert_routing import routing_of
from passes.capture.capture import graph_fingerprint
from passes.core.placements import format_spec, parse_spec
from passes.plan.plan_intra_op import InfeasibleBudgetError, plan_intra_op
from passes.rules import attention as attention_rule
from passes.rules import experts as experts_rule
from passes.rules import multidim_tp

__all__ = ["plan_captured", "resolve_pins", "flops_dtype", "training_flops"]


logger = logging.getLogger(__name__)


def _in_module(node, path: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(p == path for p, _ in stack.values())


def resolve_pins(cap, pins: dict, ndim: int) -> dict:
    """Map user pins to graph nodes.

    Keys, tried in this order: an input's argument name (``input_ids``), a parameter or
    buffer FQN (``transformer.h.0.mlp.c_fc.weight``), a node name, a module path (pins that
    module's output: the last op inside it); FQNs and module paths may use ``*`` globs.
    Values: one placement per mesh axis, as ``["S(0)", "R"]``, ``"[S(0), R]"`` or Placements.
    """
    resolved = {}
    placeholders = [n for n in cap.graph.nodes if n.op == "placeholder"]
    ops = [n for n in cap.graph.nodes if n.op == "call_function" and info(n).kind == "op"]
    module_paths = sorted({p for n in ops for p, _ in (n.meta.get("nn_module_stack") or {}).values()})
    for key, value in (pins or {}).items():
        spec = parse_spec(value, ndim)
        targets = [n for n in placeholders if info(n).name == key or n.name == key]
        if not targets:
            targets = [
                n
                for n in placeholders
                if info(n).kind in ("param", "buffer") and fnmatch.fnmatchcase(info(n).name, key)
            ]
        if not targets:
            targets = [n for n in ops if n.name == key]
        if not targets:
            for path in module_paths:
                if fnmatch.fnmatchcase(path, key):
                    inside = [n for n in ops if _in_module(n, path)]
                    if inside:
                        targets.append(inside[-1])
        if not targets:
            raise ValueError(
                f"pin {key!r} matches no input, parameter, node or module of this model; inputs are "
                f"{[info(n).name for n in placeholders if info(n).kind == 'input']}, and module paths "
                f"look like {module_paths[:3]}"
            )
        for node in targets:
            _check_pin_fits(key, value, spec, node)
            resolved[node] = spec
    return resolved


def _check_pin_fits(key: str, value, spec, node) -> None:
    """A pin that shards a dim its tensor lacks (a glob that also matches a 0-d buffer such as
    ``num_batches_tracked``) is refused here, naming the pin and the tensor: the planner would
    fail deep inside with an index error."""
    shape = info(node).shape
    ndim = len(shape) if shape is not None else 0
    for p in spec:
        dim = getattr(p, "dim", None)
        if dim is not None and not -ndim <= dim < ndim:
            raise ValueError(
                f"pin {key!r} = {value!r} shards dim {dim} of {info(node).name or node.name!r}, whose shape is "
                f"{tuple(shape or ())}: it has no dim {dim}; narrow the pattern (e.g. '*.weight') or pin that "
                "tensor on its own"
            )


def plan_captured(
    cap,
    *,
    model_name: str,
    mesh_shape=(1,),
    mesh_axis_names=None,
    options: PlanOptions | None = None,
    timings=None,
    activation_copies=1,
    zero1=True,
    microbatches=1,
    holds_gradient_sums=False,
    expert_axis=None,
    max_options="auto",
    **option_kwargs,
) -> ShardingPlan:
    """:func:`plan` for a graph already captured and analysed (``passes.capture.capture`` +
    ``passes.analysis.analyze``); ``auto_parallelize`` uses it so the model is captured once.
    ``options``: the :class:`PlanOptions` (keywords of the same names override them).
    ``activation_copies``: microbatches whose saved activations are alive at once (a pipeline
    stage under its schedule): the activation memory counts that many. ``options.precision``:
    recorded in the plan (default: the autocast dtype ``cap`` was captured under, fp32
    reductions). ``zero1``: offer ZeRO-1 weights (the configuration search turns
    them off where it prices a candidate without them). ``microbatches``: a pipeline stage's microbatches per step (its
    held-back parameter-gradient all-reduces, once per step, are weighed at their share per
    microbatch; reduce-scatters onto weights stored sharded run every microbatch).
    ``holds_gradient_sums``: a pipeline stage (it holds its gradient sums over the microbatches:
    counted in its memory). ``expert_axis``: the name of the one mesh axis every MoE layer's
    experts split over (the configuration search's ``ep``; ``expert_parallel`` must be ``"on"``).
    ``max_options``: the cap on an op's options (:func:`passes.plan.strategy_space.build_space`;
    the configuration search plans its candidates with a tighter one than ``"auto"``)."""
    opts = PlanOptions.build(options, **option_kwargs)
    precision = _precision_of_capture(cap, opts)
    timings = dict(timings or {})
    t0 = timings.pop("start", time.perf_counter())
    mesh = MeshSpec.build(mesh_shape, mesh_axis_names)
    spec = shared_cluster(get_cluster(opts.cluster_for()), mesh.size)  # ranks outnumbering the cores
    budget = parse_bytes(opts.memory_budget) if opts.memory_budget is not None else spec.memory_bytes
    t2 = time.perf_counter()
    expert_index = None if expert_axis is None else mesh.axis_names.index(expert_axis)
    pinned = _all_pins(cap, opts, mesh, expert_index, model_name)
    solve = functools.partial(
        plan_intra_op,
        cap,
        mesh.shape,
        mesh.axis_names,
        spec,
        budget=budget,
        pins=pinned,
        objective=opts.objective,
        optimizer=opts.optimizer,
        share_blocks=opts.share_blocks,
        time_limit=opts.time_limit,
        activation_copies=activation_copies,
        grad_reduce_bytes=precision.grad_reduce_bytes,
        recompute=opts.recompute,
        log=logger.info,
        zero=opts.zero,
        zero1=zero1,
        host_budget=parse_bytes(opts.host_memory_budget) if opts.host_memory_budget is not None else None,
        microbatches=microbatches,
        holds_gradient_sums=holds_gradient_sums,
        rule_options=replace(opts.rule_options(mesh.shape), expert_axis=expert_index),
        max_options=max_options,
    )
    try:
        result = solve()
    except InfeasibleBudgetError as refused:
        if refused.floor is not None:  # under every plan's peak, activations kept as shards or not
            raise
        # activations kept as their shard only add time (a gather again in backward): tried
        # when nothing fits without (passes/plan/activation_regather.py). They lower no bound of
        # the ILP's memory row, but the walked peak that row bounds from above: tried after a
        # refusal by the bound too; if nothing fits either way, the first refusal says why
        logger.info("%s: no plan fits; planning again with gathered activations kept as shards", model_name)
        try:
            result = solve(regather_activations=True)
        except InfeasibleBudgetError:
            raise refused from None
    t3 = time.perf_counter()
    stats = dict(result.stats, **timings, plan_s=t3 - t2, total_s=t3 - t0)
    data = _plan_data(cap, model_name, mesh, spec, budget, precision, opts, activation_copies, pinned, result, stats)
    made = ShardingPlan(data)
    logger.info(
        "plan ready: %.2f s in all; estimated step %.3f ms (the solver's objective, plus the optimizer step "
        "and the fixed latencies it does not weigh)",
        t3 - t0,
        made.estimate().step_time_s * 1e3,
    )
    return made


def _precision_of_capture(cap, opts: PlanOptions) -> Precision:
    """The plan's precision (default: the autocast dtype ``cap`` was captured under), refused
    when the capture was made for another precision or another expert capacity."""
    precision = (
        Precision.build(opts.precision)
        if opts.precision is not None
        else Precision(compute=cap.autocast_dtype or torch.float32)
    )
    if precision.autocast_dtype != cap.autocast_dtype:
        raise ValueError(f"the graph was captured under autocast {cap.autocast_dtype}, not for precision {precision}")
    if cap.expert_capacity != opts.expert_capacity:
        raise ValueError(
            f"the graph was captured with expert_capacity={cap.expert_capacity!r}, not "
            f"{opts.expert_capacity!r}: capture it with the capacity it is planned for"
        )
    return precision


def _all_pins(cap, opts: PlanOptions, mesh, expert_index, model_name: str) -> dict:
    """The user's pins, then what forced modes pin where the user did not: sequence-parallel
    attention (ring / Ulysses) and the 2D/2.5D/3D grids; a forced expert mode is checked."""
    pinned = resolve_pins(cap, dict(opts.pins or {}), mesh.ndim)
    for node, forced in attention_rule.forced_pins(
        cap.graph, opts.sequence_parallel, mesh.shape, mesh.axis_names
    ).items():
        pinned.setdefault(node, forced)
    for node, forced in multidim_tp.forced_pins(cap.graph, opts.tensor_parallel, mesh.shape).items():
        pinned.setdefault(node, forced)
    experts_rule.check_forced(cap.graph, opts.expert_parallel, mesh.shape, expert_index)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: pins %s", model_name, {n.name: format_spec(s) for n, s in pinned.items()})
    return pinned


def _plan_data(cap, model_name, mesh, spec, budget, precision, opts, activation_copies, pinned, result, stats) -> dict:
    """The plan's JSON value: its typed header (:class:`partitioner.plan_format.PlanHeader`: what it
    was made for, under which options, the model's FLOPs, the step's latencies the planner priced)
    and the solver's records, alternatives, blocks and stats."""
    inputs = {
        info(n).name: list(info(n).shape or ())
        for n in cap.graph.nodes
        if n.op == "placeholder" and info(n).kind == "input"
    }
    header = PlanHeader(
        fingerprint=graph_fingerprint(cap),
        structure=graph_fingerprint(cap, shapes=False),
        training=cap.training,
        precision=precision.to_dict(),
        model=model_name,
        inputs=inputs,
        mesh=mesh.to_dict(),
        cluster=spec.to_dict(),
        budget=budget,
        objective=opts.objective,
        optimizer=opts.optimizer,
        activation_copies=activation_copies,
        recompute=opts.recompute,
        sequence_parallel=opts.sequence_parallel,
        zero=opts.zero,
        tensor_parallel=opts.tensor_parallel,
        expert_parallel=opts.expert_parallel,
        expert_capacity=opts.expert_capacity,
        routing=routing_of(cap.graph),
        host_memory_budget=opts.host_memory_budget,
        share_blocks=opts.share_blocks,
        pins={n.name: format_spec(s) for n, s in pinned.items()},
        model_flops=training_flops(cap),
        flops_dtype=flops_dtype(cap),
        flat_latency_s=result.latencies.flat_latency_s,
        copy_latency_s=result.latencies.copy_latency_s,
        arrival_wait_s=result.latencies.arrival_wait_s,
    )
    data = header.to_dict()
    data.update(records=result.records, alternatives=result.alternatives, blocks=result.blocks, stats=stats)
    return data


def flops_dtype(cap) -> str:
    """The dtype most of the graph's FLOPs run in (what the cost model prices them at: a model
    built in bf16 runs its matmuls in bf16 even under an fp32 policy); MFU is taken against it."""
    by_dtype: dict = {}
    for n in cap.graph.nodes:
        i = info(n)
        if n.op == "call_function" and i.kind == "op" and i.flops:
            name = str(i.dtype or torch.float32).replace("torch.", "")
            by_dtype[name] = by_dtype.get(name, 0.0) + i.flops
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "float32"


def training_flops(cap) -> float:
    """FLOPs of one training step of the captured graph: 3x its forward (backward = 2x forward)."""
    return 3.0 * sum(info(n).flops for n in cap.graph.nodes if n.op == "call_function" and info(n).kind == "op")
