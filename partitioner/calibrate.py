"""``partitioner calibrate``: measure this machine into a cluster file the cost model prices with.

Algorithm
---------
1. **Ranks are the devices.** ``ranks`` local gloo processes start (``runtime.launch.run_on_ranks``,
   one thread each) and every figure is measured with all of them working at once, as they do in
   a job: on a machine with fewer cores than ranks, each rank's share of the cores is its device.
2. **Compute.** Every rank times ``torch.mm`` of ``n x n`` matrices for each dtype and size, an
   elementwise ``add`` over buffers of several sizes, and forward + backward of fx programs of
   ``k`` tiny elementwise ops that require grad (the mean of ``trials`` timed loops, slowest
   rank: the mean, as a step meets the machine's average share, not its best moment). The
   cost model prices an op as ``op_overhead_s + max(flops / peak[dtype], bytes /
   memory_bandwidth)`` in forward and again per backward product
   (:func:`passes.plan.cost_model.compute_time`): the programs' time per op (a line ``t = a + k *
   u``) is two overheads, ``u = 2 op_overhead_s`` (what an op costs a lowered program, fx and
   autograd included, beyond its arithmetic); the elementwise times give ``memory_bandwidth``
   (``t = a + bytes * u``, ``a`` a bare call's cost), the matmul times ``peak[dtype]`` and its
   curve: square and narrow ``m x k x n`` products, each at its arithmetic intensity ``I =
   flops / bytes`` (inputs and output) reaching ``r = flops / (t - a)``; ``peak`` is the best
   ``r`` and ``matmul_curve[dtype]`` the points ``(I, r / peak)`` (the mean where shapes share an
   intensity), which the cost model reads piecewise linearly in ``log I``: a narrow product (a
   tensor-parallel shard, a small head dimension) is priced at the rate its shape reaches, not at
   the square matmuls' peak.
   **Rated ops.** Ops that reach neither the matmul curve nor memory bandwidth (on a CPU:
   activations whose ``erf``, ``exp`` or ``tanh`` dominate, normalisations with several passes
   over their input, a fused attention's blocked kernel) are timed forward + backward through
   autograd on a transformer's activations (``op_tokens x op_width``; attention on a grid of
   sequence lengths and head dimensions), and each op's rule is asked what it counts (its FLOPs
   and the backward multiples the cost model charges, :func:`passes.plan.cost_model.backward_factor`).
   ``op_rates[dtype][op]`` is those FLOPs over the time beyond each pass's ``op_overhead_s``, so
   the cost model prices each sample at the time it took: one number for an activation or a
   norm; for attention, whose kernel here runs at 21-87 GFLOP/s (float32) depending on the
   sequence length and head dimension (short sequences and small or odd head dimensions are
   slow), the grid of rates, read at an attention's own shape
   (:func:`passes.plan.cost_model.measured_rate`; flat beyond the grid, so a 32k-token attention
   reads the 1,024-token rate).
   **Optimizer steps.** AdamW and SGD step over sets of float32 parameters (many tiny tensors, a
   few large ones): the line ``t = tensors * tensor_s + bytes / bandwidth`` (bytes as the cost
   model counts them) is ``optimizer_steps[optimizer]``. On a CPU torch steps one tensor at a
   time (tens of microseconds of Python per tensor for AdamW) and streams the state from DRAM,
   well below the cache-resident elementwise ops' bandwidth the roofline would use.
   In fresh processes (fixing the threshold cannot be undone, and a used heap serves requests
   from its freed blocks), with glibc's mmap threshold fixed as a CPU job under a memory budget
   runs (``runtime/host_memory.py``), an ``add`` writing a fresh output is
   timed against one writing a kept buffer, at sizes above the threshold: the difference per
   byte (the median over sizes) is ``fresh_page_s_per_byte``, the zero-filled pages of a
   fresh mapping, which the cost model adds per large tensor an op allocates in such a job.
3. **Collectives.** Every kind the runtime issues (all-reduce, all-gather, reduce-scatter,
   all-to-all, and a ring exchange of sends and receives) is timed at several payloads on the
   whole group and, with 4 ranks or more, on pairs too, **as a training step meets it**: each
   call follows a burst of computation (``burst`` seconds of small matmuls on every rank), and
   only the call is timed, from the moment its rank enters it (the mean over ranks and
   trials). Ranks then arrive apart, as they do between a step's ops, and on a machine with fewer
   free cores than ranks a rank that waits must be scheduled again: a tight loop of collectives
   (ranks arriving together) measures a fraction of what a step pays.
   The cost model prices one as ``collective_overhead_s + steps(n) * latency_s + wire(n) *
   payload / (bandwidth * efficiency[kind])`` (:func:`passes.plan.cost_model.collective_time`): one
   linear least-squares fit over every sample, with unknowns ``collective_overhead_s``,
   ``latency_s`` and one seconds-per-wire-byte per kind; the all-reduce's is the link's
   ``bandwidth`` and the other kinds' are its ``efficiency``. Both fixed terms stay >= 0 (a
   negative one is dropped and the rest refitted).
   **Arrival.** The collective samples follow a short burst (``burst``); in a step, ranks
   compute longer between calls, and ranks sharing cores progress unevenly, so they arrive
   further apart. For ``burst`` and each of the longer computations ``waits`` (nominally 10-100
   ms), runs of matmuls each followed by a tiny all-reduce are timed: a run's time and the time
   inside the all-reduce after it (the mean over runs and ranks, the collective samples'
   statistic). ``arrival_wait`` is, per measured run time, the time inside beyond the ``burst``
   one (kept >= 0 and non-decreasing), which the estimate adds per collective call by the compute
   since the previous call (:func:`passes.plan.collective_calls.arrival_wait_s`).
   **Overlap.** A prefetched weight gather (``passes/lower/prefetch_gathers.py``) runs asynchronously
   beside compute; on a GPU it has its own engine, on gloo its transfers run on threads that
   compete with the compute for the cores. Every rank times an all-gather of a weight's size
   (the largest payload up to 2 MiB) alone, matmuls about as long alone, and the gather started
   before the matmuls and waited for after them: ``prefetch_overlap = (compute + gather - both)
   / min(compute, gather)`` (within 0-1) is the fraction of the shorter one that running them
   together hides, the fraction of the overlapped compute the cost model credits a prefetched
   gather with.
4. **Fits minimise relative error** (every sample weighted by ``1 / t**2``), so small and large
   sizes count alike. The written model is the least-squares optimum over its own samples: the
   weighted residuals are orthogonal to every fitted term (what the test checks).

The cluster file is JSON: ``{"cluster": ClusterSpec fields, "samples": {...}, "machine": ...}``;
``cluster=<path>`` reads it everywhere (``partitioner.get_cluster``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from partitioner.cluster import ClusterSpec, LinkSpec, cluster_file_dict

__all__ = [
    "DEFAULT_SIZES",
    "QUICK_SIZES",
    "TINY_SIZES",
    "arrival_samples",
    "arrival_wait",
    "calibrate",
    "compute_samples",
    "fit",
    "fit_compute",
    "fresh_rank",
    "fresh_samples",
    "matmul_intensity",
    "measure",
    "measure_in_group",
    "median_samples",
    "op_rates",
    "op_samples",
    "optimizer_samples",
    "optimizer_steps",
    "overlap_sample",
    "prefetch_overlap",
    "rank_samples",
    "write_cluster_file",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

DEFAULT_SIZES = {
    "matmul": (64, 128, 256, 512),
    "matmul_shapes": ((512, 64, 512), (2048, 64, 256), (1024, 256, 64), (2048, 256, 1024), (512, 1024, 128)),
    "dtypes": ("float32", "bfloat16"),
    "elementwise": (1 << 10, 1 << 14, 1 << 18, 1 << 21),
    "chains": (8, 32, 128),
    "payloads": (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23),
    "trials": 3,
    "seconds": 0.05,
    "burst": 2e-3,
    "fresh": (1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 23),
    "waits": (1e-2, 3e-2, 1e-1),
    "op_tokens": 512,
    "op_width": 768,
    "attention": {"seq": (64, 256, 1024), "head_dim": (16, 32, 64, 128), "rows": 4096, "heads": 4},
    "optimizer": ((64, 64), (16, 1 << 16), (4, 1 << 20)),
}
"""Matrix sides and ``(m, k, n)`` shapes of narrow products, dtypes, elementwise elements
(float32), ops per fx program, collective payload bytes, timed trials per point, the length of
one timed loop, the computation before each collective, the bytes of the fresh allocations
timed last, the longer runs of matmuls before a tiny all-reduce (``arrival_wait``), and the
activations the rated ops are timed on (``op_tokens x op_width``; attention: a grid of sequence
lengths and head dimensions, ``heads`` heads and ``rows`` query rows (batch x heads x sequence)
at every point), and the parameter sets the optimizers step (``(tensors, elements
each)``)."""

QUICK_SIZES = {
    "matmul": (128, 256, 512),
    "matmul_shapes": ((512, 64, 512), (2048, 64, 256), (1024, 256, 64), (512, 1024, 128)),
    "dtypes": ("float32", "bfloat16"),
    "elementwise": (1 << 12, 1 << 18, 1 << 21),
    "chains": (8, 64),
    "payloads": (1 << 12, 1 << 16, 1 << 20, 1 << 22),
    "trials": 2,
    "seconds": 0.02,
    "burst": 2e-3,
    "fresh": (1 << 19, 1 << 21, 1 << 23),
    "waits": (1e-2, 5e-2),
    "op_tokens": 512,
    "op_width": 768,
    "attention": {"seq": (64, 256, 1024), "head_dim": (32, 64), "rows": 4096, "heads": 4},
    "optimizer": ((64, 64), (4, 1 << 20)),
}
"""What ``cluster="cpu"`` measures when no calibration is installed (:mod:`partitioner.local_cluster`):
every figure of :data:`DEFAULT_SIZES`, on fewer sizes and shorter loops (about half a minute for
2 ranks on a 2-core machine)."""

TINY_SIZES = {
    "matmul": (16, 32),
    "matmul_shapes": ((64, 8, 32),),
    "dtypes": ("float32",),
    "elementwise": (1 << 8, 1 << 12),
    "chains": (2, 4),
    "payloads": (1 << 8, 1 << 12),
    "trials": 1,
    "seconds": 0.002,
    "burst": 1e-4,
    "fresh": (1 << 17, 1 << 18),
    "waits": (1e-3,),
    "op_tokens": 16,
    "op_width": 32,
    "attention": {"seq": (8, 16), "head_dim": (8, 16), "rows": 32, "heads": 2},
    "optimizer": ((4, 16), (2, 256)),
}
"""A quick run for tests: the same code on sizes that take milliseconds."""


# -- measuring ----------------------------------------------------------------------------------


def _timed(fn, seconds: float, trials: int, sync=None) -> float:
    """Seconds per call of ``fn``: the mean over ``trials`` loops of about ``seconds`` each (not
    the best: on a shared machine the best loop is the moment the rank had a core to itself,
    while a training step meets the average share). With ``sync`` (max over ranks, which also
    lines the ranks up) every rank makes the same calls and each loop counts as long as its
    slowest rank's."""
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    per = (time.perf_counter() - start) / 3
    reps = max(1, min(10000, int(seconds / max(per, 1e-9))))
    if sync is not None:
        reps = int(sync(float(reps)))
    total = 0.0
    for _ in range(trials):
        if sync is not None:
            sync(0.0)
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        elapsed = (time.perf_counter() - start) / reps
        total += sync(elapsed) if sync is not None else elapsed
    return total / trials


