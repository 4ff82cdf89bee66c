"""Two plans compared node by node, folded by block: the report's diff view.

The changes are :meth:`partitioner.ShardingPlan.diff`'s, folded by block
(:func:`partitioner.diff_folding.fold_changes`: a change made in every layer of a block of
identical layers is one line naming the layers). A pipelined plan is compared stage by stage
when both have as many stages; otherwise only the configurations and estimates are.
"""

from __future__ import annotations

__all__ = ["folded_diff"]


def _fold(here, there) -> dict:
    diff = here.diff(there)
    return {
        "changed_nodes": len(diff.changed),
        "groups": diff.folded,
        "only_here": diff.only_here,
        "only_there": diff.only_there,
        "same_graph": diff.same_graph,
    }


def _summary(plan) -> dict:
    est = plan.estimate()
    config = plan.config
    return {
        "model": plan.data.get("model", "?"),
        "mesh": list(plan.mesh_shape),
        "axis_names": list(plan.axis_names),
        "config": config.describe() if config is not None else None,
        "step_s": est.step_time_s,
        "memory_bytes": est.memory_bytes,
        "comm_bytes": est.total_comm_bytes(),
    }


def folded_diff(here, there, *, names=("A", "B")) -> dict:
    """The diff view's data: both plans' summaries and, per stage, the folded changes."""
    here_stages, there_stages = here.stage_plans or [here], there.stage_plans or [there]
    stages, note = [], ""
    if len(here_stages) == len(there_stages):
        stages = [_fold(a, b) for a, b in zip(here_stages, there_stages)]
    else:
        note = (
            f"the plans have {len(here_stages)} and {len(there_stages)} pipeline stages: only their "
            f"configurations and estimates are compared"
        )
    return {
        "names": list(names),
        "here": _summary(here),
        "there": _summary(there),
        "stages": stages,
        "pipelined": bool(here.stage_plans or there.stage_plans),
        "note": note,
    }
