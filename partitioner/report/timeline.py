"""A pipelined plan's step per rank: simulated from the plan, measured from a trace.

``simulate_plan(plan)`` replays the plan's schedule (``data["pipeline"]``: schedule, ranks,
microbatches, stages per rank) with each stage's forward, backward and weight-gradient time per
microbatch from its stage plan's estimate, the point-to-point time on every dependency that
crosses ranks and each stage's once-per-step gradient reduction and optimizer step: the same
:func:`passes.schedules.simulate` call the configuration search priced the plan with,
so the simulated step ends at the plan's ``step_time_s``. It also splits the busiest rank's
step into compute, exposed communication (its collectives; the point-to-point waits are idle
time), optimizer step and bubble (idle), which add up to the step.

``read_trace(path)`` reads the measured timeline from a Chrome trace as ``partitioner.dump``
writes it (``timeline.json``, :func:`runtime.pipeline_trace.chrome_trace`): the process named
``measured``, one thread per rank.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

__all__ = ["simulate_plan", "read_trace"]

logger = logging.getLogger(__name__)


def _takes_activations(pipe: dict) -> list:
    """Per stage, whether it takes floating-point activations (saved with the plan; plans saved
    before it was: every stage but the first, the token-ids case)."""
    stages = pipe["degree"] * pipe.get("virtual_stages", 1)
    saved = pipe.get("takes_activations")
    if saved is not None:
        return list(saved)
    logger.info("plan saved without takes_activations: simulating stage 0 as taking none (token ids)")
    return [s > 0 for s in range(stages)]


def simulate_plan(plan) -> dict | None:
    """``{"timeline": {rank: [(action, start s, end s)]}, "step_s", "stage_to_rank", "split"}``
    for a pipelined plan (None for a plan without a pipeline); see the module docstring."""
    import passes.schedules as ps
    from partitioner.core_sharing import stage_plans_cores

    pipe = plan.data.get("pipeline")
    if not pipe:
        return None
    m = pipe["microbatches"]
    schedule = ps.SCHEDULES[pipe["schedule"]].make(pipe["degree"], m, pipe.get("virtual_stages", 1))
    estimates = [stage.estimate() for stage in plan.stage_plans]
    forward, backward, weight = ps.stage_durations(estimates, _takes_activations(pipe))
    result = ps.simulate(
        schedule,
        forward,
        backward,
        weight,
        comm_time=pipe.get("p2p_time_s", 0.0),
        sync_time=ps.stage_syncs(estimates),
        cores=stage_plans_cores(plan.stage_plans, pipe["degree"]),
        transfer_time=pipe.get("message_cpu_s", 0.0),
    )
    syncs = ps.stage_syncs(estimates)
    timeline = {}
    for r, rows in result.timelines.items():  # each rank's held gradient reductions and optimizer step close its step
        timeline[r] = [(str(t.action), t.start, t.end) for t in rows]
        held = sum(syncs[s] for s in schedule.stages_of(r))
        if held > 0 and rows:
            timeline[r].append(("sync+optimizer", rows[-1].end, rows[-1].end + held))
    busiest = max(result.busy, key=result.busy.__getitem__)
    mine = [estimates[s] for s in schedule.stages_of(busiest)]
    compute = sum(e.compute_s for e in mine) * m
    comm = sum((e.comm_s - e.grad_sync_s) * m + e.grad_sync_s for e in mine)
    optimizer = sum(e.optimizer_s for e in mine)
    split = {
        "rank": busiest,
        "compute_s": compute,
        "comm_s": comm,
        "optimizer_s": optimizer,
        "bubble_s": max(0.0, result.makespan - result.busy[busiest]),
    }
    return {
        "timeline": timeline,
        "step_s": result.makespan,
        "stage_to_rank": list(schedule.stage_to_rank),
        "split": split,
    }


def read_trace(path) -> dict:
    """``{rank: [(action, start s, end s)]}`` of the ``measured`` process of a Chrome trace."""
    try:
        events = json.loads(Path(path).read_text())["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: not a pipeline trace ({type(exc).__name__}: {exc}); give the timeline.json "
            f"partitioner.dump writes after a train_step"
        ) from None
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    measured = [pid for pid, name in names.items() if name == "measured"]
    if not measured:
        raise ValueError(f"{path}: the trace has no process named 'measured' (it has: {sorted(names.values())})")
    out: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == measured[0]:
            start = e["ts"] * 1e-6
            out.setdefault(int(e["tid"]), []).append((e["name"], start, start + e["dur"] * 1e-6))
    if not out:
        raise ValueError(
            f"{path}: the trace's 'measured' process has no actions (was a train_step run before the dump?)"
        )
    return {rank: sorted(rows, key=lambda row: row[1]) for rank, rows in sorted(out.items())}
