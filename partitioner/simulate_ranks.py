"""Simulate a plan on every rank of its mesh, in one process, before anything runs.

Each rank's program is lowered for its coordinates (``MeshComm.for_codegen``: no process group,
any mesh size; a pipelined plan lowers the stage program of each stage the rank owns) and read
back as the list of communication events the rank performs, in order:

* a stage or model program's collectives: its ``Reshard`` modules' forward moves in program
  order, and their backward moves in reverse order (autograd's), each with its kind, mesh axis,
  the value's global shape and the node it belongs to;
* with a pipeline, the rank's schedule (:mod:`passes.schedules`) drives the order: a
  forward action runs the stage's forward collectives, a backward action its backward ones (a
  zero-bubble ``I`` those of activations, ``W`` those of parameters), and ``SEND``/``RECV``
  become point-to-point events with the peer stage's rank at the same data/tensor coordinates.

The check executes all ranks symbolically (as :func:`passes.schedules.check_schedule`
does for one schedule): a send is buffered, a receive completes once its send is issued, and a
collective completes when every rank of its process group (the ranks that differ only in that
axis's coordinate) has reached one; they must all have reached the same one (kind, axis, shape),
else the mismatch is reported with both ranks, their event index and node. Readiness is
monotone, so advancing every rank as far as it can until nothing moves reaches the same fixed
point in any order; a rank left unfinished there is deadlocked, reported with what it waits for.
The report gives per-rank events and the ranks' estimated memory (the plan's, per stage).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

from passes.core.placements import is_partial, is_shard

__all__ = ["RankEvent", "SimulationReport", "rank_events", "simulate_ranks", "check_events", "plan_graphs"]


@dataclass(frozen=True)
class RankEvent:
    kind: str
    """``all_reduce`` / ``all_gather`` / ``reduce_scatter`` / ``all_to_all`` (a collective), or
    ``send`` / ``recv``."""
    axis: int
    """Full-mesh axis of a collective; -1 for a send or receive."""
    shape: tuple
    """The value's global shape (a collective), or ``(stage, microbatch, direction)`` (p2p)."""
    node: str
    """The Reshard module (collective) or schedule action (p2p) it comes from."""
    peer: int = -1
    """The other rank of a send or receive."""

    def signature(self) -> tuple:
        return (self.kind, self.axis, self.shape)


@dataclass
class SimulationReport:
    ranks: int
    events: int
    collectives: int
    point_to_point: int
    lower_s: float
    check_s: float
    problems: list = field(default_factory=list)
    memory_bytes: dict = field(default_factory=dict)
    """stage -> estimated peak bytes per device of that stage's ranks."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = (
            f"{self.ranks} ranks, {self.events} events ({self.collectives} collective, {self.point_to_point} "
            f"point-to-point); lowered in {self.lower_s:.1f} s, checked in {self.check_s:.1f} s: "
        )
        return head + ("every collective matched, no deadlock" if self.ok else "\n".join(self.problems[:10]))


_KIND = {("S", "R"): "all_gather", ("P", "R"): "all_reduce", ("P", "S"): "reduce_scatter", ("S", "S"): "all_to_all"}


def _moves(steps, shape) -> list:
    """(kind, stage-mesh axis) of the moves that send data."""
    out = []
    for axis, src, dst in steps or ():
        if shape[axis] <= 1 or not (is_shard(src) or is_partial(src)):
            continue
        a = "S" if is_shard(src) else "P"
        b = "S" if is_shard(dst) else ("P" if is_partial(dst) else "R")
        if b == "P":
            continue
        out.append((_KIND[(a, b)], axis))
    return out


def _program_collectives(program, shapes: dict, stage_shape, axis_map) -> tuple:
    """(forward events, backward activation events, backward parameter events) of one lowered
    program, the backward ones already in autograd's (reverse) order."""
    from runtime.prefetch import PrefetchGather
    from runtime.reshard import Reshard

    fwd, bwd_act, bwd_param = [], [], []
    started = set()  # edges whose first gather a PrefetchGather issued earlier
    for node in program.graph.nodes:
        if node.op != "call_module":
            continue
        module = program.get_submodule(node.target)
        source = node.args[0] if node.args else None
        shape = shapes.get(getattr(source, "name", ""), ())
        if isinstance(module, PrefetchGather):  # the edge's first move, an all-gather, starts here
            kind, axis = _moves(module.edge.forward_steps, stage_shape)[0]
            fwd.append(RankEvent(kind, axis_map[axis], shape, node.target))
            started.add(id(module.edge))
            continue
        if not isinstance(module, Reshard):
            continue
        moves = _moves(module.forward_steps, stage_shape)
        for kind, axis in moves[1:] if id(module) in started else moves:
            fwd.append(RankEvent(kind, axis_map[axis], shape, node.target))
        back = [
            RankEvent(k, axis_map[a], shape, node.target + ".grad")
            for k, a in _moves(module.backward_steps, stage_shape)
        ]
        (bwd_param if module.param_edge is not None else bwd_act).append(back)
    flat = lambda groups: [e for group in reversed(groups) for e in group]  # noqa: E731
    return fwd, flat(bwd_act), flat(bwd_param)


