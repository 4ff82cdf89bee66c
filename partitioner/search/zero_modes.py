"""The ZeRO stages of the configuration search: which stages a candidate tries
(:func:`zero_stages`), how a stage is asked of the intra-op solver (:func:`planner_zero`), and
the stage a made plan's weights really use (:func:`zero_stage_of`)."""

from __future__ import annotations

import logging

from partitioner.sharding_plan import ShardingPlan

logger = logging.getLogger(__name__)


def zero_stages(data: int, optimizer) -> tuple:
    """The ZeRO stages a candidate with ``data`` data-parallel ranks tries: none without a data
    axis (``"auto"``: the solver's own choice on the other axes); 1 needs Adam's state (pipelined
    candidates too: their stages keep compute copies, :mod:`runtime.pipeline`)."""
    if data == 1:
        return ("auto",)
    return tuple(z for z in (0, 1, 2, 3) if z != 1 or optimizer == "adam")


def planner_zero(stage):
    """The intra-op solver's ``zero=`` for a configuration's stage: 0 and 2 offer neither ZeRO-1
    nor a regather (the budget decides whether a weight is stored sharded), 1 forces ZeRO-1 on the
    weights replicated on some axis, 3 lets the solver regather any sharded weight where the
    budget needs it (``"auto"``, as does a candidate without a data axis)."""
    return {0: 2, 3: "auto"}.get(stage, stage)


def frees_memory(asked, other) -> bool:
    """Whether a plan at ZeRO stage ``asked`` that fit only far above its quick estimate is planned
    again at ``other``: ZeRO-1 or 3, a higher stage the intra-op solver is asked differently."""
    return other in (1, 3) and stage_rank(other) > stage_rank(asked) and planner_zero(other) != planner_zero(asked)


def stage_rank(stage) -> int:
    return -1 if stage == "auto" else int(stage)


def zero_stage_of(plan: ShardingPlan) -> int:
    """The ZeRO stage a plan's weights use on its data axes (``dp``, ``ep``, ``sp``): 3 when one is
    gathered again in backward, 2 when one is stored sharded there, 1 when one's optimizer
    shard is (ZeRO-1), else 0."""
    plans = plan.stage_plans if plan.data.get("pipeline") else [plan]
    stage = 0
    for part in plans:
        names = list(part.axis_names)
        data_axes = [k for k, a in enumerate(names) if a in ("dp", "ep", "sp")]
        for r in part.records:
            if r.get("kind") != "param":
                continue
            stored = split_spec(r.get("stored") or r["out"][0])
            cut = any(k < len(stored) and stored[k].startswith("S(") for k in data_axes)
            if not cut:
                continue
            stage = max(stage, 3 if r.get("zero") == 3 else 1 if r.get("stored") else 2)
    return stage


def split_spec(spec: str) -> list:
    return [s.strip() for s in spec.strip("[]").split(",")] if spec else []
