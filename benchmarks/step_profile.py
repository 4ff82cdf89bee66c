"""Where one rank's measured step departs from its estimate, per kind of work.

One rank's training step (the runtime benchmark's Megatron TP LLaMA on 4 gloo ranks, the
pipeline benchmark's GPT stages, or one of the memory benchmark's Partita plans on 4 ranks,
``--memory``) is run under ``torch.profiler`` and its time is split into
kinds, next to the plan's per-node estimate split the same way:

* forward: each top-level aten op the rank's program calls, by name (``linear``, views,
  ``scaled_dot_product_attention``, ...), inclusive time;
* backward: each autograd node (``autograd::engine::evaluate_function: MmBackward0``), inclusive;
* collectives: the gloo calls (forward and backward alike);
* the optimizer step.

Kinds: ``matmul`` (linear, mm, matmul, bmm, addmm and their backward nodes), ``attention``
(scaled-dot-product attention), ``view`` (ops that make views: priced 0 by the cost model),
``accumulate`` (``AccumulateGrad``: gradients added into ``.grad``), ``comm``, ``optimizer``,
``other`` (elementwise, norms, losses, embeddings), ``recompute`` (a recomputed layer's rerun:
the forward-only ops and collectives a backward node runs inside it; the estimate's
``recompute_s`` and rerun collectives). The estimate's kinds come from the plan's
records (``compute_s`` by the record's op, ``comm`` time_s). What the profile cannot attribute
(Python between ops, the profiler's own cost) is ``unattributed``. Each kind also gets its op
count, so a per-op cost can be read off.

Usage: ``python benchmarks/step_profile.py --cluster cal4.json [--size medium | --memory
recompute] [--steps 4]``.
The profiler adds a few microseconds per op; the unprofiled median step is printed beside.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MATMUL = {"linear", "mm", "matmul", "bmm", "addmm", "baddbmm", "einsum"}
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")
VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "t",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "split",
    "alias",
    "as_strided",
    "getitem",
    "unbind",
    "chunk",
    "narrow",
    "detach",
    "flatten",
    "unflatten",
    "view_as",
    "expand_as",
    "split_with_sizes",
}
COMM = (
    "gloo",
    "c10d",
    "allreduce",
    "all_reduce",
    "allgather",
    "all_gather",
    "reduce_scatter",
    "alltoall",
    "all_to_all",
    "send",
    "recv",
    "Reshard",
)


def kind_of(name: str) -> str:
    """The kind of an aten op name (``aten::linear``, ``aten.view.default``) or backward node."""
    if any(c.lower() in name.lower() for c in COMM):
        return "comm"
    base = name.replace("autograd::engine::evaluate_function: ", "").replace("aten::", "").replace("aten.", "")
    if "AccumulateGrad" in base:
        return "accumulate"
    if any(a.replace("_", "") in base.lower().replace("_", "") for a in ATTENTION):  # ScaledDotProduct...Backward0
        return "attention"
    op = base.split(".")[0]
    if op.endswith("Backward0") or op.endswith("Backward1"):
        op = op[: -len("Backward0")]
        low = op.lower()
        if low in {m.lower() for m in MATMUL} or low in {"mm", "addmm", "bmm"}:
            return "matmul"
        if low in {v.replace("_", "").lower() for v in VIEWS} or low in {"unsafeview", "asstrided", "t"}:
            return "view"
        return "other"
    if op in MATMUL:
        return "matmul"
    if op in VIEWS:
        return "view"
    return "other"


RERUN = {
    "linear",
    "addmm",
    "layer_norm",
    "native_layer_norm",
    "gelu",
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "embedding",
    "softmax",
    "_softmax",
}
"""Forward-only aten ops (their backward formulas call others: ``mm``, ``gelu_backward``): one of
them inside a backward node is a recomputed layer's rerun (non-reentrant checkpointing reruns
the layer when backward first unpacks one of its saved tensors)."""


def _rerun_s(event) -> float:
    """Seconds of a recomputed layer's rerun inside a backward node: the forward ops
    (:data:`RERUN`) and the collectives (the rerun's weight gathers) at any depth below it."""
    total = 0.0
    for child in event.cpu_children:
        op = child.name.replace("aten::", "")
        if op in RERUN or kind_of(child.name) == "comm":
            total += child.cpu_time_total / 1e6
        else:
            total += _rerun_s(child)
    return total


def profile_split(prof) -> tuple[dict, dict]:
    """(seconds, count) per kind from one profiled step: top-level ops only (no double count);
    a backward node's rerun of a recomputed layer's forward ops is the kind ``recompute``."""
    seconds: dict = defaultdict(float)
    count: dict = defaultdict(int)
    events = list(prof.events())
    main = next(e.thread for e in events if e.name == "## step ##")
    for e in events:  # the step's own thread (gloo's threads run the transfers it waits on)
        if e.thread != main or e.cpu_parent is None or e.cpu_parent.name != "## step ##":
            continue
        name = e.name
        dt = e.cpu_time_total / 1e6
        if name.startswith("Optimizer.step"):
            seconds["optimizer"] += dt
            count["optimizer"] += 1
        elif name.startswith("Optimizer.zero_grad"):
            seconds["zero_grad"] += dt
        elif name.startswith(("autograd::engine::evaluate_function", "aten::", "c10d", "gloo")) or "Reshard" in name:
            k = kind_of(name)
            backward = name.startswith("autograd::engine::evaluate_function") and k != "comm"
            rerun = _rerun_s(e) if backward else 0.0
            seconds[k] += dt - rerun
            count[k] += 1
            if rerun:
                seconds["recompute"] += rerun
                count["recompute"] += 1
    return dict(seconds), dict(count)


def estimate_split(plan) -> tuple[dict, dict]:
    """(seconds, forward op count) per kind from the plan's records."""
    seconds: dict = defaultdict(float)
    count: dict = defaultdict(int)
    for r in plan.records:
        seconds["optimizer"] += r.get("optimizer_step_s", 0.0)
        if r.get("kind") != "op":
            continue
        k = kind_of(str(r.get("target", "")))
        seconds[k] += r.get("compute_s", 0.0) - r.get("recompute_s", 0.0)
        seconds["recompute"] += r.get("recompute_s", 0.0)
        count[k] += 1
        for c in r.get("comm", []):
            seconds["recompute" if c.get("recompute") else "comm"] += c["time_s"]
            count["comm"] += 1
    return dict(seconds), dict(count)


def _tp_rank(rank, world, steps, size, cluster):
    import runtime_overhead as ro

    import partitioner

    ro.use_size(size)
    model, batch = ro.build()
    pm = partitioner.auto_parallelize(model, batch, mesh=(world,), pins=ro.megatron_pins(world), cluster=cluster)
    return _profile(pm, batch, steps, rank, pm.plan)


def _gpt_rank(rank, world, steps, size, cluster):
    import pipeline as pl

    import partitioner
    from partitioner.models import gpt_demo

    model, (ids, targets) = gpt_demo(
        pl.MB, pl.SEQ, n_layer=pl.N_LAYER // pl.P, n_embd=pl.N_EMBD, n_head=pl.N_HEAD, vocab_size=pl.VOCAB
    )
    pm = partitioner.auto_parallelize(model, (ids, targets), mesh=(1,), cluster=cluster)
    return _profile(pm, (ids, targets), steps, rank, pm.plan, optimizer=False)


def _memory_rank(rank, world, steps, row, plan_dict):
    import memory as mb

    import partitioner
    from partitioner.sharding_plan import ShardingPlan

    model, batch = mb._model()
    pm = partitioner.auto_parallelize(model, batch, mesh=(world,), plan=ShardingPlan.from_dict(plan_dict))
    return _profile(pm, batch, steps, rank, pm.plan)


def _memory_plan(row: str, cluster: str) -> tuple[str, dict]:
    """The memory benchmark's Partita plan whose run name contains ``row``, made for ``cluster``."""
    import memory as mb

    mb._use_cluster(cluster)
    _, _, plans = mb._plans()
    name, _, plan = next((p for p in plans if row in p[0]), (None, None, None))
    if plan is None:
        raise SystemExit(f"no memory-benchmark run named like {row!r}: {[p[0] for p in plans]}")
    return name, plan.to_dict()


def _profile(pm, batch, steps, rank, plan, optimizer=True):
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step():
        opt.zero_grad()
        out = pm(**batch) if isinstance(batch, dict) else pm(*batch)
        loss = out.loss if hasattr(out, "loss") else out["loss"] if isinstance(out, dict) else out
        loss.backward()
        if optimizer:
            opt.step()

    times = []
    for _ in range(steps + 2):
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    torch.distributed.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        with torch.profiler.record_function("## step ##"):
            step()
        wall = time.perf_counter() - start
    seconds, count = profile_split(prof)
    est, est_count = estimate_split(plan)
    return {
        "median_s": statistics.median(times[2:]),
        "profiled_s": wall,
        "measured": seconds,
        "measured_count": count,
        "estimated": est,
        "estimated_count": est_count,
        "estimate_s": plan.estimate().step_time_s,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", required=True)
    ap.add_argument(
        "--size",
        default="medium",
        choices=("small", "medium", "gpt"),
        help="the runtime benchmark's LLaMA (4 ranks), or one pipeline-benchmark stage on 1 rank",
    )
    ap.add_argument(
        "--memory",
        default=None,
        help="instead: the memory benchmark's Partita run whose name contains this (e.g. 'below DP', "
        "'recompute'), 4 ranks",
    )
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import runtime_overhead as ro

    from runtime.launch import run_on_ranks

    if args.memory:
        name, plan_dict = _memory_plan(args.memory, args.cluster)
        size = f"memory benchmark: {name}, 4 ranks"
        results = run_on_ranks(_memory_rank, 4, args.steps, name, plan_dict, timeout_s=1200)
    elif args.size == "gpt":
        size = "GPT stage (pipeline benchmark: 4 layers, width 192, 4 x 128 tokens), forward + backward, 1 rank"
        import pipeline  # noqa: F401 - sizes

        results = run_on_ranks(_gpt_rank, 1, args.steps, size, args.cluster, timeout_s=1200)
    else:
        name = next(s for s in ro.SIZES if s.startswith(args.size))
        size = name + ", Megatron TP on 4 ranks"
        results = run_on_ranks(_tp_rank, 4, args.steps, name, args.cluster, timeout_s=1200)
    r = results[0]
    print(
        f"{size}, rank 0: median step {r['median_s']:.4f} s, profiled step "
        f"{r['profiled_s']:.4f} s, estimate {r['estimate_s']:.4f} s"
    )
    kinds = sorted(set(r["measured"]) | set(r["estimated"]), key=lambda k: -r["measured"].get(k, 0.0))
    print(f"{'kind':<12} {'measured s':>11} {'ops':>6} {'estimated s':>12} {'fwd ops':>8} {'ratio':>7}")
    for k in kinds:
        m, e = r["measured"].get(k, 0.0), r["estimated"].get(k, 0.0)
        print(
            f"{k:<12} {m:>11.4f} {r['measured_count'].get(k, 0):>6} {e:>12.4f} "
            f"{r['estimated_count'].get(k, 0):>8} {m / e if e else float('nan'):>7.2f}"
        )
    print(f"{'unattributed':<12} {r['profiled_s'] - sum(r['measured'].values()):>11.4f}")


if __name__ == "__main__":
    main()
