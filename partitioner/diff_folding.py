"""A plan diff folded by block: one line for a change made in every layer of a repeated block.

:meth:`partitioner.ShardingPlan.diff` finds every node placed differently; in a model of 12
identical layers a change is usually made in all 12, which listed node by node is ~130 lines.
``fold_changes`` keys each changed node by its counterpart in its block's first layer
(:func:`partitioner.plan_graph.counterparts`) and by its placements before and after, so one
group stands for the same change in every layer it is made in, and lists those layers. Used by
``PlanDiff``'s text and by the report's diff view (:mod:`partitioner.report.diff`).
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.plan_graph import counterparts
from partitioner.plan_table import hidden_view, relative_path
from passes.core.plan_records import NodeRecord

__all__ = ["fold_changes"]


def _layer(r) -> str:
    return f"{r.block.rsplit('.[', 1)[0]}.{r.block_index}" if r.block else ""


def fold_changes(records: Sequence[NodeRecord], changed: list) -> list:
    """Groups of ``changed`` (``(node, module, before, after)`` of ``PlanDiff.changed``, nodes of
    ``records``), in the order their first node appears. Each group: ``node`` (the first layer's
    node), ``block``, ``name`` and ``module`` (relative to the first layer; ``full_module`` as
    is), ``op``, ``view`` (a view or getitem: :func:`partitioner.plan_table.hidden_view`),
    ``before``, ``after``, ``layers`` (the layers it is made in) and ``nodes`` (all of them)."""
    first_of = counterparts(records)
    by_name = {r.name: r for r in records}
    groups: dict = {}
    for name, _module, before, after in changed:
        r = by_name[name]
        first = by_name[first_of.get(name, name)]
        key = (first.name, before, after)
        if key not in groups:
            base = _layer(first)
            label = first.fqn if first.kind in ("param", "input", "buffer") and first.fqn else first.name
            groups[key] = {
                "node": first.name,
                "block": r.block,
                "name": relative_path(label, base) if base else label,
                "module": relative_path(first.module or "", base) if base else first.module or "",
                "full_module": first.module or "",
                "op": first.target.replace("aten.", ""),
                "view": hidden_view(first),
                "before": before,
                "after": after,
                "layers": [],
                "nodes": [],
            }
        groups[key]["nodes"].append(name)
        if r.block:
            groups[key]["layers"].append(_layer(r))
    return list(groups.values())
