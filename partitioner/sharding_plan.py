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
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from partitioner.memory import MemoryBreakdown, memory_breakdown
from partitioner.plan_format import PLAN_FORMAT, PLAN_VERSION, PlanHeader, migrate
from partitioner.units import fmt_bytes as _fmt_bytes
from partitioner.units import fmt_time as _fmt_time

__all__ = ["ShardingPlan", "Estimate", "PlanDiff", "PlanMismatchError", "PLAN_FORMAT", "PLAN_VERSION"]


class PlanMismatchError(ValueError):
    """A saved plan does not belong to this model (or these input shapes)."""


_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}


@dataclass
class Estimate:
    """What the cost model predicts for one training step on each device."""

    step_time_s: float
    compute_s: float
    comm_s: float
    memory_bytes: float
    """Peak per device over the step (``memory.peak``): state, inputs, what backward keeps and
    the largest transient, in the order the step runs (:mod:`partitioner.memory`)."""
    comm_bytes: dict
    """``comm_bytes[kind][axis_name]``: payload bytes per device per step (forward + backward)."""
    comm_bytes_by_phase: dict = field(default_factory=dict)
    """``comm_bytes_by_phase[phase][kind][axis_name]`` with phase ``fwd`` / ``bwd``."""
    weight_grad_s: float = 0.0
    """The part of ``compute_s`` spent on parameter gradients (contractions' weight products):
    what a zero-bubble pipeline schedule defers to its W pass."""
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
    """The part of ``comm_s`` that moves parameter gradients a pipeline stage holds back and
    reduces once per step, not once per microbatch: the all-reduces onto replicated storage (a
    weight stored sharded reduce-scatters its gradient in every microbatch: not counted here)."""
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


def _sum_phases(by_phase: dict) -> dict:
    """``{kind: {axis: n}}`` summed over the phases of ``{phase: {kind: {axis: n}}}``."""
    out: dict = defaultdict(lambda: defaultdict(int))
    for kinds in by_phase.values():
        for kind, axes in kinds.items():
            for axis, n in axes.items():
                out[kind][axis] += n
    return {k: dict(v) for k, v in out.items()}


def per_step_comm(per_microbatch: dict, grad_sync: dict, m: int) -> dict:
    """A pipeline stage's ``{kind: {axis: bytes}}`` over a step of ``m`` microbatches: its
    collectives once per microbatch, except the parameter-gradient ones it holds back
    (``grad_sync``, part of ``per_microbatch``), sent once per step
    (:class:`runtime.pipeline.PipelineRunner`)."""
    return {
        kind: {
            axis: (v - grad_sync.get(kind, {}).get(axis, 0.0)) * m + grad_sync.get(kind, {}).get(axis, 0.0)
            for axis, v in axes.items()
        }
        for kind, axes in per_microbatch.items()
    }


@functools.lru_cache(maxsize=1 << 12)
def _held_back(src: str, grad: str, mesh_shape: tuple) -> bool:
    """:func:`passes.plan.cost_model.grad_held_back` for placements written as text (imports torch)."""
    from passes.core.placements import parse_spec
    from passes.plan.cost_model import grad_held_back

    return grad_held_back(parse_spec(src, len(mesh_shape)), parse_spec(grad, len(mesh_shape)), mesh_shape)


