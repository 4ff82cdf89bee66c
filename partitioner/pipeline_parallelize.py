"""``auto_parallelize(..., pipeline={...})``: stages, their intra-op plans, a schedule, a runner.

The first mesh axis is the pipeline axis: ``mesh=(2, 2), pipeline={"degree": 2}`` gives two
stages, each on a sub-mesh of 2 ranks planned for tensor / data / sequence parallelism like any
model. Steps: capture on one microbatch; cut at layer boundaries (:mod:`passes.plan.split_stages`);
rank 0 plans the stages on the sub-mesh in order (a stage's inputs pinned to the placements the
stage before sends them in: each rank sends only its own piece) and broadcasts the plans;
each rank lowers its own stages, slices their parameters, and builds the schedule (checked for
deadlock before anything runs). Left open, the microbatches are the most (up to 4 per stage)
that divide the batch, and the schedule is the one simulated fastest with the stage plans' cost
estimates (``passes.schedules.choose_schedule``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import passes.schedules as ps
from partitioner.captures import captured_stages
from partitioner.core_sharing import stage_plans_cores
from partitioner.intra_op import plan_captured, resolve_pins
from partitioner.options import PlanOptions
from partitioner.pipeline_shapes import StageShapes, receive_buffers
from partitioner.pipeline_simulation import largest_message, stage_plans_messages
from partitioner.sharding_plan import ShardingPlan
from partitioner.stage_boundaries import plan_stages_in_turn, shared_weights
from partitioner.state_names import tied_names
from partitioner.weights import load_local_weights
from passes.analysis.analyze import info
from passes.core.placements import replicated
from passes.lower.lower_to_local import lower_to_local
from passes.rules import tensor_input_nodes
from runtime.collectives import MeshComm, on_rank0
from runtime.pipeline import PipelineRunner, StageProgram
from runtime.reshard import Reshard
from runtime.unstaged_state import UnstagedState

__all__ = ["PipelineConfig", "build_pipeline", "capture_pipeline"]

logger = logging.getLogger(__name__)


@dataclass
class PipelineConfig:
    degree: int = 2
    """Pipeline stages on the first mesh axis (ranks along it)."""
    schedule: str | None = None
    """A name in ``passes.schedules.SCHEDULES`` (``gpipe``, ``1f1b``, ``interleaved``,
    ``zb-h1``); None: chosen by simulation."""
    microbatches: int = 0
    """Microbatches per step; 0: chosen (the most, up to 4 per stage, that divide the batch)."""
    virtual_stages: int = 1
    """Stages per rank for ``interleaved`` (>= 2 there)."""

    @classmethod
    def build(cls, value) -> PipelineConfig:
        if isinstance(value, PipelineConfig):
            cfg = value
        elif isinstance(value, dict):
            unknown = set(value) - {"degree", "schedule", "microbatches", "virtual_stages"}
            if unknown:
                raise ValueError(
                    f"unknown pipeline options {sorted(unknown)}; use degree, schedule, microbatches, virtual_stages"
                )
            cfg = cls(**value)
        else:
            raise TypeError(f"pipeline must be a dict or PipelineConfig, got {type(value).__name__}")
        if cfg.schedule is not None:
            kind = ps.schedule_kind(cfg.schedule)
            cfg.schedule = kind.name
            if kind.virtual and cfg.virtual_stages < 2:
                cfg.virtual_stages = 2
        if cfg.degree < 1:
            raise ValueError(f"pipeline degree must be >= 1, got {cfg.degree}")
        return cfg

    def resolve(self, batch: int) -> PipelineConfig:
        """Fill in the microbatches when not given: the largest of 4p, 2p, p that divides the
        batch (more microbatches, a smaller bubble). The schedule, when not given, is chosen
        once the stages are planned (:func:`passes.schedules.choose_schedule`)."""
        p = self.degree
        m = self.microbatches or next((k for k in (4 * p, 2 * p, p) if batch % k == 0), 0)
        if not m:
            raise ValueError(
                f"the batch ({batch}) does not split into {p} or more equal microbatches for "
                f"{p} pipeline stages; give pipeline={{'microbatches': k}} with k dividing the batch"
            )
        return PipelineConfig(self.degree, self.schedule, m, self.virtual_stages)


def _make_schedule(cfg: PipelineConfig, name: str):
    """The schedule ``name`` (``cfg.schedule`` once chosen) for ``cfg``'s ranks and microbatches."""
    sched = ps.add_communication(ps.SCHEDULES[name].make(cfg.degree, cfg.microbatches, cfg.virtual_stages))
    ps.assert_valid(sched)
    return sched


