"""A plan's estimate, added up from its records: compute, collectives (bytes, calls, seconds),
memory, the optimizer step, and for a pipeline the simulated step of its busiest stage.

Priced once: every price here is one the planner wrote into the plan (each record's compute and
collective seconds; which parameter-gradient reductions a pipeline stage holds back, the
collectives' ``held`` marks; the flat calls' latency, the compute copies' part of it and the
arrival waits, the header's ``flat_latency_s``, ``copy_latency_s`` and ``arrival_wait_s``).
This module adds them up and prices nothing itself; it counts the calls
(:mod:`passes.plan.collective_calls`) and adds up the memory (:mod:`passes.plan.memory_peak`).

:func:`estimate_plan` is what :meth:`partitioner.sharding_plan.ShardingPlan.estimate` returns.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from partitioner.estimate import Estimate
from passes.core.plan_records import CollectiveRecord, NodeRecord
from passes.plan.memory_peak import memory_breakdown

if TYPE_CHECKING:
    from partitioner.sharding_plan import ShardingPlan

__all__ = [
    "copy_collective",
    "estimate_plan",
    "grad_sync_calls",
    "once_per_step",
    "per_step_comm",
    "plan_collective_calls",
    "stage_step_comm",
]

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


def copy_collective(record: NodeRecord, c: CollectiveRecord) -> bool:
    """A compute copy's own collective, once per step (on a ZeRO-1 or offloaded parameter's record:
    its gradient's reduction into the stepped tensor and, ZeRO-1, that shard's all-gather into the
    copy, :func:`passes.plan.zero_storage.zero1_collectives`)."""
    return record.kind == "param" and c.input is None and bool(c.bucketed)


def once_per_step(record: NodeRecord, c: CollectiveRecord) -> bool:
    """A collective a pipeline stage runs once per step, not once per microbatch: a gradient
    reduction the planner marked ``held`` or a compute copy's (:func:`copy_collective`)."""
    return copy_collective(record, c) or bool(c.held)


def stage_step_comm(plan: ShardingPlan, m: int) -> tuple:
    """A pipeline stage's ``({phase: {kind: {axis: bytes}}}, {phase: {kind: {axis: calls}}})`` over
    a step of ``m`` microbatches (:class:`runtime.pipeline.PipelineRunner`): every collective once
    per microbatch, except those it runs once per step (:func:`once_per_step`). Its calls: per
    edge (a stage buckets nothing), the compute copies' in flat buffers
    (:func:`passes.plan.collective_calls.group_calls`)."""
    from passes.plan.collective_calls import group_calls

    est = plan.estimate()
    once: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    once_calls: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for r in plan.node_records:
        for c in r.comm:
            if once_per_step(r, c):
                once[c.phase][c.kind][c.axis] += c.bytes
                if not copy_collective(r, c):  # a held sync: one call per edge
                    once_calls[c.phase][c.kind][c.axis] += 1
    flat, _ = group_calls(plan.node_records, plan.mesh_shape, plan.axis_names, bucket_grads=False)
    for phase, kind, axis, n in flat:  # the copies' flat calls (no gradient buckets in a stage)
        once_calls[phase][kind][axis] += n
    calls = plan_collective_calls(plan, bucket_grads=False)
    step_bytes = {ph: per_step_comm(kinds, once.get(ph, {}), m) for ph, kinds in est.comm_bytes_by_phase.items()}
    step_calls = {ph: per_step_comm(kinds, once_calls.get(ph, {}), m) for ph, kinds in calls.items()}
    return step_bytes, step_calls


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
            # a compute copy's gather runs once per step, before the forward (with the syncs below)
            forward += c.time_s if c.phase == "fwd" and not copy_collective(r, c) else 0.0
            comm[c.kind][c.axis] += c.bytes
            phases[c.phase][c.kind][c.axis] += c.bytes
            if once_per_step(r, c):  # marked by the planner, or a compute copy's: once per step
                sync_t += c.time_s
                sync[c.kind][c.axis] += c.bytes
    as_dict = lambda d: {k: dict(v) for k, v in d.items()}  # noqa: E731
    memory = memory_breakdown(plan.node_records)
    calls = plan_collective_calls(plan, bucket_grads=True)
    header = plan.header
    flat, wait = header.flat_latency_s or 0.0, header.arrival_wait_s or 0.0  # priced by the planner
    once = header.copy_latency_s or 0.0
    comm_t += flat + wait
    sync_t += once  # the compute copies' flat calls: launched once per step
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
    stage holds back (marked ``held`` by the planner), one call each (its syncs run per edge)."""
    out: dict = defaultdict(lambda: defaultdict(int))
    for r in plan.node_records:
        for c in r.comm:
            if c.held:
                out[c.kind][c.axis] += 1
    return {k: dict(v) for k, v in out.items()}


def _pipeline_estimate(plan) -> Estimate:
    """The schedule's simulated step (bubble and point-to-point time included) on the busiest
    rank: its stages' per-microbatch compute and collectives times the microbatches (the
    all-reduced parameter gradients once: the runtime holds them back until the stage's last
    backward of the step; reduce-scatters onto weights stored sharded every microbatch), plus
    the activations and gradients it sends to its neighbours (``send_recv`` on ``pp``)."""
    pipe = plan.data["pipeline"]
    stage_plans = plan.stage_plans
    by_class = {id(p): p.estimate() for p in stage_plans}  # identical stages share one plan: priced once
    stages = [by_class[id(p)] for p in stage_plans]
    m = pipe["microbatches"]
    busiest = stages[pipe.get("busiest_stage", 0)]
    comm = per_step_comm(busiest.comm_bytes, busiest.grad_sync_bytes, m)
    comm["send_recv"] = {"pp": float(pipe["p2p_bytes"])}
    # (the stages' point-to-point sends, priced in p2p_time_s, are not collectives: not counted)
    phases, calls = stage_step_comm(stage_plans[pipe.get("busiest_stage", 0)], m)
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
