"""A pipeline runner's step as the cost model predicts it: its schedule simulated with each
stage's forward, backward and weight-gradient (W) time from the stage's plan.

``stage_times(runner)`` reads the seconds per microbatch of each stage from its plan's estimate
(:func:`passes.schedules.stage_durations`) and each stage's once-per-step gradient
reduction (``stage_syncs``); ``runner_messages(runner)`` prices its point-to-point messages
(:func:`message_prices`: every boundary's message at the largest one's bytes, its seconds on the
pipeline axis's link between the ranks and its CPU on each rank, as the configuration search
prices a pipeline candidate's); ``simulated_timeline(runner)`` replays the runner's schedule with
them (:func:`passes.schedules.simulate`): pipeline rank -> [(action, start s, end s)],
the same form as :func:`runtime.pipeline_trace.measured_timeline`, so the two can be compared
(:func:`runtime.pipeline_trace.comparison_text`). It lives on the planner's side because it
prices: ``runtime/`` never imports the cost model or the simulator.
"""

from __future__ import annotations

import math

from partitioner.cluster import ClusterSpec
from partitioner.core_sharing import message_cpu_time, stage_plans_cores
from passes.schedules import simulate, stage_durations, stage_syncs

__all__ = [
    "stage_times",
    "simulated_timeline",
    "largest_message",
    "message_prices",
    "stage_plans_messages",
    "runner_messages",
]


def stage_times(runner) -> tuple:
    """(forward, backward, weight) seconds per microbatch for each stage, from its plan's estimate
    (:func:`passes.schedules.stage_durations`), and each stage's gradient reduction, once
    per step (``stage_syncs``)."""
    estimates = [plan.estimate() for plan in runner.plan["stages"]]
    return (
        *stage_durations(estimates, [graph.takes_activations for graph in runner.stage_graphs]),
        stage_syncs(estimates),
    )


def largest_message(stage_graphs, carried: dict) -> float:
    """Bytes one rank receives in the largest message between two stages: the activations a stage
    takes from the one before (``graph.receives``), as the receive buffers hold them (``carried``:
    value -> (this rank's piece's shape, dtype), :func:`partitioner.pipeline_shapes.receive_buffers`)."""
    largest = 0.0
    for graph in stage_graphs[1:]:
        pieces = [carried[name] for name in graph.receives if name in carried]
        largest = max(largest, float(sum(math.prod(shape) * dtype.itemsize for shape, dtype in pieces)))
    return largest


def message_prices(spec: ClusterSpec, mesh_shape, largest: float) -> tuple:
    """(seconds on the pipeline axis's link: latency and bytes at its bandwidth, CPU seconds at
    either end: :func:`partitioner.core_sharing.message_cpu_time`) of a message of ``largest``
    bytes between pipeline ranks (the first axis of ``mesh_shape``); (0, 0) for none."""
    if largest <= 0:
        return 0.0, 0.0
    link = spec.link_for_axis(tuple(mesh_shape), 0)
    return largest / link.bandwidth + link.latency_s, message_cpu_time(spec, largest)


def stage_plans_messages(stage_plans, pipeline_ranks: int, largest: float) -> tuple:
    """:func:`message_prices` in the stage plans' cluster, their mesh behind ``pipeline_ranks``."""
    data = stage_plans[0].data
    if not isinstance(data.get("cluster"), dict):
        return 0.0, 0.0
    mesh = (pipeline_ranks, *data["mesh"]["shape"])
    return message_prices(ClusterSpec.from_dict(data["cluster"]), mesh, largest)


def runner_messages(runner) -> tuple:
    """:func:`message_prices` of the runner's largest message (its stage plans' cluster)."""
    largest = largest_message(runner.stage_graphs, runner.carried_meta)
    return stage_plans_messages(runner.plan["stages"], runner.schedule.num_ranks, largest)


def simulated_timeline(runner, forward=None, backward=None, weight=None) -> dict:
    """pipeline rank -> [(action, start s, end s)] of the runner's schedule simulated with its stage
    times (:func:`stage_times`) and messages (:func:`runner_messages`), or with the ``forward`` /
    ``backward`` / ``weight`` times given."""
    f, b, w, sync = stage_times(runner)
    cores = stage_plans_cores(runner.plan["stages"], runner.schedule.num_ranks)
    link_s, cpu_s = runner_messages(runner)
    result = simulate(
        runner.schedule,
        forward or f,
        backward or b,
        weight or w,
        comm_time=link_s,
        sync_time=sync,
        cores=cores,
        transfer_time=cpu_s,
    )
    return {r: [(str(t.action), t.start, t.end) for t in timeline] for r, timeline in result.timelines.items()}
