"""A pipeline runner's plan as one pipelined :class:`ShardingPlan`, the value the configuration
search makes (``data["pipeline"]``: schedule, microbatches, layers, stage plans and the step
simulated with their estimates), so what reads a searched plan (the estimate, the report, its
timeline) reads a job built with ``auto_parallelize(..., pipeline=...)`` too.

The step is simulated as :func:`partitioner.pipeline_simulation.simulated_timeline` simulates it: the
runner's schedule with each stage's forward, backward and weight-gradient time from its plan
and its once-per-step gradient reduction and optimizer step, its point-to-point messages priced as
the configuration search prices them (:func:`partitioner.pipeline_simulation.runner_messages`:
``p2p_time_s`` on the link, ``message_cpu_s`` on each rank), the busy ranks sharing a CPU host's
cores where they outnumber them (:mod:`partitioner.core_sharing`).
"""

from __future__ import annotations

from partitioner.core_sharing import stage_plans_cores
from partitioner.pipeline_simulation import runner_messages
from partitioner.sharding_plan import ShardingPlan

__all__ = ["runner_plan"]


def _registry_name(schedule, microbatches: int, virtual: int) -> str:
    """The :data:`passes.schedules.SCHEDULES` key whose generator made ``schedule``."""
    import passes.schedules as ps

    for key, kind in ps.SCHEDULES.items():
        if (virtual > 1) != kind.virtual:
            continue
        if kind.make(schedule.num_ranks, microbatches, virtual).name == schedule.name:
            return key
    raise ValueError(f"schedule {schedule.name!r} is not one of {tuple(ps.SCHEDULES)}: no plan can name it")


def runner_plan(runner) -> ShardingPlan:
    """The pipelined plan ``runner`` (a :class:`runtime.pipeline.PipelineRunner`) runs."""
    import passes.schedules as ps

    plans, schedule, m = runner.plan["stages"], runner.schedule, runner.microbatches
    virtual = schedule.num_stages // schedule.num_ranks
    name = _registry_name(schedule, m, virtual)
    estimates = [plan.estimate() for plan in plans]
    takes = [graph.takes_activations for graph in runner.stage_graphs]
    forward, backward, weight = ps.stage_durations(estimates, takes)
    link_s, message_cpu_s = runner_messages(runner)
    sim = ps.simulate(
        ps.SCHEDULES[name].make(schedule.num_ranks, m, virtual),
        forward,
        backward,
        weight,
        comm_time=link_s,
        sync_time=ps.stage_syncs(estimates),
        cores=stage_plans_cores(plans, schedule.num_ranks),
        transfer_time=message_cpu_s,
    )
    per_rank = [0.0] * schedule.num_ranks
    for s, est in enumerate(estimates):
        per_rank[schedule.stage_to_rank[s]] += est.memory_bytes
    first = plans[0].data
    data = {
        **{k: first.get(k) for k in ("format", "version", "training", "precision", "cluster", "budget", "objective")},
        "optimizer": first.get("optimizer"),
        "fingerprint": None,
        "model": str(first.get("model", "?")).rsplit(" stage ", 1)[0],  # the stage plans say "GPT stage 0"
        "inputs": first.get("inputs", {}),
        "mesh": {"shape": [schedule.num_ranks, *plans[0].mesh_shape], "axis_names": ["pp", *plans[0].axis_names]},
        "records": [],
        "alternatives": {},
        "blocks": [],
        "stats": {},
        "model_flops": m * sum(float(plan.data.get("model_flops") or 0.0) for plan in plans),
        "pipeline": {
            "degree": schedule.num_ranks,
            "schedule": name,
            "microbatches": m,
            "virtual_stages": virtual,
            "layers": [list(run) for run in runner.plan["layers"]],
            "stage_map": list(range(len(plans))),
            "stage_plans": [plan.data for plan in plans],
            "step_time_s": sim.makespan,
            "bubble_fraction": sim.bubble_fraction,
            "busy_s": max(sim.busy.values()),
            "p2p_time_s": link_s,
            "message_cpu_s": message_cpu_s,
            "p2p_bytes": 0.0,
            "memory_bytes": max(per_rank),
            "busiest_stage": max(range(len(estimates)), key=lambda s: estimates[s].step_time_s),
            "takes_activations": takes,
        },
    }
    return ShardingPlan(data, stage_plans=plans)