def _shapes(graph) -> dict:
    from passes.analysis.analyze import info

    return {n.name: tuple(info(n).shape or ()) for n in graph.nodes if "partita.info" in n.meta}


def rank_events(plan, graphs, *, lower=None, every_rank: bool = True) -> tuple:
    """Every rank's events: (list of event lists by global rank, full mesh shape, lowering seconds).

    ``graphs``: the analysed capture each stage class of ``plan`` was made for (the model's for
    a plan without a pipeline; :func:`plan_graphs` makes them). ``every_rank=False`` lowers one
    rank per stage and gives every rank of the stage its events: a rank's coordinates change
    its slices and offsets, not its Reshard modules, which the plan's placements alone decide
    (``tests/test_config_search.py`` checks both ways agree). ``lower(stage, rank)`` returns
    the lowered GraphModule in place of :func:`passes.lower.lower_to_local.lower_to_local` (to break
    one rank on purpose in tests)."""
    import passes.schedules as ps
    from passes.lower.lower_to_local import lower_to_local
    from runtime.collectives import MeshComm

    pipe = plan.data.get("pipeline")
    stage_plans = plan.stage_plans if pipe else [plan]
    stage_map = pipe["stage_map"] if pipe else [0]
    class_plans = _classes(plan) if pipe else [plan]
    stage_shape = stage_plans[0].mesh_shape
    full = tuple(plan.mesh_shape) if pipe else tuple(plan.mesh_shape)
    pp = pipe["degree"] if pipe else 1
    sub = math.prod(stage_shape)
    axis_map = {a: (a + 1 if pipe else a) for a in range(len(stage_shape))}
    if pipe and math.prod(full) != pp * sub:
        raise ValueError(f"the plan's mesh {full} is not {pp} stages of {stage_shape}")
    shapes = [_shapes(g.graph) for g in graphs]
    lowered: dict = {}
    t0 = time.perf_counter()

    def default_lower(stage, sub_rank):
        k = stage_map[stage]
        comm = MeshComm.for_codegen(stage_shape, class_plans[k].axis_names, sub_rank)
        return lower_to_local(graphs[k].graph, class_plans[k].node_by_name, comm)

    lower_fn = lower or default_lower

    def program(stage, sub_rank):
        key = (stage, sub_rank if every_rank or lower is not None else 0)
        if key not in lowered:
            made = lower_fn(stage, key[1])
            lowered[key] = _program_collectives(made, shapes[stage_map[stage]], stage_shape, axis_map)
        return lowered[key]

    per_rank = []
    if not pipe:
        for rank in range(sub):
            f, a, w = program(0, rank)
            per_rank.append(f + a + w)
        return per_rank, full, time.perf_counter() - t0
    sched = ps.add_communication(ps.SCHEDULES[pipe["schedule"]].make(pp, pipe["microbatches"], pipe["virtual_stages"]))
    for rank in range(pp * sub):
        pp_coord, sub_rank = divmod(rank, sub)
        programs = {}
        for s in range(len(stage_map)):
            if sched.stage_to_rank[s] == pp_coord:
                programs[s] = program(s, sub_rank)
        events = []
        for action in sched.actions[pp_coord]:
            kind = action.kind.value
            if action.is_send or action.is_recv:
                peer = sched.stage_to_rank[action.peer] * sub + sub_rank
                direction = "F" if kind.endswith("_F") else "B"
                what = (min(action.stage, action.peer), action.microbatch, direction)
                events.append(RankEvent("send" if action.is_send else "recv", -1, what, str(action), peer))
            elif kind == "F":
                events += programs[action.stage][0]
            elif kind == "B":
                events += programs[action.stage][1] + programs[action.stage][2]
            elif kind == "I":
                events += programs[action.stage][1]
            elif kind == "W":
                events += programs[action.stage][2]
        per_rank.append(events)
    return per_rank, full, time.perf_counter() - t0


def _classes(plan) -> list:
    from partitioner.sharding_plan import ShardingPlan

    return [ShardingPlan(d) for d in plan.data["pipeline"]["stage_plans"]]


def _coords(rank: int, shape: tuple) -> list:
    out = []
    for n in reversed(shape):
        out.append(rank % n)
        rank //= n
    return out[::-1]


