"""``Estimate``: what the cost model predicts for one training step on each device, as printed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from partitioner.units import fmt_bytes as _fmt_bytes
from partitioner.units import fmt_time as _fmt_time
from passes.plan.memory_peak import MemoryBreakdown

__all__ = ["Estimate"]

logger = logging.getLogger(__name__)

_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}


@dataclass
class Estimate:
    """What the cost model predicts for one training step on each device."""

    step_time_s: float
    compute_s: float
    comm_s: float
    memory_bytes: float
    """Peak per device over the step (``memory.peak``): state, inputs, what backward keeps and
    the largest transient, in the order the step runs (:mod:`passes.plan.memory_peak`)."""
    comm_bytes: dict
    """``comm_bytes[kind][axis_name]``: payload bytes per device per step (forward + backward)."""
    comm_bytes_by_phase: dict = field(default_factory=dict)
    """``comm_bytes_by_phase[phase][kind][axis_name]`` with phase ``fwd`` / ``bwd``."""
    weight_grad_s: float = 0.0
    """The part of ``compute_s`` a zero-bubble pipeline schedule defers to its W pass: what the
    runtime's W pass runs (contractions' weight products, the weight gradients of other ops that
    meet a parameter, such as norms and bias adds, and summing gradients over microbatches:
    :func:`passes.plan.cost_model.weight_pass_time`, :func:`passes.plan.cost_model.grad_accumulate_time`)."""
    forward_s: float = 0.0
    """The part of ``step_time_s`` the forward runs: its compute and its collectives (0 in a plan
    saved without per-node forward times)."""
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    """Per device: parameters, gradients, optimizer state, inputs, saved activations, gathered
    buffers, offloaded bytes, and the forward and backward peaks."""

    # -- throughput: what the plan expects to achieve ------------------------------------------
    model_flops: float = 0.0
    """Training FLOPs of one step over all devices: forward and backward, 3x the forward's
    (recomputation not counted, so MFU compares across recomputation choices)."""
    devices: int = 1
    tflops_per_device: float = 0.0
    """``model_flops / devices / step_time_s`` in TFLOP/s."""
    mfu: float = 0.0
    """Model FLOPs utilisation: ``tflops_per_device`` over the preset's peak for the compute dtype."""
    bubble_s: float = 0.0
    """Pipelines: the busiest rank's idle time in the simulated schedule (0 without a pipeline)."""
    grad_sync_s: float = 0.0
    """The part of ``comm_s`` a pipeline stage runs once per step, not once per microbatch: the
    parameter-gradient all-reduces onto replicated storage it holds back, and the ZeRO-1 (or
    offloaded) weights' reduction into the stepped shard and all-gather into the compute copy
    (a weight stored sharded reduce-scatters its gradient in every microbatch: not counted here).
    Not part of ``forward_s``."""
    grad_sync_bytes: dict = field(default_factory=dict)
    """``grad_sync_bytes[kind][axis_name]``: the part of ``comm_bytes`` those collectives send."""
    optimizer_s: float = 0.0
    """The optimizer's step (part of ``step_time_s``): the bytes it reads and writes per element
    of the tensors it steps, at the device's memory bandwidth (the host's for offloaded state)."""
    comm_calls: dict = field(default_factory=dict)
    """``comm_calls[kind][axis_name]``: collective calls per device per step, each one paying the
    latency terms once (bucketed gradients: one call per flat buffer; :mod:`passes.plan.collective_calls`).
    What ``runtime.collectives.CommCounter.calls_dict()`` counts."""
    comm_calls_by_phase: dict = field(default_factory=dict)
    """``comm_calls_by_phase[phase][kind][axis_name]``."""
    flat_latency_s: float = 0.0
    """The part of ``comm_s`` that is the latency terms of the calls sending bucketed entries
    (flat buffers, and bucketed entries reduced on their own edge): added after solving, as the
    prefetch credit and the optimizer step are."""
    arrival_wait_s: float = 0.0
    """The part of ``comm_s`` the collective calls wait for ranks arriving apart after the compute
    since their previous call (the cluster's measured ``arrival_wait``; 0 on the presets): added
    after solving (:func:`passes.plan.collective_calls.arrival_wait_s`)."""

    def total_comm_bytes(self) -> float:
        return sum(v for per_axis in self.comm_bytes.values() for v in per_axis.values())

    def __str__(self) -> str:
        comm = (
            ", ".join(
                f"{_SHORT.get(k, k)}@{a} {_fmt_bytes(v)}"
                for k, axes in sorted(self.comm_bytes.items())
                for a, v in sorted(axes.items())
            )
            or "none"
        )
        optimizer = f", optimizer step {_fmt_time(self.optimizer_s)}" if self.optimizer_s else ""
        text = (
            f"step {_fmt_time(self.step_time_s)} (compute {_fmt_time(self.compute_s)}, communication "
            f"{_fmt_time(self.comm_s)}{optimizer}); memory {_fmt_bytes(self.memory_bytes)} per device; "
            f"communication per device: {comm}"
        )
        if self.memory is not None and self.memory.offloaded:
            text += f"; offloaded bytes on host {_fmt_bytes(self.memory.offloaded)} per device"
        return text + self.throughput_text()

    def throughput_text(self) -> str:
        if not self.model_flops:
            return ""
        bubble = f", pipeline bubble {_fmt_time(self.bubble_s)}" if self.bubble_s else ""
        return f"; {self.tflops_per_device:.1f} TFLOP/s per device (MFU {100 * self.mfu:.1f}%){bubble}"
