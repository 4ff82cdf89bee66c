"""A pipeline runner's step as the cost model predicts it: its schedule simulated with each
stage's forward, backward and weight-gradient (W) time from the stage's plan.

``stage_times(runner)`` reads the seconds per microbatch of each stage from its plan's estimate
(:func:`passes.schedules.stage_durations`) and each stage's once-per-step gradient
reduction (``stage_syncs``); ``simulated_timeline(runner)`` replays the runner's schedule with
them (:func:`passes.schedules.simulate`): pipeline rank -> [(action, start s, end s)],
the same form as :func:`runtime.pipeline_trace.measured_timeline`, so the two can be compared
(:func:`runtime.pipeline_trace.comparison_text`). It lives on the planner's side because it
prices: ``runtime/`` never imports the cost model or the simulator.
"""

from __future__ import annotations

from partitioner.core_sharing import stage_plans_cores
from passes.schedules import simulate, stage_durations, stage_syncs

__all__ = ["stage_times", "simulated_timeline"]


def stage_times(runner) -> tuple:
    """(forward, backward, weight) seconds per microbatch for each stage, from its plan's estimate
    (:func:`passes.schedules.stage_durations`), and each stage's gradient reduction, once
    per step (``stage_syncs``)."""
    estimates = [plan.estimate() for plan in runner.plan["stages"]]
    return (
        *stage_durations(estimates, [graph.takes_activations for graph in runner.stage_graphs]),
        stage_syncs(estimates),
    )


def simulated_timeline(runner, forward=None, backward=None, weight=None) -> dict:
    """pipeline rank -> [(action, start s, end s)] of the runner's schedule simulated with its stage
    times (:func:`stage_times`), or with the ``forward`` / ``backward`` / ``weight`` times given."""
    f, b, w, sync = stage_times(runner)
    cores = stage_plans_cores(runner.plan["stages"], runner.schedule.num_ranks)
    result = simulate(runner.schedule, forward or f, backward or b, weight or w, sync_time=sync, cores=cores)
    return {r: [(str(t.action), t.start, t.end) for t in timeline] for r, timeline in result.timelines.items()}
