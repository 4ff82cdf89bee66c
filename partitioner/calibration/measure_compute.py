"""Compute samples (step 2 of :mod:`partitioner.calibration`): matmuls, elementwise ops, fx programs
of tiny ops, rated ops through autograd, optimizer steps and fresh allocations."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from partitioner.calibration.measure_backward import contraction_pass_samples, matmul_shapes
from partitioner.calibration.timing import cold_calls, cold_sets, timed

logger = logging.getLogger(__name__)


def compute_samples(sizes: dict, sync=None, say: Callable[[str], None] | None = None) -> dict:
    """Matmul, elementwise, program, linear backward (:mod:`~partitioner.calibration.measure_backward`),
    rated op and optimizer timings (``sync``: see :func:`timed`)."""
    import torch

    say = say or (lambda message: None)
    seconds, trials = sizes["seconds"], sizes["trials"]
    out: dict = {"matmul": [], "elementwise": []}
    shapes = matmul_shapes(sizes)
    for dtype_name in sizes["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for m, k, n in shapes:
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            t = timed(lambda a=a, b=b: torch.mm(a, b), seconds, trials, sync)
            flops, nbytes = 2 * m * k * n, (m * k + k * n + m * n) * a.element_size()
            out["matmul"].append({"dtype": dtype_name, "m": m, "k": k, "n": n, "flops": flops, "bytes": nbytes, "s": t})
            say(f"matmul {dtype_name} {m}x{k} @ {k}x{n}: {t * 1e6:.1f} us, {flops / t / 1e9:.2f} GFLOP/s per rank")
    for numel in sizes["elementwise"]:
        nbytes = 3 * numel * 4
        operands = cold_sets(functools.partial(_pair, numel), nbytes)
        t = timed(cold_calls(operands, torch.add), seconds, trials, sync)
        out["elementwise"].append({"bytes": nbytes, "s": t})
        say(f"elementwise add of {nbytes} bytes: {t * 1e6:.1f} us, {nbytes / t / 1e9:.2f} GB/s per rank")
    for kind in ("chains", "view_chains"):
        out[kind] = []
        for ops in sizes["chains"]:
            program = _chain(ops, views=kind == "view_chains")
            x = torch.randn(8, requires_grad=True)
            t = timed(lambda program=program, x=x: program(x).sum().backward(), seconds, trials, sync)
            out[kind].append({"ops": ops, "s": t})
            what = "views" if kind == "view_chains" else "tiny ops"
            say(f"fx program of {ops} {what}, forward + backward: {t * 1e6:.1f} us, {t / ops * 1e6:.1f} us per op")
    out["contraction_passes"] = contraction_pass_samples(sizes, sync, say)
    if "op_tokens" in sizes:
        out["ops"] = op_samples(sizes, sync, say)
    if "optimizer" in sizes:
        out["optimizer"] = optimizer_samples(sizes, sync, say)
    return out


def _pair(numel: int) -> tuple:
    """Two float32 vectors of ``numel`` elements: an elementwise sample's operands."""
    import torch

    return torch.randn(numel), torch.randn(numel)


OPTIMIZERS = {"adam": ("AdamW", {"lr": 1e-3}), "sgd": ("SGD", {"lr": 1e-3})}
"""The optimizers the cost model prices (``optimizer=`` of ``partitioner.plan``) and the torch
class each is timed as, with its arguments."""


def optimizer_samples(sizes: dict, sync=None, say: Callable[[str], None] | None = None) -> list:
    """One optimizer step over ``tensors`` float32 parameters of ``numel`` elements each (every
    ``sizes["optimizer"]`` set, gradients present), for each optimizer the cost model prices:
    ``{"optimizer", "tensors", "numel", "s"}`` (``sync``: see :func:`timed`)."""
    import torch

    say = say or (lambda message: None)
    out = []
    for name, (cls, kwargs) in OPTIMIZERS.items():
        for tensors, numel in sizes["optimizer"]:
            params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
            for p in params:
                p.grad = torch.randn(numel)
            opt = getattr(torch.optim, cls)(params, **kwargs)
            t = timed(opt.step, sizes["seconds"], sizes["trials"], sync)
            out.append({"optimizer": name, "tensors": tensors, "numel": numel, "s": t})
            say(f"{cls} step over {tensors} tensors of {numel} elements: {t * 1e6:.1f} us")
    return out


