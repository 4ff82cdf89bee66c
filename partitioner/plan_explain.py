"""Why a plan is what it is: each node's options by cost (the solver's alternatives), what is
recomputed, and the configurations a search weighed."""

from __future__ import annotations

import logging
import textwrap
from typing import TYPE_CHECKING

from partitioner.units import fmt_bytes as _fmt_bytes
from partitioner.units import fmt_time as _fmt_time

if TYPE_CHECKING:
    from partitioner.sharding_plan import ShardingPlan

__all__ = ["explain", "explain_search"]

logger = logging.getLogger(__name__)


def explain_search(plan: ShardingPlan) -> str:
    """The configurations the search weighed: the chosen one, the runner-ups with their
    estimates and why they lost (over budget, slower by x%), and what was not planned."""
    search = plan.data.get("search")
    if not search:
        return "this plan was made on a given mesh, not chosen by a configuration search (plan(..., devices=N))"
    from partitioner.parallel_config import ParallelConfig

    counts = ", ".join(f"{n} {status}" for status, n in sorted(search["counts"].items()))
    lines = [
        f"configuration search for {search['devices']} devices, global batch {search['global_batch']}: "
        f"{sum(search['counts'].values())} configurations priced ({counts}), "
        f"{search.get('bounded', 0)} set aside by their bounds"
        + (f", {search['from_stages']} priced from planned stages" if search.get("from_stages") else "")
        + f"; {search['plannings']} planned with the "
        f"intra-op solver in {search['seconds']:.1f} s",
    ]
    for row in search["rows"]:
        cfg = ParallelConfig.from_dict(row["config"])
        if row["step_time_s"] is not None:
            what = f"step {_fmt_time(row['step_time_s'])}, {_fmt_bytes(row['memory_bytes'])} per device"
        else:
            what = f"bound: step >= {_fmt_time(row['time_lower_bound_s'])}, memory >= " + _fmt_bytes(
                row["memory_lower_bound"]
            )
        mark = "->" if row["status"] == "chosen" else "  "
        why = f" - {row['status']}" + (f": {row['reason']}" if row["reason"] else "")
        lines += textwrap.wrap(f"{mark} {cfg.describe()}: {what}{why}", 120, subsequent_indent="      ")
    return "\n".join(lines)


def explain(plan: ShardingPlan, target: str | None = None) -> str:
    """Why the node(s) of ``target`` (module path, parameter FQN or node name) are placed so;
    without a target, the configurations a search weighed (:func:`explain_search`)."""
    if target is None:
        return explain_search(plan)
    if "pipeline" in plan.data:
        found = []
        for s, stage in enumerate(plan.stage_plans):
            try:
                found.append(f"stage {s}:\n" + stage.explain(target))
            except KeyError:
                continue
        if not found:
            raise KeyError(f"nothing in this pipeline's stage plans is named {target!r}")
        return "\n".join(found)
    hits = [
        r
        for r in plan.node_records
        if r.name == target or r.fqn == target or r.module == target or r.module.startswith(target + ".")
    ]
    if not hits:
        raise KeyError(
            f"nothing in this plan is named {target!r}: give a module path, a parameter FQN or a "
            f"node name (see plan.summary(verbose=True))"
        )
    alts = plan.data.get("alternatives", {})
    leader_of = {m: leader for leader, a in alts.items() for m in a["members"]}
    lines, seen = [], set()
    for r in hits:
        leader = leader_of.get(r.rep, None)
        label = r.fqn if r.kind in ("param", "input") else r.name
        if leader is None:
            lines.append(f"{label} ({r.target}): {r.output_placement or '-'} — the only option")
            continue
        if leader != r.rep:
            lines.append(f"{label} ({r.target}): {r.output_placement or '-'} — follows {leader}")
            continue
        if leader in seen:
            continue
        seen.add(leader)
        a = alts[leader]
        shared = f", decided once for {a['count']} identical nodes" if a["count"] > 1 else ""
        lines += textwrap.wrap(
            f"{label} ({r.target}, module {r.module or 'top'}){shared}: options by "
            f"cost given its neighbours' choices (time includes its compute and the "
            f"resharding on its edges):",
            120,
            subsequent_indent="    ",
        )
        for o in a["options"]:
            mark = "->" if o["chosen"] else "  "
            ins = ", ".join("-" if s is None else s for s in o["ins"]) or "-"
            # ZeRO-3: the weight's gathered copies are freed after forward and gathered again
            zero = "  ZeRO-3" if o.get("zero") == 3 else ""
            if o.get("zero") == 1:  # used whole, the optimizer steps a shard placed so
                zero = f"  ZeRO-1 {o['stored']}"
            if o.get("offload"):  # optimizer state and step in host memory
                zero += "  offloaded"
            lines.append(
                f"  {mark} out {o['out'][0]:<18} in {ins:<40} {_fmt_time(o['time_s']):>12}  "
                f"{_fmt_bytes(o['memory']):>10}{zero}"
            )
    for r in hits:
        if r.optimizer_step_s:  # priced in the estimate after solving (the solver does not weigh it)
            where = "host" if r.offload else "device"
            lines.append(
                f"{r.fqn}: optimizer step {_fmt_time(r.optimizer_step_s)} (at {where} memory bandwidth; "
                f"in the estimate, not in the solver's choice)"
            )
    cores = {r.block for r in hits if r.recompute and r.block and ".attention" in (r.region or "")}
    redone = sorted({r.block for r in hits if r.recompute and r.block} - cores)
    if redone:
        lines.append(
            f"recomputed in backward (activation checkpointing, recompute="
            f"{plan.data.get('recompute', 'auto')!r}): {', '.join(redone)} keep only what leaves each "
            f"layer; backward reruns the layer's forward, its collectives included (priced in the estimate)"
        )
    if cores:  # selective: only the attention core reruns
        lines.append(
            f"attention core recomputed in backward (selective activation checkpointing, recompute="
            f"{plan.data.get('recompute', 'auto')!r}): {', '.join(sorted(cores))} keep the core's inputs "
            f"(q, k, v, a mask) and what leaves it; backward reruns the core's forward (priced in the estimate)"
        )
    return "\n".join(lines)
