"""Everything the report shows, read off a plan into one JSON-able dict.

The page's script only draws what is here; every number and text is computed in Python from the
plan's own functions (:meth:`ShardingPlan.estimate`, :meth:`ShardingPlan.explain`,
:func:`partitioner.plan_graph.plan_graph`, :func:`partitioner.axis_roles.axis_role_shares`), so
the report says what ``partita show`` and ``partita explain`` say. Keys:

* ``header``: model, inputs, cluster, precision, budget, objective, optimizer;
* ``axes``: per mesh axis its size and role shares; ``config``: the searched configuration;
* ``estimate``: the step split into compute / exposed communication / optimizer step / bubble
  (a pipeline's: on its busiest rank, adding up to the simulated step), MFU, communication;
* ``memory``: per device (per pipeline rank) the bytes at its peak by kind, and the budget;
* ``search``: the configurations the search weighed, each with its status and why it lost;
* ``stages``, ``rows``, ``blocks``: every node of every stage's plan in graph order, with its
  placements, shapes, time, memory, collectives and its ``explain`` text; ``fold`` says why a
  row is folded away by default (a later layer of a block, a view, a mask/index row);
* ``graphs``: per stage the drawn graph with coordinates (:mod:`partitioner.report.layout`);
* ``timeline``: a pipeline's simulated step per rank, and a measured one when given;
* ``diff``: the folded comparison with another plan (:mod:`partitioner.report.diff`).
"""

from __future__ import annotations

import logging

from partitioner.axis_roles import axis_role_shares
from partitioner.plan_graph import plan_graph
from partitioner.plan_table import block_first_index, hidden_view, mask_index_rows
from partitioner.report.diff import folded_diff
from partitioner.report.layout import layout_graph
from partitioner.report.timeline import read_trace, simulate_plan
from partitioner.units import fmt_bytes as _fmt_bytes
from partitioner.units import fmt_time as _fmt_time

__all__ = ["report_data"]

logger = logging.getLogger(__name__)


def _header(plan) -> dict:
    data = plan.data
    budget = data.get("budget")
    return {
        "model": data.get("model", "?"),
        "inputs": {k: "x".join(map(str, v)) or "scalar" for k, v in (data.get("inputs") or {}).items()},
        "cluster": (data.get("cluster") or {}).get("name", "?"),
        "precision": plan.precision_name,
        "budget": _fmt_bytes(budget) if budget else "none",
        "objective": data.get("objective"),
        "optimizer": data.get("optimizer"),
        "fingerprint": data.get("fingerprint"),
    }


def _axes(plan) -> list:
    out = []
    for name, size, shares in zip(plan.axis_names, plan.mesh_shape, axis_role_shares(plan), strict=True):
        ranked = sorted(shares.items(), key=lambda kv: -kv[1])
        out.append(
            {
                "name": name,
                "size": size,
                "role": ranked[0][0] if ranked else "-",
                "shares": [[role, share] for role, share in ranked if share >= 0.01],
            }
        )
    return out


def _estimate(plan, sim) -> dict:
    est = plan.estimate()
    if sim is None:
        split = {"compute_s": est.compute_s, "comm_s": est.comm_s, "optimizer_s": est.optimizer_s, "bubble_s": 0.0}
        where = "every device"
    else:
        split = {k: v for k, v in sim["split"].items() if k != "rank"}
        where = f"the busiest rank (pipeline rank {sim['split']['rank']})"
    comm = [
        [kind, axis, _fmt_bytes(v), est.comm_calls.get(kind, {}).get(axis, 0)]
        for kind, axes in sorted(est.comm_bytes.items())
        for axis, v in sorted(axes.items())
    ]
    return {
        "step_s": est.step_time_s,
        "step": _fmt_time(est.step_time_s),
        "split": split,
        "split_text": {k: _fmt_time(v) for k, v in split.items()},
        "where": where,
        "mfu": est.mfu,
        "tflops": est.tflops_per_device,
        "memory": _fmt_bytes(est.memory_bytes),
        "comm": comm,
        "text": str(est),
    }