@dataclass
class PlanDiff:
    changed: list
    """(node, module, this plan's placements, the other plan's placements)."""
    only_here: list
    only_there: list
    estimate_here: Estimate
    estimate_there: Estimate
    same_graph: bool
    folded: list = field(default_factory=list)
    """``changed`` folded by block (:func:`partitioner.diff_folding.fold_changes`): one group for
    a change made in every layer of a block of identical layers; the text lists these."""

    def __bool__(self) -> bool:
        return bool(self.changed or self.only_here or self.only_there)

    def __str__(self) -> str:
        lines = []
        if not self.same_graph:
            lines.append("note: the plans were made for different graphs; nodes are matched by name")
        a, b = self.estimate_here, self.estimate_there
        lines.append(
            f"step time {_fmt_time(a.step_time_s)} -> {_fmt_time(b.step_time_s)}; memory "
            f"{_fmt_bytes(a.memory_bytes)} -> {_fmt_bytes(b.memory_bytes)}; communication "
            f"{_fmt_bytes(a.total_comm_bytes())} -> {_fmt_bytes(b.total_comm_bytes())}"
        )
        if not self:
            lines.append("placements: identical")
        if not self.folded:
            for name, module, here, there in self.changed:
                lines.append(f"  {name:<32} {module:<40} {here} -> {there}")
        views = [g for g in self.folded if g["view"]]
        for g in self.folded:
            if g["view"]:
                continue
            where = g["block"] if len(g["nodes"]) > 1 else ""
            more = f"  (the same in {len(g['nodes'])} layers of {where})" if where else ""
            lines.append(f"  {g['node']:<32} {g['full_module']:<40} {g['before']} -> {g['after']}{more}")
        if views:
            lines.append(
                f"  and {sum(len(g['nodes']) for g in views)} views and getitems that follow their producers "
                f"(listed in .changed)"
            )
        for name in self.only_here:
            lines.append(f"  {name}: only in this plan")
        for name in self.only_there:
            lines.append(f"  {name}: only in the other plan")
        return "\n".join(lines)


