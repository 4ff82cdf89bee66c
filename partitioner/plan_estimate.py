"""A plan's estimate, added up from its records: compute, collectives (bytes, calls, seconds),
memory, the optimizer step, and for a pipeline the simulated step of its busiest stage.

:func:`estimate_plan` is what :meth:`partitioner.sharding_plan.ShardingPlan.estimate` returns.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from partitioner.estimate import Estimate
from passes.plan.memory_peak import memory_breakdown

if TYPE_CHECKING:
    from partitioner.sharding_plan import ShardingPlan
    from passes.core.plan_records import CollectiveRecord, NodeRecord

__all__ = ["estimate_plan", "grad_sync_calls", "held_grad_sync", "per_step_comm", "plan_collective_calls"]

logger = logging.getLogger(__name__)


def estimate_plan(plan: ShardingPlan) -> Estimate:
    """The plan's estimate: a pipeline's simulated step, else the sum over its records, with the
    throughput (model FLOPs, TFLOP/s per device, MFU) filled in."""
    if "pipeline" in plan.data:
        return _with_throughput(plan, _pipeline_estimate(plan))
    return _with_throughput(plan, _intra_op_estimate(plan))


def _sum_phases(by_phase: dict) -> dict:
    """``{kind: {axis: n}}`` summed over the phases of ``{phase: {kind: {axis: n}}}``."""
    out: dict = defaultdict(lambda: defaultdict(int))
    for kinds in by_phase.values():
        for kind, axes in kinds.items():
            for axis, n in axes.items():
                out[kind][axis] += n
    return {k: dict(v) for k, v in out.items()}


def per_step_comm(per_microbatch: dict, grad_sync: dict, m: int) -> dict:
    """A pipeline stage's ``{kind: {axis: bytes}}`` over a step of ``m`` microbatches: its
    collectives once per microbatch, except the parameter-gradient ones it holds back
    (``grad_sync``, part of ``per_microbatch``), sent once per step
    (:class:`runtime.pipeline.PipelineRunner`)."""
    return {
        kind: {
            axis: (v - grad_sync.get(kind, {}).get(axis, 0.0)) * m + grad_sync.get(kind, {}).get(axis, 0.0)
            for axis, v in axes.items()
        }
        for kind, axes in per_microbatch.items()
    }


@functools.lru_cache(maxsize=1 << 12)
def _held_back(src: str, grad: str, mesh_shape: tuple) -> bool:
    """:func:`passes.plan.cost_model.grad_held_back` for placements written as text (imports torch)."""
    from passes.core.placements import parse_spec
    from passes.plan.cost_model import grad_held_back

    return grad_held_back(parse_spec(src, len(mesh_shape)), parse_spec(grad, len(mesh_shape)), mesh_shape)


def held_grad_sync(plan: ShardingPlan, record: NodeRecord, c: CollectiveRecord) -> bool:
    """A collective of ``record``'s backward that moves a parameter's gradient (on the edge
    from the parameter; a ZeRO-3 regather is the weight, not its gradient) and that a
    pipeline stage holds back to once per step: an all-reduce onto replicated storage, not a
    reduce-scatter onto a weight stored sharded (:func:`passes.plan.cost_model.grad_held_back`;
    a plan saved without the consumers' gradient placements: every such collective)."""
    k = c.input
    if c.phase != "bwd" or k is None or c.regather:
        return False
    source = plan.node_by_name.get(record.inputs[k])
    if source is None or source.kind != "param":
        return False
    grads = record.grads
    if not grads or k >= len(grads) or grads[k] is None or not source.out:
        return True
    return _held_back(source.out[0], grads[k], plan.mesh_shape)


def _intra_op_estimate(plan) -> Estimate:
    compute = comm_t = weight = sync_t = optimizer = forward = 0.0
    comm = defaultdict(lambda: defaultdict(float))
    sync = defaultdict(lambda: defaultdict(float))
    phases = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for r in plan.node_records:
        compute += r.compute_s
        comm_t += r.host_transfer_s or 0.0  # offloaded optimizer state: host copies
        weight += r.weight_grad_s or 0.0
        optimizer += r.optimizer_step_s or 0.0
        forward += r.forward_s or 0.0
        for c in r.comm:
            comm_t += c.time_s
            forward += c.time_s if c.phase == "fwd" else 0.0
            comm[c.kind][c.axis] += c.bytes
            phases[c.phase][c.kind][c.axis] += c.bytes
            if held_grad_sync(plan, r, c):
                sync_t += c.time_s
                sync[c.kind][c.axis] += c.bytes
    as_dict = lambda d: {k: dict(v) for k, v in d.items()}  # noqa: E731
    memory = memory_breakdown(plan.records)
    calls, flat, wait = _priced_calls(plan)
    comm_t += flat + wait
    return Estimate(
        step_time_s=compute + comm_t + optimizer,
        compute_s=compute,
        comm_s=comm_t,
        comm_calls=_sum_phases(calls),
        comm_calls_by_phase=calls,
        flat_latency_s=flat,
        arrival_wait_s=wait,
        optimizer_s=optimizer,
        memory_bytes=memory.peak,
        comm_bytes=as_dict(comm),
        comm_bytes_by_phase={p: as_dict(v) for p, v in phases.items()},
        weight_grad_s=weight,
        forward_s=forward,
        memory=memory,
        grad_sync_s=sync_t,
        grad_sync_bytes=as_dict(sync),
    )


def plan_collective_calls(plan, *, bucket_grads: bool) -> dict:
    from passes.plan.collective_calls import collective_calls

    return collective_calls(plan.node_records, plan.mesh_shape, plan.axis_names, bucket_grads=bucket_grads)


def grad_sync_calls(plan) -> dict:
    """``{kind: {axis: n}}``: the backward entries that move parameter gradients a pipeline
    stage holds back (:func:`held_grad_sync`), one call each (its syncs run per edge)."""
    out: dict = defaultdict(lambda: defaultdict(int))
    for r in plan.node_records:
        for c in r.comm:
            if held_grad_sync(plan, r, c):
                out[c.kind][c.axis] += 1
    return {k: dict(v) for k, v in out.items()}


def _priced_calls(plan) -> tuple:
    """(calls per phase, kind and axis; the flat calls' latency terms; the arrival waits):
    :mod:`passes.plan.collective_calls` with the plan's cluster (no cluster saved: 0 s each)."""
    from passes.plan.collective_calls import arrival_wait_s, collective_calls, group_calls, unpriced_latency_s

    args = (plan.node_records, plan.mesh_shape, plan.axis_names)
    grouped = group_calls(*args)
    calls = collective_calls(*args, grouped=grouped)
    if not isinstance(plan.data.get("cluster"), dict):
        return calls, 0.0, 0.0
    from partitioner.local_cluster import get_cluster

    cluster = get_cluster(plan.data["cluster"])
    return (
        calls,
        unpriced_latency_s(*args, cluster, grouped=grouped),
        arrival_wait_s(*args, cluster, grouped=grouped),
    )


def _pipeline_estimate(plan) -> Estimate:
    """The schedule's simulated step (bubble and point-to-point time included) on the busiest
    rank: its stages' per-microbatch compute and collectives times the microbatches (the
    all-reduced parameter gradients once: the runtime holds them back until the stage's last
    backward of the step; reduce-scatters onto weights stored sharded every microbatch), plus
    the activations and gradients it sends to its neighbours (``send_recv`` on ``pp``)."""
    pipe = plan.data["pipeline"]
    stages = [p.estimate() for p in plan.stage_plans]
    m = pipe["microbatches"]
    busiest = stages[pipe.get("busiest_stage", 0)]
    comm = per_step_comm(busiest.comm_bytes, busiest.grad_sync_bytes, m)
    comm["send_recv"] = {"pp": float(pipe["p2p_bytes"])}
    phases = {
        ph: per_step_comm(kinds, busiest.grad_sync_bytes if ph == "bwd" else {}, m)
        for ph, kinds in busiest.comm_bytes_by_phase.items()
    }
    stage = plan.stage_plans[pipe.get("busiest_stage", 0)]
    stage_calls = plan_collective_calls(stage, bucket_grads=False)  # a stage's syncs: per edge, once per step
    # (the stages' point-to-point sends, priced in p2p_time_s, are not collectives: not counted)
    sync_calls = grad_sync_calls(stage)
    calls = {ph: per_step_comm(kinds, sync_calls if ph == "bwd" else {}, m) for ph, kinds in stage_calls.items()}
    return Estimate(
        step_time_s=pipe["step_time_s"],
        compute_s=busiest.compute_s * m,
        comm_s=(busiest.comm_s - busiest.grad_sync_s) * m + busiest.grad_sync_s + 2 * m * pipe["p2p_time_s"],
        memory_bytes=pipe["memory_bytes"],
        comm_bytes=comm,
        comm_bytes_by_phase=phases,
        weight_grad_s=busiest.weight_grad_s * m,
        memory=busiest.memory,
        bubble_s=max(0.0, pipe["step_time_s"] - pipe["busy_s"]),
        grad_sync_s=busiest.grad_sync_s,
        grad_sync_bytes=busiest.grad_sync_bytes,
        optimizer_s=max(s.optimizer_s for s in stages),
        comm_calls=_sum_phases(calls),
        comm_calls_by_phase=calls,
    )


def _with_throughput(plan, est: Estimate) -> Estimate:
    """Model FLOPs, TFLOP/s per device and MFU against the cluster's peak for the compute dtype."""
    header = plan.header
    flops = float(header.model_flops or 0.0)
    devices = 1
    for n in plan.mesh_shape:
        devices *= n
    est.devices = devices
    if flops and est.step_time_s > 0:
        est.model_flops = flops
        est.tflops_per_device = flops / devices / est.step_time_s / 1e12
        # the dtype the FLOPs are priced in (older plans: the precision's compute dtype)
        compute = header.flops_dtype or (header.precision or {}).get("compute", "float32")
        peaks = (header.cluster or {}).get("peak_flops", {})
        peak = peaks.get(compute) or peaks.get("float32") or 0.0
        est.mfu = est.tflops_per_device * 1e12 / peak if peak else 0.0
    return est