def _rated_ops(sizes: dict, dtype) -> list:
    """``(aten overload, args, kwargs)`` of the ops :func:`op_samples` times: the activations,
    normalisations, softmax and loss a transformer runs on ``op_tokens x op_width`` activations
    (GELU exact and tanh-approximated), and fused attention on each :func:`attention_shapes`
    shape, full and causal (floating inputs require grad)."""
    import torch

    aten = torch.ops.aten
    n, d = sizes["op_tokens"], sizes["op_width"]

    def act():
        return torch.randn(n, d, dtype=dtype, requires_grad=True)

    def vec():
        return torch.randn(d, dtype=dtype, requires_grad=True)

    cases: list[tuple] = [(op, (act(),), {}) for op in (aten.gelu.default, aten.silu.default, aten.tanh.default)]
    cases.append((aten.gelu.default, (act(),), {"approximate": "tanh"}))
    cases += [(op, (act(),), {}) for op in (aten.sigmoid.default, aten.exp.default)]
    cases.append((aten.layer_norm.default, (act(), [d], vec(), vec()), {}))
    cases.append((aten.rms_norm.default, (act(), [d], vec()), {}))
    cases.append((aten.softmax.int, (act(), -1), {}))
    cases.append((aten.cross_entropy_loss.default, (act(), torch.randint(0, d, (n,))), {}))
    for b, h, q, hd in attention_shapes(sizes["attention"]):
        for causal in (False, True):
            qkv = [torch.randn(b, h, q, hd, dtype=dtype, requires_grad=True) for _ in range(3)]
            cases.append((aten.scaled_dot_product_attention.default, tuple(qkv), {"is_causal": causal}))
    return cases


