"""The configuration search's entry points: :func:`search_config` (the best configuration for
``N`` devices, the steps of :mod:`partitioner.search`) and :func:`plan_config` (the real plan of
one given configuration, as the search plans its candidates), with the options each honours or
refuses by name."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from partitioner import expert_degrees
from partitioner.cluster import parse_bytes
from partitioner.local_cluster import get_cluster
from partitioner.options import PlanOptions
from partitioner.parallel_config import ParallelConfig
from partitioner.search.bounds import Bounds, state_bytes_per_param
from partitioner.search.candidate import Candidate, fmt_gib
from partitioner.search.enumerate import enumerate_configs
from partitioner.search.facts import ModelFacts, at_batch, batch_of, check_devices, seq_of
from partitioner.search.loop import PlanningLoop
from partitioner.search.planner import Planner
from partitioner.search.table import chosen_plan
from partitioner.sharding_plan import ShardingPlan
from passes.plan.plan_intra_op import InfeasibleBudgetError

logger = logging.getLogger(__name__)


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
    opts = search_options(PlanOptions.build(options, **option_kwargs))
    precision = opts.precision_policy
    spec = get_cluster(opts.cluster_for())
    budget = parse_bytes(opts.memory_budget) if opts.memory_budget is not None else spec.memory_bytes
    batch = batch_of(example_inputs)
    if not config.global_batch:
        config = replace(config, global_batch=batch)
    planner = Planner(
        model,
        example_inputs,
        batch if config.global_batch == batch else config.global_batch,
        spec=spec,
        budget=budget,
        precision=precision,
        options=opts,
    )
    planner.inputs = at_batch(example_inputs, batch, config.global_batch)
    planner.batch = config.global_batch
    planner.share_schedules = False  # its stages hold what its own schedule keeps alive
    planner.facts = ModelFacts.of(model, planner.capture(config.global_batch), config.global_batch)
    return planner.plan(config)


SEARCH_MODE = "in the configuration search (devices=N, or auto_parallelize without a mesh)"


def search_options(opts: PlanOptions) -> PlanOptions:
    """The options the search can honour (the rest are refused, naming what to do instead)."""
    opts.refuse(
        SEARCH_MODE,
        {
            "pins": "pins name mesh axes; give mesh= with pins",
            "objective": "the search ranks configurations by estimated step time; give mesh= to minimise memory",
        },
    )
    if opts.tensor_parallel not in ("auto", "1d"):
        raise ValueError(
            f"tensor_parallel={opts.tensor_parallel!r} is not available {SEARCH_MODE}: its grid needs a mesh of "
            f"its own shape; give mesh= (see partitioner.plan)"
        )
    return opts


def honoured(configs: list, opts: PlanOptions) -> list:
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
    """The best configuration for ``devices`` devices and its plan (the steps of
    :mod:`partitioner.search`). ``options``: the :class:`PlanOptions` (keywords of the same names override them):
    every option is honoured (forced algorithms and ZeRO stages narrow the candidates) or
    refused with a ``ValueError``. ``pipelines=False`` leaves pipelines out;
    ``pipeline_recompute=False`` leaves out pipelined candidates that recompute (what
    ``auto_parallelize`` can run today)."""
    t0 = time.perf_counter()
    devices = check_devices(devices)
    opts = search_options(PlanOptions.build(options, **option_kwargs))
    precision = opts.precision_policy
    spec = get_cluster(opts.cluster_for())
    budget = parse_bytes(opts.memory_budget) if opts.memory_budget is not None else spec.memory_bytes
    example_batch = batch_of(example_inputs)
    batch = example_batch if global_batch is None else global_batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
    inputs = at_batch(example_inputs, example_batch, batch)
    planner = Planner(model, inputs, batch, spec=spec, budget=budget, precision=precision, options=opts)
    facts = planner.facts = ModelFacts.of(model, planner.capture(batch), batch)
    bounds = Bounds(facts, spec, precision, opts.optimizer, batch, host_budget=opts.host_memory_budget)
    planner.time_bound = bounds.time
    configs = searched_configs(devices, batch, inputs, facts, spec, bounds, budget, opts, pipelines, pipeline_recompute)
    cands = [Candidate(c, bounds.memory(c), bounds.time(c), bounds.quick(c)) for c in configs]
    for cand in cands:
        if cand.memory_lb > budget:
            cand.status = "over budget"
            cand.reason = f"needs at least {fmt_gib(cand.memory_lb)} per device (bound), budget {fmt_gib(budget)}"
    alive = [c for c in cands if c.status != "over budget"]
    logger.info(
        "search: %d configurations for %d devices, %d within the memory bound (%.2f s)",
        len(cands),
        devices,
        len(alive),
        time.perf_counter() - t0,
    )
    loop = PlanningLoop(planner, bounds, budget, cands, max_plans)
    best = loop.run(alive, spec.devices_per_node)
    if best is None:
        least = min(cands, key=lambda c: c.memory_lb)
        optimizer = opts.optimizer
        need = math.ceil(facts.params * state_bytes_per_param(optimizer) / budget) if budget > 0 else 0
        raise InfeasibleBudgetError(
            f"no configuration of {devices} devices fits the budget of {fmt_gib(budget)} per device: the least "
            f"memory any needs is at least {fmt_gib(least.memory_lb)} ({least.config.describe()})"
            + (f"; planned: {loop.least_seen[1]}" if loop.least_seen else "")
            + f". The parameter state alone ({facts.params:,} parameters, optimizer {optimizer!r}) needs at least "
            f"{need} devices of this budget at batch {batch} in {precision}; raise the budget or the device count"
        )
    return chosen_plan(best, cands, devices, batch, t0, planner.plannings)


def searched_configs(devices, batch, inputs, facts, spec, bounds, budget, opts, pipelines, pipeline_recompute):
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
        seq_len=seq_of(inputs, batch),
    )
    if not pipeline_recompute:
        configs = [c for c in configs if c.pipeline == 1 or c.recompute == "none"]
    enumerated = len(configs)
    configs = expert_degrees.with_expert_degrees(configs, facts.experts, opts.expert_parallel)
    if enumerated and not configs:
        raise ValueError(
            f"expert_parallel='on' cannot be honoured {SEARCH_MODE}: no configuration of {devices} devices "
            f"without a pipeline or sequence axis has a data degree with a divisor above 1 that divides the "
            f"{facts.experts.experts} experts of its MoE layers; use 'auto', or give mesh= with an axis dividing them"
        )
    configs = honoured(configs, opts)
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
