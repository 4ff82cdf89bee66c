"""Choose the whole configuration for N devices: pipeline x data x sequence x tensor degrees, microbatches,
schedule, activation checkpointing and ZeRO stage (``partitioner.plan(..., devices=N)``).

Algorithm
---------
1. **Facts.** The model is captured once at the global batch and analysed: parameter elements,
   forward FLOPs, the repeated layers (their count ``L``, and per layer the bytes backward keeps
   and the bytes of the value entering the next layer).
2. **Enumerate.** Every factorisation ``N = p * d * t`` with ``t`` dividing the cluster's
   ``devices_per_node`` (tensor groups are consecutive ranks, so they stay inside a node) and
   ``p <= L`` (``d = 1 < t`` is left out: its one-axis stage mesh is ``(p, t, 1)``'s);
   without a pipeline (``p = 1``) one microbatch; with one, every number of microbatches
   ``m >= p`` that divides the global batch into microbatches ``d`` data-parallel
   ranks can share, each schedule of ``passes.schedules`` but GPipe (never faster than
   1F1B and heavier) - 1F1B, ZB-H1, and interleaved with 2 stages per rank where ``m`` is a
   multiple of ``p`` and ``L >= 2p`` - and recomputation ``none`` or ``all`` (without a
   pipeline the intra-op solver decides it, ``recompute="auto"``); with ``d > 1`` each with
   every ZeRO stage on ``dp`` (:func:`zero_stages`: 0, 1 without a pipeline and with Adam, 2, 3).
   For a long sequence (:func:`sequence_degrees`) also ``N = d * s`` with a sequence axis
   ``sp`` and ring or Ulysses attention forced on it (no pipeline, no tensor axis). A model with
   mixture-of-experts layers also gets, without a pipeline, each expert degree ``e > 1``
   dividing ``d`` and its expert counts: the experts split over an ``ep`` axis of ``e`` data
   ranks (:mod:`partitioner.expert_degrees`; ``expert_parallel="on"`` keeps only those).
3. **Lower bounds, cheap.** Memory per device: parameter state (weights, gradients, optimizer
   state) by ZeRO stage (:meth:`_Bounds.state_per_device`: what the stage keeps whole on ``dp``
   cut by ``tp`` alone, the rest over all ``N`` devices), plus the activations the schedule keeps alive for the layers
   of the first stage, spread over the stage's ``d * t`` devices (with recomputation only each
   layer's input, plus one layer's). Time: training FLOPs (3 forwards, 4 when recomputing) over
   ``N`` devices at the preset's peak times its matmul efficiency, divided by ``1 - bubble``
   with the schedule's closed-form bubble. A candidate whose memory bound exceeds the budget is
   dropped (``over budget``).
4. **Quick estimate.** A closed-form step time (the time bound plus Megatron-style tensor
   all-reduces per layer, the data-parallel traffic of the ZeRO stage: a gradient all-reduce
   once (0), a reduce-scatter and an all-gather once (1), a reduce-scatter once and a weight
   all-gather per microbatch (2) or two (3), and the stage-to-stage sends,
   on the links the mesh axes cross) orders the survivors; it is never reported as a plan's
   estimate.
5. **Plan the survivors with the real planner**, in that order after one seed, the usual
   recipe (tensor parallel across the node, the fewest pipeline stages whose memory bound fits,
   one sample per microbatch per data-parallel rank, 1F1B, recomputation): the intra-op ILP
   (:func:`partitioner.intra_op.plan_captured`) on the ``(d, t)`` mesh, and for a pipeline the
   stages cut at layer boundaries (:mod:`passes.plan.split_stages`), each stage planned with its
   inputs pinned to what the stage before sends and its activations counted for the
   microbatches the schedule keeps alive; identical stages (same position, layers and incoming
   placements) are planned once. The pipeline's step is the schedule simulated with the
   stages' per-microbatch estimates and the point-to-point time of the largest boundary
   message on the link the pipeline axis crosses. 1F1B and ZB-H1 share one set of stage plans
   (planned for the most microbatches either keeps alive: ZB-H1 keeps ``p`` at every stage,
   1F1B ``p - s`` at stage ``s``); :func:`plan_config`, for one given configuration, plans its
   stages for its own schedule. Stop when the next candidate's time
   bound exceeds the best step found, or after ``max_plans`` distinct plannings (each extra
   one costs seconds at large scale; one refused over budget counts half), one per set of
   degrees ``(p, d, t)`` (the best-ranked microbatch count and recomputation for them; 1F1B
   and ZB-H1 come from the same plannings);
   the rest are listed as not planned, with their bounds. A candidate left out by that limit
   whose quick estimate times the median ratio of a planned step to its quick estimate in
   the search still beats the best step is planned past the limit (``_RUNNER_UPS`` at most);
   the others whose quick estimate is below the chosen step say what that product is.
   Candidates likely to fit are planned first: a refusal over budget scales the activations
   in every bound by what that plan really needed, and a plan that fits only because the
   solver stored weights sharded beyond the asked ZeRO stage counts as a refusal of that
   stage (the candidates whose bounds are as tight are planned after the others). A set of
   degrees refused over budget is planned once more, by a higher ZeRO stage the solver is asked differently. The stage
   reaches the solver as ``zero=`` (:func:`planner_zero`), and the configuration records the
   stage the plan's weights use (:func:`zero_stage_of`).
6. The fastest plan that fits is returned with its :class:`ParallelConfig` (``plan.config``)
   and the search's table (``plan.explain()``: runner-ups, their estimates, why they lost).

A pipelined plan is one :class:`ShardingPlan` whose ``data["pipeline"]`` holds the stage plans
(``stage_plans``, shared by ``stage_map``), the schedule and its simulated step;
``plan.estimate()`` then reports the schedule's step (bubble included) and the point-to-point
bytes (``comm_bytes["send_recv"]["pp"]``). The search's captures and stage splits are cached
by microbatch size, so a size is captured once.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import time
from dataclasses import dataclass, field, replace

import torch

import passes.schedules as ps
from partitioner import expert_degrees
from partitioner.axis_uses import describe_config
from partitioner.cluster import parse_bytes
from partitioner.local_cluster import get_cluster
from partitioner.mesh import MeshSpec
from partitioner.options import PlanOptions
from partitioner.parallel_config import ParallelConfig
from partitioner.precision import Precision
from partitioner.sharding_plan import ShardingPlan
from passes.analysis.analyze import analyze, info
from passes.analysis.expert_routing import measure_routing
from passes.capture.blocks import find_blocks
from passes.capture.capture import describe_captured, graph_fingerprint
from passes.capture.capture_blocks import capture_model
from passes.plan.plan_intra_op import InfeasibleBudgetError
from passes.plan.split_stages import stages_of_layers

__all__ = ["search_config", "plan_config", "ModelFacts", "enumerate_configs", "check_devices"]

logger = logging.getLogger(__name__)

_PIPELINE_SCHEDULES = ("1f1b", "zb-h1", "interleaved")


def check_devices(devices) -> int:
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int (the number of devices to plan for), got {devices!r}")
    return devices


def _divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]


def _batch_of(example_inputs) -> int:
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    for x in values:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise ValueError("the example inputs have no tensor with a batch dimension: pass global_batch= and batched inputs")


def _seq_of(example_inputs, batch: int) -> int:
    """The sequence length: dim 1 of the first batched input with two dims or more (0 if none)."""
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    for x in values:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == batch:
            return int(x.shape[1])
    return 0


def _at_batch(example_inputs, batch: int, size: int):
    """The example inputs with every tensor whose first dim is ``batch`` cut or repeated to ``size``."""

    def resize(x):
        if not (isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch) or size == batch:
            return x
        if size < batch:
            return x[:size]
        reps = -(-size // batch)
        return x.repeat((reps,) + (1,) * (x.dim() - 1))[:size]

    if isinstance(example_inputs, dict):
        return {k: resize(v) for k, v in example_inputs.items()}
    return tuple(resize(v) for v in example_inputs)


def _kept_bytes(node) -> float:
    """Bytes backward keeps because of ``node``: its storage when some op saves it, plus the
    op's own saved buffers (a norm's statistics, attention's weights or log-sum-exp)."""
    own = info(node).saves
    return (_bytes_of(node) if info(node).saved else 0.0) + (own.extra_bytes if own is not None else 0.0)


