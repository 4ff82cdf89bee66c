"""The cost model: seconds and bytes for compute, collectives, resharding and memory.

Pure functions of shapes, placements, the mesh shape and a cluster description (decision 4).

Collectives on a mesh axis of n devices, ring algorithms, ``payload`` the buffer named below:

================  ==========================  ==================  ============
kind              payload                      bytes on the wire   ring steps
================  ==========================  ==================  ============
all_reduce        the buffer                   2 (n-1)/n payload   2 (n-1)
all_gather        the gathered (output) buffer (n-1)/n payload     n-1
reduce_scatter    the full (input) buffer      (n-1)/n payload     n-1
all_to_all        the local buffer             (n-1)/n payload     n-1
send_recv         the bytes this rank sends    payload             n-1
================  ==========================  ==================  ============

``send_recv`` is ring attention's point-to-point traffic (:mod:`runtime.ring_attention`): ``n - 1``
transfers of a block to the next rank of the axis while one arrives from the previous; its
payload is what one rank sends over all of them. Its overlap with the block computation is not
credited (the estimate adds it to the compute time, an upper bound).

time = ``collective_overhead_s + steps * latency_s + wire_bytes / (bandwidth * efficiency)``
(``collective_efficiency[kind]`` of the cluster, 1.0 unless measured); parameter
gradient synchronisations are bucketed (fused, as DDP does) and pay the bandwidth term only. Reported
communication volumes (``comm_bytes``) are payloads: the Megatron formula's "2 all-reduces
of b*s*h elements" reads directly off them, and the runtime counts the same buffers.

Resharding ``src -> dst`` walks the mesh axes in order; on each axis that changes:
``S->R`` all-gather, ``S->S'`` all-to-all, ``P->R`` all-reduce, ``P->S`` reduce-scatter,
``S->P`` all-gather, ``R->S`` and ``R->P`` are local (slice, or keep one rank's share).

Backward mirrors forward: the gradient flowing back along an edge goes from the placement
the consumer produces for it (``AxisStrategy.grad_placement``) to the dual of the producer's
output placement (``Shard`` stays, ``Replicate`` and ``Partial`` need ``Replicate``). This
one rule yields Megatron's backward all-reduce (replicated input, column-sharded weight) and
data-parallel gradient synchronisation (replicated parameter, batch-sharded compute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from passes.core.placements import (
    Partial,
    dual_spec,
    gradient_shrinks,
    is_partial,
    is_shard,
    total_shard_degree,
    transition_steps,
)

__all__ = [
    "Collective",
    "collective_time",
    "host_copy_time",
    "optimizer_step_bytes",
    "optimizer_step_time",
    "reshard",
    "collective_kind",
    "dtype_bytes",
    "local_bytes",
    "compute_time",
    "measured_rate",
    "grid_rates",
    "check_rate_grid",
    "backward_factor",
    "weight_pass_time",
    "grad_accumulate_time",
    "matmul_fraction",
    "allocation_time",
    "arrival_wait",
    "param_state_bytes",
    "param_state_parts",
    "saved_bytes",
    "edge_allocates",
    "edge_gathers",
    "grad_communicates",
    "grad_held_back",
    "largest_share",
    "extra_payload",
    "own_collectives",
]


@dataclass(frozen=True)
class Collective:
    kind: str
    axis: int
    payload_bytes: float
    bucketed: bool = False
    """A parameter-gradient synchronisation: fused with others into buckets (as DDP does),
    so it pays bandwidth only, not a launch and ring latency of its own."""


def dtype_bytes(dtype) -> int:
    if dtype is None:
        return 4
    try:
        return dtype.itemsize
    except AttributeError:
        return 4


def local_bytes(shape, spec, mesh_shape, elem: int) -> float:
    numel = math.prod(shape) if shape else 1
    return numel * elem / total_shard_degree(spec, mesh_shape)


_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "send_recv": lambda n: n - 1,
}
_WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


def collective_time(c: Collective, mesh_shape, cluster) -> float:
    n = mesh_shape[c.axis]
    if n <= 1 or c.payload_bytes <= 0:
        return 0.0
    link = cluster.link_for_axis(mesh_shape, c.axis)
    fixed = 0.0 if c.bucketed else cluster.collective_overhead_s + _STEPS[c.kind](n) * link.latency_s
    efficiency = cluster.collective_efficiency.get(c.kind, 1.0)
    return fixed + _WIRE[c.kind](n) * c.payload_bytes / (link.bandwidth * efficiency)


def host_copy_time(nbytes: float, cluster) -> float:
    """Seconds of one step's traffic for a tensor of ``nbytes`` whose optimizer state lives in host
    memory: its gradient copied to the host and the stepped tensor copied back, over the host
    link (``cluster.host()``), one transfer each way."""
    link = cluster.host()
    return 2 * (link.latency_s + nbytes / link.bandwidth)


def optimizer_step_bytes(numel: float, elem: int, optimizer: str | None) -> float:
    """Bytes the optimizer's step reads and writes for ``numel`` parameter elements of ``elem``
    bytes. Adam(W): reads the parameter, its gradient and two moments, writes the parameter and
    the moments: 28 B per fp32 element; a low-precision parameter steps an fp32 master copy (reads
    the gradient, the master and the moments, writes them and the parameter): ``24 + 2 elem``.
    SGD (no momentum): reads the parameter and the gradient, writes the parameter. None: 0."""
    if optimizer is None:
        return 0.0
    if optimizer == "sgd":
        return 3.0 * numel * elem
    if elem >= 4:
        return 7.0 * numel * elem
    return numel * (24.0 + 2 * elem)


def optimizer_step_time(numel: float, elem: int, optimizer: str | None, cluster, *, offloaded: bool) -> float:
    """Seconds of the optimizer's step over one parameter tensor of ``numel`` elements:
    memory-bound, at the device's memory bandwidth, or the host's (``host_memory_bandwidth``) for
    state offloaded there; on a cluster with a measured step for ``optimizer``
    (``optimizer_steps``: a CPU, where the device's memory is the host's) its fixed cost per
    tensor plus the bytes at its measured rate."""
    nbytes = optimizer_step_bytes(numel, elem, optimizer)
    host = offloaded and getattr(cluster, "host_memory_bandwidth", None)
    measured = (getattr(cluster, "optimizer_steps", None) or {}).get(optimizer) if optimizer else None
    if measured and not host:
        return measured["tensor_s"] + nbytes / measured["bandwidth"]
    return nbytes / (cluster.host_memory_bandwidth if host else cluster.memory_bandwidth)


def reshard(src, dst, shape, mesh_shape, elem: int) -> list:
    """The collectives that turn a tensor placed ``src`` into ``dst`` (both full specs).

    Walks :func:`passes.core.placements.transition_steps`; local moves (``R->S`` slice,
    ``R->P``) cost nothing and are not listed.
    """
    if src == dst or src is None or dst is None:
        return []
    shape = tuple(shape or ())
    out = []
    current = list(src)
    for axis, p, q in transition_steps(tuple(src), tuple(dst)):
        here = local_bytes(shape, tuple(current), mesh_shape, elem)
        n = mesh_shape[axis]
        kind = collective_kind(p, q)
        if kind == "all_gather":
            out.append(Collective(kind, axis, here * n))
        elif kind is not None:
            out.append(Collective(kind, axis, here))
        current[axis] = q
    return [c for c in out if mesh_shape[c.axis] > 1]


def collective_kind(p, q):
    """The collective one move on one axis needs (None: a local move)."""
    if is_shard(p):
        return "all_to_all" if is_shard(q) else "all_gather"
    if isinstance(p, Partial):
        return "reduce_scatter" if is_shard(q) else "all_reduce"
    return None


def compute_time(
    flops: float,
    mem_bytes: float,
    dtype,
    contraction: bool,
    cluster,
    op: str | None = None,
    shape=None,
    *,
    product: str = "forward",
) -> float:
    """Roofline: the slower of math and memory traffic, plus the cluster's fixed cost of one op
    (an op that neither computes nor moves memory costs nothing here: a view's fixed cost is the
    cluster's ``view_overhead_s``, which the planner adds). A contraction runs at
    the fraction of peak the cluster's curve for ``product`` gives at its FLOPs per byte
    (``flops / mem_bytes``; :func:`matmul_fraction`): ``"forward"`` (a training step's, as a
    linear layer runs it), or one of the backward's products (``"backward"``, ``"weight"``: priced
    at the forward's FLOPs and bytes). An op the
    cluster has a measured rate for (``op_rates[dtype][op]``, ``op`` its name as
    :func:`passes.rules.base.rate_key` gives it: a fused attention, an activation whose ``erf``
    or ``exp`` costs more than its memory traffic on a CPU) computes at that rate instead, its
    memory traffic included (the rate was timed with it; a roofline's memory term beside it
    counted the traffic twice); a rate measured over a grid of shapes is read at ``shape``
    (:func:`measured_rate`)."""
    name = str(dtype).replace("torch.", "") if dtype is not None else "float32"
    rate = measured_rate(cluster, name, op, shape) if op else None
    if rate and flops > 0:  # timed with its memory traffic: the rate is the whole price
        return flops / rate + cluster.op_overhead_s
    if contraction:
        intensity = flops / mem_bytes if mem_bytes else math.inf
        peak = cluster.flops_for(name) * matmul_fraction(cluster, name, intensity, product)
    else:
        peak = cluster.flops_for("float32") * cluster.matmul_efficiency
    roof = max(flops / peak, mem_bytes / cluster.memory_bandwidth)
    return roof + cluster.op_overhead_s if roof > 0 else 0.0


def measured_rate(cluster, dtype_name: str, op: str, shape=None) -> float | None:
    """The cluster's measured rate of ``op`` in ``dtype_name`` (None: not measured). A rate is one
    number, or a grid (``{"axes": [values of each shape axis], "rates": nested lists}``, a fused
    attention's over sequence lengths and head dimensions, :meth:`passes.rules.base.OpRule.rate_shape`)
    read at ``shape`` piecewise linearly in the log of each axis and flat beyond the grid's edges;
    a grid asked without a shape gives its mean."""
    rate = (getattr(cluster, "op_rates", None) or {}).get(dtype_name, {}).get(op)
    if not isinstance(rate, dict):
        return rate
    if shape is None:
        flat = grid_rates(rate)
        return sum(flat) / len(flat)
    if len(shape) != len(rate["axes"]):
        raise ValueError(
            f"the {dtype_name} rate of {op} is a grid over {len(rate['axes'])} shape axes; "
            f"it was asked at {tuple(shape)}"
        )
    return _grid_read(rate["axes"], rate["rates"], [float(x) for x in shape])


def _grid_read(axes: list, rates, point: list) -> float:
    """Multilinear interpolation in log coordinates on a grid, clamped to its edges."""
    values, *rest = axes
    x = min(max(point[0], values[0]), values[-1])
    hi = next((k for k, v in enumerate(values) if v >= x), len(values) - 1)
    lo = max(hi - 1, 0)
    w = 0.0 if hi == lo else math.log(x / values[lo]) / math.log(values[hi] / values[lo])
    if not rest:
        return rates[lo] + w * (rates[hi] - rates[lo])
    a, b = _grid_read(rest, rates[lo], point[1:]), _grid_read(rest, rates[hi], point[1:])
    return a + w * (b - a)


def grid_rates(grid: dict) -> list:
    """Every rate of a rate grid (:func:`measured_rate`), flat."""
    flat = grid["rates"]
    for _ in grid["axes"][1:]:
        flat = [r for row in flat for r in row]
    return flat


def check_rate_grid(grid: dict, where: str) -> None:
    """Raise ValueError (naming ``where``) unless ``grid`` is a rate grid :func:`measured_rate`
    can read: each axis's values positive and increasing, ``rates`` nested to match, every rate
    positive."""

    def bad(why):
        raise ValueError(f"{where}: not a rate grid ({why}); expected {{'axes': [[...], ...], 'rates': nested lists}}")

    if set(grid) != {"axes", "rates"} or not grid["axes"]:
        bad(f"keys {sorted(grid)}")
    for values in grid["axes"]:
        if not values or any(v <= 0 for v in values) or any(b <= a for a, b in zip(values, values[1:])):
            bad(f"axis {values} is not positive and increasing")

    def walk(rates, axes):
        if not isinstance(rates, list) or len(rates) != len(axes[0]):
            bad(f"rates do not match the axes {grid['axes']}")
        for r in rates:
            if len(axes) > 1:
                walk(r, axes[1:])
            elif not isinstance(r, (int, float)) or r <= 0:
                bad(f"rate {r!r}")

    walk(grid["rates"], grid["axes"])


def backward_factor(contraction: bool, grads_in: int) -> int:
    """Backward's work as a multiple of forward's: a contraction makes one product per input that
    needs a gradient (two at most: ``x @ w`` gives ``dx`` and ``dw``), any other op one pass."""
    return min(2, grads_in) if contraction else 1


def weight_pass_time(contraction: bool, forward_s: float, backward_s: float, cluster) -> float:
    """Seconds a zero-bubble ``W`` pass spends on one op that meets a parameter needing a
    gradient (:meth:`runtime.pipeline.StageProgram.weight_meeting_points`: the runtime calls
    ``autograd.backward`` from the op's output to its parameters, once per such op): a
    contraction's weight product (``forward_s``: the forward's FLOPs priced as the weight pass's
    product, :func:`compute_time`'s ``product="weight"``), any other op's weight
    gradients at the price of its backward (a norm's weight and bias gradients, an embedding's, a
    bias add's: the pass re-reads the op's input and output gradient), plus the cluster's fixed
    cost of one op for the call itself. Never more than the op's backward (``backward_s``): it is
    the part of the backward the ``I`` pass leaves to ``W``."""
    own = forward_s if contraction else backward_s
    return min(own + cluster.op_overhead_s, backward_s)


def grad_accumulate_time(grad_bytes: float, microbatches: int, cluster) -> float:
    """Seconds per microbatch of adding a parameter's gradient of ``grad_bytes`` into its
    ``.grad`` in a step of ``microbatches`` (autograd sums the second microbatch's gradient and
    every later one into the first's: reads two, writes one, at the device's memory bandwidth,
    one op each), averaged over the step's microbatches; 0 for one microbatch, whose gradient
    is stored, not added."""
    if microbatches <= 1 or grad_bytes <= 0:
        return 0.0
    add = 3.0 * grad_bytes / cluster.memory_bandwidth + cluster.op_overhead_s
    return add * (microbatches - 1) / microbatches


_PRODUCT_CURVES = {"forward": "forward_curve", "backward": "backward_curve", "weight": "weight_curve"}
"""The cluster's curve for each product of a contraction (:func:`compute_time`'s ``product``)."""


def matmul_fraction(cluster, dtype_name: str, intensity: float, product: str = "forward") -> float:
    """The fraction of peak a contraction's ``product`` (see :func:`compute_time`) of ``intensity``
    FLOPs per byte reaches: the cluster's curve for it and the dtype (else float32's; a product
    without a curve of its own: the bare ``mm``'s ``matmul_curve``), piecewise linear in log intensity between
    its points and flat beyond them; ``matmul_efficiency`` without a curve."""
    if product not in _PRODUCT_CURVES:
        raise ValueError(f"unknown contraction product {product!r}: one of {sorted(_PRODUCT_CURVES)}")
    curve = None
    for name in dict.fromkeys((_PRODUCT_CURVES[product], "matmul_curve")):
        curves = getattr(cluster, name, None) or {}
        curve = curves.get(dtype_name) or curves.get("float32")
        if curve:
            break
    if not curve:
        return cluster.matmul_efficiency
    if intensity <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if intensity <= x1:
            w = math.log(intensity / x0) / math.log(x1 / x0)
            return y0 + w * (y1 - y0)
    return curve[-1][1]


def arrival_wait(compute_s: float, cluster) -> float:
    """Seconds a collective call takes beyond its :func:`collective_time` when the ranks computed
    ``compute_s`` since their previous call: the cluster's ``arrival_wait`` curve, piecewise linear
    in the compute between its points, flat beyond them (0 without a curve)."""
    curve = getattr(cluster, "arrival_wait", None)
    if not curve:
        return 0.0
    if compute_s <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if compute_s <= x1:
            return y0 + (compute_s - x0) / (x1 - x0) * (y1 - y0)
    return curve[-1][1]


def allocation_time(nbytes: float, cluster) -> float:
    """Seconds a tensor of ``nbytes`` costs to allocate beyond its computation: fresh zero-filled
    pages (``fresh_page_s_per_byte``) when the cluster's job gets large allocations as fresh
    mappings (``fresh_allocations``) and the tensor is at least ``MMAP_THRESHOLD`` bytes."""
    from runtime.host_memory import MMAP_THRESHOLD

    if not cluster.fresh_allocations or nbytes < MMAP_THRESHOLD:
        return 0.0
    return nbytes * cluster.fresh_page_s_per_byte


def extra_payload(elements, scaling, itemsize, n_axis, split) -> float:
    """Payload of a collective inside an op (see ``AxisStrategy.extra``). Besides ``"work"`` and
    ``"none"``: ``"local"``, the local share of ``elements`` (an all-to-all of an input's buffer);
    ``"ring"``, that share ``n_axis - 1`` times (ring attention's transfers of its k/v blocks);
    ``"gathered"``, a ``"work"`` buffer all-gathered: every rank's, ``n_axis`` times its bytes
    (the synchronised batch norm's per-rank moments)."""
    if scaling == "gathered":
        return elements * itemsize * n_axis * n_axis / split
    if scaling == "local":
        return elements * itemsize / split
    if scaling == "ring":
        return elements * itemsize * (n_axis - 1) / split
    if scaling == "work":
        return elements * itemsize * n_axis / split
    return float(elements * itemsize)


def _same_cut_degree(axes, ax: int, mesh_shape) -> int:
    """The devices of the other mesh axes whose strategy cuts the op's first input on the same dim
    as axis ``ax`` (two axes cutting a softmax's or a norm's reduced dim): they split the work
    (``split``) but not the rows a ``"work"`` collective sums."""
    first = axes[ax].ins[0] if axes[ax].ins else None
    if not is_shard(first):
        return 1
    degree = 1
    for other, b in enumerate(axes):
        if other != ax and b.ins and b.ins[0] == first:
            degree *= mesh_shape[other]
    return degree


def own_collectives(axes, itemsize, mesh_shape, cluster, split, forward_s, backward_s) -> list:
    """The collectives inside an op (``AxisStrategy.extra`` of each axis in ``axes``) as
    ``(Collective, phase, seconds)``, ``forward_s`` / ``backward_s`` being the op's compute.

    Ring transfers (scaling ``"ring"``) overlap the block computations: in a phase with compute
    ``c`` over the ``n`` blocks of an ``n``-rank ring and transfers taking ``t`` over its ``n - 1``
    hops, each hop runs beside one block, so the phase takes ``c / n + (n - 1) max(c / n, t / (n
    - 1))``: the transfers cost their exposed part ``(n - 1) max(0, t / (n - 1) - c / n)``, shared
    among them in proportion to their time. Their bytes are unchanged."""
    out = []
    for ax, a in enumerate(axes):
        for kind, phase, elements, scaling in a.extra:
            # row statistics: the axes cutting the same reduced dim do not shrink the rows
            same = _same_cut_degree(axes, ax, mesh_shape) if scaling in ("work", "gathered") else 1
            c = Collective(kind, ax, extra_payload(elements, scaling, itemsize, mesh_shape[ax], split) * same)
            out.append([c, phase, scaling == "ring", collective_time(c, mesh_shape, cluster)])
    for phase, compute in (("fwd", forward_s), ("bwd", backward_s)):
        ring = [e for e in out if e[2] and e[1] == phase]
        total = sum(e[3] for e in ring)
        if total <= 0:
            continue
        n = mesh_shape[ring[0][0].axis]
        exposed = (n - 1) * max(0.0, total / (n - 1) - compute / n)
        for e in ring:
            e[3] *= exposed / total
    return [(c, phase, t) for c, phase, _, t in out]


def param_state_bytes(numel: float, elem: int, optimizer: str | None) -> float:
    """Parameter + gradient + optimizer state per parameter (the sum of :func:`param_state_parts`)."""
    return sum(param_state_parts(numel, elem, optimizer))


def param_state_parts(numel: float, elem: int, optimizer: str | None) -> tuple:
    """(parameter, gradient, optimizer state) bytes of ``numel`` elements of ``elem`` bytes.

    fp32 Adam: 4 + 4 + 8 = 16 bytes. Low-precision parameters keep an fp32 master copy and
    fp32 moments: 2 + 2 + (4 + 8). SGD keeps no state; ``None`` counts the parameter only.
    """
    if optimizer is None:
        return (numel * elem, 0.0, 0.0)
    if optimizer == "sgd":
        return (numel * elem, numel * elem, 0.0)
    state = 8 if elem >= 4 else 12
    return (numel * elem, numel * elem, numel * state)


def saved_bytes(node_info, out_specs, mesh_shape, inputs=(), share=None) -> float:
    """Bytes an op keeps for backward of its own, placed ``out_specs``: its output when some op
    keeps it (``node_info.saved``) and its own saved buffers (masks, statistics), at the share of
    the graph's size its largest input has here (``inputs``: (global shape, placement) pairs), or
    ``share`` where the op's rule says (:meth:`passes.rules.base.OpRule.buffer_share`).
    What consumers keep of their inputs through new edge buffers depends on both ends'
    placements: :mod:`passes.plan.memory_accounting` counts it once the plan is chosen."""
    elem = dtype_bytes(node_info.dtype)
    outs = [(s, spec) for s, spec in zip(node_info.out_shapes, out_specs) if s is not None and spec is not None]
    total = sum(local_bytes(s, spec, mesh_shape, elem) for s, spec in outs) if node_info.saved else 0.0
    saves = getattr(node_info, "saves", None)
    if saves is not None and saves.extra_bytes:
        fraction = share if share is not None else largest_share(list(inputs) or outs, mesh_shape)
        total += saves.extra_bytes * fraction
    return total


def largest_share(shapes_specs, mesh_shape) -> float:
    """The fraction of its whole a device holds of the largest of ``(shape, placement)`` pairs
    (1.0 for none): how an op's own buffers (masks, statistics) scale with its placement."""
    placed = [(math.prod(s) if s else 1, spec) for s, spec in shapes_specs if s is not None and spec is not None]
    if not placed:
        return 1.0
    _, spec = max(placed, key=lambda p: p[0])
    return 1.0 / total_shard_degree(spec, mesh_shape)


def _moves(src, dst, mesh_shape):
    if src is None or dst is None:
        return []
    return [(a, p, q) for a, p, q in transition_steps(tuple(src), tuple(dst)) if mesh_shape[a] > 1]


def edge_gathers(src, dst, mesh_shape) -> bool:
    """Whether the edge's forward sends data (a collective writes the consumer's copy): what a
    parameter stored ZeRO-3 style frees after forward and gathers again for backward."""
    return any(is_shard(p) or is_partial(p) for _, p, _ in _moves(src, dst, mesh_shape))


def grad_communicates(src, grad, mesh_shape) -> bool:
    """Whether the backward of an edge from a value placed ``src``, its gradient arriving placed
    ``grad``, sends data (the runtime's ``Reshard.backward_communicates``): a parameter's such edge
    is a gradient synchronisation (which a pipeline stage may hold back: :func:`grad_held_back`)."""
    if src is None or grad is None:
        return False
    return any(is_shard(p) or is_partial(p) for _, p, _ in _moves(grad, dual_spec(tuple(src)), mesh_shape))


def grad_held_back(src, grad, mesh_shape) -> bool:
    """Whether a pipeline stage holds back the gradient of a parameter placed ``src`` along an
    edge whose consumer makes it placed ``grad``, moving the sum over the step's microbatches
    once (:class:`runtime.pipeline.PipelineRunner`): when the backward communicates and does not
    shrink it (an all-reduce onto replicated storage). One that shrinks it (a reduce-scatter onto
    a weight stored sharded, :func:`passes.core.placements.gradient_shrinks`, also when it all-reduces
    on another axis) runs in every microbatch, and the stage keeps only the piece, in ``.grad``."""
    if not grad_communicates(src, grad, mesh_shape):
        return False
    return not gradient_shrinks(tuple(grad), dual_spec(tuple(src)), mesh_shape)


def edge_allocates(src, dst, grad, mesh_shape, *, requires_grad: bool, from_param: bool) -> bool:
    """Whether the edge moving a value placed ``src`` to ``dst`` (gradient back from ``grad``)
    gives its consumer a new storage, as the runtime's ``Reshard`` does: when a move sends data
    (a collective writes a new buffer), or the value needs a gradient (a copy is handed out, not a
    view made inside autograd) unless it is a parameter whose forward does not move (passed
    through). Otherwise (no move; a local slice of a value without gradient) it shares ``src``'s."""
    forward = _moves(src, dst, mesh_shape)
    backward = _moves(grad, dual_spec(tuple(src)), mesh_shape) if requires_grad and grad is not None else []
    if not forward and not backward:
        return False  # no Reshard at all
    if any(is_shard(p) or is_partial(p) for _, p, _ in forward):
        return True  # a collective writes a new buffer
    if not forward:
        return requires_grad and not from_param  # passed through, or copied out of autograd's way
    return requires_grad  # a local slice: a view, copied when it needs a gradient
