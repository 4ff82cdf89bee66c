"""Step 5 of :mod:`partitioner.search`: the real plan of one candidate configuration. A
configuration without a pipeline is the intra-op ILP (:func:`partitioner.intra_op.plan_captured`)
on its ``(d, s, t)`` mesh (:mod:`partitioner.search.whole_model`); a pipelined one is planned stage class by stage class
(:mod:`partitioner.search.pipeline_candidate`). Captures (by batch size), model cuts, stage
splits, schedules and fingerprints are cached, so a search captures each microbatch size once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

import passes.schedules as ps
from partitioner import expert_degrees
from partitioner.options import PlanOptions
from partitioner.parallel_config import ParallelConfig
from partitioner.search.facts import ModelFacts, at_batch
from partitioner.search.pipeline_candidate import plan_pipeline
from partitioner.search.whole_model import plan_whole_model
from partitioner.search.zero_modes import zero_stage_of
from partitioner.sharding_plan import ShardingPlan
from passes.analysis.analyze import analyze
from passes.analysis.expert_routing import measure_routing
from passes.capture.capture import describe_captured, graph_fingerprint
from passes.capture.capture_blocks import capture_model
from passes.plan.split_stages import stages_of_layers

logger = logging.getLogger(__name__)


SEARCH_MAX_OPTIONS = 12
"""The cap on an op's options in the search's plannings on meshes of two or more axes (the
lowest-compute ones kept: :func:`passes.plan.strategy_space.build_space`). The ILP's size grows
with the square of the options on an edge: on the 405B's (32, 8) stage mesh, 12 solve its stage
classes 4x faster than no cap (8.4 against 33 CPU-s) for a step 0.04% slower."""


class Planner:
    """Step 5: real plans for configurations, with captures and stage splits cached."""

    def __init__(self, model, example_inputs, batch, *, spec, budget, precision, options: PlanOptions):
        self.model, self.inputs, self.batch = model, example_inputs, batch
        self.spec, self.budget, self.precision = spec, budget, precision
        self.options = options.replace(cluster=spec, precision=precision)
        self.optimizer, self.layers = options.optimizer, options.layers
        self.name = type(model).__name__
        self._caps: dict = {}
        self._splits: dict = {}
        self.stage_sets: dict = {}
        self._schedules: dict = {}
        self._fingerprints: dict = {}  # id of a cached capture -> its fingerprints
        self._lengths: dict = {}  # stages -> layers per stage
        self.share_schedules = True  # 1F1B and ZB-H1 share stage plans (the search); False: exact
        self.plannings = 0
        self.facts: ModelFacts | None = None
        self.time_bound: Callable[[ParallelConfig], float] | None = None  # the search's Bounds.time, once known

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
                at_batch(self.inputs, self.batch, size),
                layers=self.layers,
                autocast_dtype=self.precision.autocast_dtype,
            )
            analyze(cap)
            measure_routing(self.model, at_batch(self.inputs, self.batch, size), cap)  # MoE layers' loads
            logger.info(
                "search: captured at batch %d in %.2f s (%s)", size, time.perf_counter() - t0, describe_captured(cap)
            )
            self._caps[size] = cap
        return self._caps[size]

    def plan_graph(
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
            max_options=SEARCH_MAX_OPTIONS if sum(n > 1 for n in shape) >= 2 else "auto",
            activation_copies=copies,
            zero1=zero1,
            microbatches=microbatches,
            holds_gradient_sums=holds_gradient_sums,
        )

    def plan(self, c: ParallelConfig) -> ShardingPlan:
        """The real plan for ``c`` (raises InfeasibleBudgetError when nothing fits); its config
        records the ZeRO stage the plan's weights use (:func:`zero_stage_of`)."""
        if c.pipeline == 1:
            made = plan_whole_model(self, c)
        else:
            made = plan_pipeline(self, c)
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
                at_batch(self.inputs, self.batch, size),
                layers=mode,
                autocast_dtype=self.precision.autocast_dtype,
            )
        finally:
            setattr(owner, attr, layers)
        analyze(cap)
        return cap

    def class_split(self, size: int, counts: tuple):
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
