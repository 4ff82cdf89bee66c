"""Stage durations from the cost model's estimates, and the schedule they favour."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from passes.schedules.in_flight import peak_in_flight
from passes.schedules.registry import AUTO_SCHEDULES, SCHEDULES
from passes.schedules.shared_cores import SharedCores
from passes.schedules.simulator import StageTime, simulate

logger = logging.getLogger(__name__)


def stage_durations(estimates: Sequence, takes_activations: Sequence[bool]) -> tuple:
    """(forward, backward, weight) seconds per microbatch for each stage, as dicts by stage.

    ``estimates[s]`` is stage ``s``'s cost estimate for one microbatch (``step_time_s``:
    forward + backward; ``forward_s``: the forward's part; ``weight_grad_s``: what its W pass
    runs; ``grad_sync_s``: the parameter-gradient reductions it holds back and ``optimizer_s`` its
    optimizer step, which a pipeline runs once per step, :func:`stage_syncs`). The rest less the
    forward is backward (a plan without forward times: a third forward, two thirds backward).
    ``weight`` is what a zero-bubble W pass runs: the parameter gradients (weight products, the
    weight and bias gradients of the other ops that meet a parameter, the sums over
    microbatches), or the whole backward on a stage that takes no floating-point activations
    (the first: its input-gradient pass has nothing to compute, so all of its backward waits for
    W).
    """
    forward, backward, weight = {}, {}, {}
    for s, (est, takes) in enumerate(zip(estimates, takes_activations)):
        per_microbatch = est.step_time_s - est.grad_sync_s - getattr(est, "optimizer_s", 0.0)
        priced_forward = getattr(est, "forward_s", 0.0)
        forward[s] = priced_forward if 0.0 < priced_forward < per_microbatch else per_microbatch / 3.0
        backward[s] = per_microbatch - forward[s]
        weight[s] = min(est.weight_grad_s, backward[s]) if takes else backward[s]
    return forward, backward, weight


def stage_syncs(estimates: Sequence) -> dict:
    """stage -> seconds of its parameter-gradient reduction and its optimizer step, once per step
    (``sync_time`` of :func:`simulate`)."""
    return {s: est.grad_sync_s + getattr(est, "optimizer_s", 0.0) for s, est in enumerate(estimates)}


def choose_schedule(
    p: int,
    m: int,
    forward: StageTime,
    backward: StageTime,
    weight: StageTime,
    sync: StageTime | None = None,
    cores: int | SharedCores | None = None,
    comm_time: float = 0.0,
    transfer_time: StageTime | None = None,
) -> tuple:
    """The fastest one-stage-per-rank schedule for these stage durations: each of
    :data:`AUTO_SCHEDULES` is simulated; the shortest step wins, then the fewest microbatches in
    flight on any rank (activation memory), then the order of :data:`AUTO_SCHEDULES`.
    ``cores``, ``comm_time``, ``transfer_time``: as :func:`simulate` takes them.
    Returns (name, {name: simulated step seconds})."""
    steps, keys = {}, {}
    for order, name in enumerate(AUTO_SCHEDULES):
        sched = SCHEDULES[name].make(p, m, 1)
        result = simulate(
            sched,
            forward,
            backward,
            weight,
            comm_time=comm_time,
            sync_time=sync,
            cores=cores,
            transfer_time=transfer_time,
        )
        steps[name] = result.makespan
        keys[name] = (round(result.makespan, 12), max(peak_in_flight(sched).values()), order)
    return min(AUTO_SCHEDULES, key=keys.__getitem__), steps