def _peak_parts(m) -> list:
    """(kind, bytes) of what one device holds at its peak (the larger of the two phases)."""
    resident = [
        ("parameters", m.parameters),
        ("optimizer state", m.optimizer_state),
        ("inputs and buffers", m.inputs),
        ("held gradient sums", m.held_gradients),
    ]
    if m.backward_peak >= m.forward_peak:
        parts = resident[:1] + [("gradients", m.gradients)] + resident[1:]
        parts += [("saved activations", m.saved_activations), ("gathered buffers", m.gathered_buffers)]
    else:
        parts = resident + [("gradients (pipeline)", m.gradients_in_forward)]
    rest = m.peak - sum(v for _, v in parts)
    parts.append(("transient at the peak" if m.backward_peak >= m.forward_peak else "activations + transient", rest))
    return [(k, v) for k, v in parts if v > 0]


def _memory(plan, sim) -> dict:
    stages = plan.stage_plans
    if not stages:
        bars = [("every device", plan.estimate().memory)]
    else:
        bars = []
        for rank in range(plan.mesh_shape[0]):
            mine = [s for s, r in enumerate(sim["stage_to_rank"]) if r == rank]
            for s in mine:
                bars.append((f"rank {rank}, stage {s}", stages[s].estimate().memory))
    rows = []
    for label, m in bars:
        parts = _peak_parts(m)
        rows.append(
            {
                "label": label,
                "peak": m.peak,
                "peak_text": _fmt_bytes(m.peak),
                "phase": "backward" if m.backward_peak >= m.forward_peak else "forward",
                "parts": [[k, v, _fmt_bytes(v)] for k, v in parts],
                "offloaded": _fmt_bytes(m.offloaded) if m.offloaded else "",
            }
        )
    budget = plan.data.get("budget")
    return {"bars": rows, "budget": budget or 0, "budget_text": _fmt_bytes(budget) if budget else "none"}


def _search(plan) -> dict | None:
    from partitioner.parallel_config import ParallelConfig

    search = plan.data.get("search")
    if not search:
        return None
    rows = []
    for row in search["rows"]:
        planned = row["step_time_s"] is not None
        rows.append(
            {
                "config": ParallelConfig.from_dict(row["config"]).describe(),
                "status": row["status"],
                "reason": row["reason"] or "",
                "step": _fmt_time(row["step_time_s"]) if planned else f">= {_fmt_time(row['time_lower_bound_s'])}",
                "memory": _fmt_bytes(row["memory_bytes"]) if planned else f">= {_fmt_bytes(row['memory_lower_bound'])}",
                "step_s": row["step_time_s"] if planned else row["time_lower_bound_s"],
            }
        )
    return {"summary": plan.explain_search().splitlines()[0], "rows": rows}


def _explain(plan, name) -> str:
    try:
        return plan.explain(name)
    except KeyError as exc:  # a node explain cannot name (it matches by module and FQN too)
        return str(exc)


