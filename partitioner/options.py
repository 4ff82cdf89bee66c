"""``PlanOptions``: the one set of planning options every entry point carries.

``partitioner.plan``, ``auto_parallelize``, the configuration search (``devices=N`` or no mesh),
the pipeline builder and the CLI all take these options by the same names and with the same
defaults; each builds one :class:`PlanOptions` from its keyword arguments (validated once,
here) and hands it down, so an option cannot be lost on the way to the solver.

An option a mode cannot honour is refused, never dropped: a mode states what it does not
support with :meth:`PlanOptions.refuse` (``{"pins": "the search has no mesh to pin on"}``), and
a value other than the default for one of those raises a ``ValueError`` naming the option, the
mode and what to do instead.

The default cluster is the devices this process runs on (:func:`default_cluster`): the
measured ``"cpu"`` cluster without a GPU, the preset of the GPU's kind with one. So
``plan(model, inputs, mesh=(2, 2))`` previews exactly what ``auto_parallelize`` on this
machine runs; to plan for other hardware, name it (``cluster="h100"``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from partitioner.cluster import PRESETS, parse_bytes
from partitioner.precision import Precision
from passes.core.rule_options import RuleOptions
from passes.plan.ilp_solver import TIME_LIMIT_S
from passes.plan.recompute import check_recompute_mode
from passes.plan.zero_storage import check_zero

__all__ = ["PlanOptions", "default_cluster", "OBJECTIVES", "OPTIMIZERS", "LAYER_MODES"]

logger = logging.getLogger(__name__)

OBJECTIVES = ("time", "memory")
OPTIMIZERS = ("adam", "sgd", None)
LAYER_MODES = ("auto", "full", "blocks")


@dataclass(frozen=True)
class PlanOptions:
    """What the planner may choose and under which limits (the keyword arguments of
    :func:`partitioner.plan` and :func:`partitioner.auto_parallelize`)."""

    cluster: Any = None
    """Cost model: ``"h100"``, ``"h200"``, ``"a100"``, ``"cpu"`` (measured here), a cluster file's
    path or a ClusterSpec. None: the devices this process runs on (the measured ``"cpu"`` without
    a GPU; see :func:`default_cluster`)."""
    memory_budget: Any = None
    """Bytes per device (``"80GiB"`` or an int); None: the cluster's device memory."""
    host_memory_budget: Any = None
    """Host-memory bytes per device for offloaded optimizer state (``"200GiB"``): a weight's
    optimizer state and step can then live on the host, its gradient and stepped values crossing
    the host link (PCIe on the GPU presets) once per step; chosen where the device budget needs
    it. None: nothing offloaded."""
    pins: Mapping | None = None
    """Fixed placements by input, parameter, node or module name (needs a mesh), e.g.
    ``{"input_ids": ["S(0)", "R"], "lm_head.weight": ["R", "S(0)"]}``
    (see :func:`partitioner.intra_op.resolve_pins`)."""
    objective: str = "time"
    """``"time"`` (estimated step time) or ``"memory"`` (peak memory per device)."""
    optimizer: str | None = "adam"
    """Optimizer state to count: ``"adam"`` (16 bytes per fp32 parameter), ``"sgd"`` or None
    (weights only)."""
    share_blocks: bool = True
    """Decide once for identical repeated blocks (transformer layers)."""
    time_limit: float = TIME_LIMIT_S
    """Wall-clock seconds the ILP solver may take for one solve: a safety net (600 s by default);
    the solver's node limit is what normally stops it, the same on every machine."""
    layers: str = "auto"
    """How deep models are captured: ``"auto"`` captures deep models (8+ identical layers) by
    exporting two layers and repeating them in the graph (node for node what a full export
    gives, much faster); ``"full"`` always exports every layer (for layers whose code depends on
    their index); ``"blocks"`` repeats any list of 3 or more identical layers (an error where
    there is none)."""
    precision: Any = None
    """``"fp32"``, ``"bf16"``, ``"fp16"`` or a MixedPrecisionPolicy: the model is captured under
    ``torch.autocast`` in that dtype and priced as it computes (fp32 master weights and optimizer
    state; see :mod:`partitioner.precision`). None: fp32 (or a replayed plan's own)."""
    recompute: str = "auto"
    """Activation checkpointing of repeated blocks (transformer layers): ``"auto"`` lets the solver
    choose per block kind between keeping its activations, recomputing its attention core
    (selective) and recomputing all of it, when the memory budget needs it (never otherwise: it
    only adds time); ``"selective"`` recomputes every block's attention core, ``"all"`` every
    repeated block, ``"none"`` nothing (see :mod:`passes.plan.recompute`)."""
    sequence_parallel: str = "auto"
    """Attention over a sequence split (``docs/ARCHITECTURE.md``, "Long sequences"): ``"auto"`` lets
    the solver choose among head-sharded (Megatron), ring and Ulysses attention by cost and
    memory; ``"ring"`` / ``"ulysses"`` force that algorithm on every attention op, on the last
    mesh axis (data parallel on the others); ``"none"`` offers neither."""
    zero: Any = "auto"
    """A weight stored sharded and gathered for use (FSDP / ZeRO): ``"auto"`` lets the solver choose
    per weight between keeping the gathered copy for backward (ZeRO-2, FSDP's
    ``reshard_after_forward=False``) and freeing it after forward to gather it again in backward
    (ZeRO-3); and, for a weight replicated on a data-parallel axis, keeping it whole with its
    optimizer state sharded there (ZeRO-1: one reduce-scatter and one all-gather per step, the
    optimizer sees the shard); ``1``, ``2`` or ``3`` force one; a dict of parameter name patterns
    to modes (``{"h.*.mlp.*": 3, "*": 2}``, first match) decides per weight
    (``docs/ARCHITECTURE.md``, "Parameter storage")."""
    tensor_parallel: str = "auto"
    """How weight contractions (linear layers) split over the mesh: ``"auto"`` (the solver chooses
    per layer and axis), ``"1d"`` (Megatron on the last axis, data parallel on the others),
    ``"2d"`` (SUMMA / Optimus on a ``q x q`` mesh), ``"2.5d"`` (Tesseract on ``d x q x q``) or
    ``"3d"`` (on ``c x c x c``); see :mod:`passes.rules.multidim_tp`."""
    expert_parallel: str = "auto"
    """Mixture-of-experts layers (HuggingFace experts modules, captured as one op each): ``"auto"``
    lets the solver split the stacked experts over a mesh axis (tokens dispatched to them and
    combined back by all-to-all) where that is faster or needed to fit; ``"on"`` splits every MoE
    layer's experts over one mesh axis; ``"off"`` never does (see ``docs/moe.md``)."""
    expert_capacity: float | None = None
    """Token dropping in mixture-of-experts layers: each expert computes at most
    ``ceil(expert_capacity * T * k / E)`` of the ``T k`` (token, expert) pairs of a call (``T``
    tokens, top-``k`` of ``E`` experts), first choices before second ones; the rest are dropped
    (their rows of the layer's output are zero), exactly as on one device under
    :func:`partitioner.token_dropping`. None: dropless (see ``docs/moe.md``, "Token dropping")."""

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be 'adam', 'sgd' or None, got {self.optimizer!r}")
        if self.layers not in LAYER_MODES:
            raise ValueError(f"layers must be 'auto', 'full' or 'blocks', got {self.layers!r}")
        if not isinstance(self.share_blocks, bool):
            raise ValueError(f"share_blocks must be True or False, got {self.share_blocks!r}")
        if isinstance(self.time_limit, bool) or not isinstance(self.time_limit, int | float) or self.time_limit <= 0:
            raise ValueError(f"time_limit must be a positive number of seconds, got {self.time_limit!r}")
        if self.pins is not None and not isinstance(self.pins, Mapping):
            raise ValueError(f"pins must be a dict of name -> placements, got {type(self.pins).__name__}")
        for name in ("memory_budget", "host_memory_budget"):
            value = getattr(self, name)
            if value is not None:
                try:
                    parse_bytes(value)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{name}: {e}") from None
        if self.expert_capacity is not None and (
            isinstance(self.expert_capacity, bool)
            or not isinstance(self.expert_capacity, int | float)
            or not self.expert_capacity > 0
        ):
            raise ValueError(
                f"expert_capacity must be a positive number (a capacity factor) or None, got {self.expert_capacity!r}"
            )
        check_recompute_mode(self.recompute)
        self.rule_options()  # sequence_parallel, tensor_parallel and expert_parallel: checked there
        check_zero(self.zero)
        if self.precision is not None:
            Precision.build(self.precision)

    @classmethod
    def build(cls, options: PlanOptions | None = None, **kwargs) -> PlanOptions:
        """Options from keyword arguments, over ``options`` if given (a keyword wins)."""
        base = options if options is not None else cls()
        if not isinstance(base, PlanOptions):
            raise ValueError(f"options must be a partitioner.PlanOptions, got {type(base).__name__}")
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown planning options {unknown}: see partitioner.PlanOptions")
        return replace(base, **kwargs) if kwargs else base

    @classmethod
    def from_call(cls, options: PlanOptions | None, **given) -> PlanOptions:
        """The options of one call of an entry point: ``options`` (if any) with every keyword
        the call gave a value other than its default laid over it."""
        if options is None:
            return cls.build(**given)
        defaults = cls()
        return cls.build(options, **{k: v for k, v in given.items() if not _same(v, getattr(defaults, k))})

    @classmethod
    def pick(cls, scope: Mapping) -> dict:
        """The options among a call's arguments (``locals()`` of an entry point taking them)."""
        return {f.name: scope[f.name] for f in fields(cls)}

    def changed(self) -> dict:
        """The options set to something other than their defaults."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if not _same(getattr(self, f.name), f.default if f.default is not dataclasses.MISSING else None)
        }

    def refuse(self, mode: str, unsupported: Mapping) -> None:
        """Raise for the first option of ``unsupported`` (name -> what to do instead) that is set
        to something other than its default: ``mode`` says where (``"with pipeline="``)."""
        changed = self.changed()
        for name, instead in unsupported.items():
            if name in changed:
                raise ValueError(f"{name}={changed[name]!r} is not available {mode}: {instead}")

    def replace(self, **kwargs) -> PlanOptions:
        return replace(self, **kwargs)

    @property
    def precision_policy(self) -> Precision:
        """The precision to plan for (fp32 when none is given)."""
        return Precision.build(self.precision if self.precision is not None else "fp32")

    def rule_options(self, mesh_shape=()) -> RuleOptions:
        """The algorithm modes the op rules honour when a graph is planned on ``mesh_shape``."""
        return RuleOptions(
            mesh_shape=tuple(mesh_shape),
            tensor_parallel=self.tensor_parallel,
            sequence_parallel=self.sequence_parallel,
            expert_parallel=self.expert_parallel,
            expert_capacity=self.expert_capacity,
        )

    def cluster_for(self, device: torch.device | str | None = None):
        """The cluster to price with: the one given, else the devices this process runs on."""
        return self.cluster if self.cluster is not None else default_cluster(device)

    def solver_kwargs(self) -> dict:
        """The options ``partitioner.intra_op.plan_captured`` takes, by its argument names."""
        return dict(
            memory_budget=self.memory_budget,
            host_memory_budget=self.host_memory_budget,
            objective=self.objective,
            optimizer=self.optimizer,
            share_blocks=self.share_blocks,
            time_limit=self.time_limit,
            recompute=self.recompute,
            sequence_parallel=self.sequence_parallel,
            zero=self.zero,
            tensor_parallel=self.tensor_parallel,
            expert_parallel=self.expert_parallel,
            expert_capacity=self.expert_capacity,
        )


def _same(a, b) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # a tensor-like value compares elementwise: then it is not the default
        return False


_GPU_PRESETS = {"H200": "h200", "H100": "h100", "A100": "a100"}


def default_cluster(device: torch.device | str | None = None) -> str:
    """The cluster of the devices this process runs on: ``device`` (default: a GPU if this
    process has one, else the CPU). A GPU is priced by the preset of its kind (the H100 preset
    for a kind without one, with a warning); the CPU by the measured ``"cpu"`` cluster."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    for kind, preset in _GPU_PRESETS.items():
        if kind in name.upper() and preset in PRESETS:
            return preset
    logger.warning("no cluster preset for GPU %r: pricing it as an H100 (give cluster= to choose)", name)
    return "h100"
