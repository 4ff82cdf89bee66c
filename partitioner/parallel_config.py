"""``ParallelConfig``: the whole configuration of a training job on N devices, as one value.

Degrees (pipeline x data x sequence x tensor, and the expert degree: the data ranks that split
the experts), the mesh they make (axis names ``pp``, ``dp``, ``ep``, ``sp``, ``tp``; an axis of
size 1 is left out), the microbatches per step, the pipeline schedule,
activation checkpointing, the ZeRO stage on the data-parallel axes and the sequence-parallel
attention. :mod:`partitioner.search` chooses one; a :class:`ShardingPlan` made by the
search carries it (``plan.config``) and shows it in its summary. Plain data, no torch import:
JSON in, JSON out.

The mesh is laid out row-major, so the last axis (``tp``, else ``sp``) is the innermost: its groups are
consecutive ranks, inside one node when ``tensor <= devices_per_node``. The axis names state the
search's intent (the batch split on ``dp``, tensor groups inside a node on ``tp``); the
intra-op solver places every tensor on each axis freely, so a plan may also shard weights on
``dp`` (FSDP-style) or activations on ``tp`` (sequence parallelism).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["ParallelConfig", "ZERO_STAGES"]

ZERO_STAGES = ("auto", 0, 1, 2, 3)

_INTENT = {"dp": "data", "ep": "data+experts", "sp": "sequence", "tp": "tensor"}
"""What the search put each stage axis there for (the label :meth:`ParallelConfig.describe` prints)."""


@dataclass(frozen=True)
class ParallelConfig:
    pipeline: int = 1
    """Pipeline stages (ranks along ``pp``)."""
    data: int = 1
    """Ranks along ``dp`` in every stage."""
    tensor: int = 1
    """Ranks along ``tp`` in every stage (consecutive ranks: inside a node first)."""
    microbatches: int = 1
    """Microbatches per training step (1 without a pipeline)."""
    schedule: str | None = None
    """Pipeline schedule name (``passes.schedules.SCHEDULES``); None without a pipeline."""
    virtual_stages: int = 1
    """Stages per rank (``interleaved`` only)."""
    recompute: str = "none"
    """Activation checkpointing of repeated blocks: ``none``, ``all`` or, without a pipeline,
    ``auto`` (the intra-op solver decides)."""
    global_batch: int = 0
    """Samples per training step (all microbatches, all data-parallel ranks)."""
    zero: int | str = "auto"
    """ZeRO stage of the weights on the data-parallel axes: ``0`` (replicated: one gradient
    all-reduce), ``1`` (optimizer state sharded), ``2`` (weights, gradients and state sharded,
    the gathered copy kept for backward), ``3`` (gathered again in backward), or ``"auto"`` (the
    intra-op solver decides per weight). A searched plan records the stage its weights use."""
    sequence: int = 1
    """Ranks along ``sp`` in every stage: the sequence split over them (ring or Ulysses attention)."""
    sequence_parallel: str = "auto"
    """Attention over ``sp`` (``"ring"`` or ``"ulysses"`` when ``sequence > 1``); ``"auto"``
    otherwise (the solver may still choose either on any axis)."""
    expert: int = 1
    """Expert parallelism: ranks every mixture-of-experts layer splits its experts over, a
    divisor of ``data`` (the experts over data ranks, as DeepSeek-V3 does). With ``expert > 1``
    the data ranks are laid out as two axes, ``dp`` (``data / expert``, outer) and ``ep``
    (``expert``), the batch split over both and the experts over ``ep``; 1: no expert axis (the
    solver may still split experts, ``expert_parallel="auto"``)."""

    def __post_init__(self):
        for name in ("pipeline", "data", "tensor", "microbatches", "virtual_stages", "sequence", "expert"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}")
        if self.data % self.expert:
            raise ValueError(f"ParallelConfig.expert ({self.expert}) must divide data ({self.data})")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"ParallelConfig.zero must be one of {ZERO_STAGES}, got {self.zero!r}")
        if self.sequence > 1 and self.sequence_parallel not in ("ring", "ulysses"):
            raise ValueError(
                f"ParallelConfig.sequence_parallel must be 'ring' or 'ulysses' with sequence={self.sequence}, "
                f"got {self.sequence_parallel!r}"
            )

    @property
    def devices(self) -> int:
        return self.pipeline * self.data * self.sequence * self.tensor

    @property
    def stage_mesh_shape(self) -> tuple:
        """The mesh one pipeline stage is planned on (``dp``, ``sp``, ``tp``; size-1 axes left out)."""
        shape = tuple(n for _, n in self._stage_axes())
        return shape or (1,)

    @property
    def stage_axis_names(self) -> tuple:
        names = tuple(a for a, _ in self._stage_axes())
        return names or ("dp",)

    def _stage_axes(self) -> list:
        data = (("dp", self.data // self.expert), ("ep", self.expert))
        return [(a, n) for a, n in (*data, ("sp", self.sequence), ("tp", self.tensor)) if n > 1]

    @property
    def mesh_shape(self) -> tuple:
        """The whole job's mesh: ``(pipeline, data, sequence, tensor)`` without size-1 axes."""
        if self.pipeline > 1:
            return (self.pipeline,) + tuple(n for _, n in self._stage_axes())
        return self.stage_mesh_shape

    @property
    def axis_names(self) -> tuple:
        if self.pipeline > 1:
            return ("pp",) + tuple(a for a, _ in self._stage_axes())
        return self.stage_axis_names

    @property
    def microbatch_size(self) -> int:
        """Samples in one microbatch (all data-parallel ranks together)."""
        return self.global_batch // self.microbatches if self.global_batch else 0

    def describe(self, uses: tuple | None = None) -> str:
        """One line: degrees, mesh, microbatches or batch, recompute, ZeRO stage. ``uses`` (one
        label per stage axis, :func:`partitioner.axis_uses.axis_uses`) is what each axis does in
        the plan made for this configuration; where it differs from the axis's intent the degrees
        are named by their use (``replicated 2 (dp)``) and the intent follows."""
        degrees, note = self._degrees(uses)
        parts = [f"{degrees} = {self.devices} devices, mesh {self.mesh_shape} ({', '.join(self.axis_names)}){note}"]
        if self.pipeline > 1:
            virtual = f", {self.virtual_stages} stages per rank" if self.virtual_stages > 1 else ""
            parts.append(
                f"{self.microbatches} microbatches of {self.microbatch_size} samples, schedule {self.schedule}{virtual}"
            )
        elif self.global_batch:
            parts.append(f"batch {self.global_batch}")
        parts.append(f"recompute {self.recompute}")
        if self.zero != "auto":
            parts.append(f"ZeRO-{self.zero}")
        return "; ".join(parts)

    def _degrees(self, uses: tuple | None) -> tuple:
        """``(degrees, note)``: the degrees named by their use, and what the search meant them for
        where that differs (empty otherwise)."""
        planned = (
            f"pipeline {self.pipeline} x data {self.data}"
            + (f" (experts over {self.expert}: ep)" if self.expert > 1 else "")
            + (f" x sequence {self.sequence} ({self.sequence_parallel})" if self.sequence > 1 else "")
            + f" x tensor {self.tensor}"
        )
        axes = self._stage_axes()
        if uses is None or not axes or [_INTENT[a] for a, _ in axes] == list(uses):
            return planned, ""
        if len(uses) != len(axes):
            raise ValueError(f"{len(uses)} axis uses {uses!r} for the {len(axes)} stage axes of {planned}")
        used = " x ".join(f"{use} {n} ({a})" for (a, n), use in zip(axes, uses))
        idle = [a for (a, _), use in zip(axes, uses) if use == "replicated"]
        note = f", searched as {planned}"
        if idle:
            their = "their devices repeat" if len(idle) > 1 else "its devices repeat"
            note += f" (nothing is split on {', '.join(idle)}: {their} the same work)"
        return f"pipeline {self.pipeline} x {used}", note

    def __str__(self) -> str:
        return self.describe()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ParallelConfig:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)