def _row(plan, r, stage, folded) -> dict:
    label = r.fqn if r.kind in ("param", "input", "buffer") and r.fqn else r.name
    first = r.block is None or r.block_index == block_first_index(r.block)
    fold = None if first else "layer"
    if fold is None and hidden_view(r):
        fold = "view"
    if fold is None and r.name in folded:
        fold = "mask"
    seconds = r.compute_s + sum(c.time_s for c in r.comm)
    return {
        "id": r.name if stage is None else f"{stage}:{r.name}",
        "stage": stage,
        "name": r.name,
        "label": label,
        "module": r.module or "",
        "op": r.target.replace("aten.", "").replace(".default", ""),
        "kind": r.kind,
        "shape": "x".join(map(str, r.shapes[0])) if r.shapes and r.shapes[0] is not None else "",
        "local": "x".join(map(str, r.local_shapes[0])) if r.local_shapes and r.local_shapes[0] is not None else "",
        "out": r.out[0] if r.out else "",
        "ins": [s if s is not None else "-" for s in r.ins],
        "time_s": seconds,
        "time": _fmt_time(seconds) if seconds else "",
        "memory_b": r.memory,
        "memory": _fmt_bytes(r.memory) if r.memory else "",
        "comm": [[c.kind, c.axis, c.phase, _fmt_bytes(c.bytes), _fmt_time(c.time_s)] for c in r.comm],
        "block": r.block,
        "layer": r.block_index,
        "fold": fold,
        "folded_into": folded.get(r.name),
        "explain": _explain(plan, r.name),
    }


def _stage_views(plan, sim) -> tuple:
    """(stages, rows, blocks, graphs) for a plan on one mesh (one stage, index None) or each stage."""
    stage_plans = plan.stage_plans
    pieces = [(None, plan)] if not stage_plans else list(enumerate(stage_plans))
    stages, rows, blocks, graphs = [], [], [], []
    for index, stage in pieces:
        folded = mask_index_rows(stage.node_records)
        rows += [_row(stage, r, index, folded) for r in stage.node_records if r.kind != "output"]
        blocks += [dict(b, stage=index) for b in stage.data.get("blocks", [])]
        graph = plan_graph(stage)
        drawn = layout_graph(graph)
        prefix = "" if index is None else f"{index}:"
        by_name = {n.name: n for n in graph.nodes}
        for node in drawn["nodes"]:
            g = by_name.get(node["name"])
            node.update(
                id=prefix + node["name"] if g else None,
                title=g.title if g else "output",
                op=g.op if g else "",
                placement=g.placement if g else "",
                colour=g.colour if g else "#eeeeee",
                folded_rows=g.folded_rows if g else 0,
            )
        drawn.update(stage=index, legend=[[p, c] for p, c in graph.legend.items()], folded=graph.folded)
        graphs.append(drawn)
        layers = plan.data["pipeline"]["layers"][index] if index is not None else None
        rank = sim["stage_to_rank"][index] if index is not None else None
        stages.append({"index": index, "rank": rank, "layers": layers, "nodes": len(stage.records) - 1})
    return stages, rows, blocks, graphs


def _timeline(plan, sim, trace) -> dict | None:
    if sim is None and trace is None:
        return None
    return {
        "simulated": {str(r): rows for r, rows in sim["timeline"].items()} if sim else None,
        "measured": {str(r): rows for r, rows in read_trace(trace).items()} if trace is not None else None,
        "schedule": plan.data["pipeline"]["schedule"] if sim else None,
        "step_s": sim["step_s"] if sim else None,
    }


def report_data(plan, *, other=None, trace=None, names=("this plan", "the other plan")) -> dict:
    """The report's data for ``plan`` (see the module docstring); ``other``: a plan to compare
    with (the diff view), ``trace``: a Chrome trace with the measured pipeline step."""
    sim = simulate_plan(plan)
    if trace is not None and sim is None:
        raise ValueError("a measured trace (--trace) is for a pipelined plan: this plan has no pipeline")
    stages, rows, blocks, graphs = _stage_views(plan, sim)
    config = plan.config
    logger.info("report: %d nodes in %d stage(s)", len(rows), len(stages))
    return {
        "header": _header(plan),
        "axes": _axes(plan),
        "config": config.describe() if config is not None else None,
        "estimate": _estimate(plan, sim),
        "memory": _memory(plan, sim),
        "search": _search(plan),
        "stages": stages,
        "rows": rows,
        "blocks": blocks,
        "graphs": graphs,
        "timeline": _timeline(plan, sim, trace),
        "diff": folded_diff(plan, other, names=names) if other is not None else None,
    }
