"""A pipelined candidate's plan (step 5 of :mod:`partitioner.search`): the stage classes (the
first stage, the middle stages by layer count, the last) planned in turn on the model cut to
their layers, each stage's inputs pinned to what the stage before sends and its activations
counted for the microbatches the schedule keeps alive; identical stage sets
(:func:`stage_set_key`) are planned once. The step is the schedule simulated with the classes'
per-microbatch estimates and the largest boundary message's time on the pipeline link."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

import passes.schedules as ps
from partitioner.core_sharing import message_cpu_time, stage_plans_cores
from partitioner.mesh import MeshSpec
from partitioner.parallel_config import ParallelConfig
from partitioner.search.facts import bytes_of
from partitioner.search.zero_modes import planner_zero, split_spec
from partitioner.sharding_plan import ShardingPlan
from passes.analysis.analyze import info
from passes.capture.blocks import find_blocks
from passes.plan.plan_intra_op import InfeasibleBudgetError

if TYPE_CHECKING:
    from partitioner.search.planner import Planner

logger = logging.getLogger(__name__)


def stage_set_key(c: ParallelConfig, shared: bool = True) -> tuple:
    """What a pipelined configuration's stage plans depend on: configurations with the same key
    share one set of stage plans (with ``shared``, the search's way, 1F1B and ZB-H1 among them,
    planned for the activations either keeps alive; interleaved cuts its own)."""
    family = "auto" if shared and c.schedule != "interleaved" else c.schedule
    return (
        c.microbatch_size,
        c.pipeline,
        c.data,
        c.sequence,
        c.tensor,
        c.expert,
        c.virtual_stages,
        c.recompute,
        family,
        planner_zero(c.zero),
    )


def stage_plans(planner: Planner, c: ParallelConfig):
    """Stage plans for ``c``'s microbatch, degrees and recomputation (shared by 1F1B and
    ZB-H1). Stages are planned once per class: the first stage, the middle stages by their
    layer count, the last stage (a middle class takes the placements the class before it
    sends). Returns (class graphs, class plans, class of each stage, layer runs, sends, class
    estimates)."""
    from partitioner.stage_boundaries import plan_stages_in_turn, shared_weights

    size = c.microbatch_size
    stages = c.pipeline * c.virtual_stages
    if c.schedule == "interleaved" or not planner.share_schedules:
        copies = ps.SCHEDULES[c.schedule or "1f1b"].in_flight(c.pipeline, c.microbatches, c.virtual_stages)
    else:
        copies = ps.auto_stage_in_flight(c.pipeline, c.microbatches)
    lengths = planner.stage_lengths(stages)
    classes: list = []
    for s, n in enumerate(lengths):
        kind = "first" if s == 0 else "last" if s == stages - 1 else "middle"
        if (kind, n) not in classes:
            classes.append((kind, n))
    classes.sort(key=lambda k: ("first", "middle", "last").index(k[0]))
    stage_map = [
        classes.index(("first" if s == 0 else "last" if s == stages - 1 else "middle", n))
        for s, n in enumerate(lengths)
    ]
    class_copies = [max(copies[s] for s in range(stages) if stage_map[s] == k) for k in range(len(classes))]
    key = stage_set_key(c, shared=planner.share_schedules)
    if key in planner.stage_sets:
        return planner.stage_sets[key]
    planner.plannings += 1
    t0 = time.perf_counter()
    cap, graphs = planner.class_split(size, tuple(n for _, n in classes))
    t1 = time.perf_counter()
    tied = {n for names in shared_weights(cap, graphs) for n in names}
    shape, names = c.stage_mesh_shape, c.stage_axis_names
    budget = planner.budget / c.virtual_stages
    # the middle classes (most of the stages) are planned first, their inputs free; the first
    # class is then planned sending what the middle one receives, and the later classes
    # receiving what the class before sends
    order = list(range(1, len(graphs) - 1)) + [0, len(graphs) - 1] if len(graphs) > 2 else [0, 1]

    def plan_one(k, g, pins):
        return planner.plan_graph(
            g.captured,
            f"{planner.name} stage class {g.index}",
            shape,
            names,
            pins=pins,
            copies=class_copies[k],
            recompute=c.recompute,
            budget=budget,
            microbatches=c.microbatches,
            holds_gradient_sums=True,
            zero=planner_zero(c.zero),
            sequence_parallel=c.sequence_parallel,
            config=c,
        )

    def send_pins(k, made_by):  # the first class sends what the middle one takes
        return first_stage_pins(graphs[0], graphs[1], made_by[1], len(shape)) if k == 0 and len(graphs) > 2 else {}

    made_by, sent_as = plan_stages_in_turn(graphs, order, len(shape), tied, plan_one, send_pins)
    plans = [made_by[k] for k in range(len(graphs))]
    logger.info(
        "search: %s: %d stage classes cut in %.2f s, planned in %.2f s",
        c.describe(),
        len(plans),
        t1 - t0,
        time.perf_counter() - t1,
    )
    runs, k = [], 0
    for n in lengths:
        runs.append(list(range(k, k + n)))
        k += n
    result = (graphs, plans, stage_map, runs, sent_as, [p.estimate() for p in plans])  # priced once per class
    planner.stage_sets[key] = result
    return result


def boundary_messages(planner: Planner, c, graphs, sent_as) -> tuple:
    """(largest boundary message per device in bytes, its seconds on the pipeline link, bytes
    sent per device per step by the busiest rank)."""
    shape = c.stage_mesh_shape
    largest = 0.0
    grads = 0.0
    for g in graphs[1:]:
        total = grad = 0.0
        for node in g.captured.graph.nodes:
            if node.op != "placeholder" or node.name not in g.activation_inputs:
                continue
            spec = sent_as.get(node.name) or ""
            cut = math.prod(n for n, s in zip(shape, split_spec(spec)) if s.startswith("S("))
            size = bytes_of(node) / max(cut, 1)
            total += size
            dtype = info(node).dtype
            if dtype is not None and dtype.is_floating_point:
                grad += size
        if total > largest:
            largest, grads = total, grad
    link = planner.spec.link_for_axis(c.mesh_shape, 0)
    seconds = largest / link.bandwidth + link.latency_s if largest else 0.0
    per_rank = c.virtual_stages * c.microbatches * (largest + grads)
    return largest, seconds, per_rank


def plan_pipeline(planner: Planner, c: ParallelConfig) -> ShardingPlan:
    graphs, plans, stage_map, runs, sent_as, class_ests = stage_plans(planner, c)
    ests = [class_ests[r] for r in stage_map]
    takes = [graphs[r].takes_activations for r in stage_map]
    forward, backward, weight = ps.stage_durations(ests, takes)
    largest, p2p_s, p2p_bytes = boundary_messages(planner, c, graphs, sent_as)
    message_cpu_s = message_cpu_time(planner.spec, largest)  # a CPU host's ranks pay each message's CPU
    sched = planner.schedule(c)
    cores = stage_plans_cores(plans, c.pipeline)  # ranks outnumbering a CPU host's cores share them
    sim = ps.simulate(
        sched,
        forward,
        backward,
        weight,
        comm_time=p2p_s,
        sync_time=ps.stage_syncs(ests),
        cores=cores,
        transfer_time=message_cpu_s,
    )
    per_rank_memory = [0.0] * c.pipeline
    for s, est in enumerate(ests):
        per_rank_memory[sched.stage_to_rank[s]] += est.memory_bytes
    memory = max(per_rank_memory)
    if memory > planner.budget:
        raise InfeasibleBudgetError(
            f"the stages of {c.describe()} need {memory / 2**30:.3f} GiB ({memory:.0f} bytes) on one rank, "
            f"over the budget"
        )
    model_flops = c.microbatches * sum(float(plans[r].data.get("model_flops", 0.0)) for r in stage_map)
    first = plans[0].data
    whole = planner.capture(planner.batch)
    data = {
        **{k: first[k] for k in ("format", "version", "training", "precision", "cluster", "budget", "objective")},
        "optimizer": planner.optimizer,
        **planner.fingerprints(whole),
        "model": planner.name,
        "inputs": inputs_of(whole),
        "mesh": MeshSpec.build(c.mesh_shape, c.axis_names).to_dict(),
        "activation_copies": 1,
        "recompute": c.recompute,
        "pins": {},
        "records": [],
        "alternatives": {},
        "blocks": [],
        "stats": {},
        "model_flops": model_flops,
        "config": c.to_dict(),
        "pipeline": {
            "degree": c.pipeline,
            "schedule": c.schedule,
            "microbatches": c.microbatches,
            "virtual_stages": c.virtual_stages,
            "layers": runs,
            "stage_map": stage_map,
            "stage_plans": [p.data for p in plans],
            "step_time_s": sim.makespan,
            "bubble_fraction": sim.bubble_fraction,
            "busy_s": max(sim.busy.values()),
            "p2p_time_s": p2p_s,
            "message_cpu_s": message_cpu_s,
            "p2p_bytes": p2p_bytes,
            "memory_bytes": memory,
            "busiest_stage": max(range(len(ests)), key=lambda s: ests[s].step_time_s),
            "takes_activations": takes,  # what the step above was simulated with (partitioner.report)
        },
    }
    return ShardingPlan(data, stage_plans=plans)


def first_stage_pins(first, second, second_plan, ndim) -> dict:
    """Pins for ``first``'s returned values: the placements ``second``'s plan receives them in
    (node name -> placement), so the first stage sends what the next one chose to take.

    A value made inside a repeated layer (the last layer's output) is not pinned: the layers
    share one decision, so its pin would place every layer's output so (the middle stages'
    free choice of input placement, say replicated over ``dp``, would become every layer's
    output in the first stage and what each layer's checkpoint keeps under recomputation).
    The first stage then sends its own placement, as it does when a job plans its stages in
    order (:mod:`partitioner.pipeline_parallelize`: each stage receives what the one before
    sends)."""
    from passes.core.placements import format_spec, parse_spec

    records = {r["name"]: r for r in second_plan.records}
    returned = first.captured.graph.find_nodes(op="output")[0].args[0]
    returned = returned if isinstance(returned, (list, tuple)) else [returned]
    blocks = find_blocks(first.captured.graph)
    pins = {}
    for node, name in zip(returned, first.outputs):
        record = records.get(name)
        if isinstance(node, torch.fx.Node) and blocks.count.get(blocks.represent(node), 1) > 1:
            continue
        if name in second.activation_inputs and record and record.get("out") and hasattr(node, "name"):
            spec = parse_spec(record["out"][0], ndim)
            if all(type(p).__name__ != "Partial" for p in spec):
                pins[node.name] = format_spec(spec)
    return pins


def inputs_of(cap) -> dict:
    return {
        info(n).name: list(info(n).shape or ())
        for n in cap.graph.nodes
        if n.op == "placeholder" and info(n).kind == "input"
    }
