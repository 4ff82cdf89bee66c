"""Comparing two plans: the placements that changed (folded by block), and both estimates."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from partitioner.diff_folding import fold_changes
from partitioner.estimate import Estimate
from partitioner.units import fmt_bytes as _fmt_bytes
from partitioner.units import fmt_time as _fmt_time

if TYPE_CHECKING:
    from partitioner.sharding_plan import ShardingPlan

__all__ = ["PlanDiff", "diff_plans"]

logger = logging.getLogger(__name__)


@dataclass
class PlanDiff:
    changed: list
    """(node, module, this plan's placements, the other plan's placements)."""
    only_here: list
    only_there: list
    estimate_here: Estimate
    estimate_there: Estimate
    same_graph: bool
    folded: list = field(default_factory=list)
    """``changed`` folded by block (:func:`partitioner.diff_folding.fold_changes`): one group for
    a change made in every layer of a block of identical layers; the text lists these."""

    def __bool__(self) -> bool:
        return bool(self.changed or self.only_here or self.only_there)

    def __str__(self) -> str:
        lines = []
        if not self.same_graph:
            lines.append("note: the plans were made for different graphs; nodes are matched by name")
        a, b = self.estimate_here, self.estimate_there
        lines.append(
            f"step time {_fmt_time(a.step_time_s)} -> {_fmt_time(b.step_time_s)}; memory "
            f"{_fmt_bytes(a.memory_bytes)} -> {_fmt_bytes(b.memory_bytes)}; communication "
            f"{_fmt_bytes(a.total_comm_bytes())} -> {_fmt_bytes(b.total_comm_bytes())}"
        )
        if not self:
            lines.append("placements: identical")
        if not self.folded:
            for name, module, here, there in self.changed:
                lines.append(f"  {name:<32} {module:<40} {here} -> {there}")
        views = [g for g in self.folded if g["view"]]
        for g in self.folded:
            if g["view"]:
                continue
            where = g["block"] if len(g["nodes"]) > 1 else ""
            more = f"  (the same in {len(g['nodes'])} layers of {where})" if where else ""
            lines.append(f"  {g['node']:<32} {g['full_module']:<40} {g['before']} -> {g['after']}{more}")
        if views:
            lines.append(
                f"  and {sum(len(g['nodes']) for g in views)} views and getitems that follow their producers "
                f"(listed in .changed)"
            )
        for name in self.only_here:
            lines.append(f"  {name}: only in this plan")
        for name in self.only_there:
            lines.append(f"  {name}: only in the other plan")
        return "\n".join(lines)


def diff_plans(plan: ShardingPlan, other: ShardingPlan) -> PlanDiff:
    """Placements that differ between two plans (nodes matched by name), and both estimates."""
    changed, only_here = [], []
    for r in plan.node_records:
        o = other.node_by_name.get(r.name)
        if o is None:
            only_here.append(r.name)
        elif r.out != o.out or r.ins != o.ins:
            changed.append((r.name, r.module, " ".join(r.out), " ".join(o.out)))
    only_there = [n for n in other.node_by_name if n not in plan.node_by_name]
    return PlanDiff(
        changed,
        only_here,
        only_there,
        plan.estimate(),
        other.estimate(),
        plan.fingerprint == other.fingerprint,
        fold_changes(plan.node_records, changed),
    )
