"""The other schedules of planned degrees (step 5 of :mod:`partitioner.search`): once a pipelined
candidate is planned, each *schedule twin* (the same degrees, microbatches, recomputation and
ZeRO stage, another schedule whose stages are cut differently: interleaved against 1F1B / ZB-H1)
is priced from the stages just planned, without a planning of its own.

Algorithm
---------
1. Per microbatch, each planned stage's forward, backward and weight-pass seconds and its
   once-per-step gradient sync (:func:`passes.schedules.stage_durations`, ``stage_syncs``) are
   split into a **per-layer part** (a middle stage's seconds over its layers; without a middle
   stage, the first and last stages' seconds per FLOP times a layer's FLOPs) and a **fixed part**
   of the first and last stages (what is left of theirs: the embedding, the head and the loss).
   A first or last stage whose seconds are less than its layers at the per-layer part, or any
   of a pipeline without middle stages, scales with its FLOPs instead.
2. The twin's stages (``p * v`` of them, the balanced layer counts its own cut uses,
   :meth:`Planner.stage_lengths`) get their kind's fixed part plus their layers times the
   per-layer part; its schedule is simulated with them and the planned stage boundary's
   point-to-point time (the same microbatch and stage mesh send the same message). A stage cut
   as planned gets its planned seconds back, so the planned schedule is expected at its own step.
3. A twin expected below the best step found is planned next, past the limit and the
   one-planning-per-degrees rule; the others say what they were expected at (``PRICED``) and are
   not planned: the best step only falls, so they cannot win later.

The expectation is not a plan's estimate: a twin's stages are planned with their own budget
(``budget / v``) and activations in flight, so its real plan may place them differently. It
replaces, for these twins, the quick estimate times a planned / quick ratio, which priced the
whole schedule in closed form.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import passes.schedules as ps
from partitioner.core_sharing import stage_plans_cores
from partitioner.search.candidate import Candidate, degrees_of, fmt_s
from partitioner.search.pipeline_candidate import stage_set_key
from partitioner.search.zero_modes import planner_zero

if TYPE_CHECKING:
    from partitioner.search.loop import PlanningLoop
    from partitioner.search.planner import Planner

logger = logging.getLogger(__name__)

PRICED = "priced from the stage plans of its degrees"


def schedule_twins(cands: list, planned: Candidate) -> list:
    """The candidates not yet planned that differ from ``planned`` only in their schedule and
    whose stages are cut differently (a different stage set: 1F1B and ZB-H1 share one)."""
    c = planned.config
    return [
        o
        for o in cands
        if o is not planned
        and o.plan is None
        and o.status == "not planned"
        and o.config.pipeline > 1
        and degrees_of(o.config) == degrees_of(c)
        and (o.config.microbatches, o.config.recompute, o.config.sequence_parallel)
        == (c.microbatches, c.recompute, c.sequence_parallel)
        and planner_zero(o.config.zero) == planner_zero(c.zero)
        and stage_set_key(o.config) != stage_set_key(c)
    ]


def _kind(s: int, stages: int) -> str:
    return "first" if s == 0 else "last" if s == stages - 1 else "middle"


def _rescale(planner: Planner, lengths: list, per_stage: dict, twin_lengths: list) -> dict:
    """One duration of the planned stages (``per_stage``, by stage; ``lengths``: their layers)
    rescaled to stages of ``twin_lengths`` layers (the module's algorithm): a middle stage is
    its layers times the per-layer seconds, the first and the last their own fixed seconds plus
    that. Where a kind's seconds are less than its layers at the per-layer seconds, or the
    planned pipeline has no middle stage, that kind's seconds scale with its FLOPs instead."""
    f = planner.facts
    assert f is not None, "the planner's model facts are set before pipelines are planned"
    stages, layer = len(lengths), f.layer_flops_per_sample

    def flops(kind: str, n: int) -> float:
        return (
            n * layer
            + (f.pre_flops_per_sample if kind == "first" else 0.0)
            + (f.post_flops_per_sample if kind == "last" else 0.0)
        )

    own = {"first": 0, "last": stages - 1}
    middles = [s for s in range(1, stages - 1) if lengths[s]]
    if middles:
        s = max(middles, key=lambda k: lengths[k])
        per_layer = per_stage[s] / lengths[s]
    else:  # the first and last stages' seconds per FLOP, for a layer
        total = flops("first", lengths[0]) + flops("last", lengths[-1])
        per_layer = (per_stage[0] + per_stage[stages - 1]) * layer / total if total > 0 else 0.0
    out = {}
    n = len(twin_lengths)
    for t, k in enumerate(twin_lengths):
        kind = _kind(t, n)
        if kind == "middle":
            out[t] = k * per_layer
            continue
        src = own[kind]
        fixed = per_stage[src] - lengths[src] * per_layer
        if middles and fixed >= 0:
            out[t] = fixed + k * per_layer
        else:
            base = flops(kind, lengths[src])
            out[t] = per_stage[src] * flops(kind, k) / base if base > 0 else per_stage[src]
    return out


def expected_step(planner: Planner, planned: Candidate, twin) -> float:
    """The step ``twin`` (a :class:`ParallelConfig` of ``planned``'s degrees) is expected to take
    with ``planned``'s stages rescaled to its own cut (the module's algorithm)."""
    plan = planned.plan
    assert plan is not None
    pipe = plan.data["pipeline"]
    stage_plans = plan.stage_plans
    by_class = {id(p): p.estimate() for p in stage_plans}
    ests = [by_class[id(p)] for p in stage_plans]
    durations = ps.stage_durations(ests, pipe["takes_activations"]) + (ps.stage_syncs(ests),)
    lengths = [len(run) for run in pipe["layers"]]
    twin_lengths = planner.stage_lengths(twin.pipeline * twin.virtual_stages)
    forward, backward, weight, syncs = (_rescale(planner, lengths, d, twin_lengths) for d in durations)
    weight = {s: min(w, backward[s]) for s, w in weight.items()}  # W is part of B (parts rescaled apart)
    sim = ps.simulate(
        planner.schedule(twin),
        forward,
        backward,
        weight,
        comm_time=pipe["p2p_time_s"],
        sync_time=syncs,
        cores=stage_plans_cores(stage_plans, twin.pipeline),
        transfer_time=pipe.get("message_cpu_s", 0.0),
    )
    return sim.makespan


def price_schedule_twins(loop: PlanningLoop, planned: Candidate) -> None:
    """Price ``planned``'s schedule twins from its stages: the one expected to beat the best
    step goes to the front of the queue (planned past the limit); the others are explained and
    leave the queue."""
    best = loop.best
    if planned.plan is None or planned.config.pipeline == 1 or best is None:
        return
    for twin in schedule_twins(loop.cands, planned):
        expected = expected_step(loop.planner, planned, twin.config)
        if twin in loop.queue:
            loop.queue.remove(twin)
        if expected < best.step_time_s:
            loop.queue.insert(0, twin)
            loop.forced.add(id(twin))
            twin.reason = ""
            logger.info(
                "search: %s expected %s from the stages of %s, below the best step %s: planned next",
                twin.config.describe(),
                fmt_s(expected),
                planned.config.schedule,
                fmt_s(best.step_time_s),
            )
        else:
            twin.reason = (
                f"{PRICED} ({planned.config.schedule}): expected {fmt_s(expected)}, not below the best step "
                f"{fmt_s(best.step_time_s)}"
            )