def check_events(per_rank: list, shape: tuple) -> list:
    """Problems found by executing every rank's events symbolically (see the module docstring)."""
    n = len(per_rank)
    coords = [_coords(r, shape) for r in range(n)]
    pos = [0] * n
    sent: set = set()  # (src, dst, what)
    waiting: dict = defaultdict(dict)  # group -> {rank: event} arrived at a collective
    problems: list = []

    def group_of(rank, axis):
        c = list(coords[rank])
        c[axis] = None
        return (axis, tuple(c))

    def members(rank, axis):
        c = list(coords[rank])
        stride = math.prod(shape[axis + 1 :])
        base = rank - c[axis] * stride
        return [base + k * stride for k in range(shape[axis])]

    work = list(range(n))
    while work:
        rank = work.pop()
        while pos[rank] < len(per_rank[rank]):
            e = per_rank[rank][pos[rank]]
            if e.kind == "send":
                sent.add((rank, e.peer, e.shape))
                pos[rank] += 1
                if pos[e.peer] < len(per_rank[e.peer]):
                    work.append(e.peer)
                continue
            if e.kind == "recv":
                if (e.peer, rank, e.shape) in sent:
                    pos[rank] += 1
                    continue
                break
            group = group_of(rank, e.axis)
            arrived = waiting[group]
            if rank in arrived:
                break
            arrived[rank] = (pos[rank], e)
            if len(arrived) < shape[e.axis]:
                break
            first_rank, (first_pos, first) = min(arrived.items())
            for other, (other_pos, ev) in sorted(arrived.items()):
                if ev.signature() != first.signature():
                    problems.append(
                        f"collective mismatch on axis {e.axis} among ranks {members(rank, e.axis)}: rank "
                        f"{first_rank} (coordinates {coords[first_rank]}) event {first_pos} is {first.kind} of "
                        f"{first.shape} at node {first.node}, rank {other} (coordinates {coords[other]}) event "
                        f"{other_pos} is {ev.kind} of {ev.shape} at node {ev.node}"
                    )
                    return problems
            for other in arrived:
                pos[other] += 1
                if other != rank:
                    work.append(other)
            waiting[group] = {}
    stuck = [r for r in range(n) if pos[r] < len(per_rank[r])]
    if not stuck:
        return problems

    def at(r):
        e = per_rank[r][pos[r]]
        what = f"a receive from rank {e.peer}" if e.kind == "recv" else f"{e.kind} on axis {e.axis} at node {e.node}"
        return f"rank {r} (coordinates {coords[r]}) event {pos[r]}: {what}"

    # a collective some ranks of its group reached and others did not: name the missing ranks
    for group, arrived in waiting.items():
        if not arrived:
            continue
        r0 = min(arrived)
        missing = [r for r in members(r0, group[0]) if r not in arrived]
        problems.append(
            f"deadlock: {len(arrived)} ranks wait in a collective on axis {group[0]} ({at(r0)}) that rank(s) "
            f"{missing[:4]} never reach: " + "; ".join(at(r) for r in missing[:4])
        )
        if len(problems) >= 4:
            break
    if not problems:
        problems += [f"deadlock: {at(r)}" for r in stuck[:8]]
    problems.append(f"{len(stuck)} of {n} ranks cannot finish")
    return problems


def plan_graphs(plan, model, example_inputs) -> list:
    """The analysed graphs ``plan`` was made for: the model captured at the plan's batch, or for
    a pipelined plan from the configuration search its stage classes (the model cut to their
    layers, captured at the microbatch, split)."""
    from partitioner.local_cluster import get_cluster
    from partitioner.options import PlanOptions
    from partitioner.search.facts import ModelFacts, batch_of
    from partitioner.search.planner import Planner

    batch = batch_of(example_inputs)
    planner = Planner(
        model,
        example_inputs,
        batch,
        spec=get_cluster(plan.data["cluster"]),
        budget=plan.data.get("budget") or 0,
        precision=plan.precision,
        options=PlanOptions(optimizer=plan.data.get("optimizer")),
    )
    pipe = plan.data.get("pipeline")
    if not pipe:
        return [planner.capture(batch)]
    planner.facts = ModelFacts.of(model, planner.capture(batch), batch)
    counts = [0] * len(pipe["stage_plans"])
    for s, k in enumerate(pipe["stage_map"]):
        counts[k] = len(pipe["layers"][s])
    config = plan.config
    _, graphs = planner.class_split(config.microbatch_size, tuple(counts))
    return [g.captured for g in graphs]


def simulate_ranks(plan, graphs, *, lower=None, every_rank: bool = True) -> SimulationReport:
    """Lower every rank of ``plan`` and check its collectives and schedule (module docstring;
    ``every_rank``: see :func:`rank_events`)."""
    per_rank, shape, lower_s = rank_events(plan, graphs, lower=lower, every_rank=every_rank)
    t0 = time.perf_counter()
    problems = check_events(per_rank, shape)
    check_s = time.perf_counter() - t0
    total = sum(len(e) for e in per_rank)
    p2p = sum(1 for events in per_rank for e in events if e.kind in ("send", "recv"))
    pipe = plan.data.get("pipeline")
    stages = plan.stage_plans if pipe else [plan]
    memory = {s: p.estimate().memory_bytes for s, p in enumerate(stages)}
    return SimulationReport(len(per_rank), total, total - p2p, p2p, lower_s, check_s, problems, memory)
