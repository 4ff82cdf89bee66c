"""The algorithm modes the op rules read while one graph is planned, as one immutable value.

A user may force how some ops are parallelised (``tensor_parallel="2d"``, ``sequence_parallel=
"ring"``, ``expert_parallel="on"``: :class:`partitioner.PlanOptions`). The rules that honour these
modes (:mod:`passes.rules.multidim_tp`, :mod:`passes.rules.attention`, :mod:`passes.rules.experts`) read
them from a :class:`RuleOptions` handed down with the graph, never from module state: the planner
(:func:`partitioner.intra_op.plan_captured`) builds one per plan and gives it to
:func:`passes.plan.strategy_space.build_space`, which puts it on every :class:`passes.rules.base.OpView`
it makes (``op.options``). Two plans made at once, or one inside another (a pipeline stage planned
while a search candidate is planned), each see their own modes.

This module is part of the bottom layer: it imports nothing of Partita's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = [
    "RuleOptions",
    "DEFAULT_RULE_OPTIONS",
    "TP_MODES",
    "SEQUENCE_PARALLEL_MODES",
    "EXPERT_PARALLEL_MODES",
    "check_choice",
]

logger = logging.getLogger(__name__)

TP_MODES = ("auto", "1d", "2d", "2.5d", "3d")
SEQUENCE_PARALLEL_MODES = ("auto", "ring", "ulysses", "none")
EXPERT_PARALLEL_MODES = ("auto", "on", "off")


def check_choice(option: str, value, choices: tuple):
    """``value`` when it is one of ``choices``; a ValueError naming ``option`` otherwise."""
    if value not in choices:
        raise ValueError(f"{option} must be one of {choices}, got {value!r}")
    return value


@dataclass(frozen=True)
class RuleOptions:
    """What the op rules may offer on one mesh (the defaults: everything, the solver chooses)."""

    mesh_shape: tuple = ()
    """The mesh the graph is planned on (devices per axis)."""
    tensor_parallel: str = "auto"
    """Weight contractions: one of :data:`TP_MODES` (:mod:`passes.rules.multidim_tp`)."""
    sequence_parallel: str = "auto"
    """Attention over a sequence split: one of :data:`SEQUENCE_PARALLEL_MODES`."""
    expert_parallel: str = "auto"
    """Mixture-of-experts layers: one of :data:`EXPERT_PARALLEL_MODES`."""
    expert_capacity: float | None = None
    """The capacity factor MoE layers drop tokens at (None: dropless): their compute,
    all-to-all and buffers are priced at the pairs kept."""
    expert_axis: int | None = None
    """With ``expert_parallel="on"``: the one mesh axis every MoE layer's experts split over (the
    configuration search's ``ep``); None: any axis."""

    def __post_init__(self):
        object.__setattr__(self, "mesh_shape", tuple(int(n) for n in self.mesh_shape))
        check_choice("sequence_parallel", self.sequence_parallel, SEQUENCE_PARALLEL_MODES)
        check_choice("tensor_parallel", self.tensor_parallel, TP_MODES)
        check_choice("expert_parallel", self.expert_parallel, EXPERT_PARALLEL_MODES)
        if self.expert_axis is not None and self.expert_parallel != "on":
            raise ValueError(
                f"an expert axis ({self.expert_axis}) needs expert_parallel='on', got {self.expert_parallel!r}"
            )

    def axis_sizes(self) -> list:
        """The sizes of the mesh axes of more than one device, in order."""
        return [n for n in self.mesh_shape if n > 1]


DEFAULT_RULE_OPTIONS = RuleOptions()
