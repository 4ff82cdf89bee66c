"""Pipeline timelines: what a step did on each rank, beside what the cost model predicted.

``measured_timeline(runner)`` collects, on every rank, the (action, start, end) records the
interpreter kept for its last ``train_step`` (a collective; one row per pipeline rank).
:func:`partitioner.pipeline_simulation.simulated_timeline` replays the same schedule with each
stage's times from its plan (the runtime never prices: that is the planner's side).
``chrome_trace`` writes both as Chrome-trace JSON (open in chrome://tracing or Perfetto: one
process per timeline, one thread per rank); ``timeline_svg`` draws them one above the other,
on one time scale.
``idle_fraction`` is the share of rank-time not spent computing, comparable with
``(p-1)/(m+p-1)``.

The simulated timeline is priced with the cluster the stage plans were made for
(``pricing_cluster``: ``auto_parallelize``'s ``cluster=``, by default ``"cpu"``, measured on
the machine, when the job runs on CPUs); nothing re-prices it. ``comparison_text`` puts the
two side by side: per stage and action kind the mean duration simulated and measured, the
step and the idle share, each with the ratio measured / simulated, and says when the plans
were priced for another kind of device than the job runs on.
"""

from __future__ import annotations

import html
import json
import re
from collections import defaultdict

import torch.distributed as dist

__all__ = [
    "measured_timeline",
    "chrome_trace",
    "timeline_svg",
    "idle_fraction",
    "pricing_cluster",
    "action_durations",
    "step_seconds",
    "comparison_text",
]

_COLOURS = {"F": "#6fa8dc", "B": "#93c47d", "I": "#b6d7a8", "W": "#ffd966"}


def measured_timeline(runner) -> dict:
    """pipeline rank -> [(action, start s, end s)] of compute actions, from every rank (collective)."""
    mine = (runner.comm_pp[1], [t for t in runner.trace if t[0].lstrip("0123456789")[:1] in ("F", "B", "I", "W")])
    parts: list = [None] * dist.get_world_size()  # filled by all_gather_object
    dist.all_gather_object(parts, mine)
    out = {}
    for pp_rank, trace in parts:
        out.setdefault(pp_rank, trace)
    return dict(sorted(out.items()))


def pricing_cluster(runner) -> str:
    """The name of the cluster the stage plans were priced with (the simulated timeline's)."""
    names = sorted({plan.data["cluster"]["name"] for plan in runner.plan["stages"]})
    return names[0] if len(names) == 1 else ", ".join(names)


_ACTION = re.compile(r"^(\d+)([FBIW])")


def action_durations(timeline: dict) -> dict:
    """``{(stage, kind): mean seconds}`` over a timeline's compute actions (``0F1``: stage 0, F)."""
    spans = defaultdict(list)
    for rows in timeline.values():
        for action, start, end in rows:
            match = _ACTION.match(action)
            if match:
                spans[(int(match.group(1)), match.group(2))].append(end - start)
    return {key: sum(v) / len(v) for key, v in sorted(spans.items())}


def step_seconds(timeline: dict) -> float:
    """From the first action's start to the last action's end, over all ranks."""
    rows = [row for rows in timeline.values() for row in rows]
    return max(e for _, _, e in rows) - min(s for _, s, _ in rows) if rows else 0.0


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _ratio(measured, simulated) -> str:
    return f"{measured / simulated:.2f}x" if measured is not None and simulated else "-"