def compute_samples(sizes: dict, sync=None, say: Callable[[str], None] | None = None) -> dict:
    """Matmul and elementwise timings (``sync``: see :func:`_timed`)."""
    import torch

    say = say or (lambda message: None)
    seconds, trials = sizes["seconds"], sizes["trials"]
    out: dict = {"matmul": [], "elementwise": [], "chains": []}
    shapes = [(n, n, n) for n in sizes["matmul"]] + [tuple(s) for s in sizes.get("matmul_shapes", ())]
    for dtype_name in sizes["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for m, k, n in shapes:
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            t = _timed(lambda a=a, b=b: torch.mm(a, b), seconds, trials, sync)
            flops, nbytes = 2 * m * k * n, (m * k + k * n + m * n) * a.element_size()
            out["matmul"].append({"dtype": dtype_name, "m": m, "k": k, "n": n, "flops": flops, "bytes": nbytes, "s": t})
            say(f"matmul {dtype_name} {m}x{k} @ {k}x{n}: {t * 1e6:.1f} us, {flops / t / 1e9:.2f} GFLOP/s per rank")
    for numel in sizes["elementwise"]:
        x, y = torch.randn(numel), torch.randn(numel)
        t = _timed(lambda x=x, y=y: torch.add(x, y), seconds, trials, sync)
        nbytes = 3 * numel * 4
        out["elementwise"].append({"bytes": nbytes, "s": t})
        say(f"elementwise add of {nbytes} bytes: {t * 1e6:.1f} us, {nbytes / t / 1e9:.2f} GB/s per rank")
    for ops in sizes["chains"]:
        program = _chain(ops)
        x = torch.randn(8, requires_grad=True)
        t = _timed(lambda program=program, x=x: program(x).sum().backward(), seconds, trials, sync)
        out["chains"].append({"ops": ops, "s": t})
        say(f"fx program of {ops} tiny ops, forward + backward: {t * 1e6:.1f} us, {t / ops * 1e6:.1f} us per op")
    if "op_tokens" in sizes:
        out["ops"] = op_samples(sizes, sync, say)
    if "optimizer" in sizes:
        out["optimizer"] = optimizer_samples(sizes, sync, say)
    return out


OPTIMIZERS = {"adam": ("AdamW", {"lr": 1e-3}), "sgd": ("SGD", {"lr": 1e-3})}
"""The optimizers the cost model prices (``optimizer=`` of ``partitioner.plan``) and the torch
class each is timed as, with its arguments."""


def optimizer_samples(sizes: dict, sync=None, say: Callable[[str], None] | None = None) -> list:
    """One optimizer step over ``tensors`` float32 parameters of ``numel`` elements each (every
    ``sizes["optimizer"]`` set, gradients present), for each optimizer the cost model prices:
    ``{"optimizer", "tensors", "numel", "s"}`` (``sync``: see :func:`_timed`)."""
    import torch

    say = say or (lambda message: None)
    out = []
    for name, (cls, kwargs) in OPTIMIZERS.items():
        for tensors, numel in sizes["optimizer"]:
            params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
            for p in params:
                p.grad = torch.randn(numel)
            opt = getattr(torch.optim, cls)(params, **kwargs)
            t = _timed(opt.step, sizes["seconds"], sizes["trials"], sync)
            out.append({"optimizer": name, "tensors": tensors, "numel": numel, "s": t})
            say(f"{cls} step over {tensors} tensors of {numel} elements: {t * 1e6:.1f} us")
    return out


def optimizer_steps(samples: list) -> dict:
    """``ClusterSpec.optimizer_steps`` from :func:`optimizer_samples`: per optimizer, the line
    ``t = tensors * tensor_s + bytes / bandwidth`` (bytes: what the cost model counts,
    :func:`passes.plan.cost_model.optimizer_step_bytes`) fitted on relative error, both terms >= 0."""
    from passes.plan.cost_model import optimizer_step_bytes

    out = {}
    for name in sorted({s["optimizer"] for s in samples}):
        mine = [s for s in samples if s["optimizer"] == name]
        if len(mine) < 2:
            continue
        rows = [[float(s["tensors"]), s["tensors"] * optimizer_step_bytes(s["numel"], 4, name)] for s in mine]
        times = [s["s"] for s in mine]
        tensor_s, per_byte = _weighted_lstsq(rows, times, [0, 1])
        if tensor_s < 0 or per_byte <= 0:  # noise: the one-term line that fits better
            tensor_s, per_byte = min(
                (_weighted_lstsq(rows, times, [j]) for j in (0, 1)),
                key=lambda c: sum(((r[0] * c[0] + r[1] * c[1]) / t - 1.0) ** 2 for r, t in zip(rows, times)),
            )
        out[name] = {"tensor_s": max(tensor_s, 0.0), "bandwidth": 1.0 / per_byte if per_byte > 0 else math.inf}
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
    cost model charges (``sync``: see :func:`_timed`)."""
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

            t = _timed(step, sizes["seconds"], sizes["trials"], sync)
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


def _chain(ops: int):
    """An fx program of ``ops`` elementwise ops on a tiny tensor: each costs its overhead only."""
    import torch
    import torch.fx

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for i in range(ops):
        x = graph.call_function(torch.ops.aten.mul.Tensor if i % 2 else torch.ops.aten.add.Tensor, (x, 1.0))
    graph.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def rank_samples(rank: int, world: int, sizes: dict, progress: bool = False) -> dict:
    """One rank's part of :func:`measure` (``sizes``: every key of ``DEFAULT_SIZES``)."""
    import torch
    import torch.distributed as dist

    from runtime.collectives import _all_gather_single, _reduce_scatter_single

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def mean(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / world

    def say(message: str) -> None:
        if rank == 0 and progress:
            print(f"[partita calibrate] {message}", file=sys.stderr, flush=True)

    seconds, trials = sizes["seconds"], sizes["trials"]
    out = compute_samples(sizes, slowest, say)
    out["collectives"] = []
    a = torch.randn(96, 96)
    start = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    per_mm = (time.perf_counter() - start) / 20
    count = max(1, int(slowest(sizes["burst"] / per_mm)))  # every rank computes the same burst

    def burst():
        for _ in range(count):
            torch.mm(a, a)

    groups = [(world, None)]
    if world >= 4 and world % 2 == 0:  # pairs as well: two ring step counts per kind at two group sizes
        pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        groups.append((2, pairs[rank // 2] if rank < 2 * (world // 2) else None))
    for n, group in groups:
        if n < 2 or (group is None and n != world):
            continue
        me = dist.get_rank(group) if group is not None else rank
        for kind in COLLECTIVES:
            for payload in sizes["payloads"]:
                fn = _collective(kind, payload, n, me, group, torch, dist, _all_gather_single, _reduce_scatter_single)
                t = _timed_after(burst, fn, seconds, trials, slowest, mean)
                out["collectives"].append({"kind": kind, "n": n, "payload": payload, "s": t})
                say(
                    f"{kind} on {n} ranks, {payload} bytes, after {sizes['burst'] * 1e3:g} ms of work: {t * 1e6:.1f} us"
                )
    out["arrival"] = arrival_samples(a, per_mm, (sizes["burst"], *sizes["waits"]), trials, mean, slowest)
    say(
        "a tiny all-reduce after "
        + ", ".join(f"{x['compute_s'] * 1e3:.2f} ms of matmuls: {x['s'] * 1e3:.2f} ms" for x in out["arrival"])
    )
    payload = max([p for p in sizes["payloads"] if p <= 1 << 21] or [min(sizes["payloads"])])  # a weight's size
    out["overlap"] = overlap_sample(rank, world, payload, a, per_mm, trials, mean, slowest)
    o = out["overlap"]
    say(
        f"all-gather of {o['payload']} bytes started before {o['compute_s'] * 1e3:.2f} ms of matmuls: "
        f"{o['both_s'] * 1e3:.2f} ms together, {o['gather_s'] * 1e3:.2f} ms alone"
    )
    return out


def arrival_samples(a, per_mm, bursts, trials, mean, agree) -> list:
    """For each ``b`` of ``bursts`` (the collective samples' burst first): runs of matmuls of about
    ``b`` seconds, each followed by a tiny all-reduce, as a step's compute is followed by its next
    collective; ``compute_s``: a run's time, ``s``: the time inside the all-reduce after it (from
    the moment the rank enters it, as the collective samples), each the mean over ``4 trials``
    runs (after one unmeasured) and over ranks."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(2)
    reps = 4 * trials
    out = []
    dist.all_reduce(buf)
    t0 = time.perf_counter()
    for _ in range(50):  # a matmul's time now, every rank busy (``per_mm``, timed at the start, can be far off)
        torch.mm(a, a)
    per_mm = agree((time.perf_counter() - t0) / 50)
    for b in bursts:
        count = max(1, int(b / per_mm))
        work = inside = 0.0
        for i in range(reps + 1):
            t0 = time.perf_counter()
            for _ in range(count):
                torch.mm(a, a)
            t1 = time.perf_counter()
            dist.all_reduce(buf)
            if i:
                work, inside = work + t1 - t0, inside + time.perf_counter() - t1
        out.append({"compute_s": mean(work / reps), "s": mean(inside / reps)})
    return out


def arrival_wait(samples: list | None) -> list:
    """``ClusterSpec.arrival_wait`` from :func:`arrival_samples`: per compute length, the time
    inside the all-reduce beyond its time after the shortest (which the collective fit prices), at
    least 0 and never less than after a shorter one."""
    if not samples or len(samples) < 2:
        return []
    ordered = sorted(samples, key=lambda x: x["compute_s"])
    curve, top = [], 0.0
    for x in ordered:
        top = max(top, x["s"] - ordered[0]["s"])
        curve.append([x["compute_s"], top])
    return curve


def overlap_sample(rank, world, payload, a, per_mm, trials, mean, agree) -> dict:
    """How much of an asynchronous all-gather (a prefetched weight gather) computing beside it
    hides: on every rank at once, the gather of ``payload`` bytes alone, a run of matmuls about as
    long alone, and the gather started before the matmuls and waited for after them (``both``),
    interleaved, each the mean over ``8 trials`` rounds and over ranks."""
    import torch
    import torch.distributed as dist

    from runtime.collectives import _all_gather_single

    numel = max(world, payload // 4 // world * world)
    out, inp = torch.empty(numel), torch.ones(numel // world)

    def gather(async_op=False):
        return _all_gather_single(out, inp, async_op=async_op)

    gather()
    alone = []
    for _ in range(5):
        t0 = time.perf_counter()
        gather()
        alone.append(time.perf_counter() - t0)
    count = max(1, int(agree(statistics.median(alone) / per_mm)))  # matmuls as long as a gather

    def compute():
        for _ in range(count):
            torch.mm(a, a)

    def both():
        work = gather(async_op=True)
        compute()
        work.wait()

    sums = {"compute_s": 0.0, "gather_s": 0.0, "both_s": 0.0}
    rounds = 8 * trials
    for _ in range(rounds):
        for key, fn in (("compute_s", compute), ("gather_s", gather), ("both_s", both)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sums[key] += time.perf_counter() - t0
    return {"payload": payload, **{k: mean(v / rounds) for k, v in sums.items()}}


def prefetch_overlap(sample: dict | None) -> float:
    """The fraction of the shorter of a gather and its compute that running them together hid
    (``(compute + gather - both) / min(compute, gather)``, kept within 0-1); 1.0 unmeasured."""
    if not sample:
        return 1.0
    c, g, both = sample["compute_s"], sample["gather_s"], sample["both_s"]
    return min(1.0, max(0.0, (c + g - both) / max(min(c, g), 1e-12)))


def fresh_rank(rank: int, world: int, sizes: dict) -> list:
    """One rank's :func:`fresh_samples`, in processes of their own (see there), all ranks at once."""
    import torch
    import torch.distributed as dist

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    return fresh_samples(sizes, slowest)


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
        fresh = _timed(lambda x=x, y=y: torch.add(x, y), sizes["seconds"], sizes["trials"], sync)
        reused = _timed(lambda x=x, y=y, o=kept: torch.add(x, y, out=o), sizes["seconds"], sizes["trials"], sync)
        out.append({"bytes": nbytes, "s": fresh, "kept_s": reused})
        (say or (lambda m: None))(
            f"add writing {nbytes} fresh bytes: {fresh * 1e6:.1f} us, into a kept buffer: {reused * 1e6:.1f} us"
        )
    return out


def _timed_after(work, fn, seconds: float, trials: int, agree, mean) -> float:
    """Seconds inside ``fn`` per call when each call follows ``work`` (see the module docstring):
    the mean over ``trials`` and ranks; ``agree`` (max over ranks) fixes the call count."""
    work()
    fn()
    start = time.perf_counter()
    for _ in range(3):
        work()
        fn()
    reps = int(agree(float(max(1, min(10000, int(seconds * 3 / max(time.perf_counter() - start, 1e-9)))))))
    total = 0.0
    for _ in range(trials):
        agree(0.0)
        inside = 0.0
        for _ in range(reps):
            work()
            t0 = time.perf_counter()
            fn()
            inside += time.perf_counter() - t0
        total += mean(max(inside / reps, 1e-7))
    return total / trials


def _collective(kind, payload, n, me, group, torch, dist, all_gather, reduce_scatter):
    """One call of ``kind`` moving ``payload`` bytes as :mod:`passes.plan.cost_model` names them
    (all-gather: the gathered buffer; reduce-scatter: the full input; send/recv: what this rank
    sends to the next rank of the ring while it receives from the previous one)."""
    numel = max(n, payload // 4 // n * n)
    if kind == "all_reduce":
        buf = torch.ones(numel)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        out, inp = torch.empty(numel), torch.ones(numel // n)
        return lambda: all_gather(out, inp, group=group)
    if kind == "reduce_scatter":
        inp, out = torch.ones(numel), torch.empty(numel // n)
        return lambda: reduce_scatter(out, inp, group=group)
    if kind == "all_to_all":
        inp, out = torch.ones(numel), torch.empty(numel)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    send, recv = torch.ones(numel), torch.empty(numel)
    peers = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    nxt, prv = peers[(me + 1) % n], peers[(me - 1) % n]

    def exchange():
        works = [dist.isend(send, nxt), dist.irecv(recv, prv)]
        for w in works:
            w.wait()

    return exchange


def measure(
    ranks: int = 2,
    sizes: dict | None = None,
    *,
    progress: bool = False,
    timeout_s: float = 900,
    repeats: int = 1,
    say: Callable[[str], None] | None = None,
) -> dict:
    """Run the measurements on ``ranks`` local gloo ranks; returns the samples (rank 0's view of
    the slowest rank): ``{"matmul": [...], "elementwise": [...], "collectives": [...], ...}``.
    With ``repeats`` > 1 the whole set is measured that many times, one pass after another, and
    every figure is the median over the passes (:func:`median_samples`): a machine whose speed
    drifts for a while (a shared host's other tenants) spoils one pass, not the calibration."""
    from runtime.launch import run_on_ranks

    if ranks < 2:
        raise ValueError(f"calibrate: ranks must be >= 2 to measure collectives, got {ranks}")
    if repeats < 1:
        raise ValueError(f"calibrate: repeats must be >= 1, got {repeats}")
    merged = dict(DEFAULT_SIZES, **(sizes or {}))
    unknown = set(merged) - set(DEFAULT_SIZES)
    if unknown:
        raise ValueError(f"calibrate: unknown size keys {sorted(unknown)}; known: {sorted(DEFAULT_SIZES)}")
    passes = []
    for k in range(repeats):
        if repeats > 1 and say is not None:
            say(f"pass {k + 1} of {repeats} (load average {os.getloadavg()[0]:.1f})")
        out = run_on_ranks(rank_samples, ranks, merged, progress, timeout_s=timeout_s, collective_timeout_s=120)[0]
        out["fresh"] = run_on_ranks(fresh_rank, ranks, merged, timeout_s=timeout_s, collective_timeout_s=120)[0]
        passes.append(out)
    return median_samples(passes)


def measure_in_group(sizes: dict | None = None, *, progress: bool = False) -> dict:
    """:func:`measure` by the ranks of the running job's default process group (collective: every
    rank calls it), without forking: rank 0's view of the slowest rank. The fresh-allocation
    samples are left out (they fix glibc's mmap threshold, which a running job must not have
    changed under it), so ``fresh_page_s_per_byte`` fits to 0."""
    import torch.distributed as dist

    merged = dict(DEFAULT_SIZES, **(sizes or {}))
    return rank_samples(dist.get_rank(), dist.get_world_size(), merged, progress)


def median_samples(passes: list):
    """One set of samples from several passes of the same measurements: the structure of the
    first, every number the median over the passes, each number on its own (sizes, counts and
    shapes are equal in every pass, so only the times change; two times of one sample, such as
    an overlap sample's alone and together, can come from different passes); anything else
    (names, flags, tuples) as the first pass has it."""
    first = passes[0]
    if isinstance(first, dict):
        return {key: median_samples([p[key] for p in passes]) for key in first}
    if isinstance(first, list):
        if any(len(p) != len(first) for p in passes):
            raise ValueError("calibrate: passes measured different sample lists; cannot merge them")
        return [median_samples(list(column)) for column in zip(*passes)]
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    return statistics.median(passes) if isinstance(first, float) else statistics.median_low(passes)


# -- fitting ------------------------------------------------------------------------------------


def _weighted_lstsq(rows: list, times: list, keep: list) -> list:
    """Least squares of ``times`` on the ``keep`` columns of ``rows``, each row weighted by
    ``1 / t``; the dropped columns' coefficients are 0."""
    import numpy as np

    a = np.array([[r[j] for j in keep] for r in rows], dtype=float)
    t = np.array(times, dtype=float)
    w = 1.0 / t
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(a * w[:, None] / scale, t * w, rcond=None)
    coef = coef / scale
    full = [0.0] * len(rows[0])
    for j, c in zip(keep, coef):
        full[j] = float(c)
    return full


def _fit_nonnegative(rows: list, times: list, fixed_columns: list) -> tuple[list, list]:
    """Fit all columns; while a coefficient comes out negative, drop a fixed-cost column (a
    negative one first, else the last still kept) and refit. Without fixed columns every slope is
    positive (each a line through the origin through positive samples). Returns (coefficients,
    kept columns)."""
    keep = list(range(len(rows[0])))
    while True:
        coef = _weighted_lstsq(rows, times, keep)
        kept_fixed = [j for j in fixed_columns if j in keep]
        if all(c >= 0 for c in coef) or not kept_fixed:
            return coef, keep
        negative = [j for j in kept_fixed if coef[j] < 0]
        keep.remove(negative[0] if negative else kept_fixed[-1])


def collective_design(kind: str, n: int, payload: float) -> list:
    """The row of the collective fit for one sample: [1, steps, wire bytes of kind 0, ...]."""
    from passes.plan.cost_model import _STEPS, _WIRE

    row = [1.0, float(_STEPS[kind](n))] + [0.0] * len(COLLECTIVES)
    row[2 + COLLECTIVES.index(kind)] = _WIRE[kind](n) * payload
    return row


def fit_compute(samples: dict) -> dict:
    """``op_overhead_s``, ``memory_bandwidth`` and ``peak_flops`` from the compute samples."""
    elementwise, chains = samples["elementwise"], samples["chains"]
    if len(elementwise) < 2 or len(chains) < 2 or not samples["matmul"]:
        raise ValueError("calibrate: the fit needs elementwise and program times at two sizes or more, and matmuls")
    ew, _ = _fit_nonnegative([[1.0, s["bytes"]] for s in elementwise], [s["s"] for s in elementwise], [0])
    call, per_byte = ew
    (_, per_op), _ = _fit_nonnegative([[1.0, s["ops"]] for s in chains], [s["s"] for s in chains], [0])
    peaks, curves = {}, {}
    for dtype in sorted({s["dtype"] for s in samples["matmul"]}):
        rates: dict = {}  # intensity -> achieved FLOP/s (the mean where shapes share one)
        for s in samples["matmul"]:
            if s["dtype"] == dtype:
                rates.setdefault(matmul_intensity(s), []).append(s["flops"] / max(s["s"] - call, 1e-12))
        peaks[dtype] = max(max(r) for r in rates.values())
        curves[dtype] = [[x, sum(r) / len(r) / peaks[dtype]] for x, r in sorted(rates.items())]
    if "float32" not in peaks:
        raise ValueError("calibrate: the fit needs float32 matmul times (the default for other dtypes)")
    # per byte, the median over sizes (one noisy size must not set it; a relative least-squares
    # line through the origin follows the cheapest sample)
    fresh = sorted(max(s["s"] - s["kept_s"], 0.0) / s["bytes"] for s in samples.get("fresh", []))
    fresh_per_byte = statistics.median(fresh) if fresh else 0.0
    return {
        "op_rates": op_rates(samples.get("ops", []), per_op / 2),
        "optimizer_steps": optimizer_steps(samples.get("optimizer", [])),
        "op_overhead_s": per_op / 2,
        "memory_bandwidth": 1.0 / per_byte,
        "peak_flops": {**{d: peaks["float32"] for d in ("bfloat16", "float16")}, **peaks},
        "matmul_curve": curves,
        "fresh_page_s_per_byte": max(fresh_per_byte, 0.0),
    }


def op_rates(samples: list, op_overhead_s: float) -> dict:
    """``ClusterSpec.op_rates`` from :func:`op_samples`: per dtype and op, the rule's FLOPs of every
    pass over the time the passes took beyond the fixed cost the cost model adds to each
    (``op_overhead_s``). An op timed on one kind of shape keeps the mean over its samples; one
    whose samples carry a ``shape`` (attention: sequence length, head dimension) keeps a grid,
    ``{"axes": [the sorted values of each shape axis], "rates": nested lists}``, the mean at each
    point, so the cost model (:func:`passes.plan.cost_model.measured_rate`) prices every sample at the
    time it was measured in (the test checks it) and interpolates between them. A sample that is
    all fixed cost (95% or more) rates nothing; a grid point left without a rate (its samples all
    fixed cost) takes the rate of the measured point nearest to it in log coordinates."""
    rates: dict = {}
    for s in samples:
        work = s["s"] - s["passes"] * op_overhead_s
        if s["flops"] <= 0 or work <= 0.05 * s["s"]:  # all overhead (tiny sizes): nothing to rate
            continue
        point = tuple(s["shape"]) if s.get("shape") is not None else None
        rates.setdefault(s["dtype"], {}).setdefault(s["op"], {}).setdefault(point, []).append(
            s["flops"] * s["passes"] / work
        )
    return {dtype: {op: _rate_of(points) for op, points in ops.items()} for dtype, ops in rates.items()}


def _rate_of(points: dict):
    """One op's rates by shape (None: no shape) -> its ``op_rates`` entry (see :func:`op_rates`)."""
    if None in points:
        return sum(r for rs in points.values() for r in rs) / sum(len(rs) for rs in points.values())
    means = {p: sum(r) / len(r) for p, r in points.items()}
    axes = [sorted({p[k] for p in means}) for k in range(len(next(iter(means))))]

    def nearest(point):  # a grid point left without a rate: the measured one closest in log space
        def distance(p):
            return sum(math.log(a / b) ** 2 for a, b in zip(point, p))

        return means[min(means, key=distance)]

    def nest(prefix):
        k = len(prefix)
        if k == len(axes):
            point = tuple(prefix)
            return means[point] if point in means else nearest(point)
        return [nest([*prefix, v]) for v in axes[k]]

    return {"axes": axes, "rates": nest([])}


def _rate_text(rate) -> str:
    from passes.plan.cost_model import grid_rates

    if not isinstance(rate, dict):
        return f"{rate / 1e9:.2f} GFLOP/s"
    flat = grid_rates(rate)
    return f"{min(flat) / 1e9:.2f}-{max(flat) / 1e9:.2f} GFLOP/s over shapes {' x '.join(map(str, rate['axes']))}"


def matmul_intensity(sample: dict) -> float:
    """FLOPs per byte of a matmul sample (inputs and output), as the cost model computes it for a
    contraction (``flops / mem_bytes``); samples without shapes (older files) are ``n x n`` squares."""
    nbytes = sample.get("bytes") or 3 * sample["n"] ** 2 * (4 if sample["dtype"] == "float32" else 2)
    return sample["flops"] / nbytes


def fit(samples: dict, *, ranks: int, name: str = "calibrated", memory_bytes: int | None = None) -> ClusterSpec:
    """The cluster whose cost model best reproduces ``samples`` (see the module docstring)."""
    compute = fit_compute(samples)
    coll = samples["collectives"]
    missing = [k for k in COLLECTIVES if not any(s["kind"] == k for s in coll)]
    if missing:
        raise ValueError(f"calibrate: no samples for {missing}")
    rows = [collective_design(s["kind"], s["n"], s["payload"]) for s in coll]
    coef, _ = _fit_nonnegative(rows, [s["s"] for s in coll], [0, 1])
    overhead, latency = coef[0], coef[1]
    per_wire = dict(zip(COLLECTIVES, coef[2:]))
    bandwidth = 1.0 / per_wire["all_reduce"]
    link = LinkSpec(bandwidth=bandwidth, latency_s=latency)
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks
    return ClusterSpec(
        name=name,
        peak_flops=compute["peak_flops"],
        memory_bandwidth=compute["memory_bandwidth"],
        memory_bytes=int(memory_bytes),
        devices_per_node=ranks,
        intra_node=link,
        inter_node=link,
        collective_overhead_s=overhead,
        matmul_efficiency=1.0,
        matmul_curve=compute["matmul_curve"],
        op_rates=compute["op_rates"],
        optimizer_steps=compute["optimizer_steps"],
        fresh_page_s_per_byte=compute["fresh_page_s_per_byte"],
        op_overhead_s=compute["op_overhead_s"],
        prefetch_overlap=prefetch_overlap(samples.get("overlap")),
        arrival_wait=arrival_wait(samples.get("arrival")),
        collective_efficiency={k: per_wire["all_reduce"] / v for k, v in per_wire.items() if k != "all_reduce"},
        notes=f"measured by `partitioner calibrate` on {ranks} gloo ranks of {platform.node() or 'this machine'}",
    )


# -- the whole command ------------------------------------------------------------------------------


def write_cluster_file(path, spec: ClusterSpec, samples: dict, ranks: int) -> None:
    machine = {
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "ranks": ranks,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(path).write_text(json.dumps(cluster_file_dict(spec, samples=samples, machine=machine), indent=1) + "\n")


def calibrate(
    path,
    *,
    ranks: int = 2,
    sizes: dict | None = None,
    name: str = "calibrated",
    memory_bytes: int | None = None,
    say: Callable[[str], None] | None = None,
    progress: bool = False,
    repeats: int = 1,
) -> ClusterSpec:
    """Measure on ``ranks`` local ranks (``repeats`` passes, the median of each figure), fit,
    write the cluster file ``path``; returns the spec."""
    say = say or (lambda message: None)
    say(f"measuring on {ranks} gloo ranks (load average {os.getloadavg()[0]:.1f})")
    samples = measure(ranks, sizes, progress=progress, repeats=repeats, say=say)
    spec = fit(samples, ranks=ranks, name=name, memory_bytes=memory_bytes)
    write_cluster_file(path, spec, samples, ranks)
    say(
        f"fitted: matmul {', '.join(f'{d} {v / 1e9:.2f}' for d, v in sorted(spec.peak_flops.items()))} GFLOP/s, "
        f"memory {spec.memory_bandwidth / 1e9:.2f} GB/s, op overhead {spec.op_overhead_s * 1e6:.1f} us, "
        f"collective overhead {spec.collective_overhead_s * 1e6:.1f} us + {spec.intra_node.latency_s * 1e6:.1f} us "
        f"per ring step, link {spec.intra_node.bandwidth / 1e9:.2f} GB/s; matmul fraction of peak by FLOPs per byte "
        f"{', '.join(f'{x:.0f}: {y:.2f}' for x, y in spec.matmul_curve.get('float32', []))}; a fresh allocation "
        f"{spec.fresh_page_s_per_byte * 1e9:.2f} ns per byte; a prefetched gather's overlap with compute "
        f"{spec.prefetch_overlap:.2f}; a collective after "
        + ", ".join(f"{x * 1e3:g} ms of work: +{y * 1e3:.2f} ms" for x, y in spec.arrival_wait)
    )
    rates = spec.op_rates.get("float32", {})
    if rates:
        say("float32 op rates: " + ", ".join(f"{op} {_rate_text(r)}" for op, r in sorted(rates.items())))
    for name, step in sorted(spec.optimizer_steps.items()):
        say(f"{name} step: {step['tensor_s'] * 1e6:.1f} us per tensor + bytes at {step['bandwidth'] / 1e9:.2f} GB/s")
    say(f"cluster file written to {path}")
    return spec
