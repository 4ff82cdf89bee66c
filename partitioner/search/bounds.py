"""Steps 3 and 4 of :mod:`partitioner.search`: a candidate's lower bounds (memory per device:
parameter state by ZeRO stage plus the activations its schedule keeps alive; time: training FLOPs
at the preset's achievable rate over ``1 - bubble``) and its quick closed-form step estimate
(the time bound plus tensor, data, sequence, expert and stage-to-stage traffic on the links the
mesh axes cross), which orders the candidates and is never reported as a plan's estimate."""

from __future__ import annotations

import logging
import math

import passes.schedules as ps
from partitioner import expert_degrees
from partitioner.cluster import parse_bytes
from partitioner.core_sharing import core_share
from partitioner.parallel_config import ParallelConfig
from partitioner.precision import Precision
from partitioner.search.facts import ModelFacts
from partitioner.search.zero_modes import stage_rank

logger = logging.getLogger(__name__)


def most_splits(shape: tuple, d: int, t: int) -> int:
    """The most pieces a tensor of ``shape`` can be cut into on a ``(d, t)`` mesh: both axes on
    one dim or two, else the larger axis that divides a dim, else 1 (replicated)."""
    dims = [n for n in shape if n > 0]
    both = any(n % (d * t) == 0 for n in dims) or any(
        a % d == 0 and b % t == 0 for i, a in enumerate(dims) for j, b in enumerate(dims) if i != j
    )
    if both:
        return d * t
    return max([k for k in (d, t) if any(n % k == 0 for n in dims)], default=1)


def state_bytes_per_param(optimizer) -> int:
    return 4 + (4 if optimizer is not None else 0) + (8 if optimizer == "adam" else 0)


class Bounds:
    """Steps 3 and 4 of :mod:`partitioner.search` for one model, cluster and batch."""

    def __init__(self, facts: ModelFacts, spec, precision: Precision, optimizer, global_batch: int, host_budget=None):
        self.f, self.spec, self.batch = facts, spec, global_batch
        # offloaded optimizer state leaves the device: the bound counts what the host cannot take
        self.host = parse_bytes(host_budget) if host_budget is not None else 0
        name = str(precision.compute).replace("torch.", "")
        self.peak = spec.flops_for(name) * spec.matmul_efficiency
        self.state = facts.params * state_bytes_per_param(optimizer)
        self.bytes_per_param = state_bytes_per_param(optimizer)
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
                total += expert_degrees.expert_state(experts, c, stage_rank(stage), whole, self.bytes_per_param)
                gathered -= experts.layer_params * (1 - 1 / c.expert)
            for shape, count in self.f.param_shapes.items():
                count -= experts.shapes.get(shape, 0)
                n = count * math.prod(shape)
                tp_only = n / most_splits(shape, 1, c.tensor)
                if stage == 0:
                    total += tp_only * whole
                else:
                    total += tp_only * whole + n / most_splits(shape, data, c.tensor) * self.bytes_per_param
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
        share = core_share(self.spec, c.devices)  # ranks outnumbering a CPU host's cores share them
        compute = self.f.fwd_flops_per_sample * self.batch * passes / (c.devices * share * self.peak)
        return compute if share < 1.0 else compute / (1.0 - self._bubble(c))  # shared: no core idles

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
            local = f.boundary_per_sample * mb / (data * c.tensor)  # ring beside tp: its heads only
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
            per_micro += 2 * (f.boundary_per_sample * mb / (data * c.tensor) / link.bandwidth + link.latency_s)
        compute = self.time(c) * (1.0 - self._bubble(c)) / c.microbatches
        return (compute + per_micro) * c.microbatches / (1.0 - self._bubble(c)) + once
