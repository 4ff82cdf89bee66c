"""Two plans compared node by node, folded by block: the report's diff view.

:meth:`partitioner.ShardingPlan.diff` lists every node whose placements differ; a change made
in every layer of a block of identical layers is listed once per layer there (~130 lines for a
12-layer model). Here each change is keyed by the node's counterpart in its block's first layer
(:func:`partitioner.plan_graph.counterparts`) and its placements before and after, so one line
stands for the same change in every layer it happens in, and names the layers. A pipelined plan
is compared stage by stage when both have as many stages; otherwise only the configurations
and estimates are.
"""

from __future__ import annotations

from partitioner.plan_graph import counterparts
from partitioner.plan_table import hidden_view, relative_path

__all__ = ["folded_diff"]


def _layer_prefix(r) -> str:
    return f"{r['block'].rsplit('.[', 1)[0]}.{r['block_index']}" if r.get("block") else ""


def _fold(here, there) -> dict:
    diff = here.diff(there)
    first_of = counterparts(here.records)
    by_name = {r["name"]: r for r in here.records}
    groups: dict = {}
    for name, _module, before, after in diff.changed:
        r = by_name[name]
        first = by_name[first_of.get(name, name)]
        key = (first["name"], before, after)
        if key not in groups:
            base = _layer_prefix(first)
            label = first["fqn"] if first["kind"] in ("param", "input", "buffer") and first.get("fqn") else name
            groups[key] = {
                "block": r.get("block"),
                "name": relative_path(label, base) if base else label,
                "module": relative_path(first["module"] or "", base) if base else first["module"] or "",
                "op": first["target"].replace("aten.", ""),
                "view": hidden_view(first),
                "before": before,
                "after": after,
                "layers": [],
                "nodes": [],
            }
        groups[key]["nodes"].append(name)
        if r.get("block"):
            groups[key]["layers"].append(_layer_prefix(r))
    return {
        "changed_nodes": len(diff.changed),
        "groups": list(groups.values()),
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
