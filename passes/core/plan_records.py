"""The plan's records, typed: one :class:`NodeRecord` per graph node, one :class:`CollectiveRecord`
per collective it runs, each with its JSON I/O.

A saved plan (``partitioner.ShardingPlan``) keeps its records as the JSON objects the planner
wrote (``data["records"]``, :func:`passes.plan.plan_intra_op.plan_intra_op`); readers take them
typed, one attribute per key, each documented below (``ShardingPlan.node_records``).

The JSON does not change with the types (the plan format's version stays): every key of a record
is a field of the same name. A key every version has written is a required field and always
written back; any other is optional, ``None`` when the record lacks it, and written back only when
set, so ``NodeRecord.from_dict(d).to_dict() == d`` for every record a plan holds (the tests check
it on plans of every kind). A key no field names (a file from a newer writer) is kept in
``extra`` and written back unchanged.

This module sits in the bottom layer (it imports nothing of Partita): the passes that write
records and the partitioner code that reads them both import it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["CollectiveRecord", "NodeRecord", "typed_by_name"]

logger = logging.getLogger(__name__)


def _from_dict(cls, data: dict, **converted):
    """An instance of the record dataclass ``cls`` from its JSON object: required keys must be
    present (a ``ValueError`` names the missing ones), unknown keys go to ``extra``."""
    names = {f.name for f in fields(cls)} - {"extra"}
    missing = [f.name for f in fields(cls) if f.name != "extra" and _required(f) and f.name not in data]
    if missing:
        raise ValueError(f"{cls.__name__}: the plan record {data.get('name', data)!r} lacks {missing}")
    values = {k: v for k, v in data.items() if k in names}
    values.update(converted)
    return cls(**values, extra={k: v for k, v in data.items() if k not in names})


def _to_dict(record, **converted) -> dict:
    """The JSON object of a record: required fields always, optional ones when set, then ``extra``."""
    out = {}
    for f in fields(record):
        if f.name == "extra":
            continue
        value = converted[f.name] if f.name in converted else getattr(record, f.name)
        if _required(f) or value is not None:
            out[f.name] = value
    out.update(record.extra)
    return out


def _required(f) -> bool:
    return f.metadata.get("required", False)


def _key(**kw):
    """A required field (every writer has written its key)."""
    return field(metadata={"required": True}, **kw)


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective a node's record runs per microbatch, on one mesh axis (an edge's move into
    the node, the node's own, or a weight's once-per-step reduction and gather)."""

    kind: str = _key()
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all``."""
    axis: str = _key()
    """The mesh axis's name."""
    bytes: float = _key()
    """Payload bytes per device (the buffer reduced or gathered)."""
    phase: str = _key()
    """``fwd`` or ``bwd``."""
    input: int | None = _key()
    """The index of the tensor input whose edge runs it (None: the node's own, or a weight's
    once-per-step collective)."""
    time_s: float = _key()
    """Its price in seconds (:func:`passes.plan.cost_model.collective_time`)."""
    bucketed: bool | None = None
    """True: a parameter gradient's synchronisation, sent in flat buckets."""
    regather: bool | None = None
    """True: a gather repeated in backward (a ZeRO-3 weight, or an activation kept as its shard)."""
    recompute: bool | None = None
    """True: a forward collective a recomputed layer runs again in backward."""
    sync_s: float | None = None
    """A bucketed gradient reduction's full price; its ``time_s`` is then the part backward's
    compute does not hide (:mod:`passes.plan.bucket_overlap`)."""
    held: bool | None = None
    """True: a parameter gradient's reduction a pipeline stage holds back over the step's
    microbatches and sends once per step (an all-reduce onto replicated storage, not a
    reduce-scatter onto a weight stored sharded: :func:`passes.plan.cost_model.grad_held_back`),
    marked by the planner so the estimate adds it up without deciding it again."""
    extra: dict = field(default_factory=dict, compare=False)
    """Keys no field names (written back unchanged)."""

    @classmethod
    def from_dict(cls, data: dict) -> CollectiveRecord:
        return _from_dict(cls, data)

    def to_dict(self) -> dict:
        return _to_dict(self)


