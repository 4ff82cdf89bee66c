"""How many collective calls a plan's step issues, per phase, kind and mesh axis.

A collective's latency terms (``collective_overhead_s`` and the ring steps' ``latency_s``,
:func:`passes.plan.cost_model.collective_time`) are paid once per call, so the estimate must know the
calls the runtime makes, not only the bytes. A plan's records list every collective once per
edge or op (:attr:`passes.core.plan_records.NodeRecord.comm`); most of them are one call each.
The ones marked ``bucketed`` are sent in flat buffers together with others, as the runtime
groups them:

* **Gradient buckets** (:class:`runtime.grad_sync.GradientBuckets`): the backward reductions of a
  parameter used by exactly one op whose gradient needs only ``Partial -> Replicate`` /
  ``Partial -> Shard`` moves (:func:`passes.lower.lower_to_local._bucketable` decides it from the same
  placements). Such gradients join one bucket per reduction signature (the ``(axis, kind)``
  moves) in the order backward reaches them (here: reverse program order); a bucket is sent when
  it holds :data:`passes.core.bucket_sizes.BUCKET_BYTES` or more, and the rest at the end of backward:
  one call per move of the signature per bucket. With ``bucket_grads=False`` (a pipeline's
  stages, which hold their syncs over the step's microbatches) every edge reduces on its own.
* **Compute copies** (ZeRO-1 and offloaded weights, :class:`runtime.optimizer_shards.OptimizerShards`):
  their gradient reductions (the record's own ``bwd`` entries) are one flat collective per move
  per reduction signature; the all-gathers of the stepped shards into the copies (``fwd``) are
  grouped by gathered axes and cut into buffers of at most
  :data:`passes.core.bucket_sizes.REFRESH_BUCKET_BYTES` (a larger weight alone).
* Every other bucketed entry (a tied weight's edges, a gradient with a local move besides its
  reductions, a ZeRO-3 weight's gradient: launched alone) is reduced on its own edge: one call
  each.
* A ring attention's ``send_recv`` entry (forward k/v, backward k/v and their gradients) is
  ``p - 1`` hops on an axis of ``p`` ranks, each hop a transfer per tensor of the pair
  (:data:`passes.rules.attention.RING_TRANSFERS_PER_HOP`): ``2 (p - 1)`` calls. Every other
  unbucketed entry is one call.

:func:`collective_calls` gives the calls; :func:`unpriced_latency_s` the latency terms that the
per-entry prices leave out (a bucketed entry's ``time_s`` is its bandwidth term only): once per
flat call, and once per bucketed entry the runtime sends on its own.

:func:`step_latencies` gives both (and the compute copies' part of the first), for the plan to
record: the planner prices them once, when it writes the records (``PlanHeader.flat_latency_s``,
``copy_latency_s``, ``arrival_wait_s``), and the estimate adds
them up.

:func:`arrival_wait_s` prices how far apart the ranks arrive at each call
(:func:`passes.plan.cost_model.arrival_wait`, by the compute since the rank's previous call). The
step's calls in the order they run: forward, the records in program order, each record's
forward entries (its input edges) before its forward compute; backward, in reverse, each
record's regathers before its backward compute, a recomputed layer's rerun (its compute, then
its collectives) before it too, its other backward entries (its input edges' gradients) after it;
the flat calls at the end of backward (the first after the compute left, the others at once) and
the copies' refresh gathers at the start of forward.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from passes.core import bucket_sizes
from passes.core.placements import parse_spec
from passes.core.plan_records import NodeRecord
from passes.rules.attention import RING_TRANSFERS_PER_HOP

__all__ = [
    "group_calls",
    "collective_calls",
    "call_latency_s",
    "unpriced_latency_s",
    "arrival_wait_s",
    "StepLatencies",
    "step_latencies",
]


def _flat_bucket_calls(members: list, limit: float, *, before: bool) -> int:
    """Buffers sent for ``members`` (their byte sizes, in order) with a size limit: ``before``:
    a buffer is cut before the member that would take it past ``limit`` (the copies' refresh);
    else after the member that brings it to ``limit`` or more (gradient buckets)."""
    count, size = 0, 0.0
    for nbytes in members:
        if before and size and size + nbytes > limit:
            count, size = count + 1, 0.0
        size += nbytes
        if not before and size >= limit:
            count, size = count + 1, 0.0
    return count + (1 if size else 0)


def _reductions_only(grad, src, mesh_shape) -> bool:
    """The runtime's ``reduce_moves`` is not None: every move of the gradient on an axis of more
    than one device is ``Partial -> Replicate`` or ``Partial -> Shard``."""
    from passes.plan.bucket_memory import reduction_signature

    return reduction_signature(grad, src, mesh_shape) is not None


def group_calls(records: Sequence[NodeRecord], mesh_shape, axis_names, bucket_grads: bool = True) -> tuple:
    """(the flat calls, ``(phase, kind, axis name, count)``; the ids of the entries they send):
    what the functions below take as ``grouped`` (computed once for several of them)."""
    ndim = len(mesh_shape)
    parsed: dict = {}

    def spec(text):
        if text not in parsed:
            parsed[text] = parse_spec(text, ndim)
        return parsed[text]

    by_name = {r.name: r for r in records}
    users: dict = defaultdict(set)
    for r in records:
        for name in r.inputs:
            users[name].add(r.name)
    covered: set = set()
    buckets: dict = {}  # gradient signature -> gradient bytes, in backward order
    copy_reduce: set = set()  # compute copies' reduction signatures
    copy_gather: dict = {}  # gathered axes -> gathered bytes per weight, in program order
    for r in reversed(records):
        own = [c for c in r.comm if c.bucketed and c.input is None]
        if own:  # a compute copy's reduction and gather (on the parameter's record)
            covered.update(id(c) for c in own)
            red = tuple((c.axis, c.kind) for c in own if c.phase == "bwd")
            if red:
                copy_reduce.add(red)
            gather = [c for c in own if c.phase == "fwd"]
            if gather:
                copy_gather.setdefault(tuple(c.axis for c in gather), []).insert(0, gather[0].bytes)
        if not bucket_grads:
            continue
        edges: dict = defaultdict(list)
        for c in r.comm:
            if c.bucketed and c.input is not None and c.phase == "bwd":
                edges[c.input].append(c)
        grads = r.grads or []
        for k, entries in edges.items():
            param = by_name.get(r.inputs[k])
            if param is None or len(users[param.name]) != 1 or k >= len(grads) or grads[k] is None:
                continue  # a tied weight: reduced per edge
            if param.regather:
                continue  # ZeRO-3: reduce-scattered at once, on its own (runtime.grad_sync)
            if not _reductions_only(spec(grads[k]), spec(param.out[0]), mesh_shape):
                continue  # a local move besides the reductions: reduced per edge
            buckets.setdefault(tuple((c.axis, c.kind) for c in entries), []).append(entries[0].bytes)
            covered.update(id(c) for c in entries)
    flat = []
    for sig, sizes in buckets.items():
        n = _flat_bucket_calls(sizes, bucket_sizes.BUCKET_BYTES, before=False)
        flat += [("bwd", kind, axis, n) for axis, kind in sig]
    for sig in sorted(copy_reduce):
        flat += [("bwd", kind, axis, 1) for axis, kind in sig]
    for axes, sizes in copy_gather.items():
        n = _flat_bucket_calls(sizes, bucket_sizes.REFRESH_BUCKET_BYTES, before=True)
        flat += [("fwd", "all_gather", axis, n) for axis in axes]
    return flat, covered


def _entry_calls(c, mesh_shape, axis_names) -> int:
    """Calls the runtime makes for one entry sent on its own (see the module docstring)."""
    if c.kind != "send_recv":
        return 1
    return RING_TRANSFERS_PER_HOP * (mesh_shape[list(axis_names).index(c.axis)] - 1)


def collective_calls(
    records: Sequence[NodeRecord], mesh_shape, axis_names, *, bucket_grads: bool = True, grouped=None
) -> dict:
    """``{phase: {kind: {axis name: calls}}}`` of one step of a plan's ``records``."""
    calls: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    flat, covered = grouped or group_calls(records, mesh_shape, axis_names, bucket_grads)
    for phase, kind, axis, n in flat:
        calls[phase][kind][axis] += n
    for r in records:
        for c in r.comm:
            if id(c) not in covered:
                calls[c.phase][c.kind][c.axis] += _entry_calls(c, mesh_shape, axis_names)
    return {p: {k: dict(v) for k, v in kinds.items()} for p, kinds in calls.items()}


def call_latency_s(kind: str, axis: str, mesh_shape, axis_names, cluster) -> float:
    """One call's latency terms: its launch and its ring steps on the axis's link."""
    from passes.plan.cost_model import _STEPS

    a = list(axis_names).index(axis)
    link = cluster.link_for_axis(mesh_shape, a)
    return cluster.collective_overhead_s + _STEPS[kind](mesh_shape[a]) * link.latency_s


def unpriced_latency_s(
    records: Sequence[NodeRecord], mesh_shape, axis_names, cluster, *, bucket_grads: bool = True, grouped=None
) -> float:
    """The latency terms the records' per-entry prices leave out: a bucketed entry's ``time_s``
    is its bandwidth term only, so each flat call pays its launch and ring steps here once, and so
    does each bucketed entry that the runtime reduces on its own edge (a tied weight's)."""
    flat, covered = grouped or group_calls(records, mesh_shape, axis_names, bucket_grads)
    total = sum(n * call_latency_s(kind, axis, mesh_shape, axis_names, cluster) for _phase, kind, axis, n in flat)
    for r in records:
        for c in r.comm:
            if c.bucketed and id(c) not in covered:
                total += call_latency_s(c.kind, c.axis, mesh_shape, axis_names, cluster)
    return total


def arrival_wait_s(
    records: Sequence[NodeRecord], mesh_shape, axis_names, cluster, *, bucket_grads: bool = True, grouped=None
) -> float:
    """Seconds the step's collective calls wait for ranks arriving apart (see the module doc)."""
    from passes.plan.cost_model import arrival_wait

    if not getattr(cluster, "arrival_wait", None):
        return 0.0
    flat, covered = grouped or group_calls(records, mesh_shape, axis_names, bucket_grads)
    total, since = 0.0, 0.0

    def call() -> None:
        nonlocal total, since
        total += arrival_wait(since, cluster)
        since = 0.0

    for _ in range(sum(n for phase, _, _, n in flat if phase == "fwd")):
        call()
    for r in records:
        for c in r.comm:
            if c.phase == "fwd" and not c.recompute and id(c) not in covered:
                call()
        since += r.forward_s or 0.0
    for r in reversed(records):
        comm = [c for c in r.comm if id(c) not in covered]
        for c in comm:
            if c.regather:
                call()
        since += r.recompute_s or 0.0
        for c in comm:
            if c.recompute:
                call()
        since += r.compute_s - (r.forward_s or 0.0) - (r.recompute_s or 0.0)
        for c in comm:
            if c.phase == "bwd" and not c.regather:
                call()
    for _ in range(sum(n for phase, _, _, n in flat if phase == "bwd")):
        call()
    return total


@dataclass(frozen=True)
class StepLatencies:
    """The step's latency prices the records' entries leave out, priced once by the planner and
    kept in the plan's header (the estimate adds them up)."""

    flat_latency_s: float = 0.0
    """:func:`unpriced_latency_s`: once per flat call, and per bucketed entry sent on its own."""
    copy_latency_s: float = 0.0
    """The part of it the compute copies' flat calls pay (a pipeline stage: once per step)."""
    arrival_wait_s: float = 0.0
    """:func:`arrival_wait_s`."""


def step_latencies(records: Sequence[NodeRecord], mesh_shape, axis_names, cluster) -> StepLatencies:
    """The :class:`StepLatencies` of a plan's ``records`` on ``cluster`` (the calls grouped once)."""
    grouped = group_calls(records, mesh_shape, axis_names)
    copies, _ = group_calls(records, mesh_shape, axis_names, bucket_grads=False)  # the compute copies' flat calls
    fixed = [n * call_latency_s(kind, axis, mesh_shape, axis_names, cluster) for _, kind, axis, n in copies]
    return StepLatencies(
        flat_latency_s=unpriced_latency_s(records, mesh_shape, axis_names, cluster, grouped=grouped),
        copy_latency_s=sum(fixed),
        arrival_wait_s=arrival_wait_s(records, mesh_shape, axis_names, cluster, grouped=grouped),
    )
