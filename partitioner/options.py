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
from passes.recompute import check_recompute_mode
from passes.rule_options import RuleOptions
from passes.strategy_space import check_zero

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
    """Cost model: a preset name (``"h100"``, ``"h200"``, ``"a100"``, ``"cpu"``: measured here),
    a cluster file's path or a ClusterSpec. None: the devices this process runs on
    (:func:`default_cluster`)."""
    memory_budget: Any = None
    """Bytes per device (``"80GiB"`` or an int); None: the cluster's device memory."""
    host_memory_budget: Any = None
    """Host-memory bytes per device for offloaded optimizer state; None: nothing offloaded."""
    pins: Mapping | None = None
    """Fixed placements by input, parameter, node or module name (needs a mesh)."""
    objective: str = "time"
    """``"time"`` (estimated step time) or ``"memory"`` (peak memory per device)."""
    optimizer: str | None = "adam"
    """Optimizer state to count: ``"adam"``, ``"sgd"`` or None (weights only)."""
    share_blocks: bool = True
    """Decide once for identical repeated blocks (transformer layers)."""
    time_limit: float = 60.0
    """Seconds the ILP solver may take for one plan."""
    layers: str = "auto"
    """How deep models are captured: ``"auto"``, ``"full"`` or ``"blocks"``."""
    precision: Any = None
    """``"fp32"``, ``"bf16"``, ``"fp16"`` or a MixedPrecisionPolicy; None: fp32 (or a replayed
    plan's own)."""
    recompute: str = "auto"
    """Activation checkpointing of repeated blocks: ``"auto"``, ``"selective"``, ``"all"``, ``"none"``."""
    sequence_parallel: str = "auto"
    """Attention over a sequence split: ``"auto"``, ``"ring"``, ``"ulysses"`` or ``"none"``."""
    zero: Any = "auto"
    """ZeRO for weights on data-parallel axes: ``"auto"``, ``1``, ``2``, ``3`` or a dict of name patterns."""
    tensor_parallel: str = "auto"
    """Weight contractions: ``"auto"``, ``"1d"``, ``"2d"``, ``"2.5d"`` or ``"3d"``."""
    expert_parallel: str = "auto"
    """Mixture-of-experts layers: ``"auto"`` (the solver may split the experts over a mesh axis),
    ``"on"`` (every MoE layer's experts split over one axis) or ``"off"`` (experts never split)."""

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
