"""``ShardingPlan``: the planner's answer as a value you can read, save, compare and replay.

A plan holds one record per graph node (placements per mesh axis, global and local shapes,
compute time, the collectives on its incoming edges forward and backward, memory), the
solver's alternatives for each decision, the mesh and cluster it was made for, and a
fingerprint of the captured graph. It is plain data: JSON in, JSON out (no pickle), so a
plan saved today loads anywhere and is refused, with a message saying why, by a model whose
graph differs.

Communication volumes are payloads (the buffer a collective reduces or gathers), per device
per training step, keyed by collective kind and mesh axis name.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from partitioner.estimate import Estimate
from partitioner.plan_diff import PlanDiff, diff_plans
from partitioner.plan_estimate import estimate_plan
from partitioner.plan_explain import explain, explain_search
from partitioner.plan_format import PLAN_FORMAT, PLAN_VERSION, PlanHeader, migrate
from partitioner.units import fmt_bytes as _fmt_bytes
from partitioner.units import fmt_time as _fmt_time
from passes.core.plan_records import NodeRecord

__all__ = ["ShardingPlan", "Estimate", "PlanDiff", "PlanMismatchError", "PLAN_FORMAT", "PLAN_VERSION"]


class PlanMismatchError(ValueError):
    """A saved plan does not belong to this model (or these input shapes)."""


class ShardingPlan:
    """A complete intra-op plan for one captured model on one mesh."""

    def __init__(self, data: dict, *, stage_plans: list | None = None):
        self.data = data
        self._by_name = {r["name"]: r for r in data["records"]}
        # a pipeline's class plans already read (their typed records are not read again)
        self._stage_objects = stage_plans

    # -- identity ------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.data["fingerprint"]

    @property
    def mesh_shape(self) -> tuple:
        return tuple(self.data["mesh"]["shape"])

    @property
    def axis_names(self) -> tuple:
        return tuple(self.data["mesh"]["axis_names"])

    @property
    def records(self) -> list:
        """The records as the JSON holds them (dicts); :attr:`node_records` reads them typed."""
        return self.data["records"]

    @functools.cached_property
    def node_records(self) -> tuple[NodeRecord, ...]:
        """One :class:`passes.core.plan_records.NodeRecord` per graph node, in graph order (read
        once from :attr:`records`)."""
        return tuple(NodeRecord.from_dict(r) for r in self.records)

    @functools.cached_property
    def node_by_name(self) -> dict[str, NodeRecord]:
        """Node name -> its typed record."""
        return {r.name: r for r in self.node_records}

    @property
    def header(self) -> PlanHeader:
        """What the plan was made for and under which options, typed
        (:class:`partitioner.plan_format.PlanHeader`)."""
        return PlanHeader.from_dict(self.data)

    @property
    def precision(self):
        """The :class:`partitioner.precision.Precision` the plan was made for (imports torch)."""
        from partitioner.precision import Precision

        return Precision.from_dict(self.data.get("precision"))

    @property
    def precision_name(self) -> str:
        """``fp32``, ``bf16`` or ``fp16``: the dtype ops compute in (no torch import)."""
        compute = (self.data.get("precision") or {}).get("compute", "float32")
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(compute, compute)

    def record(self, name: str) -> dict:
        if name not in self._by_name:
            raise KeyError(f"no node named {name!r} in this plan")
        return self._by_name[name]

    def placement_of(self, target: str) -> str | None:
        """Output placement of a parameter (FQN), input (argument name) or node (name), as text
        such as ``"[S(0), R]"``; None for a node with no tensor output."""
        for r in self.records:
            if r["name"] == target or (r.get("fqn") == target and r["kind"] in ("param", "buffer", "input")):
                return r["out"][0] if r["out"] else None
        raise KeyError(f"no parameter, input or node named {target!r} in this plan")

    def check_fingerprint(self, fingerprint: str, what: str = "this model") -> None:
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for a different graph (plan fingerprint {self.fingerprint}, {what} has "
                f"{fingerprint}; the plan is for {self.data.get('model', '?')} with inputs "
                f"{self.data.get('inputs', {})}). Plan again for this model, or capture it with the same "
                f"example input shapes the plan was made with."
            )

    # -- estimate ------------------------------------------------------------------------
    def estimate(self) -> Estimate:
        """What the plan predicts for one step per device (:func:`partitioner.plan_estimate.estimate_plan`)."""
        return estimate_plan(self)

    # -- the whole configuration (partitioner.search) ------------------------------------------
    @property
    def config(self):
        """The :class:`partitioner.parallel_config.ParallelConfig` this plan was made for (degrees,
        mesh, microbatches, schedule, recompute); None for a plan made on a given mesh."""
        from partitioner.parallel_config import ParallelConfig

        raw = self.data.get("config")
        return ParallelConfig.from_dict(raw) if raw is not None else None

    @property
    def stage_plans(self) -> list:
        """A pipelined plan's stage plans, one per stage (identical stages share one); else []."""
        pipe = self.data.get("pipeline")
        if not pipe:
            return []
        datas = pipe["stage_plans"]
        plans = self._stage_objects
        if plans is None or len(plans) != len(datas) or any(p.data is not d for p, d in zip(plans, datas)):
            plans = self._stage_objects = [ShardingPlan(d) for d in datas]  # read once per plan
        return [plans[i] for i in pipe["stage_map"]]

    def explain_search(self) -> str:
        """The configurations the search weighed: the chosen one, the runner-ups with their
        estimates and why they lost (over budget, slower by x%), and what was not planned."""
        return explain_search(self)

    # -- presentation ----------------------------------------------------------------------
    def summary(self, *, verbose: bool = False, wide: bool = False) -> str:
        """A table of the plan with its estimate; repeated blocks are shown once with their count.

        By default it fits 120 columns and folds views and mask/index rows (the attention mask,
        positions, label shifts) into the nodes that use them; ``verbose=True`` shows every row,
        ``wide=True`` every column in full. See :mod:`partitioner.plan_table`.
        """
        from partitioner.plan_table import plan_table

        return plan_table(self, verbose=verbose, wide=wide)

    def __str__(self) -> str:
        return self.summary()

    def report(self, path, *, other: ShardingPlan | None = None, trace=None, names=None) -> Path:
        """Write the plan explorer, one self-contained HTML file, to ``path``: configuration,
        estimate, memory chart, search runner-ups, the sortable and filterable table with each
        node's :meth:`explain`, the graph, a pipeline's timeline (``trace``: a dump's
        ``timeline.json``, drawn as measured beside it) and, with ``other``, the diff folded by
        block. See :mod:`partitioner.report`."""
        from partitioner.report import write_report

        return write_report(self, path, other=other, trace=trace, names=names)

    def __repr__(self) -> str:
        e = self.estimate()
        return (
            f"ShardingPlan(model={self.data.get('model')}, mesh={self.mesh_shape}, "
            f"step={_fmt_time(e.step_time_s)}, memory={_fmt_bytes(e.memory_bytes)})"
        )

    def explain(self, target: str | None = None) -> str:
        """Why the node(s) of ``target`` (module path, parameter FQN or node name) are placed so;
        without a target, the configurations a search weighed (:meth:`explain_search`)."""
        return explain(self, target)

    def diff(self, other: ShardingPlan) -> PlanDiff:
        """Placements that differ from ``other`` and both estimates (:func:`partitioner.plan_diff.diff_plans`)."""
        return diff_plans(self, other)

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return self.data

    def to_json(self) -> str:
        return json.dumps(self.data, indent=1, sort_keys=False)

    def save(self, path) -> Path:
        path = Path(path)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def from_dict(cls, data: dict) -> ShardingPlan:
        """A plan from its JSON object: a version-1 object is migrated to the current version
        (:func:`partitioner.plan_format.migrate`), any other refused with a message naming it."""
        return cls(migrate(data))

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """The inverse of :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a Partita sharding plan: the text is not valid JSON ({exc})") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path) -> ShardingPlan:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(data)