class ShardingPlan:
    """A complete intra-op plan for one captured model on one mesh."""

    def __init__(self, data: dict):
        self.data = data
        self._by_name = {r["name"]: r for r in data["records"]}

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
        return self.data["records"]

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
        if "pipeline" in self.data:
            return self._with_throughput(self._pipeline_estimate())
        return self._with_throughput(self._intra_op_estimate())

    def _held_grad_sync(self, record: dict, c: dict) -> bool:
        """A collective of ``record``'s backward that moves a parameter's gradient (on the edge
        from the parameter; a ZeRO-3 regather is the weight, not its gradient) and that a
        pipeline stage holds back to once per step: an all-reduce onto replicated storage, not a
        reduce-scatter onto a weight stored sharded (:func:`passes.plan.cost_model.grad_held_back`;
        a plan saved without the consumers' gradient placements: every such collective)."""
        k = c.get("input")
        if c["phase"] != "bwd" or k is None or c.get("regather"):
            return False
        source = self._by_name.get(record["inputs"][k])
        if source is None or source["kind"] != "param":
            return False
        grads = record.get("grads")
        if not grads or k >= len(grads) or grads[k] is None or not source.get("out"):
            return True
        return _held_back(source["out"][0], grads[k], self.mesh_shape)

    def _intra_op_estimate(self) -> Estimate:
        compute = comm_t = weight = sync_t = optimizer = 0.0
        comm = defaultdict(lambda: defaultdict(float))
        sync = defaultdict(lambda: defaultdict(float))
        phases = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
        for r in self.records:
            compute += r.get("compute_s", 0.0)
            comm_t += r.get("host_transfer_s", 0.0)  # offloaded optimizer state: host copies
            weight += r.get("weight_grad_s", 0.0)
            optimizer += r.get("optimizer_step_s", 0.0)
            for c in r.get("comm", []):
                comm_t += c["time_s"]
                comm[c["kind"]][c["axis"]] += c["bytes"]
                phases[c["phase"]][c["kind"]][c["axis"]] += c["bytes"]
                if self._held_grad_sync(r, c):
                    sync_t += c["time_s"]
                    sync[c["kind"]][c["axis"]] += c["bytes"]
        as_dict = lambda d: {k: dict(v) for k, v in d.items()}  # noqa: E731
        memory = memory_breakdown(self.records)
        calls, flat, wait = self._priced_calls()
        comm_t += flat + wait
        return Estimate(
            step_time_s=compute + comm_t + optimizer,
            compute_s=compute,
            comm_s=comm_t,
            comm_calls=_sum_phases(calls),
            comm_calls_by_phase=calls,
            flat_latency_s=flat,
            arrival_wait_s=wait,
            optimizer_s=optimizer,
            memory_bytes=memory.peak,
            comm_bytes=as_dict(comm),
            comm_bytes_by_phase={p: as_dict(v) for p, v in phases.items()},
            weight_grad_s=weight,
            memory=memory,
            grad_sync_s=sync_t,
            grad_sync_bytes=as_dict(sync),
        )

    def _calls(self, *, bucket_grads: bool) -> dict:
        from passes.plan.collective_calls import collective_calls

        return collective_calls(self.records, self.mesh_shape, self.axis_names, bucket_grads=bucket_grads)

    def _grad_sync_calls(self) -> dict:
        """``{kind: {axis: n}}``: the backward entries that move parameter gradients a pipeline
        stage holds back (:meth:`_held_grad_sync`), one call each (its syncs run per edge)."""
        out: dict = defaultdict(lambda: defaultdict(int))
        for r in self.records:
            for c in r.get("comm", []):
                if self._held_grad_sync(r, c):
                    out[c["kind"]][c["axis"]] += 1
        return {k: dict(v) for k, v in out.items()}

    def _priced_calls(self) -> tuple:
        """(calls per phase, kind and axis; the flat calls' latency terms; the arrival waits):
        :mod:`passes.plan.collective_calls` with the plan's cluster (no cluster saved: 0 s each)."""
        from passes.plan.collective_calls import arrival_wait_s, collective_calls, group_calls, unpriced_latency_s

        args = (self.records, self.mesh_shape, self.axis_names)
        grouped = group_calls(*args)
        calls = collective_calls(*args, grouped=grouped)
        if not isinstance(self.data.get("cluster"), dict):
            return calls, 0.0, 0.0
        from partitioner.local_cluster import get_cluster

        cluster = get_cluster(self.data["cluster"])
        return (
            calls,
            unpriced_latency_s(*args, cluster, grouped=grouped),
            arrival_wait_s(*args, cluster, grouped=grouped),
        )

    # -- the whole configuration (partitioner.config_search) -----------------------------------
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
        plans = [ShardingPlan(d) for d in pipe["stage_plans"]]
        return [plans[i] for i in pipe["stage_map"]]

    def _pipeline_estimate(self) -> Estimate:
        """The schedule's simulated step (bubble and point-to-point time included) on the busiest
        rank: its stages' per-microbatch compute and collectives times the microbatches (the
        all-reduced parameter gradients once: the runtime holds them back until the stage's last
        backward of the step; reduce-scatters onto weights stored sharded every microbatch), plus
        the activations and gradients it sends to its neighbours (``send_recv`` on ``pp``)."""
        pipe = self.data["pipeline"]
        stages = [p.estimate() for p in self.stage_plans]
        m = pipe["microbatches"]
        busiest = stages[pipe.get("busiest_stage", 0)]
        comm = per_step_comm(busiest.comm_bytes, busiest.grad_sync_bytes, m)
        comm["send_recv"] = {"pp": float(pipe["p2p_bytes"])}
        phases = {
            ph: per_step_comm(kinds, busiest.grad_sync_bytes if ph == "bwd" else {}, m)
            for ph, kinds in busiest.comm_bytes_by_phase.items()
        }
        stage = self.stage_plans[pipe.get("busiest_stage", 0)]
        stage_calls = stage._calls(bucket_grads=False)  # a stage's syncs: per edge, once per step
        # (the stages' point-to-point sends, priced in p2p_time_s, are not collectives: not counted)
        sync_calls = stage._grad_sync_calls()
        calls = {ph: per_step_comm(kinds, sync_calls if ph == "bwd" else {}, m) for ph, kinds in stage_calls.items()}
        return Estimate(
            step_time_s=pipe["step_time_s"],
            compute_s=busiest.compute_s * m,
            comm_s=(busiest.comm_s - busiest.grad_sync_s) * m + busiest.grad_sync_s + 2 * m * pipe["p2p_time_s"],
            memory_bytes=pipe["memory_bytes"],
            comm_bytes=comm,
            comm_bytes_by_phase=phases,
            weight_grad_s=busiest.weight_grad_s * m,
            memory=busiest.memory,
            bubble_s=max(0.0, pipe["step_time_s"] - pipe["busy_s"]),
            grad_sync_s=busiest.grad_sync_s,
            grad_sync_bytes=busiest.grad_sync_bytes,
            optimizer_s=max(s.optimizer_s for s in stages),
            comm_calls=_sum_phases(calls),
            comm_calls_by_phase=calls,
        )

    def _with_throughput(self, est: Estimate) -> Estimate:
        """Model FLOPs, TFLOP/s per device and MFU against the cluster's peak for the compute dtype."""
        flops = float(self.data.get("model_flops") or 0.0)
        devices = 1
        for n in self.mesh_shape:
            devices *= n
        est.devices = devices
        if flops and est.step_time_s > 0:
            est.model_flops = flops
            est.tflops_per_device = flops / devices / est.step_time_s / 1e12
            # the dtype the FLOPs are priced in (older plans: the precision's compute dtype)
            compute = self.data.get("flops_dtype") or (self.data.get("precision") or {}).get("compute", "float32")
            peaks = self.data.get("cluster", {}).get("peak_flops", {})
            peak = peaks.get(compute) or peaks.get("float32") or 0.0
            est.mfu = est.tflops_per_device * 1e12 / peak if peak else 0.0
        return est

    def explain_search(self) -> str:
        """The configurations the search weighed: the chosen one, the runner-ups with their
        estimates and why they lost (over budget, slower by x%), and what was not planned."""
        search = self.data.get("search")
        if not search:
            return "this plan was made on a given mesh, not chosen by a configuration search (plan(..., devices=N))"
        from partitioner.parallel_config import ParallelConfig

        counts = ", ".join(f"{n} {status}" for status, n in sorted(search["counts"].items()))
        lines = [
            f"configuration search for {search['devices']} devices, global batch {search['global_batch']}: "
            f"{sum(search['counts'].values())} configurations priced ({counts}), "
            f"{search.get('bounded', 0)} set aside by their bounds; {search['plannings']} planned with the "
            f"intra-op solver in {search['seconds']:.1f} s",
        ]
        for row in search["rows"]:
            cfg = ParallelConfig.from_dict(row["config"])
            if row["step_time_s"] is not None:
                what = f"step {_fmt_time(row['step_time_s'])}, {_fmt_bytes(row['memory_bytes'])} per device"
            else:
                what = f"bound: step >= {_fmt_time(row['time_lower_bound_s'])}, memory >= " + _fmt_bytes(
                    row["memory_lower_bound"]
                )
            mark = "->" if row["status"] == "chosen" else "  "
            why = f" - {row['status']}" + (f": {row['reason']}" if row["reason"] else "")
            lines += textwrap.wrap(f"{mark} {cfg.describe()}: {what}{why}", 120, subsequent_indent="      ")
        return "\n".join(lines)

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
        if target is None:
            return self.explain_search()
        if "pipeline" in self.data:
            found = []
            for s, stage in enumerate(self.stage_plans):
                try:
                    found.append(f"stage {s}:\n" + stage.explain(target))
                except KeyError:
                    continue
            if not found:
                raise KeyError(f"nothing in this pipeline's stage plans is named {target!r}")
            return "\n".join(found)
        hits = [
            r
            for r in self.records
            if r["name"] == target
            or r.get("fqn") == target
            or r["module"] == target
            or r["module"].startswith(target + ".")
        ]
        if not hits:
            raise KeyError(
                f"nothing in this plan is named {target!r}: give a module path, a parameter FQN or a "
                f"node name (see plan.summary(verbose=True))"
            )
        alts = self.data.get("alternatives", {})
        leader_of = {m: leader for leader, a in alts.items() for m in a["members"]}
        lines, seen = [], set()
        for r in hits:
            leader = leader_of.get(r["rep"], None)
            label = r["fqn"] if r["kind"] in ("param", "input") else r["name"]
            if leader is None:
                lines.append(f"{label} ({r['target']}): {r['out'][0] if r['out'] else '-'} — the only option")
                continue
            if leader != r["rep"]:
                lines.append(f"{label} ({r['target']}): {r['out'][0] if r['out'] else '-'} — follows {leader}")
                continue
            if leader in seen:
                continue
            seen.add(leader)
            a = alts[leader]
            shared = f", decided once for {a['count']} identical nodes" if a["count"] > 1 else ""
            lines += textwrap.wrap(
                f"{label} ({r['target']}, module {r['module'] or 'top'}){shared}: options by "
                f"cost given its neighbours' choices (time includes its compute and the "
                f"resharding on its edges):",
                120,
                subsequent_indent="    ",
            )
            for o in a["options"]:
                mark = "->" if o["chosen"] else "  "
                ins = ", ".join("-" if s is None else s for s in o["ins"]) or "-"
                # ZeRO-3: the weight's gathered copies are freed after forward and gathered again
                zero = "  ZeRO-3" if o.get("zero") == 3 else ""
                if o.get("zero") == 1:  # used whole, the optimizer steps a shard placed so
                    zero = f"  ZeRO-1 {o['stored']}"
                if o.get("offload"):  # optimizer state and step in host memory
                    zero += "  offloaded"
                lines.append(
                    f"  {mark} out {o['out'][0]:<18} in {ins:<40} {_fmt_time(o['time_s']):>12}  "
                    f"{_fmt_bytes(o['memory']):>10}{zero}"
                )
        for r in hits:
            if r.get("optimizer_step_s"):  # priced in the estimate after solving (the solver does not weigh it)
                where = "host" if r.get("offload") else "device"
                lines.append(
                    f"{r['fqn']}: optimizer step {_fmt_time(r['optimizer_step_s'])} (at {where} memory bandwidth; "
                    f"in the estimate, not in the solver's choice)"
                )
        cores = {r["block"] for r in hits if r.get("recompute") and ".attention" in (r.get("region") or "")}
        redone = sorted({r["block"] for r in hits if r.get("recompute")} - cores)
        if redone:
            lines.append(
                f"recomputed in backward (activation checkpointing, recompute="
                f"{self.data.get('recompute', 'auto')!r}): {', '.join(redone)} keep only what leaves each "
                f"layer; backward reruns the layer's forward, its collectives included (priced in the estimate)"
            )
        if cores:  # selective: only the attention core reruns
            lines.append(
                f"attention core recomputed in backward (selective activation checkpointing, recompute="
                f"{self.data.get('recompute', 'auto')!r}): {', '.join(sorted(cores))} keep the core's inputs "
                f"(q, k, v, a mask) and what leaves it; backward reruns the core's forward (priced in the estimate)"
            )
        return "\n".join(lines)

    def diff(self, other: ShardingPlan) -> PlanDiff:
        changed, only_here = [], []
        for r in self.records:
            o = other._by_name.get(r["name"])
            if o is None:
                only_here.append(r["name"])
            elif r["out"] != o["out"] or r["ins"] != o["ins"]:
                changed.append((r["name"], r["module"], " ".join(r["out"]), " ".join(o["out"])))
        only_there = [n for n in other._by_name if n not in self._by_name]
        from partitioner.diff_folding import fold_changes

        return PlanDiff(
            changed,
            only_here,
            only_there,
            self.estimate(),
            other.estimate(),
            self.fingerprint == other.fingerprint,
            fold_changes(self.records, changed),
        )

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