def _bytes_of(node) -> float:
    shape, dtype = info(node).shape, info(node).dtype
    if shape is None or dtype is None:
        return 0.0
    return float(math.prod(shape)) * torch.empty((), dtype=dtype).element_size()


@dataclass
class ModelFacts:
    """What the bounds need, per sample of the batch (from one analysed capture)."""

    params: int
    fwd_flops_per_sample: float
    layers: int
    layer_saved_per_sample: float
    """Bytes backward keeps for one layer."""
    boundary_per_sample: float
    """Bytes of the value one layer hands the next (what a checkpoint keeps, what a stage sends)."""
    other_saved_per_sample: float
    layer_params: int
    param_shapes: dict = field(default_factory=dict)
    """Parameter shape -> how many parameters have it (tied weights once)."""
    layer_flops_per_sample: float = 0.0
    pre_flops_per_sample: float = 0.0
    """Forward FLOPs before the first layer (embeddings) and after the last (head, loss)."""
    post_flops_per_sample: float = 0.0
    experts: expert_degrees.ExpertFacts = field(default_factory=expert_degrees.ExpertFacts)
    """The mixture-of-experts layers (:mod:`partitioner.expert_degrees`)."""

    @classmethod
    def of(cls, model, cap, batch: int) -> ModelFacts:
        unique = {id(p): p for p in model.parameters()}.values()
        params = sum(p.numel() for p in unique)
        shapes: dict = {}
        for p in unique:
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
        ops = [n for n in cap.graph.nodes if n.op == "call_function" and info(n).kind == "op"]
        flops = sum(info(n).flops for n in ops)
        saved_all = sum(_kept_bytes(n) for n in ops)
        blocks = find_blocks(cap.graph)
        layers = layer_saved = boundary = layer_flops = pre = 0.0
        layer_params = 0
        if blocks.groups:
            group = max(blocks.groups, key=lambda g: len(g.indices))
            layers = len(group.indices)
            first = group.members[0]
            layer_saved = sum(_kept_bytes(n) for n in first if n.op == "call_function" and info(n).kind == "op")
            order = {n: i for i, n in enumerate(cap.graph.nodes)}
            last_op = max((n for n in first if n.op == "call_function"), key=order.__getitem__)
            boundary = _bytes_of(last_op)
            layer_params = sum(
                math.prod(info(n).shape or ()) for n in first if n.op == "placeholder" and info(n).kind == "param"
            )
            layer_flops = sum(info(n).flops for n in first if n.op == "call_function")
            start = min(order[n] for n in first if n.op == "call_function")
            in_group = {n for members in group.members for n in members}
            pre = sum(info(n).flops for n in ops if order[n] < start and n not in in_group)
        return cls(
            params=params,
            fwd_flops_per_sample=flops / batch,
            layers=int(layers),
            layer_saved_per_sample=layer_saved / batch,
            boundary_per_sample=boundary / batch,
            other_saved_per_sample=max(0.0, saved_all - layers * layer_saved) / batch,
            layer_params=int(layer_params),
            param_shapes=shapes,
            layer_flops_per_sample=layer_flops / batch,
            pre_flops_per_sample=pre / batch,
            post_flops_per_sample=max(0.0, flops - pre - layers * layer_flops) / batch,
            experts=expert_degrees.ExpertFacts.of(cap, batch),
        )


def _most_splits(shape: tuple, d: int, t: int) -> int:
    """The most pieces a tensor of ``shape`` can be cut into on a ``(d, t)`` mesh: both axes on
    one dim or two, else the larger axis that divides a dim, else 1 (replicated)."""
    dims = [n for n in shape if n > 0]
    both = any(n % (d * t) == 0 for n in dims) or any(
        a % d == 0 and b % t == 0 for i, a in enumerate(dims) for j, b in enumerate(dims) if i != j
    )
    if both:
        return d * t
    return max([k for k in (d, t) if any(n % k == 0 for n in dims)], default=1)


def _state_bytes_per_param(optimizer) -> int:
    return 4 + (4 if optimizer is not None else 0) + (8 if optimizer == "adam" else 0)


def zero_stages(data: int, pipeline: int, optimizer) -> tuple:
    """The ZeRO stages a candidate with ``data`` data-parallel ranks tries: none without a data
    axis (``"auto"``: the solver's own choice on the other axes); 1 needs Adam's state and no
    pipeline (stage programs keep no compute copies)."""
    if data == 1:
        return ("auto",)
    return tuple(z for z in (0, 1, 2, 3) if z != 1 or (optimizer == "adam" and pipeline == 1))


def sequence_degrees(devices: int, global_batch: int, seq_len: int) -> list:
    """Sequence-parallel degrees ``s > 1`` offered for a long sequence (at least 64 tokens per
    sample of the global batch, or a batch smaller than the devices): ``s`` divides the devices
    and the sequence into ``2 s`` chunks (the causal ring's zig-zag)."""
    if seq_len < 2 or not (seq_len >= 64 * global_batch or global_batch < devices):
        return []
    return [s for s in _divisors(devices) if s > 1 and seq_len % (2 * s) == 0]


