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
* backward, in a pipeline stage: parameters + gradients + optimizer state + inputs + held
  gradient sums + everything kept (released as backward proceeds; the start is the worst case)
  + the largest backward transient;
* backward, without a pipeline (the records carry ``gradients_alive``,
  :mod:`passes.plan.bucket_memory`), walked op by op: at op ``t``, parameters + optimizer state +
  inputs + what ops up to ``t`` keep (an op's saved tensors are freed once its backward ran) +
  its backward transient + the parameter gradients alive then (``.grad`` made so far, gradients
  waiting in the runtime's buckets, their flat buffers); at the end of backward (on the first
  parameter's record, nothing kept) the gradients while the last buckets are sent. With
  recomputed layers, whose rebuilt tensors are counted on the layer's first op only, the
  pipeline's bound counts too.

``peak`` is the larger of the two. Plans saved before these fields existed report the sum of
their records' ``memory`` as the peak, with no breakdown.

The planner reads it inside its solve loop (the exact peak of a candidate choice,
:mod:`passes.plan.plan_intra_op`) and the plan's estimate reads it from the saved records
(``partitioner.memory`` re-exports it as part of the public API).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from passes.core.plan_records import NodeRecord

__all__ = ["MemoryBreakdown", "NodeMemory", "memory_breakdown"]

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
    gradients_alive: float = 0.0
    """Without a pipeline: the most parameter-gradient bytes alive at once in backward (``.grad``
    made so far, gradients waiting in the runtime's buckets, their flat buffers)."""
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


@dataclass(frozen=True)
class NodeMemory:
    """One node's memory fields, bytes per device (:func:`passes.plan.memory_accounting.memory_fields`
    writes them; the :class:`passes.core.plan_records.NodeRecord` field of each name documents it),
    0 where the record has none."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer_state: float = 0.0
    offloaded: float = 0.0
    held_gradients: float = 0.0
    gradients_in_forward: float = 0.0
    input_bytes: float = 0.0
    saved_activations: float = 0.0
    gathered_buffers: float = 0.0
    transient_fwd: float = 0.0
    transient_bwd: float = 0.0
    gradients_alive: float = 0.0
    memory: float = 0.0
    itemised: bool = False
    """The record has the breakdown (a plan saved before it has only ``memory``)."""
    alive_known: bool = False
    """The record has ``gradients_alive`` (a plan walked through backward as the buckets hold it)."""
    in_backward: bool = False
    """The record has ``gradients_alive`` or ``transient_bwd``: a step of the backward walk."""
    recompute: bool = False

    @classmethod
    def of(cls, record: NodeRecord | Mapping) -> NodeMemory:
        """The fields of a typed record, or of a mapping of them (the solver's loop: a candidate's
        fields, :mod:`passes.plan.plan_intra_op`)."""
        read = functools.partial(getattr, record) if isinstance(record, NodeRecord) else record.get
        flags = ("itemised", "alive_known", "in_backward", "recompute")
        values = {f.name: read(f.name) or 0.0 for f in fields(cls) if f.name not in flags}
        itemised = any(read(name) is not None for name in ("parameters", "saved_activations", "input_bytes"))
        alive = read("gradients_alive") is not None
        in_backward = alive or read("transient_bwd") is not None
        return cls(
            **values, itemised=itemised, alive_known=alive, in_backward=in_backward, recompute=bool(read("recompute"))
        )


def memory_breakdown(records: Sequence[NodeRecord | Mapping]) -> MemoryBreakdown:
    """The breakdown and peaks of a plan's records (in graph order; typed, or mappings of their
    memory fields)."""
    nodes = [NodeMemory.of(r) for r in records]
    if not any(n.itemised for n in nodes):
        total = sum(n.memory for n in nodes)  # a plan from before the breakdown
        return MemoryBreakdown(forward_peak=total, backward_peak=total)
    m = MemoryBreakdown()
    kept = fwd_extra = bwd_extra = walked = 0.0
    for n in nodes:
        m.parameters += n.parameters
        m.gradients += n.gradients
        m.optimizer_state += n.optimizer_state
        m.offloaded += n.offloaded
        m.held_gradients += n.held_gradients
        m.gradients_in_forward += n.gradients_in_forward
        m.inputs += n.input_bytes
        m.saved_activations += n.saved_activations
        m.gathered_buffers += n.gathered_buffers
        kept += n.saved_activations + n.gathered_buffers
        fwd_extra = max(fwd_extra, kept + n.transient_fwd)
        bwd_extra = max(bwd_extra, n.transient_bwd)
        m.gradients_alive = max(m.gradients_alive, n.gradients_alive)
        if n.in_backward:
            walked = max(walked, kept + n.transient_bwd + n.gradients_alive)
    resident = m.parameters + m.optimizer_state + m.inputs + m.held_gradients
    m.forward_peak = resident + m.gradients_in_forward + fwd_extra
    bound = resident + m.gradients + kept + bwd_extra
    if not any(n.alive_known for n in nodes):
        m.backward_peak = bound
    elif any(n.recompute for n in nodes):
        m.backward_peak = max(bound, resident + walked)
    else:
        m.backward_peak = resident + walked
    return m
