"""A plan's memory per device: what is held, by kind, and the peak in the order a step runs.

Read off the plan's records (plain data, no torch): parameters, gradients and optimizer state
on parameter records; the batch pieces and model buffers on input and buffer records; on op
records the storages autograd keeps for backward (``saved_activations``: outputs, masks and
statistics; ``gathered_buffers``: tensors made by resharding edges that are kept, e.g. a weight
stored sharded and all-gathered for use) and what lives only while the op runs
(``transient_fwd``: its unkept output and edge buffers; ``transient_bwd``: the gradients its
backward holds). :mod:`passes.plan.memory_accounting` writes those fields.

The peak follows the step:

* forward, at op ``t``: parameters + optimizer state + inputs + everything kept by ops up to
  ``t`` + ``t``'s transient (gradients are not held: ``zero_grad`` sets them to None), and in a
  pipeline stage the gradient sums it holds back over the microbatches (``held_gradients``, the
  all-reduced ones, there from the first microbatch's backward on) and the ``.grad`` of the
  parameters it reduces every microbatch or not at all (``gradients_in_forward``: there from
  the first backward too; a bound under GPipe, whose forwards all come first);
* backward: parameters + gradients + optimizer state + inputs (+ held gradient sums) + everything kept (released as
  backward proceeds; the start is the worst case) + the largest backward transient.

``peak`` is the larger of the two. Plans saved before these fields existed report the sum of
their records' ``memory`` as the peak, with no breakdown.

The planner reads it inside its solve loop (the exact peak of a candidate choice,
:mod:`passes.plan.plan_intra_op`) and the plan's estimate reads it from the saved records
(``partitioner.memory`` re-exports it as part of the public API).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["MemoryBreakdown", "memory_breakdown"]

logger = logging.getLogger(__name__)


@dataclass
class MemoryBreakdown:
    """Bytes per device for one training step (see the module docstring)."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer_state: float = 0.0
    inputs: float = 0.0
    """The batch pieces and the model's buffers."""
    saved_activations: float = 0.0
    gathered_buffers: float = 0.0
    """Tensors made by resharding (gathered weights, moved activations) that backward keeps."""
    gradients_in_forward: float = 0.0
    """The part of ``gradients`` a pipeline stage has while later microbatches run forward: the
    ``.grad`` of parameters with an edge not held back (reduce-scattered every microbatch, or not
    reduced), made by the first microbatch's backward (in the forward peak)."""
    held_gradients: float = 0.0
    """A pipeline stage's gradient sums held back over a step's microbatches, one per parameter
    edge that all-reduces (resident from the first backward to the stage's last: in both peaks;
    a weight stored sharded reduce-scatters in every microbatch and holds nothing here)."""
    offloaded: float = 0.0
    """Bytes kept in host memory instead: offloaded weights' optimizer state, with the tensor the
    optimizer steps and its gradient (not part of the device's peak)."""
    forward_peak: float = 0.0
    backward_peak: float = 0.0

    @property
    def state(self) -> float:
        """Parameters + gradients + optimizer state."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def saved(self) -> float:
        """Everything backward keeps: saved activations and gathered buffers."""
        return self.saved_activations + self.gathered_buffers

    @property
    def peak(self) -> float:
        return max(self.forward_peak, self.backward_peak)


def memory_breakdown(records: list) -> MemoryBreakdown:
    """The breakdown and peaks of a plan's records (in graph order)."""
    if not any("parameters" in r or "saved_activations" in r or "input_bytes" in r for r in records):
        total = sum(r.get("memory", 0.0) for r in records)  # a plan from before the breakdown
        return MemoryBreakdown(forward_peak=total, backward_peak=total)
    m = MemoryBreakdown()
    kept = fwd_extra = bwd_extra = 0.0
    for r in records:
        m.parameters += r.get("parameters", 0.0)
        m.gradients += r.get("gradients", 0.0)
        m.optimizer_state += r.get("optimizer_state", 0.0)
        m.offloaded += r.get("offloaded", 0.0)
        m.held_gradients += r.get("held_gradients", 0.0)
        m.gradients_in_forward += r.get("gradients_in_forward", 0.0)
        m.inputs += r.get("input_bytes", 0.0)
        m.saved_activations += r.get("saved_activations", 0.0)
        m.gathered_buffers += r.get("gathered_buffers", 0.0)
        kept += r.get("saved_activations", 0.0) + r.get("gathered_buffers", 0.0)
        fwd_extra = max(fwd_extra, kept + r.get("transient_fwd", 0.0))
        bwd_extra = max(bwd_extra, r.get("transient_bwd", 0.0))
    resident = m.parameters + m.optimizer_state + m.inputs + m.held_gradients
    m.forward_peak = resident + m.gradients_in_forward + fwd_extra
    m.backward_peak = resident + m.gradients + kept + bwd_extra
    return m