def enumerate_configs(
    devices,
    global_batch,
    layers,
    devices_per_node,
    *,
    recompute="auto",
    pipelines=True,
    optimizer="adam",
    seq_len=0,
):
    """Every configuration step 2 of the module docstring lists (pipelined recomputation only
    where ``recompute`` allows it: ``"auto"`` tries ``none`` and ``all``), each with every ZeRO
    stage :func:`zero_stages` allows; for a long sequence (:func:`sequence_degrees`), also
    ``N = d * s`` without a pipeline or tensor axis, ring or Ulysses attention over ``sp``
    (forced modes put the sequence on the last axis and the batch on the others)."""
    out = []
    for s in sequence_degrees(devices, global_batch, seq_len):
        d = devices // s
        if global_batch % d:
            continue
        for algo in ("ring", "ulysses"):
            for z in zero_stages(d * s, 1, optimizer):
                out.append(
                    ParallelConfig(
                        1, d, 1, 1, None, 1, recompute, global_batch, zero=z, sequence=s, sequence_parallel=algo
                    )
                )
    pipe_rc = ("none", "all") if recompute == "auto" else (recompute,)
    for t in _divisors(devices):
        if devices_per_node % t and t > 1:
            continue
        if t > devices_per_node:
            continue
        for p in _divisors(devices // t):
            d = devices // (t * p)
            if d == 1 and t > 1:
                continue  # the same one-axis stage mesh as (p, t, 1): the solver places it alike
            if p == 1:
                if global_batch % d == 0:
                    for z in zero_stages(d, 1, optimizer):
                        out.append(ParallelConfig(1, d, t, 1, None, 1, recompute, global_batch, zero=z))
                continue
            if not pipelines or p > layers:
                continue
            for m in _divisors(global_batch):
                if m < p or (global_batch // m) % d:
                    continue
                for name in _PIPELINE_SCHEDULES:
                    v = 2 if name == "interleaved" else 1
                    if name == "interleaved" and (m % p or layers < 2 * p):
                        continue
                    for rc in pipe_rc:
                        if rc == "all" and layers // (p * v) < 2:
                            continue  # a stage of one layer has no repeated block to recompute
                        for z in zero_stages(d, p, optimizer):
                            out.append(ParallelConfig(p, d, t, m, name, v, rc, global_batch, zero=z))
    return out


@dataclass
class Candidate:
    config: ParallelConfig
    memory_lb: float
    time_lb: float
    quick_s: float
    status: str = "not planned"
    reason: str = ""
    step_time_s: float = math.inf
    """The real plan's estimate (inf until planned)."""
    memory_bytes: float = 0.0
    plan: ShardingPlan | None = field(default=None, repr=False)

    def row(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "status": self.status,
            "reason": self.reason,
            "step_time_s": self.step_time_s if self.plan is not None else None,
            "memory_bytes": self.memory_bytes if self.plan is not None else None,
            "time_lower_bound_s": self.time_lb,
            "memory_lower_bound": self.memory_lb,
            "quick_estimate_s": self.quick_s,
        }


class _Bounds:
    """Steps 3 and 4 of the module docstring for one model, cluster and batch."""

    def __init__(self, facts: ModelFacts, spec, precision: Precision, optimizer, global_batch: int, host_budget=None):
        self.f, self.spec, self.batch = facts, spec, global_batch
        # offloaded optimizer state leaves the device: the bound counts what the host cannot take
        self.host = parse_bytes(host_budget) if host_budget is not None else 0
        name = str(precision.compute).replace("torch.", "")
        self.peak = spec.flops_for(name) * spec.matmul_efficiency
        self.state = facts.params * _state_bytes_per_param(optimizer)
        self.bytes_per_param = _state_bytes_per_param(optimizer)
        self.grad_bytes = 4 if optimizer is not None else 0
        self._state_cache: dict = {}
        self.reduce_bytes = precision.grad_reduce_bytes or 4

    def _bubble(self, c: ParallelConfig) -> float:
        if c.pipeline == 1:
            return 0.0
        return ps.SCHEDULES[c.schedule or "1f1b"].bubble(c.pipeline, c.microbatches, c.virtual_stages)

    def memory(self, c: ParallelConfig) -> float:
        f = self.f
        mb = self.batch / c.microbatches
        share = c.data * c.sequence * c.tensor
        if c.pipeline == 1:
            kept_layer = f.boundary_per_sample if c.recompute != "none" else f.layer_saved_per_sample
            acts = f.layers * kept_layer * mb + f.other_saved_per_sample * mb
        else:
            # some stage holds ceil(L/p) layers; the last holds the head's activations too; every
            # stage is planned for min(p, m) microbatches in flight (1F1B's first, ZB-H1's all)
            most = -(-f.layers // c.pipeline)
            least = f.layers // c.pipeline
            copies = min(c.pipeline, c.microbatches)
            kept = f.boundary_per_sample if c.recompute == "all" else f.layer_saved_per_sample
            per_copy = max(most * kept, least * kept + f.other_saved_per_sample)
            acts = copies * per_copy * mb + (f.layer_saved_per_sample * mb if c.recompute == "all" else 0.0)
        state = self.state_per_device(c)
        if self.host:  # at most the stage's optimizer moments can move to the host
            state -= min(self.host, self.f.params * max(0, self.bytes_per_param - 4 - self.grad_bytes) / c.pipeline)
        return max(0.0, state) + acts / share

    def state_per_device(self, c: ParallelConfig) -> float:
        """Parameter state on the busiest device, at best, the stage holding at least ``1/p`` of
        the weights. Each weight's sharded part is its share cut by the stage mesh axes that
        divide one of its dims (a weight of width 25,600 cannot be split 96 ways); what the ZeRO
        stage keeps whole on the data axes (``dp`` and ``sp``) is cut by ``tp`` alone: stage 0
        all of it (fp32 weight, gradient, optimizer state), 1 the weight and its gradient (the
        compute copy) beside a shard of everything, 2 the gathered weight kept for backward
        (with nothing recomputed: a recomputed layer gathers again, so otherwise as 3), 3 one
        layer's gathered weights; ``"auto"`` (no data axis) all sharded. A pipeline stage with
        ZeRO-0 on a data axis also holds its gradients' sums over the microbatches
        (:func:`passes.plan.cost_model.grad_held_back`)."""
        stage = 3 if c.zero == 2 and c.recompute != "none" else c.zero
        key = (c.pipeline, c.data * c.sequence, c.tensor, stage, c.expert)
        if key not in self._state_cache:
            data = c.data * c.sequence
            whole = {0: self.bytes_per_param, 1: 4 + self.grad_bytes, 2: 4}.get(stage, 0)  # type: ignore[arg-type]
            if stage == 0 and c.pipeline > 1 and data > 1:  # the gradient sums a stage holds back
                whole += self.grad_bytes
            total, gathered = 0.0, float(self.f.layer_params)
            experts = self.f.experts if c.expert > 1 else expert_degrees.ExpertFacts()
            if experts.params:  # split over ep (partitioner/expert_degrees.py)
                total += expert_degrees.expert_state(experts, c, _stage_rank(stage), whole, self.bytes_per_param)
                gathered -= experts.layer_params * (1 - 1 / c.expert)
            for shape, count in self.f.param_shapes.items():
                count -= experts.shapes.get(shape, 0)
                n = count * math.prod(shape)
                tp_only = n / _most_splits(shape, 1, c.tensor)
                if stage == 0:
                    total += tp_only * whole
                else:
                    total += tp_only * whole + n / _most_splits(shape, data, c.tensor) * self.bytes_per_param
            total /= c.pipeline
            if stage == 3 and self.f.layers:
                total += gathered * 4 / c.tensor  # the one layer gathered at a time
            self._state_cache[key] = total
        return self._state_cache[key]

    def activations_without_recompute(self, c: ParallelConfig) -> float:
        """A whole-model (``p = 1``) plan's activation bound with nothing recomputed."""
        f = self.f
        return (
            (f.layers * f.layer_saved_per_sample + f.other_saved_per_sample)
            * self.batch
            / (c.data * c.sequence * c.tensor)
        )

    def time(self, c: ParallelConfig) -> float:
        passes = 4 if c.recompute == "all" else 3
        compute = self.f.fwd_flops_per_sample * self.batch * passes / (c.devices * self.peak)
        return compute / (1.0 - self._bubble(c))

    def quick(self, c: ParallelConfig) -> float:
        f, spec = self.f, self.spec
        shape = (c.pipeline, c.data * c.sequence, c.tensor)
        data = c.data * c.sequence  # the weights' data axes: a sequence split replicates them too
        mb = self.batch / c.microbatches
        per_stage_layers = max(1, f.layers // c.pipeline) if f.layers else 1
        overhead = spec.collective_overhead_s
        per_micro = 0.0
        if c.tensor > 1:  # Megatron: two all-reduces forward and two backward per layer (three with a rerun)
            link = spec.link_for_axis(shape, 2)
            ar = 2 * (c.tensor - 1) / c.tensor * f.boundary_per_sample * mb / data / link.bandwidth
            per_micro += per_stage_layers * (6 if c.recompute == "all" else 4) * (ar + overhead + link.latency_s)
        once = 0.0
        if c.sequence > 1:
            # per layer, with local blocks of b = boundary / (d s) bytes: the ring sends k and v
            # (2b) s - 1 times forward and twice that backward; Ulysses makes 9 all-to-alls of b
            # (q, k, v, output forward; dO, dq, dk, dv and the row sums backward); a rerun adds
            # the forward's share again (all of it counted, none hidden behind compute)
            link = spec.link_for_axis(shape, 1)
            local = f.boundary_per_sample * mb / data
            n = c.sequence
            if c.sequence_parallel == "ring":
                hops = 3 * (n - 1)
                moved = hops * 2 * local
            else:
                hops = 9
                moved = hops * (n - 1) / n * local
            rerun = 4 / 3 if c.recompute == "all" else 1.0
            per_micro += per_stage_layers * rerun * (moved / link.bandwidth + hops * (overhead + link.latency_s))
        if data > 1:
            # by ZeRO stage: the stage's gradients all-reduced once per step (0; bucketed, a
            # pipeline holds them back until its last microbatch), reduce-scattered and the
            # stepped shards all-gathered once (1), or reduce-scattered once (in a pipeline: in
            # every microbatch) and the weights gathered in every microbatch's forward (2) and
            # again in its backward (3); or, when
            # cheaper, a per-layer reduction of activations over dp in every microbatch: a stand-in
            # for the plans the solver finds with activations split on both axes
            link = spec.link_for_axis(shape, 1)
            share = (data - 1) / data / link.bandwidth
            synced = expert_degrees.data_synced_params(f.experts, c, f.params)
            grads = synced / (c.pipeline * c.tensor) * self.reduce_bytes
            weights = synced / (c.pipeline * c.tensor) * 4
            hop = overhead + link.latency_s
            gathers = {2: 1, 3: 2}.get(c.zero, 0)  # type: ignore[arg-type]
            if c.zero in (0, "auto"):
                sync, gather = 2 * share * grads + hop, 0.0
            elif c.zero == 1:
                sync, gather = share * (grads + weights) + 2 * hop, 0.0
            else:
                sync, gather = share * grads + hop, gathers * (share * weights + hop)
                if c.pipeline > 1:  # a pipeline stage reduce-scatters them in every microbatch
                    sync, gather = 0.0, gather + sync
            ar = 2 * (data - 1) / data * f.boundary_per_sample * mb / c.tensor / link.bandwidth
            as_tensor = per_stage_layers * (6 if c.recompute == "all" else 4) * (ar + overhead + link.latency_s)
            if sync + gather * c.microbatches <= as_tensor * c.microbatches:
                once = sync
                per_micro += gather
            else:
                per_micro += as_tensor
        per_micro += expert_degrees.dispatch_seconds(f.experts, c, spec, mb)
        if c.pipeline > 1:  # an activation forward and its gradient back, per microbatch
            link = spec.link_for_axis(shape, 0)
            per_micro += 2 * (f.boundary_per_sample * mb / (c.data * c.tensor) / link.bandwidth + link.latency_s)
        compute = self.time(c) * (1.0 - self._bubble(c)) / c.microbatches
        return (compute + per_micro) * c.microbatches / (1.0 - self._bubble(c)) + once


class _Planner:
    """Step 5: real plans for configurations, with captures and stage splits cached."""

    def __init__(self, model, example_inputs, batch, *, spec, budget, precision, options: PlanOptions):
        self.model, self.inputs, self.batch = model, example_inputs, batch
        self.spec, self.budget, self.precision = spec, budget, precision
        self.options = options.replace(cluster=spec, precision=precision)
        self.optimizer, self.layers = options.optimizer, options.layers
        self.name = type(model).__name__
        self._caps: dict = {}
        self._splits: dict = {}
        self._stage_sets: dict = {}
        self._schedules: dict = {}
        self._fingerprints: dict = {}  # id of a cached capture -> its fingerprints
        self._lengths: dict = {}  # stages -> layers per stage
        self.share_schedules = True  # 1F1B and ZB-H1 share stage plans (the search); False: exact
        self.plannings = 0
        self.facts: ModelFacts | None = None

    def fingerprints(self, cap) -> dict:
        """The whole model's fingerprints a pipelined plan records (computed once per capture)."""
        if id(cap) not in self._fingerprints:
            self._fingerprints[id(cap)] = {
                "fingerprint": graph_fingerprint(cap),
                "structure": graph_fingerprint(cap, shapes=False),
            }
        return self._fingerprints[id(cap)]

    def schedule(self, c: ParallelConfig) -> ps.Schedule:
        """``c``'s compute schedule, made once per (schedule, stages, microbatches, stages per
        rank): configurations that differ in their stage plans replay the same schedule, which
        :func:`passes.schedules.simulate` indexes and checks once."""
        key = (c.schedule or "1f1b", c.pipeline, c.microbatches, c.virtual_stages)
        if key not in self._schedules:
            self._schedules[key] = ps.SCHEDULES[key[0]].make(*key[1:])
        return self._schedules[key]

    def capture(self, size: int):
        if size not in self._caps:
            t0 = time.perf_counter()
            cap = capture_model(
                self.model,
                _at_batch(self.inputs, self.batch, size),
                layers=self.layers,
                autocast_dtype=self.precision.autocast_dtype,
            )
            analyze(cap)
            measure_routing(self.model, _at_batch(self.inputs, self.batch, size), cap)  # MoE layers' loads
            logger.info(
                "search: captured at batch %d in %.2f s (%s)", size, time.perf_counter() - t0, describe_captured(cap)
            )
            self._caps[size] = cap
        return self._caps[size]

    def _plan(
        self,
        cap,
        name,
        shape,
        names,
        *,
        pins=None,
        copies=1,
        recompute="none",
        budget=None,
        zero1=True,
        microbatches=1,
        holds_gradient_sums=False,
        zero="auto",
        sequence_parallel="auto",
        config=None,
    ):
        from partitioner.intra_op import plan_captured

        experts, expert_axis = self.options.expert_parallel, None
        if config is not None and self.facts is not None:
            experts, expert_axis = expert_degrees.solver_mode(config, self.facts.experts, experts)
        return plan_captured(
            cap,
            model_name=name,
            mesh_shape=shape,
            mesh_axis_names=names,
            options=self.options.replace(
                memory_budget=self.budget if budget is None else budget,
                pins=pins,
                recompute=recompute,
                # the user's own zero= (a forced stage, name patterns) wins over the configuration's
                zero=zero if self.options.zero == "auto" else self.options.zero,
                sequence_parallel=sequence_parallel
                if self.options.sequence_parallel == "auto"
                else self.options.sequence_parallel,
                expert_parallel=experts,
            ),
            expert_axis=expert_axis,
            activation_copies=copies,
            zero1=zero1,
            microbatches=microbatches,
            holds_gradient_sums=holds_gradient_sums,
        )

    def plan(self, c: ParallelConfig) -> ShardingPlan:
        """The real plan for ``c`` (raises InfeasibleBudgetError when nothing fits); its config
        records the ZeRO stage the plan's weights use (:func:`zero_stage_of`)."""
        if c.pipeline == 1:
            self.plannings += 1
            made = self._plan(
                self.capture(self.batch),
                self.name,
                c.stage_mesh_shape,
                c.stage_axis_names,
                recompute=c.recompute,
                zero=planner_zero(c.zero),
                sequence_parallel=c.sequence_parallel,
                config=c,
            )
        else:
            made = self._pipeline(c)
        if c.zero != "auto":
            c = replace(c, zero=zero_stage_of(made))
        made.data["config"] = c.to_dict()
        return made

    # -- pipelines ---------------------------------------------------------------------------
    def stage_lengths(self, stages: int) -> list:
        """Layers per stage: the balanced split :func:`passes.plan.split_stages.assign_stages` makes
        (layers priced by their FLOPs, the ops before the first layer and after the last riding
        with them)."""
        from passes.plan.split_stages import balance_layers

        f = self.facts
        assert f is not None, "the planner's model facts are set before pipelines are planned"
        if stages not in self._lengths:
            costs = [f.layer_flops_per_sample] * f.layers
            costs[0] += f.pre_flops_per_sample
            costs[-1] += f.post_flops_per_sample
            self._lengths[stages] = balance_layers(costs, stages)
        return list(self._lengths[stages])

    def _truncated(self, size: int, n_layers: int):
        """The model cut to its first ``n_layers`` repeated layers, captured at batch ``size``."""
        from passes.capture.capture_blocks import repeated_layers

        found = repeated_layers(self.model, min_layers=2)
        if found is None:
            raise ValueError(
                f"{self.name} has no list of identical layers to cut into pipeline stages; plan it with pipelines=False"
            )
        path, layers = found
        owner = self.model
        for part in path.split(".")[:-1]:
            owner = getattr(owner, part)
        attr = path.split(".")[-1]
        setattr(owner, attr, torch.nn.ModuleList(list(layers)[:n_layers]))
        try:
            mode = self.layers if self.layers == "full" else ("blocks" if n_layers >= 3 else "full")
            cap = capture_model(
                self.model,
                _at_batch(self.inputs, self.batch, size),
                layers=mode,
                autocast_dtype=self.precision.autocast_dtype,
            )
        finally:
            setattr(owner, attr, layers)
        analyze(cap)
        return cap

    def _class_split(self, size: int, counts: tuple):
        """Stage graphs of the stage classes (first, middles by layer count, last): the model cut
        to ``sum(counts)`` layers, split into runs of ``counts`` layers."""
        from passes.plan.split_stages import split_stages

        key = (size, counts)
        if key not in self._splits:
            cap = self._truncated(size, sum(counts))
            stage_of, runs = stages_of_layers(cap, list(counts))
            graphs = split_stages(cap, stage_of, runs)
            for g in graphs:
                analyze(g.captured)
            self._splits[key] = (cap, graphs)
        return self._splits[key]

    def _stage_plans(self, c: ParallelConfig):
        """Stage plans for ``c``'s microbatch, degrees and recomputation (shared by 1F1B and
        ZB-H1). Stages are planned once per class: the first stage, the middle stages by their
        layer count, the last stage (a middle class takes the placements the class before it
        sends). Returns (class graphs, class plans, class of each stage, layer runs, sends)."""
        from partitioner.stage_boundaries import sent_placements, shared_weights

        size = c.microbatch_size
        stages = c.pipeline * c.virtual_stages
        if c.schedule == "interleaved" or not self.share_schedules:
            copies = ps.SCHEDULES[c.schedule or "1f1b"].in_flight(c.pipeline, c.microbatches, c.virtual_stages)
        else:
            copies = ps.auto_stage_in_flight(c.pipeline, c.microbatches)
        lengths = self.stage_lengths(stages)
        classes: list = []
        for s, n in enumerate(lengths):
            kind = "first" if s == 0 else "last" if s == stages - 1 else "middle"
            if (kind, n) not in classes:
                classes.append((kind, n))
        classes.sort(key=lambda k: ("first", "middle", "last").index(k[0]))
        stage_map = [
            classes.index(("first" if s == 0 else "last" if s == stages - 1 else "middle", n))
            for s, n in enumerate(lengths)
        ]
        class_copies = [max(copies[s] for s in range(stages) if stage_map[s] == k) for k in range(len(classes))]
        key = stage_set_key(c, shared=self.share_schedules)
        if key in self._stage_sets:
            return self._stage_sets[key]
        self.plannings += 1
        t0 = time.perf_counter()
        cap, graphs = self._class_split(size, tuple(n for _, n in classes))
        t1 = time.perf_counter()
        tied = {n for names in shared_weights(cap, graphs) for n in names}
        shape, names = c.stage_mesh_shape, c.stage_axis_names
        budget = self.budget / c.virtual_stages
        # the middle classes (most of the stages) are planned first, their inputs free; the first
        # class is then planned sending what the middle one receives, and the later classes
        # receiving what the class before sends
        order = list(range(1, len(graphs) - 1)) + [0, len(graphs) - 1] if len(graphs) > 2 else [0, 1]
        made_by: dict = {}
        sent_as: dict = {}
        for k in order:
            g = graphs[k]
            pins = {n: ["R"] * len(shape) for n in g.inputs if n in tied}
            pins.update({a: sent_as[a] for a in g.activation_inputs if a in sent_as})
            if k == 0 and len(graphs) > 2:
                pins.update(_send_pins(g, graphs[1], made_by[1], len(shape)))
            made_by[k] = self._plan(  # no ZeRO-1 weights: stage programs keep no compute copies
                g.captured,
                f"{self.name} stage class {g.index}",
                shape,
                names,
                pins=pins,
                copies=class_copies[k],
                recompute=c.recompute,
                budget=budget,
                zero1=False,
                microbatches=c.microbatches,
                holds_gradient_sums=True,
                zero=planner_zero(c.zero),
                sequence_parallel=c.sequence_parallel,
                config=c,
            )
            sent_as.update(sent_placements(g, made_by[k], len(shape)))
        plans = [made_by[k] for k in range(len(graphs))]
        logger.info(
            "search: %s: %d stage classes cut in %.2f s, planned in %.2f s",
            c.describe(),
            len(plans),
            t1 - t0,
            time.perf_counter() - t1,
        )
        runs, k = [], 0
        for n in lengths:
            runs.append(list(range(k, k + n)))
            k += n
        result = (graphs, plans, stage_map, runs, sent_as)
        self._stage_sets[key] = result
        return result

    def _p2p(self, c, graphs, sent_as) -> tuple:
        """(largest boundary message per device in bytes, its seconds on the pipeline link, bytes
        sent per device per step by the busiest rank)."""
        shape = c.stage_mesh_shape
        largest = 0.0
        grads = 0.0
        for g in graphs[1:]:
            total = grad = 0.0
            for node in g.captured.graph.nodes:
                if node.op != "placeholder" or node.name not in g.activation_inputs:
                    continue
                spec = sent_as.get(node.name) or ""
                cut = math.prod(n for n, s in zip(shape, _split_spec(spec)) if s.startswith("S("))
                size = _bytes_of(node) / max(cut, 1)
                total += size
                dtype = info(node).dtype
                if dtype is not None and dtype.is_floating_point:
                    grad += size
            if total > largest:
                largest, grads = total, grad
        link = self.spec.link_for_axis(c.mesh_shape, 0)
        seconds = largest / link.bandwidth + link.latency_s if largest else 0.0
        per_rank = c.virtual_stages * c.microbatches * (largest + grads)
        return largest, seconds, per_rank

    def _pipeline(self, c: ParallelConfig) -> ShardingPlan:
        graphs, plans, stage_map, runs, sent_as = self._stage_plans(c)
        class_ests = [p.estimate() for p in plans]  # once per stage class, not per stage
        ests = [class_ests[r] for r in stage_map]
        takes = [graphs[r].takes_activations for r in stage_map]
        forward, backward, weight = ps.stage_durations(ests, takes)
        _, p2p_s, p2p_bytes = self._p2p(c, graphs, sent_as)
        sched = self.schedule(c)
        sim = ps.simulate(sched, forward, backward, weight, comm_time=p2p_s, sync_time=ps.stage_syncs(ests))
        per_rank_memory = [0.0] * c.pipeline
        for s, est in enumerate(ests):
            per_rank_memory[sched.stage_to_rank[s]] += est.memory_bytes
        memory = max(per_rank_memory)
        if memory > self.budget:
            raise InfeasibleBudgetError(
                f"the stages of {c.describe()} need {memory / 2**30:.3f} GiB ({memory:.0f} bytes) on one rank, "
                f"over the budget"
            )
        model_flops = c.microbatches * sum(float(plans[r].data.get("model_flops", 0.0)) for r in stage_map)
        first = plans[0].data
        whole = self.capture(self.batch)
        data = {
            **{k: first[k] for k in ("format", "version", "training", "precision", "cluster", "budget", "objective")},
            "optimizer": self.optimizer,
            **self.fingerprints(whole),
            "model": self.name,
            "inputs": _inputs_of(whole),
            "mesh": MeshSpec.build(c.mesh_shape, c.axis_names).to_dict(),
            "activation_copies": 1,
            "recompute": c.recompute,
            "pins": {},
            "records": [],
            "alternatives": {},
            "blocks": [],
            "stats": {},
            "model_flops": model_flops,
            "config": c.to_dict(),
            "pipeline": {
                "degree": c.pipeline,
                "schedule": c.schedule,
                "microbatches": c.microbatches,
                "virtual_stages": c.virtual_stages,
                "layers": runs,
                "stage_map": stage_map,
                "stage_plans": [p.data for p in plans],
                "step_time_s": sim.makespan,
                "bubble_fraction": sim.bubble_fraction,
                "busy_s": max(sim.busy.values()),
                "p2p_time_s": p2p_s,
                "p2p_bytes": p2p_bytes,
                "memory_bytes": memory,
                "busiest_stage": max(range(len(ests)), key=lambda s: ests[s].step_time_s),
                "takes_activations": takes,  # what the step above was simulated with (partitioner.report)
            },
        }
        return ShardingPlan(data)


def planner_zero(stage):
    """The intra-op solver's ``zero=`` for a configuration's stage: 0 and 2 offer neither ZeRO-1
    nor a regather (the budget decides whether a weight is stored sharded), 1 forces ZeRO-1 on the
    weights replicated on some axis, 3 lets the solver regather any sharded weight where the
    budget needs it (``"auto"``, as does a candidate without a data axis)."""
    return {0: 2, 3: "auto"}.get(stage, stage)


def _stage_rank(stage) -> int:
    return -1 if stage == "auto" else int(stage)


def zero_stage_of(plan: ShardingPlan) -> int:
    """The ZeRO stage a plan's weights use on its data axes (``dp``, ``ep``, ``sp``): 3 when one is
    gathered again in backward, 2 when one is stored sharded there, 1 when one's optimizer
    shard is (ZeRO-1), else 0."""
    plans = plan.stage_plans if plan.data.get("pipeline") else [plan]
    stage = 0
    for part in plans:
        names = list(part.axis_names)
        data_axes = [k for k, a in enumerate(names) if a in ("dp", "ep", "sp")]
        for r in part.records:
            if r.get("kind") != "param":
                continue
            stored = _split_spec(r.get("stored") or r["out"][0])
            cut = any(k < len(stored) and stored[k].startswith("S(") for k in data_axes)
            if not cut:
                continue
            stage = max(stage, 3 if r.get("zero") == 3 else 1 if r.get("stored") else 2)
    return stage


def _send_pins(first, second, second_plan, ndim) -> dict:
    """Pins for ``first``'s returned values: the placements ``second``'s plan receives them in
    (node name -> placement), so the first stage sends what the next one chose to take.

    A value made inside a repeated layer (the last layer's output) is not pinned: the layers
    share one decision, so its pin would place every layer's output so (the middle stages'
    free choice of input placement, say replicated over ``dp``, would become every layer's
    output in the first stage and what each layer's checkpoint keeps under recomputation).
    The first stage then sends its own placement, as it does when a job plans its stages in
    order (:mod:`partitioner.pipeline_parallelize`: each stage receives what the one before
    sends)."""
    from passes.core.placements import format_spec, parse_spec

    records = {r["name"]: r for r in second_plan.records}
    returned = first.captured.graph.find_nodes(op="output")[0].args[0]
    returned = returned if isinstance(returned, (list, tuple)) else [returned]
    blocks = find_blocks(first.captured.graph)
    pins = {}
    for node, name in zip(returned, first.outputs):
        record = records.get(name)
        if isinstance(node, torch.fx.Node) and blocks.count.get(blocks.represent(node), 1) > 1:
            continue
        if name in second.activation_inputs and record and record.get("out") and hasattr(node, "name"):
            spec = parse_spec(record["out"][0], ndim)
            if all(type(p).__name__ != "Partial" for p in spec):
                pins[node.name] = format_spec(spec)
    return pins


def _split_spec(spec: str) -> list:
    return [s.strip() for s in spec.strip("[]").split(",")] if spec else []


def _inputs_of(cap) -> dict:
    return {
        info(n).name: list(info(n).shape or ())
        for n in cap.graph.nodes
        if n.op == "placeholder" and info(n).kind == "input"
    }


def _fmt_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_config(
    model,
    example_inputs,
    config: ParallelConfig,
    *,
    options: PlanOptions | None = None,
    **option_kwargs,
) -> ShardingPlan:
    """The real plan for one given configuration (a published one, say), as the search plans
    its candidates; ``config.global_batch`` 0 takes the example inputs' batch. ``options``: the
    :class:`PlanOptions` (keywords of the same names override them); the configuration decides
    the mesh, so options are checked as the search checks them."""
    opts = _search_options(PlanOptions.build(options, **option_kwargs))
    precision = opts.precision_policy
    spec = get_cluster(opts.cluster_for())
    budget = parse_bytes(opts.memory_budget) if opts.memory_budget is not None else spec.memory_bytes
    batch = _batch_of(example_inputs)
    if not config.global_batch:
        config = replace(config, global_batch=batch)
    planner = _Planner(
        model,
        example_inputs,
        batch if config.global_batch == batch else config.global_batch,
        spec=spec,
        budget=budget,
        precision=precision,
        options=opts,
    )
    planner.inputs = _at_batch(example_inputs, batch, config.global_batch)
    planner.batch = config.global_batch
    planner.share_schedules = False  # its stages hold what its own schedule keeps alive
    planner.facts = ModelFacts.of(model, planner.capture(config.global_batch), config.global_batch)
    return planner.plan(config)


_SEARCH_MODE = "in the configuration search (devices=N, or auto_parallelize without a mesh)"


def _search_options(opts: PlanOptions) -> PlanOptions:
    """The options the search can honour (the rest are refused, naming what to do instead)."""
    opts.refuse(
        _SEARCH_MODE,
        {
            "pins": "pins name mesh axes; give mesh= with pins",
            "objective": "the search ranks configurations by estimated step time; give mesh= to minimise memory",
        },
    )
    if opts.tensor_parallel not in ("auto", "1d"):
        raise ValueError(
            f"tensor_parallel={opts.tensor_parallel!r} is not available {_SEARCH_MODE}: its grid needs a mesh of "
            f"its own shape; give mesh= (see partitioner.plan)"
        )
    return opts


def _honoured(configs: list, opts: PlanOptions) -> list:
    """The enumerated configurations that agree with the user's forced options: a forced
    sequence algorithm keeps the sequence-parallel candidates running it (``"none"``: none of
    them); ``tensor_parallel="1d"`` the candidates with a tensor axis; a forced ZeRO stage the
    candidates with that stage on their data axes (name patterns: one candidate per set of
    degrees, the patterns deciding)."""
    sp = opts.sequence_parallel
    if sp == "none":
        configs = [c for c in configs if c.sequence == 1]
    elif sp in ("ring", "ulysses"):
        configs = [c for c in configs if c.sequence > 1 and c.sequence_parallel == sp]
    if opts.tensor_parallel == "1d":
        configs = [c for c in configs if c.tensor > 1]
    if isinstance(opts.zero, int):
        configs = [c for c in configs if c.data * c.sequence == 1 or c.zero == opts.zero]
    elif isinstance(opts.zero, dict):
        configs = list(dict.fromkeys(replace(c, zero="auto") for c in configs))
    return configs


def search_config(
    model,
    example_inputs,
    *,
    devices: int,
    global_batch: int | None = None,
    options: PlanOptions | None = None,
    max_plans: int = 5,
    pipelines: bool = True,
    pipeline_recompute: bool = True,
    **option_kwargs,
) -> ShardingPlan:
    """The best configuration for ``devices`` devices and its plan (the module docstring's
    steps). ``options``: the :class:`PlanOptions` (keywords of the same names override them):
    every option is honoured (forced algorithms and ZeRO stages narrow the candidates) or
    refused with a ``ValueError``. ``pipelines=False`` leaves pipelines out;
    ``pipeline_recompute=False`` leaves out pipelined candidates that recompute (what
    ``auto_parallelize`` can run today)."""
    t0 = time.perf_counter()
    devices = check_devices(devices)
    opts = _search_options(PlanOptions.build(options, **option_kwargs))
    precision = opts.precision_policy
    spec = get_cluster(opts.cluster_for())
    budget = parse_bytes(opts.memory_budget) if opts.memory_budget is not None else spec.memory_bytes
    example_batch = _batch_of(example_inputs)
    batch = example_batch if global_batch is None else global_batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
    inputs = _at_batch(example_inputs, example_batch, batch)
    planner = _Planner(model, inputs, batch, spec=spec, budget=budget, precision=precision, options=opts)
    facts = planner.facts = ModelFacts.of(model, planner.capture(batch), batch)
    bounds = _Bounds(facts, spec, precision, opts.optimizer, batch, host_budget=opts.host_memory_budget)
    configs = _searched_configs(
        devices, batch, inputs, facts, spec, bounds, budget, opts, pipelines, pipeline_recompute
    )
    cands = [Candidate(c, bounds.memory(c), bounds.time(c), bounds.quick(c)) for c in configs]
    for cand in cands:
        if cand.memory_lb > budget:
            cand.status = "over budget"
            cand.reason = f"needs at least {_fmt_gib(cand.memory_lb)} per device (bound), budget {_fmt_gib(budget)}"
    alive = [c for c in cands if c.status != "over budget"]
    logger.info(
        "search: %d configurations for %d devices, %d within the memory bound (%.2f s)",
        len(cands),
        devices,
        len(alive),
        time.perf_counter() - t0,
    )
    loop = _PlanningLoop(planner, bounds, budget, cands, max_plans)
    best = loop.run(alive, spec.devices_per_node)
    if best is None:
        least = min(cands, key=lambda c: c.memory_lb)
        optimizer = opts.optimizer
        need = math.ceil(facts.params * _state_bytes_per_param(optimizer) / budget) if budget > 0 else 0
        raise InfeasibleBudgetError(
            f"no configuration of {devices} devices fits the budget of {_fmt_gib(budget)} per device: the least "
            f"memory any needs is at least {_fmt_gib(least.memory_lb)} ({least.config.describe()})"
            + (f"; planned: {loop.least_seen[1]}" if loop.least_seen else "")
            + f". The parameter state alone ({facts.params:,} parameters, optimizer {optimizer!r}) needs at least "
            f"{need} devices of this budget at batch {batch} in {precision}; raise the budget or the device count"
        )
    return _chosen(best, cands, devices, batch, t0, planner.plannings)


def _searched_configs(devices, batch, inputs, facts, spec, bounds, budget, opts, pipelines, pipeline_recompute):
    """The configurations to price: every one for ``devices`` devices (:func:`enumerate_configs`),
    narrowed to those the options honour (a ValueError naming the options when none is left);
    without a pipeline, one whose kept activations alone overflow the budget recomputes."""
    configs = enumerate_configs(
        devices,
        batch,
        facts.layers,
        spec.devices_per_node,
        recompute=opts.recompute,
        pipelines=pipelines,
        optimizer=opts.optimizer,
        seq_len=_seq_of(inputs, batch),
    )
    if not pipeline_recompute:
        configs = [c for c in configs if c.pipeline == 1 or c.recompute == "none"]
    enumerated = len(configs)
    configs = expert_degrees.with_expert_degrees(configs, facts.experts, opts.expert_parallel)
    if enumerated and not configs:
        raise ValueError(
            f"expert_parallel='on' cannot be honoured {_SEARCH_MODE}: no configuration of {devices} devices "
            f"without a pipeline or sequence axis has a data degree with a divisor above 1 that divides the "
            f"{facts.experts.experts} experts of its MoE layers; use 'auto', or give mesh= with an axis dividing them"
        )
    configs = _honoured(configs, opts)
    if not configs:
        forced = {k: v for k, v in opts.changed().items() if k in ("sequence_parallel", "tensor_parallel", "zero")}
        raise ValueError(
            f"no configuration of {devices} devices divides the global batch of {batch}"
            + (f" with {forced} ({enumerated} without them)" if forced and enumerated else "")
            + f": choose a batch that {devices} (or a divisor of it) divides"
            + (", or leave those options out" if forced else "")
        )
    # without a pipeline, a model whose kept activations alone overflow the budget recomputes:
    # planned with recompute="all" (the solver's "auto" would first try, and fail, without)
    return [
        replace(c, recompute="all")
        if c.pipeline == 1
        and c.recompute == "auto"
        and bounds.state_per_device(c) + bounds.activations_without_recompute(c) > budget
        else c
        for c in configs
    ]


class _PlanningLoop:
    """Step 5 of the module docstring: plan the candidates in order, best first, until the limit.

    Planning order: the candidates likely to fit first, each group by the quick estimate. Likely
    to fit: the memory bound with its activations scaled by ``slack``, the largest ratio of a
    refused plan's least memory to its bound seen so far (the bound leaves out buffers, copies
    and transients the solver counts), starting at 1."""

    def __init__(self, planner: _Planner, bounds: _Bounds, budget: float, cands: list, max_plans: int):
        self.planner, self.bounds, self.budget, self.cands, self.max_plans = planner, bounds, budget, cands, max_plans
        self.best: Candidate | None = None
        self.least_seen: tuple | None = None  # (memory bound, why) of the least refused over budget
        self.slack = 1.0
        self.queue: list = []
        self.tried: dict = {}  # (p, d, s, t, e) -> (what was planned for them, its memory bound if refused over budget)
        self.refused = 0  # plannings refused over budget count half toward max_plans (they stop early)
        self.limit: float = max_plans  # raised by one for each runner-up planned after the limit

    def order(self, c: Candidate) -> tuple:
        state = self.bounds.state_per_device(c.config)
        return (state + self.slack * (c.memory_lb - state) > self.budget, c.quick_s, c.time_lb)

    def run(self, alive: list, devices_per_node: int) -> Candidate | None:
        """The fastest candidate planned (None: none fits)."""
        self.queue = sorted(alive, key=self.order)
        seed = _rule_of_thumb(self.queue, devices_per_node, self.bounds, self.budget)
        if seed is not None:  # planned first: the best plan is never worse than the usual recipe
            self.queue.remove(seed)
            self.queue.insert(0, seed)
        while True:
            if not self.queue:
                again = _runner_up(self.cands, self.best, self.limit - self.max_plans < _RUNNER_UPS)
                if again is None:
                    break
                self.limit = self.planner.plannings - self.refused / 2 + 1
                self.queue.append(again)
            cand = self.queue.pop(0)
            if self.skipped(cand):
                continue
            made = self.plan(cand)
            if made is not None:
                self.take(cand, made)
        return self.best

    def skipped(self, cand: Candidate) -> bool:
        """Whether ``cand`` is left unplanned (its reason set): its time bound is past the best
        step, the planning limit is reached, or its degrees were planned already."""
        best = self.best
        if best is not None and cand.time_lb > best.step_time_s:
            cand.status = "pruned"
            cand.reason = f"its time bound {_fmt_s(cand.time_lb)} exceeds the best step {_fmt_s(best.step_time_s)}"
            return True
        degrees = _degrees(cand.config)
        if _cached(self.planner, cand.config):
            return False
        if self.planner.plannings - self.refused / 2 >= self.limit:
            cand.reason = f"{_LIMIT} ({self.max_plans} plannings); quick estimate {_fmt_s(cand.quick_s)}"
            return True
        # one planning per set of degrees, and one more after a refusal over budget: a higher
        # ZeRO stage that the solver is asked differently (or the other sequence algorithm)
        tried = self.tried
        if degrees in tried and not (
            tried[degrees][1]
            and _stage_rank(cand.config.zero) > _stage_rank(tried[degrees][2])
            and planner_zero(cand.config.zero) != planner_zero(tried[degrees][2])
        ):
            cand.reason = f"these degrees were planned with {tried[degrees][0]}; quick estimate {_fmt_s(cand.quick_s)}"
            return True
        return False

    def plan(self, cand: Candidate) -> ShardingPlan | None:
        """``cand``'s plan; None when it is refused (over budget: the slack learns from it; or an
        algorithm that cannot run there)."""
        degrees = _degrees(cand.config)
        retry = degrees in self.tried
        self.tried[degrees] = (
            f"{cand.config.microbatches} microbatches, recompute {cand.config.recompute}, ZeRO {cand.config.zero}",
            False,
            cand.config.zero,
        )
        try:
            return self.planner.plan(cand.config)
        except InfeasibleBudgetError as exc:
            self.refused += 1
            cand.status = "over budget"
            cand.reason = str(exc).split(". ")[0]
            if self.least_seen is None or cand.memory_lb < self.least_seen[0]:
                self.least_seen = (cand.memory_lb, cand.reason)
            needed = re.search(r"\((\d+) bytes\)", str(exc))
            state = self.bounds.state_per_device(cand.config)
            self.tried[degrees] = (self.tried[degrees][0], not retry, cand.config.zero)
            if needed and cand.memory_lb > state:
                self.slack = max(self.slack, (float(needed.group(1)) - state) / (cand.memory_lb - state))
                self.queue.sort(key=self.order)
            return None
        except ValueError as exc:  # a forced ring / Ulysses that cannot run here (heads, masks)
            if cand.config.sequence == 1:
                raise
            self.tried[degrees] = (self.tried[degrees][0], True, -1)  # the other algorithm may
            cand.status, cand.reason = "cannot run", str(exc).split(". ")[0]
            return None

    def take(self, cand: Candidate, made: ShardingPlan) -> None:
        """Record ``cand``'s plan (under the configuration it ran as) and keep the fastest."""
        est = made.estimate()
        if made.config is not None and made.config.zero != cand.config.zero:
            cand.reason = f"asked ZeRO-{cand.config.zero}; "
            if _stage_rank(made.config.zero) > _stage_rank(cand.config.zero):
                # the solver had to store weights sharded to fit: the asked stage did not, so its
                # bound was optimistic at least by budget / bound (a refusal, softly)
                state = self.bounds.state_per_device(cand.config)
                if cand.memory_lb > state:
                    self.slack = max(self.slack, 1.001 * (self.budget - state) / (cand.memory_lb - state))
                    self.queue.sort(key=self.order)
            cand.config = made.config
        if any(o.plan is not None and o.config == made.config for o in self.cands):
            cand.reason += "the plan of an earlier candidate (the same stage plans)"
            return
        cand.status, cand.plan = "planned", made
        cand.step_time_s, cand.memory_bytes = est.step_time_s, est.memory_bytes
        logger.info(
            "search: %s -> step %s, %s per device",
            cand.config.describe(),
            _fmt_s(est.step_time_s),
            _fmt_gib(est.memory_bytes),
        )
        if self.best is None or est.step_time_s < self.best.step_time_s:
            self.best = cand


def _degrees(c) -> tuple:
    return (c.pipeline, c.data, c.sequence, c.tensor, c.expert)


def _chosen(best: Candidate, cands: list, devices: int, batch: int, t0: float, plannings: int) -> ShardingPlan:
    """The chosen candidate's plan, with its configuration and the search's table (every
    candidate, why it lost) in its data."""
    _explain_runner_ups(cands, best)
    for cand in cands:
        if cand.status == "planned" and cand is not best:
            slower = 100 * (cand.step_time_s / best.step_time_s - 1)
            cand.reason += f"slower by {slower:.1f}%"
    best.status, best.reason = "chosen", ""
    plan = best.plan
    assert plan is not None
    t2 = time.perf_counter()
    plan.data["config"] = best.config.to_dict()
    plan.data["search"] = _search_table(cands, best, devices, batch, t2 - t0, plannings)
    plan.data.setdefault("stats", {})["search_s"] = t2 - t0
    table = plan.data["search"]
    logger.info(
        "search: chose %s in %.2f s: %d configurations priced, %d set aside by their bounds, %d plannings",
        describe_config(plan),
        t2 - t0,
        table["priced"],
        table["bounded"],
        table["plannings"],
    )
    return plan


_LIMIT = "search limit"
_RUNNER_UPS = 2
"""Plannings past ``max_plans`` for candidates the limit left out that may beat the chosen plan."""


def _planned_over_quick(cands: list) -> float:
    """The median ratio of a planned candidate's estimated step to its quick estimate in this
    search (1.0 before any): how far the quick estimates ran from the real plans here."""
    ratios = [c.step_time_s / c.quick_s for c in cands if c.plan is not None and c.quick_s > 0]
    return statistics.median(ratios) if ratios else 1.0


def _runner_up(cands: list, best, allowed: bool):
    """The candidate the search limit left out whose quick estimate, scaled by
    :func:`_planned_over_quick`, beats the best step found by most (planned next, past the
    limit); None when none does, or when ``allowed`` is false (no runner-ups left to plan)."""
    if best is None or not allowed:
        return None
    ratio = _planned_over_quick(cands)
    left = [c for c in cands if c.status == "not planned" and c.reason.startswith(_LIMIT)]
    left = [c for c in left if c.quick_s * ratio < best.step_time_s]
    if not left:
        return None
    pick = min(left, key=lambda c: c.quick_s)
    pick.reason = ""
    logger.info(
        "search: %s: quick estimate %s x %.2f (the median planned / quick ratio here) beats the best step %s: "
        "planned past the limit",
        pick.config.describe(),
        _fmt_s(pick.quick_s),
        ratio,
        _fmt_s(best.step_time_s),
    )
    return pick


def _explain_runner_ups(cands: list, best) -> None:
    """Say, for each candidate left out by the search limit whose quick estimate is below the
    chosen step, why it was not planned: the quick estimate scaled by the median ratio of a
    planned step to its quick estimate in this search, against the step."""
    ratio = _planned_over_quick(cands)
    for c in cands:
        if c.status != "not planned" or not c.reason.startswith(_LIMIT) or c.quick_s >= best.step_time_s:
            continue
        expected = c.quick_s * ratio
        verdict = (
            f"not below the chosen step {_fmt_s(best.step_time_s)}"
            if expected >= best.step_time_s
            else f"below the chosen step {_fmt_s(best.step_time_s)}, but the {_RUNNER_UPS} plannings past the limit "
            "went to lower ones"
        )
        c.reason += (
            f", below the chosen step; planned candidates here took {ratio:.2f}x their quick estimates (median), "
            f"so expected {_fmt_s(expected)}: {verdict}"
        )


def _rule_of_thumb(cands: list, devices_per_node: int, bounds: _Bounds, budget: float) -> Candidate | None:
    """The usual recipe (Megatron's): tensor parallel across the node, the fewest pipeline stages
    whose memory bound fits, one sample per microbatch per data-parallel rank, 1F1B, and
    recomputation in a pipeline; None when no candidate is of that form."""
    fits = [
        c
        for c in cands
        if c.memory_lb <= budget
        and c.config.tensor == max(x.config.tensor for x in cands)
        and c.config.tensor <= devices_per_node
        and (
            c.config.pipeline == 1
            or (
                c.config.schedule == "1f1b"
                and c.config.recompute == "all"
                and c.config.microbatch_size == c.config.data
            )
        )
    ]
    return min(fits, key=lambda c: (c.config.pipeline, c.quick_s), default=None)


def stage_set_key(c: ParallelConfig, shared: bool = True) -> tuple:
    """What a pipelined configuration's stage plans depend on: configurations with the same key
    share one set of stage plans (with ``shared``, the search's way, 1F1B and ZB-H1 among them,
    planned for the activations either keeps alive; interleaved cuts its own)."""
    family = "auto" if shared and c.schedule != "interleaved" else c.schedule
    return (
        c.microbatch_size,
        c.pipeline,
        c.data,
        c.sequence,
        c.tensor,
        c.expert,
        c.virtual_stages,
        c.recompute,
        family,
        planner_zero(c.zero),
    )


def _cached(planner: _Planner, c: ParallelConfig) -> bool:
    return c.pipeline > 1 and stage_set_key(c) in planner._stage_sets


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _search_table(cands, best, devices, batch, seconds, plannings) -> dict:
    """What ``plan.explain()`` shows: every planned candidate, the best few unplanned, and the
    counts of the rest by status."""
    planned = sorted((c for c in cands if c.status in ("chosen", "planned")), key=lambda c: c.step_time_s)
    refused = [c for c in cands if c.status == "over budget" and c.reason and not c.reason.startswith("needs at least")]
    others = sorted((c for c in cands if c.status in ("not planned", "pruned")), key=lambda c: c.quick_s)[:8]
    bound_over = [c for c in cands if c.status == "over budget" and c.reason.startswith("needs at least")]
    counts: dict = {}
    for c in cands:
        counts[c.status] = counts.get(c.status, 0) + 1
    return {
        "devices": devices,
        "global_batch": batch,
        "seconds": seconds,
        "plannings": plannings,
        "priced": len(cands),
        "bounded": sum(1 for c in cands if c.status == "pruned" or c.reason.startswith("needs at least")),
        "counts": counts,
        "rows": [c.row() for c in planned + refused + others]
        + [c.row() for c in sorted(bound_over, key=lambda c: c.memory_lb)[:3]],
    }