def _choose(config: PipelineConfig, plans, graphs, carried: dict):
    """The schedule simulated fastest with the stage plans' cost estimates and messages
    (``carried``: the receive buffers, :func:`partitioner.pipeline_simulation.largest_message`)."""
    estimates = [plan.estimate() for plan in plans]
    forward, backward, weight = ps.stage_durations(estimates, [g.takes_activations for g in graphs])
    logger.debug(
        "pipeline: stage seconds per microbatch: forward %s, backward %s, weight %s", forward, backward, weight
    )
    link_s, message_cpu_s = stage_plans_messages(plans, config.degree, largest_message(graphs, carried))
    name, steps = ps.choose_schedule(
        config.degree,
        config.microbatches,
        forward,
        backward,
        weight,
        ps.stage_syncs(estimates),
        cores=stage_plans_cores(plans, config.degree),
        comm_time=link_s,
        transfer_time=message_cpu_s,
    )
    logger.info(
        "pipeline: schedule %s chosen (simulated step with the stage estimates: %s)",
        name,
        ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in sorted(steps.items(), key=lambda kv: kv[1])),
    )
    config = PipelineConfig(config.degree, name, config.microbatches, config.virtual_stages)
    return config, _make_schedule(config, name)


def _batch_of(example_inputs) -> int:
    """The batch size: the first dim of the first input tensor that has one (0 if none)."""
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    return next((x.shape[0] for x in values if isinstance(x, torch.Tensor) and x.dim() > 0), 0)


