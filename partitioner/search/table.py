"""The search's answer: the chosen candidate's plan with its configuration and the search's
table in its data (``plan.explain()``: every planned candidate, the best few unplanned, the
counts by status, how many configurations were priced, set aside by their bounds and planned)."""

from __future__ import annotations

import logging
import time

from partitioner.axis_uses import describe_config
from partitioner.search.candidate import Candidate
from partitioner.search.runner_ups import explain_runner_ups
from partitioner.search.schedule_twins import PRICED
from partitioner.sharding_plan import ShardingPlan

logger = logging.getLogger(__name__)


def chosen_plan(best: Candidate, cands: list, devices: int, batch: int, t0: float, plannings: int) -> ShardingPlan:
    """The chosen candidate's plan, with its configuration and the search's table (every
    candidate, why it lost) in its data."""
    explain_runner_ups(cands, best)
    for cand in cands:
        if cand.status == "planned" and cand is not best:
            slower = 100 * (cand.step_time_s / best.step_time_s - 1)
            cand.reason += f"slower by {slower:.1f}%"
    best.status, best.reason = "chosen", ""
    plan = best.plan
    assert plan is not None
    t2 = time.perf_counter()
    plan.data["config"] = best.config.to_dict()
    plan.data["search"] = search_table(cands, best, devices, batch, t2 - t0, plannings)
    plan.data.setdefault("stats", {})["search_s"] = t2 - t0
    table = plan.data["search"]
    logger.info(
        "search: chose %s in %.2f s: %d configurations priced, %d set aside by their bounds, %d priced from "
        "planned stages, %d plannings",
        describe_config(plan),
        t2 - t0,
        table["priced"],
        table["bounded"],
        table["from_stages"],
        table["plannings"],
    )
    return plan


def search_table(cands, best, devices, batch, seconds, plannings) -> dict:
    """What ``plan.explain()`` shows: every planned candidate, the best few unplanned, and the
    counts of the rest by status."""
    planned = sorted((c for c in cands if c.status in ("chosen", "planned")), key=lambda c: c.step_time_s)
    refused = [c for c in cands if c.status == "over budget" and c.reason and not c.reason.startswith("needs at least")]
    others = sorted((c for c in cands if c.status in ("not planned", "pruned")), key=lambda c: c.quick_s)[:8]
    bound_over = [c for c in cands if c.status == "over budget" and c.reason.startswith("needs at least")]
    counts: dict = {}
    for c in cands:
        counts[c.status] = counts.get(c.status, 0) + 1
    return {
        "devices": devices,
        "global_batch": batch,
        "seconds": seconds,
        "plannings": plannings,
        "priced": len(cands),
        "bounded": sum(1 for c in cands if c.status == "pruned" or c.reason.startswith("needs at least")),
        "from_stages": sum(1 for c in cands if c.reason.startswith(PRICED)),  # schedule twins of planned degrees
        "counts": counts,
        "rows": [c.row() for c in planned + refused + others]
        + [c.row() for c in sorted(bound_over, key=lambda c: c.memory_lb)[:3]],
    }