@dataclass(frozen=True)
class NodeRecord:
    """What the plan does at one graph node: its placements, shapes, collectives, time and memory."""

    name: str = _key()
    """The fx node's name (unique in the graph)."""
    kind: str = _key()
    """``param``, ``buffer``, ``input``, ``op`` or ``output``."""
    module: str = _key()
    """The module path the node comes from (``""``: top level)."""
    target: str = _key()
    """The aten op's name, or the node's fx op (``placeholder``, ``output``)."""
    fqn: str | None = _key()
    """A parameter's or buffer's qualified name, an input's argument name; None for ops."""
    shapes: list = _key()
    """Global shape of each output (None: not a tensor)."""
    dtype: str | None = _key()
    inputs: list = _key()
    """The names of the tensor inputs, in argument order."""
    rep: str = _key()
    """The representative node whose decision it shares (itself outside repeated blocks)."""
    out: list = _key()
    """Each output's placement as text (``"[S(0), R]"``); [] for a node with no decision."""
    ins: list = _key()
    """The placement each tensor input arrives in (None: not moved / no data)."""
    local_shapes: list = _key()
    """Each output's shape on one rank."""
    comm: tuple = _key()
    """The :class:`CollectiveRecord` s the node runs."""
    compute_s: float = _key()
    """Forward + backward compute seconds per microbatch."""
    memory: float = _key()
    """Bytes the solver charged the node's option (its exact share: the memory fields below)."""
    decision: str | None = None
    """``leader`` (decides its group's option), ``follower`` or ``output``."""
    grads: list | None = None
    """The placement each input's gradient leaves the node in (None: no strategy)."""
    forward_s: float | None = None
    """The forward part of ``compute_s``."""
    weight_grad_s: float | None = None
    """The part of ``compute_s`` a zero-bubble W pass runs (parameter gradients, and on a
    parameter's record summing them over microbatches)."""
    grad_accumulate_s: float | None = None
    """A parameter in a pipeline stage: seconds per microbatch of summing its gradient into
    ``.grad`` (part of ``compute_s`` and ``weight_grad_s``)."""
    regather: bool | None = None
    """ZeRO-3: the weight's gathered copies are freed after forward and gathered again."""
    stored: str | None = None
    """ZeRO-1: the placement of the shard the optimizer steps."""
    offload: bool | None = None
    """The optimizer's tensor, gradient and state live in host memory."""
    host_transfer_s: float | None = None
    """Seconds copying an offloaded weight's gradient to the host and the stepped tensor back."""
    optimizer_step_s: float | None = None
    """Seconds of the optimizer's step over the tensor it steps."""
    tp_roles: Any = None
    """A weight contraction's role per mesh axis (2D/2.5D/3D tensor parallelism)."""
    tp_weight: str | None = None
    """The name of that contraction's weight input."""
    tensor_parallel: str | None = None
    """The tensor-parallel algorithm the contraction runs (``1d``, ``2d``, ``2.5d``, ``3d``)."""
    notes: dict | None = None
    """Axis name -> the rule's note on the strategy there (e.g. sequence-parallel attention)."""
    block: str | None = None
    """The repeated block's label the node belongs to."""
    block_index: int | None = None
    """Which instance of that block."""
    region: str | None = None
    """The recomputed region (a layer, or its attention core) the node belongs to."""
    recompute: bool | None = None
    """Recomputed in backward (activation checkpointing)."""
    recompute_s: float | None = None
    """Seconds of the forward the recomputation runs again."""
    regather_inputs: list | None = None
    """Inputs kept as their shard and gathered again in backward."""
    parameters: float | None = None
    """Memory fields (:func:`passes.plan.memory_accounting.memory_fields`), bytes per device:
    the parameter's stored piece (and compute copy)."""
    gradients: float | None = None
    optimizer_state: float | None = None
    offloaded: float | None = None
    """Bytes held in host memory (offloaded optimizer tensor, gradient and state)."""
    held_gradients: float | None = None
    """A pipeline stage's parameter-gradient sums held over the step's microbatches."""
    gradients_in_forward: float | None = None
    input_bytes: float | None = None
    saved_activations: float | None = None
    gathered_buffers: float | None = None
    transient_fwd: float | None = None
    transient_bwd: float | None = None
    gradients_alive: float | None = None
    """Without a pipeline: the parameter-gradient bytes alive while the op's backward runs (on
    the first parameter: at the end of backward), :mod:`passes.plan.bucket_memory`."""
    extra: dict = field(default_factory=dict, compare=False)
    """Keys no field names (written back unchanged)."""

    @classmethod
    def from_dict(cls, data: dict) -> NodeRecord:
        comm = tuple(CollectiveRecord.from_dict(c) for c in data.get("comm", ()))
        return _from_dict(cls, data, comm=comm)

    def to_dict(self) -> dict:
        return _to_dict(self, comm=[c.to_dict() for c in self.comm])

    @property
    def output_placement(self) -> str | None:
        """The first output's placement as text (None: no tensor output)."""
        return self.out[0] if self.out else None


def typed_by_name(records: Mapping[str, NodeRecord | dict]) -> dict[str, NodeRecord]:
    """``records`` (node name -> its record, as the plan's JSON holds it or already typed), typed:
    what a reader that takes either form (lowering) works on."""
    return {name: r if isinstance(r, NodeRecord) else NodeRecord.from_dict(r) for name, r in records.items()}