def attention_shapes(grid: dict) -> list:
    """``(batch, heads, sequence, head dim)`` at every point of the attention grid: every
    sequence length with every head dimension, ``rows`` query rows (``batch x heads x
    sequence``) at each where the batch can shrink to hold them (it stops at one: a sequence
    longer than ``rows / heads`` has more rows)."""
    h = grid["heads"]
    return [(max(1, grid["rows"] // (h * q)), h, q, d) for q in grid["seq"] for d in grid["head_dim"]]


def _priced_work(target, args, kwargs, out) -> tuple:
    """(FLOPs the op's rule counts, backward passes the cost model charges per forward, the name
    its rate is kept under: :func:`passes.rules.base.rate_key`, the shape it is read at:
    :meth:`passes.rules.base.OpRule.rate_shape`) for one call of ``target``: the op as an fx node
    whose values are the real tensors."""
    import torch
    import torch.fx as fx

    from passes.plan.cost_model import backward_factor
    from passes.rules import op_view, rate_key, rule_for

    graph = fx.Graph()

    def node_of(value, k):
        if not isinstance(value, torch.Tensor):
            return value
        p = graph.placeholder(f"x{k}")
        p.meta["val"] = value
        return p

    node = graph.call_function(
        target,
        tuple(node_of(a, k) for k, a in enumerate(args)),
        {key: node_of(v, f"_{key}") for key, v in kwargs.items()},
    )
    node.meta["val"] = out
    rule = rule_for(node)
    grads_in = sum(1 for a in [*args, *kwargs.values()] if getattr(a, "requires_grad", False))
    view = op_view(node)
    return rule.flops(view), backward_factor(rule.contraction, grads_in), rate_key(node), rule.rate_shape(view)


def op_samples(sizes: dict, sync=None, say: Callable[[str], None] | None = None) -> list:
    """Forward + backward (through autograd, as a training step runs them; the input gradients
    returned, not accumulated) of every op of :func:`_rated_ops` for each dtype: ``{"op",
    "dtype", "flops", "passes", "s"}`` with ``op`` the name its rate is kept under, ``flops``
    what the op's rule counts per forward and ``passes`` forward plus the backward multiples the
    cost model charges (``sync``: see :func:`timed`)."""
    import torch

    say = say or (lambda message: None)
    out = []
    for dtype_name in sizes["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for target, args, kwargs in _rated_ops(sizes, dtype):
            result = target(*args, **kwargs)
            flops, factor, name, shape = _priced_work(target, args, kwargs, result)
            grad = torch.ones_like(result)
            inputs = [a for a in args if getattr(a, "requires_grad", False)]

            def step(target=target, args=args, kwargs=kwargs, grad=grad, inputs=inputs):
                torch.autograd.grad(target(*args, **kwargs), inputs, grad)

            t = timed(step, sizes["seconds"], sizes["trials"], sync)
            sample = {"op": name, "dtype": dtype_name, "flops": flops, "passes": 1 + factor, "s": t}
            if shape is not None:
                sample["shape"] = list(shape)
            out.append(sample)
            where = "" if shape is None else f" {tuple(shape)}"
            say(
                f"{name}{where} {dtype_name}, forward + backward: {t * 1e6:.1f} us, "
                f"{flops * (1 + factor) / t / 1e9:.2f} GFLOP/s"
            )
    return out


def _chain(ops: int, views: bool = False):
    """An fx program of ``ops`` elementwise ops on a tiny tensor, each costing its overhead only;
    with ``views``, of ``ops`` views (``[8] -> [2, 4] -> [8]``: dispatch, the view's metadata
    and autograd's view node, in forward and backward)."""
    import torch
    import torch.fx

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for i in range(ops):
        if views:
            x = graph.call_function(aten.view.default, (x, [8] if i % 2 else [2, 4]))
        else:
            x = graph.call_function(aten.mul.Tensor if i % 2 else aten.add.Tensor, (x, 1.0))
    graph.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def host_cores() -> int:
    """The cores this process may run on (its affinity; the CPU count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def on_own_cores(rank: int, world: int, measure: Callable) -> tuple:
    """Compute timed as a rank with a core to itself: ``measure(slowest)`` on the first ``cores``
    ranks at once (``cores``: rank 0's :func:`host_cores`; ``slowest``: the max over them, see
    :func:`timed`), the other ranks waiting, so a figure does not depend on how the scheduler
    shares cores between more ranks than it has (ranks that outnumber the cores are priced by
    :mod:`partitioner.core_sharing`). Collective: every rank calls it. Returns (cores, what
    ``measure`` returned, None on the waiting ranks)."""
    import torch
    import torch.distributed as dist

    box = [host_cores()]
    dist.broadcast_object_list(box, src=0)
    timing = list(range(min(box[0], world)))
    group = dist.new_group(timing) if len(timing) < world else None  # every rank makes the group

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    out = measure(slowest) if rank in timing else None
    dist.barrier()
    return box[0], out


def fresh_rank(rank: int, world: int, sizes: dict) -> list:
    """One rank's :func:`fresh_samples`, in processes of their own (see there), on as many ranks
    at once as there are cores (:func:`on_own_cores`)."""
    return on_own_cores(rank, world, lambda slowest: fresh_samples(sizes, slowest))[1] or []


def fresh_samples(sizes: dict, sync=None, say: Callable[[str], None] | None = None) -> list:
    """What a large allocation costs when it is a fresh mapping: an elementwise ``add`` into a new
    output, and into a kept one, with glibc's mmap threshold fixed (``runtime/host_memory.py``,
    as a CPU job under a memory budget runs). In a process of its own, first thing: fixing the
    threshold cannot be undone, and a heap that already holds freed blocks serves requests from
    them instead of fresh mappings (as a job that fixes it at its start does not)."""
    import torch

    from runtime.host_memory import return_freed_blocks

    if not return_freed_blocks():
        return []  # not glibc: allocations are whatever the C library makes them, not priced
    out = []
    for nbytes in sizes["fresh"]:
        x, y, kept = torch.randn(nbytes // 4), torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        fresh = timed(lambda x=x, y=y: torch.add(x, y), sizes["seconds"], sizes["trials"], sync)
        reused = timed(lambda x=x, y=y, o=kept: torch.add(x, y, out=o), sizes["seconds"], sizes["trials"], sync)
        out.append({"bytes": nbytes, "s": fresh, "kept_s": reused})
        (say or (lambda m: None))(
            f"add writing {nbytes} fresh bytes: {fresh * 1e6:.1f} us, into a kept buffer: {reused * 1e6:.1f} us"
        )
    return out