def _microbatch(example_inputs, m):
    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % m:
                raise ValueError(
                    f"the batch dim ({x.shape[0]}) does not split into {m} microbatches; give "
                    f"pipeline={{'microbatches': k}} with k dividing the batch"
                )
            return x[: x.shape[0] // m]
        return x

    if isinstance(example_inputs, dict):
        return {k: cut(v) for k, v in example_inputs.items()}
    return tuple(cut(v) for v in example_inputs)


def build_pipeline(model, example_inputs, *, device_mesh, config, options: PlanOptions, source, device):
    """The pipeline runner for this rank (``auto_parallelize(..., pipeline=...)``); the steps
    are the functions below, in this order. ``options``: the planning options every stage is
    planned with (``auto_parallelize`` has refused those stages cannot honour; stages keep
    their activations, so they plan with ``recompute="none"``). ``source``: where full weights
    come from (:class:`partitioner.weights.WeightSource`)."""
    full = MeshComm(device_mesh)
    precision = options.precision_policy
    config, schedule = _resolve_config(config, full, example_inputs)
    stages = schedule.num_stages if schedule is not None else config.degree
    cap, graphs, runs = _capture_stages(
        model, example_inputs, config, stages, options.layers, precision, options.sequence_parallel
    )
    sub = _stage_mesh(full, device_mesh)
    tied = shared_weights(cap, graphs)
    user_pins = _stage_pins(cap, graphs, options.pins, sub.ndim)
    if options.recompute == "auto":
        logger.info("pipeline: stages keep their activations (recompute='auto' plans them without recomputation)")
    plans = _plan_stages(
        graphs,
        sub,
        tied,
        user_pins,
        schedule,
        config,
        model_name=type(model).__name__,
        options=options.replace(recompute="none", pins=None, precision=precision),
    )
    carried = receive_buffers(graphs, plans, sub)
    if schedule is None:
        config, schedule = _choose(config, plans, graphs, carried)
    stages = _build_stages(graphs, plans, schedule, full.coords[0], sub, source, cap, tied, device, precision)
    unstaged = _unstaged_state(model, graphs, source, sub if full.coords[0] == 0 else None, device, cap.exported)
    return PipelineRunner(
        stages=stages,
        schedule=schedule,
        stage_graphs=graphs,
        comm_pp=(device_mesh.get_group(0), full.coords[0], full.shape[0]),
        peer_rank=_peer_ranks(schedule, full),
        microbatches=config.microbatches,
        input_names=list(cap.user_inputs),
        in_spec=cap.exported.call_spec.in_spec,
        loss_name=_loss_name(graphs[-1]),
        carried_meta=carried,
        plan={"stages": plans, "schedule": schedule, "layers": runs},
        tied=_tied_groups(tied, graphs, schedule, full),
        unstaged=unstaged,
        specialize=StageShapes(
            model,
            graphs=graphs,
            plans=plans,
            owned=list(stages),
            sub=sub,
            device=device,
            layers=options.layers,
            precision=precision,
            sequence_parallel=options.sequence_parallel,
        ),
    )


# -- the steps ---------------------------------------------------------------------------------


def _resolve_config(config: PipelineConfig, full, example_inputs) -> tuple:
    """Check the degree against the mesh and fill in the microbatches; a given schedule is built
    (and checked) before any work, an open one (None) is chosen after planning the stages."""
    if full.shape[0] != config.degree:
        raise ValueError(
            f"pipeline degree {config.degree} must equal the first mesh axis ({full.shape[0]}); "
            f"mesh {full.shape} = (pipeline, ...)"
        )
    batch = _batch_of(example_inputs)
    resolved = config.resolve(batch)
    schedule = _make_schedule(resolved, resolved.schedule) if resolved.schedule is not None else None
    stages = schedule.num_stages if schedule is not None else resolved.degree
    how = "given" if config.microbatches else f"chosen: the most, up to 4 per stage, that divide the batch of {batch}"
    logger.info(
        "pipeline: %d ranks, %d stages, %d microbatches (%s), schedule %s",
        resolved.degree,
        stages,
        resolved.microbatches,
        how,
        resolved.schedule or "chosen after planning the stages",
    )
    return resolved, schedule


def capture_pipeline(model, example_inputs, pipeline, **options) -> tuple:
    """What ``auto_parallelize(model, example_inputs, pipeline=pipeline, **options)`` captures:
    (capture, stage graphs, layer runs), kept for that call inside
    :func:`partitioner.captures.keep_captures` (a parent captures once for its forked ranks)."""
    opts = PlanOptions.from_call(None, **options)
    config = PipelineConfig.build(pipeline).resolve(_batch_of(example_inputs))
    stages = _make_schedule(config, config.schedule).num_stages if config.schedule is not None else config.degree
    return _capture_stages(
        model, example_inputs, config, stages, opts.layers, opts.precision_policy, opts.sequence_parallel
    )


def _capture_stages(model, example_inputs, config, stages, layers, precision=None, sequence_parallel="auto") -> tuple:
    """:func:`partitioner.captures.captured_stages` on one microbatch of ``example_inputs``."""
    autocast_dtype = precision.autocast_dtype if precision is not None else None
    microbatch = _microbatch(example_inputs, config.microbatches)
    return captured_stages(
        model, microbatch, stages, layers=layers, autocast_dtype=autocast_dtype, sequence_parallel=sequence_parallel
    )


def _stage_mesh(full, device_mesh):
    """The mesh of one stage: every axis after the pipeline axis (a 1-device mesh if none)."""
    sub = MeshComm.__new__(MeshComm)
    sub.shape, sub.axis_names = full.shape[1:] or (1,), full.axis_names[1:] or ("local",)
    sub.groups = [device_mesh.get_group(a) for a in range(1, full.ndim)] or [None]
    sub.coords = list(full.coords[1:]) or [0]
    sub.device_mesh = device_mesh[full.axis_names[1:]] if full.ndim > 1 else None
    return sub


def _stage_pins(cap, graphs, pins, ndim) -> list:
    """The user's pins each stage resolves (one dict per stage), checked on every rank before
    planning. A pin may match only some stages (a layer's weight lives on one); one that matches
    no stage is refused with :func:`partitioner.intra_op.resolve_pins`' error for the whole model (or,
    if the whole model has it but no stage does, an error saying so)."""
    per_stage = [{} for _ in graphs]
    for key, value in (pins or {}).items():
        for g, chosen in zip(graphs, per_stage):
            try:
                resolve_pins(g.captured, {key: value}, ndim)
            except ValueError:
                continue
            chosen[key] = value
            logger.debug("pipeline: pin %r binds in stage %d", key, g.index)
        if not any(key in chosen for chosen in per_stage):
            resolve_pins(cap, {key: value}, ndim)  # raises the error naming what the model has
            raise ValueError(
                f"pin {key!r} matches the model but no pipeline stage's graph: pin the parameter, "
                f"input or module inside a stage instead (a stage boundary value is placed by the "
                f"stage that produces it)"
            )
    return per_stage


def _plan_stages(graphs, sub, tied, user_pins, schedule, config, *, model_name, options: PlanOptions) -> list:
    """Rank 0 plans the stages in order on the stage mesh and broadcasts the plans.

    ``user_pins``: the user's pins per stage (:func:`_stage_pins`). Weights shared by stages are
    replicated (their gradients add up elementwise); a stage's activation inputs are pinned to
    the placement the stage before sends them in (rank (s, c) sends its piece to (s+1, c)); each
    plan holds as many microbatches' activations as the schedule keeps alive (for an open
    schedule: the most any automatic one does)."""
    tied_names = {n for names in tied for n in names}
    copies = (
        ps.stage_in_flight(schedule)
        if schedule is not None
        else ps.auto_stage_in_flight(config.degree, config.microbatches)
    )

    def plan_one(k, g, stage_pins):
        return plan_captured(
            g.captured,
            model_name=f"{model_name} stage {g.index}",
            mesh_shape=sub.shape,
            mesh_axis_names=sub.axis_names,
            options=options.replace(pins=stage_pins),
            activation_copies=copies[g.index],
            microbatches=config.microbatches,
            holds_gradient_sums=True,
        )

    def plan_all():
        order = range(len(graphs))
        plans, _ = plan_stages_in_turn(graphs, order, len(sub.shape), tied_names, plan_one, lambda k, _: user_pins[k])
        return [plans[k].to_json() for k in order]

    return [ShardingPlan.from_dict(json.loads(text)) for text in on_rank0(plan_all, "planning the stages")]


def _build_stages(graphs, plans, schedule, pp_coord, sub, source, cap, tied, device, precision=None) -> dict:
    """Lower this rank's stages and load their weights: stage index -> stage program (parameter
    gradients synced in the precision's reduce dtype)."""
    owned = {}
    for s, g in enumerate(graphs):
        if schedule.stage_to_rank[s] != pp_coord:
            continue
        records = {r["name"]: r for r in plans[s].records}
        program = lower_to_local(g.captured.graph, records, sub, device=device)
        for edge in program.modules():
            if isinstance(edge, Reshard) and edge.param_edge is not None and precision is not None:
                edge.reduce_dtype = precision.grad_reduce_dtype
        weights, specs, strided = load_local_weights(
            g.captured, records, sub, source, device, exported=cap.exported, tied=[sorted(t) for t in tied]
        )
        owned[s] = stage = StageProgram(
            s,
            program,
            g.inputs,
            g.outputs,
            weights.params,
            weights.buffers,
            specs,
            sub,
            plans[s],
            strided,
            activations=g.activation_inputs,
            autocast_dtype=g.captured.autocast_dtype,
            frozen=g.captured.frozen_params(),
        )
        if precision is not None:  # ZeRO-1 weights' reductions too
            stage.optimizer_shards.reduce_dtype = precision.grad_reduce_dtype
    return owned


def _unstaged_state(model, graphs, source, first_stage_mesh, device, exported) -> UnstagedState:
    """The model's ``state_dict()`` names no stage reads (:mod:`runtime.unstaged_state`): a tied
    name whose other name a stage holds is an alias of it; the rest, unread state, is loaded whole
    on the first pipeline rank (``first_stage_mesh``: its stage mesh; None on the other ranks)."""
    names = tuple(model.state_dict(keep_vars=True))
    staged = {fqn for g in graphs for fqn in (*g.captured.params.values(), *g.captured.buffers.values())}
    others = tied_names(model)
    aliases, unread = {}, []
    for name in names:
        if name in staged:
            continue
        held = next((o for o in others.get(name, []) if o in staged), None)
        if held is not None:
            aliases[name] = held
        else:
            unread.append(name)
    if unread:
        logger.info("pipeline: %d tensors no stage reads, held by the first stage: %s", len(unread), unread[:5])
    if first_stage_mesh is None:
        return UnstagedState(names, aliases)
    spec = replicated(first_stage_mesh.ndim)
    tensors = {name: source.piece(name, spec, first_stage_mesh, {}, exported)[0].to(device) for name in unread}
    return UnstagedState(names, aliases, tensors, first_stage_mesh)


def _loss_name(last) -> str:
    """The last stage's scalar output: the loss the schedule backpropagates."""
    out_node = last.captured.graph.find_nodes(op="output")[0]
    name = next((name for name, n in zip(last.outputs, tensor_input_nodes(out_node)) if info(n).shape == ()), None)
    if name is None:
        raise ValueError("pipeline training needs the model to return a scalar loss (its last stage has none)")
    return name


def _sub_size(full) -> int:
    return math.prod(full.shape[1:])


def _peer_ranks(schedule, full) -> dict:
    """Stage -> the global rank of its owner at this rank's stage-mesh coordinates."""
    sub_size = _sub_size(full)
    sub_index = dist.get_rank() - full.coords[0] * sub_size
    return {s: schedule.stage_to_rank[s] * sub_size + sub_index for s in range(schedule.num_stages)}


def _tied_groups(tied, graphs, schedule, full) -> list:
    """(process group over the ranks holding a shared weight, its placeholder names) for each
    shared weight this rank holds that lives on more than one rank."""
    sub_size = _sub_size(full)
    pp_coord = full.coords[0]
    sub_index = dist.get_rank() - pp_coord * sub_size
    groups = []
    for names in tied:
        owners = sorted({schedule.stage_to_rank[s] for s, g in enumerate(graphs) for n in names if n in g.inputs})
        if len(owners) < 2:
            continue
        group = None
        for index in range(sub_size):  # every rank creates every group, in the same order
            made = dist.new_group([o * sub_size + index for o in owners])
            if index == sub_index:
                group = made
        if pp_coord in owners:
            groups.append((group, set(names)))
    return groups
