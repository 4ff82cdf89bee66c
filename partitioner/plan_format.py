"""The plan file's format: its marker, its version, its typed header, and the migration of older files.

A saved plan (:meth:`partitioner.ShardingPlan.save`) is one JSON object. Its *header* is what the
plan was made for and under which options, and the plan-wide prices the planner recorded:
:class:`PlanHeader`, one typed field per key, each
documented below. The rest is the plan's bulk, read by the code that owns it: ``records`` (one
per graph node, :mod:`passes.plan.plan_intra_op`), ``alternatives``, ``blocks``, ``stats``, and for
the plans the search or a pipeline makes ``config``, ``search`` and ``pipeline`` (whose
``stage_plans`` are plans of their own).

Versions:

* **1**: the header's keys were written as they were added, so a file written before a key
  existed lacks it, and readers each assumed their own default.
* **2** (:data:`PLAN_VERSION`): every header key is present. :func:`migrate` turns a version-1
  object into a version-2 one, the stage plans of a pipeline included, filling each missing key
  with the default its field gives (the value the version-1 readers assumed). Any other version
  is refused with a message naming it.

Prices the planner records (the header's ``flat_latency_s``, ``copy_latency_s``, ``arrival_wait_s``, the
collectives' ``held`` marks) came after version 2 without changing it: the estimate only adds
them up, so a file written before them (any version; the planner always writes a number) is
priced once as it loads, by the planner's own functions (:func:`_price_unpriced`): the held
marks from the records' placements (:func:`passes.plan.cost_model.grad_held_back`), the
latencies from the records and the saved cluster
(:func:`passes.plan.collective_calls.step_latencies`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "PlanHeader", "migrate"]

logger = logging.getLogger(__name__)

PLAN_FORMAT = "partita.sharding_plan"
PLAN_VERSION = 2


@dataclass(kw_only=True)
class PlanHeader:
    """What a plan was made for and under which options, and the plan-wide prices the planner
    recorded (the top-level keys of its JSON)."""

    format: str = PLAN_FORMAT
    """Always :data:`PLAN_FORMAT`: marks the object as a Partita plan."""
    version: int = PLAN_VERSION
    """The format's version (:data:`PLAN_VERSION` once loaded: older files are migrated)."""
    fingerprint: str | None
    """The captured graph's fingerprint with shapes: a replay is refused on any other graph
    (None: a pipeline runner's plan, whose stages carry their own)."""
    structure: str | None = None
    """The graph's fingerprint without shapes (the same model at other input shapes)."""
    training: bool = True
    """Captured in training mode (False: ``eval()``)."""
    precision: dict | None = None
    """The :class:`partitioner.precision.Precision` as a dict (None: fp32)."""
    model: str = "?"
    """The model's class name (a stage plan: ``"GPT stage 0"``)."""
    inputs: dict = field(default_factory=dict)
    """Each example input's name and global shape."""
    mesh: dict
    """The mesh: ``{"shape": [...], "axis_names": [...]}``."""
    cluster: dict | None = None
    """The :class:`partitioner.cluster.ClusterSpec` the plan was priced on, as a dict."""
    budget: float | None = None
    """Memory budget per device in bytes (None: none)."""
    objective: str = "time"
    """What the solver minimised: ``"time"`` or ``"memory"``."""
    optimizer: str | None = "adam"
    """The optimizer whose state was counted (None: weights only)."""
    activation_copies: int = 1
    """Microbatches whose saved activations are alive at once (a pipeline stage's)."""
    recompute: str = "auto"
    """The activation-checkpointing option the plan was made with."""
    sequence_parallel: str = "auto"
    """The sequence-parallel attention option."""
    zero: Any = "auto"
    """The ZeRO option (a mode, or a dict of parameter-name patterns to modes)."""
    tensor_parallel: str = "auto"
    """The 1D / 2D / 2.5D / 3D tensor-parallel option."""
    expert_parallel: str = "auto"
    """The mixture-of-experts option."""
    expert_capacity: float | None = None
    """The MoE token-dropping capacity factor (None: dropless)."""
    routing: dict | None = None
    """Per MoE layer, the router's expert loads measured on the example batch (None: no MoE)."""
    host_memory_budget: Any = None
    """Host memory per device for offloaded optimizer state (None: nothing offloaded)."""
    share_blocks: bool = True
    """Whether repeated blocks shared one decision."""
    pins: dict = field(default_factory=dict)
    """Node name -> the placement pinned there (the user's pins and the forced modes')."""
    model_flops: float | None = None
    """FLOPs of one training step of the whole model (for MFU)."""
    flops_dtype: str | None = None
    """The dtype most of those FLOPs run in."""
    flat_latency_s: float | None = None
    """Seconds of the latency terms the records' entries leave out, once per flat call of bucketed
    entries (:func:`passes.plan.collective_calls.unpriced_latency_s`), priced by the planner
    (None: a pipelined plan, whose stage plans carry their own)."""
    copy_latency_s: float | None = None
    """The part of ``flat_latency_s`` the compute copies' flat calls pay (ZeRO-1 and offloaded
    weights; a pipeline stage launches them once per step), priced by the planner."""
    arrival_wait_s: float | None = None
    """Seconds the step's collective calls wait for ranks arriving apart
    (:func:`passes.plan.collective_calls.arrival_wait_s`), priced by the planner."""

    @classmethod
    def from_dict(cls, data: dict) -> PlanHeader:
        """The header of a plan's JSON object (version 2; other keys are the plan's bulk)."""
        missing = [f.name for f in fields(cls) if _required(f) and f.name not in data]
        if missing:
            raise ValueError(f"not a complete Partita sharding plan: it lacks {missing}")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _required(f) -> bool:
    """A field every version wrote from the start (no default to migrate with)."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _defaults() -> dict:
    """Each header key that a version-1 file may lack, with the value its field defaults to."""
    out = {}
    for f in fields(PlanHeader):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def migrate(data: dict) -> dict:
    """``data`` (a plan's JSON object, any supported version) as a version-:data:`PLAN_VERSION`
    object, changed in place; raises naming what is wrong for anything else."""
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise ValueError(f"not a Partita sharding plan (missing format marker {PLAN_FORMAT!r})")
    version = data.get("version")
    if version == 1:
        logger.info("sharding plan of version 1 (%s): read as version %d", data.get("model", "?"), PLAN_VERSION)
        for key, value in _defaults().items():
            data.setdefault(key, value)
        data["version"] = PLAN_VERSION
    elif version != PLAN_VERSION:
        raise ValueError(
            f"sharding plan version {version} is not supported by this Partita "
            f"(reads versions 1 and {PLAN_VERSION}); plan again with this version"
        )
    for stage in (data.get("pipeline") or {}).get("stage_plans", ()):
        migrate(stage)
    unpriced = data.get("flat_latency_s") is None or data.get("copy_latency_s") is None
    if unpriced and "pipeline" not in data:
        _price_unpriced(data)
    PlanHeader.from_dict(data)  # every key now present, or a message naming the missing one
    return data


def _price_unpriced(data: dict) -> None:
    """Record, in ``data`` (a plan written before the planner recorded them), the held marks of
    its parameter-gradient reductions and the step's latencies, as the planner does."""
    from partitioner.cluster import ClusterSpec
    from passes.core.placements import parse_spec
    from passes.core.plan_records import NodeRecord
    from passes.plan.collective_calls import step_latencies
    from passes.plan.cost_model import grad_held_back

    mesh = tuple(data["mesh"]["shape"])
    by_name = {r["name"]: r for r in data.get("records", ())}
    for record in data.get("records", ()):
        grads = record.get("grads")
        for c in record.get("comm", ()):
            k = c.get("input")
            if c["phase"] != "bwd" or k is None or c.get("regather"):
                continue
            source = by_name.get(record["inputs"][k])
            if source is None or source["kind"] != "param":
                continue
            unknown = not grads or k >= len(grads) or grads[k] is None or not source["out"]
            if unknown or grad_held_back(
                parse_spec(source["out"][0], len(mesh)), parse_spec(grads[k], len(mesh)), mesh
            ):
                c["held"] = True
    if not isinstance(data.get("cluster"), dict):
        data.update(flat_latency_s=0.0, copy_latency_s=0.0, arrival_wait_s=0.0)
        return
    typed = [NodeRecord.from_dict(r) for r in data.get("records", ())]
    cluster = ClusterSpec.from_dict(data["cluster"])
    data.update(dataclasses.asdict(step_latencies(typed, mesh, tuple(data["mesh"]["axis_names"]), cluster)))