def comparison_text(measured: dict, simulated: dict, *, cluster: str, device: str, schedule: str = "") -> str:
    """The last step, simulated by the cost model and measured, side by side (see the module
    docstring); ``cluster``: the simulation's, ``device``: the device type the job ran on."""
    lines = [
        f"Pipeline step{f' ({schedule})' if schedule else ''}: simulated by the cost model vs measured on "
        f"this job's last train_step",
        f"simulated with the stage plans' estimates, cluster {cluster} (the cluster the stage plans were "
        f"priced with); job device: {device}",
    ]
    if (device == "cpu") != (cluster == "cpu"):
        lines.append(
            f"note: the stage plans were priced for {cluster}, not for this job's {device}: the simulated "
            f"column is what {cluster} would take, not a prediction for this machine"
        )
    lines += ["", f"{'stage':>5}  {'action':<6}  {'simulated':>12}  {'measured':>12}  {'measured/simulated':>18}"]
    sim, real = action_durations(simulated), action_durations(measured)
    for stage, kind in sorted(set(sim) | set(real), key=lambda sk: (sk[0], "FBIW".index(sk[1]))):
        s, m = sim.get((stage, kind)), real.get((stage, kind))
        lines.append(f"{stage:>5}  {kind:<6}  {_ms(s):>12}  {_ms(m):>12}  {_ratio(m, s):>18}")
    s, m = step_seconds(simulated), step_seconds(measured)
    lines.append(f"{'step':>5}  {'':<6}  {_ms(s):>12}  {_ms(m):>12}  {_ratio(m, s):>18}")
    lines.append(f"{'idle':>5}  {'':<6}  {idle_fraction(simulated):>12.1%}  {idle_fraction(measured):>12.1%}")
    lines.append(
        "(action times: the mean over the step's microbatches, per microbatch; idle: the share of "
        "rank-time not computing)"
    )
    return "\n".join(lines) + "\n"


def idle_fraction(timeline: dict) -> float:
    start = min(s for rows in timeline.values() for _, s, _ in rows)
    end = max(e for rows in timeline.values() for _, _, e in rows)
    busy = sum(e - s for rows in timeline.values() for _, s, e in rows)
    span = (end - start) * len(timeline)
    return 1.0 - busy / span if span > 0 else 0.0


def _kind(action: str) -> str:
    for k in ("F", "B", "I", "W"):
        if k in action.lstrip("0123456789")[:1]:
            return k
    return "F"


def chrome_trace(timelines: dict) -> str:
    """``timelines``: name -> {rank: [(action, start, end)]}; JSON in the Trace Event format."""
    events = []
    for pid, (name, timeline) in enumerate(timelines.items()):
        origin = min((s for rows in timeline.values() for _, s, _ in rows), default=0.0)
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        for rank, rows in timeline.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
            for action, start, end in rows:
                events.append(
                    {
                        "name": action,
                        "cat": _kind(action),
                        "ph": "X",
                        "pid": pid,
                        "tid": rank,
                        "ts": (start - origin) * 1e6,
                        "dur": max(end - start, 0.0) * 1e6,
                    }
                )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def timeline_svg(timelines: dict, *, width: int = 900, row: int = 26) -> str:
    """One panel per timeline, one row per rank, boxes coloured by F / B / I / W; every panel on
    the time scale of the longest, so a step twice as long draws twice as wide."""
    panels, y = [], 10
    longest = max((step_seconds(timeline) for timeline in timelines.values()), default=0.0)
    scale = (width - 90) / max(longest, 1e-12)
    for name, timeline in timelines.items():
        start = min(s for rows in timeline.values() for _, s, _ in rows)
        end = max(e for rows in timeline.values() for _, _, e in rows)
        idle = idle_fraction(timeline)
        panels.append(
            f'<text x="4" y="{y + 12}" font-size="13" font-weight="bold">{html.escape(name)}: '
            f"{(end - start) * 1e3:.2f} ms, idle {idle:.1%}</text>"
        )
        y += 20
        for rank, rows in sorted(timeline.items()):
            panels.append(f'<text x="4" y="{y + row * 0.65:.1f}" font-size="11">rank {rank}</text>')
            for action, s, e in rows:
                x = 80 + (s - start) * scale
                w = max((e - s) * scale, 0.5)
                colour = _COLOURS.get(_kind(action), "#cccccc")
                panels.append(
                    f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 4}" fill="{colour}" '
                    f'stroke="#333" stroke-width="0.4"><title>{html.escape(action)}</title></rect>'
                )
                if w > 22:
                    panels.append(
                        f'<text x="{x + 2:.2f}" y="{y + row * 0.6:.1f}" font-size="9">{html.escape(action)}</text>'
                    )
            y += row
        y += 14
    legend = " ".join(
        f'<rect x="{80 + i * 90}" y="{y}" width="12" height="12" fill="{c}"/>'
        f'<text x="{96 + i * 90}" y="{y + 10}" font-size="11">{k}</text>'
        for i, (k, c) in enumerate(_COLOURS.items())
    )
    y += 24
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" font-family="Helvetica">'
        + "".join(panels)
        + legend
        + "</svg>"
    )
