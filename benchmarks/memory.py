"""Per-rank memory and step time on 4 gloo ranks: Partita's plans under decreasing budgets
against PyTorch FSDP2 (``fully_shard``) and DDP, on one GPT.

Memory is measured on the CPU, where there is no allocator peak to read: per rank, the bytes
held for one training step = parameters + gradients + optimizer state (AdamW's real moments)
+ the activations saved for backward (unique storages seen by a ``saved_tensors_hooks`` pack
hook). For Partita that is ``partitioner.measure_memory`` (the estimate's counterpart). FSDP2
saves the gathered weights for backward and frees their storage after forward (``resize_`` to
0), so a pack-time count would charge them; for FSDP2 and DDP the saved storages are counted
at the end of forward, at the size they then have (for Partita both counts are equal, checked).

Runs (one forked run of 4 ranks each; the batch is the same global batch, each data-parallel
rank taking its quarter):

1. Partita, no budget (the solver's fastest plan on this cluster);
2. Partita, a budget below DP's replicated state (16 B per parameter): the plan must shard;
3. Partita, a budget below the least memory of any plan without recomputation: it recomputes
   (the solver chooses kept / selective / full per block kind); then the tightest budget it
   meets (a little above the least memory any plan needs);
4. FSDP2 (``fully_shard`` per block and the root), and FSDP2 with each block checkpointed;
5. DDP.

Step time: the median of ``--steps`` timed steps (forward, backward, AdamW) after one warm-up,
the slowest rank's, in wall seconds and in CPU seconds of the rank's process (the machine is
shared: other jobs' load stretches wall time much more than a process's own CPU time). Printed:
per run, measured memory (state, saved, total), Partita's estimate, the ratios Partita / FSDP2
of memory and of CPU step time, and the load average when the run started.

Beside each Partita run's measured step: its plan's estimate and measured / estimate, for the cluster
the plans are made for (``--cluster``: ``cpu``, a preset, or a cluster file from ``python -m
partitioner calibrate``).

Usage: ``python benchmarks/memory.py [--steps 3] [--cluster FILE] [--partita-only] [--out
benchmarks/results/<date>-memory.md]``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WORLD = 4
N_LAYER, N_EMBD, N_HEAD, VOCAB, SEQ, BATCH = 4, 256, 8, 2048, 256, 16
CLUSTER = "cpu"


def _model():
    from partitioner import models

    model, (idx, tgt) = models.gpt_demo(batch=BATCH, seq=SEQ, n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD,
                                        vocab_size=VOCAB)
    return model, (idx, tgt)


def _storage_key(t):
    s = t.untyped_storage()
    return (s.data_ptr(), id(s) if s.data_ptr() == 0 else 0)


class _HeldAfterForward:
    """Saved-for-backward storages, counted at the end of forward at the size they then have."""

    def __init__(self, exclude):
        self.exclude = exclude
        self.storages = {}

    def pack(self, t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            local = getattr(t, "_local_tensor", t)
            s = local.untyped_storage()
            if s.data_ptr() not in self.exclude:
                self.storages[s.data_ptr() or id(s)] = s
        return t

    def bytes(self):
        return sum(s.nbytes() for s in self.storages.values())


def _local(t):
    return getattr(t, "_local_tensor", t)


def _state_bytes(model, opt):
    params = {_local(p).untyped_storage().data_ptr(): _local(p) for p in model.parameters()}
    p = sum(t.numel() * t.element_size() for t in params.values())
    g = sum(_local(q.grad).numel() * _local(q.grad).element_size() for q in model.parameters() if q.grad is not None)
    s = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                s += _local(v).numel() * _local(v).element_size()
    return p, g, s


def _time_steps(step, steps):
    import torch.distributed as dist

    step()  # warm-up
    times, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu)


def _train_then_hold(net, batch, state, steps):
    """Time ``steps`` AdamW steps of ``net`` on ``batch``, then one more forward counting what it
    holds for backward (storages of ``state`` and the batch left out) and its backward. Returns
    (optimizer, median step s, median CPU s, bytes held at the end of forward)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = net(*batch)
        loss.backward()
        opt.step()
        return loss

    step_s, cpu_s = _time_steps(step, steps)
    opt.zero_grad(set_to_none=True)
    held = _HeldAfterForward({_local(t).untyped_storage().data_ptr() for t in [*state, *batch]})
    with torch.autograd.graph.saved_tensors_hooks(held.pack, lambda t: t):
        loss = net(*batch)
    after_forward = held.bytes()
    loss.backward()
    return opt, step_s, cpu_s, after_forward


def partita_worker(rank, world, plan_dict, steps):
    import partitioner
    from partitioner.sharding_plan import ShardingPlan

    model, batch = _model()
    plan = ShardingPlan.from_dict(plan_dict)
    pm = partitioner.auto_parallelize(model, batch, mesh=(world,), plan=plan)
    opt, step_s, cpu_s, after_forward = _train_then_hold(pm, batch, [*pm.parameters(), *pm.buffers()], steps)
    opt.zero_grad(set_to_none=True)
    m = partitioner.measure_memory(pm, batch, optimizer=opt)
    est = pm.plan.estimate()
    return dict(step_s=step_s, cpu_s=cpu_s, state=m.state, saved=m.saved_activations, after_forward=after_forward,
                est_state=est.memory.state, est_saved=est.memory.saved, est_peak=est.memory_bytes,
                est_step_s=est.step_time_s)


def torch_worker(rank, world, kind, steps):
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    model, (idx, tgt) = _model()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    batch = (idx[lo:hi].contiguous(), tgt[lo:hi].contiguous())
    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.h:
            if kind == "fsdp2_ac":
                inner = block.forward
                block.forward = lambda x, _f=inner: checkpoint(_f, x, use_reentrant=False)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt, step_s, cpu_s, saved = _train_then_hold(net, batch, list(model.parameters()), steps)
    p, g, s = _state_bytes(model, opt)
    dist.barrier()
    return dict(step_s=step_s, cpu_s=cpu_s, state=p + g + s, saved=saved)


def _plans():
    """The three Partita plans: no budget, a budget data parallelism cannot meet, a budget that
    forces recomputation. Returns (parameters, DP's estimated peak, [(name, budget, plan)])."""
    import partitioner

    model, batch = _model()
    n_params = sum(p.numel() for p in model.parameters())

    def plan(budget, **kw):
        return partitioner.plan(model, batch, mesh_shape=(WORLD,), cluster=CLUSTER, memory_budget=budget, **kw)

    free = plan(None)
    dp = plan(None, pins={"idx": ["S(0)"], "targets": ["S(0)"], "*": ["R"], "h.*": ["S(0)"], "ln_f": ["S(0)"],
                          "lm_head": ["S(0)"]}, recompute="none")
    dp_peak = dp.estimate().memory_bytes
    no_dp = int(0.85 * min(dp_peak, free.estimate().memory_bytes))
    sharded = plan(no_dp)
    out = [("Partita, no budget", None, free), ("Partita, budget below DP's peak", no_dp, sharded)]
    least_kept = sharded.data["stats"]["least_memory_without_recompute"]
    least = sharded.data["stats"]["least_memory"]
    for fraction in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
        budget = int(fraction * min(least_kept, sharded.estimate().memory_bytes))
        if budget < least:
            break
        try:
            redo = plan(budget)
        except partitioner.InfeasibleBudgetError:
            continue
        if any(b.get("recompute") for b in redo.data["blocks"]):
            out.append(("Partita, budget forcing recompute", budget, redo))
            break
    for factor in (1.05, 1.1, 1.2, 1.3, 1.5):  # about the least memory any plan needs
        budget = int(factor * least)
        try:
            out.append((f"Partita, tightest budget met ({factor:.2f} x the least)", budget, plan(budget)))
            break
        except partitioner.InfeasibleBudgetError:
            continue
    return n_params, dp_peak, out


def _use_cluster(cluster):
    global CLUSTER
    CLUSTER = cluster


def _fmt_mib(b):
    return f"{b / 2**20:.1f}"


def main(argv=None):
    from bench_common import revision

    from runtime.launch import run_on_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cluster", default=CLUSTER, help="what Partita plans for: cpu, a preset or a cluster file")
    ap.add_argument("--partita-only", action="store_true", help="skip the FSDP2 and DDP runs")
    args = ap.parse_args(argv)
    _use_cluster(args.cluster)
    torch.set_num_threads(1)
    n_params, dp_peak, plans = _plans()
    rows = []
    for name, budget, plan in plans:
        load = os.getloadavg()[0]
        res = run_on_ranks(partita_worker, WORLD, plan.to_dict(), args.steps, timeout_s=1800, collective_timeout_s=600)
        modes = ", ".join(f"{b['label']}: {b.get('recompute_mode', 'full' if b.get('recompute') else 'kept')}"
                          for b in plan.data["blocks"])
        rows.append(dict(name=name, budget=budget, modes=modes, load=load, **_worst(res)))
        print(rows[-1], flush=True)
        print(f"  {name}: measured {rows[-1]['step_s']:.3f} s/step, estimated {rows[-1]['est_step_s']:.3f} s/step "
              f"({CLUSTER}): measured/estimate {rows[-1]['step_s'] / rows[-1]['est_step_s']:.2f}", flush=True)
    for kind, name in (("fsdp2", "FSDP2 (fully_shard)"), ("fsdp2_ac", "FSDP2 + activation checkpointing"),
                       ("ddp", "DDP")):
        if args.partita_only:
            break
        try:
            load = os.getloadavg()[0]
            res = run_on_ranks(torch_worker, WORLD, kind, args.steps, timeout_s=1800, collective_timeout_s=600)
            rows.append(dict(name=name, load=load, **_worst(res)))
        except Exception as e:  # noqa: BLE001 - reported in the results, as the brief asks
            rows.append(dict(name=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
        print(rows[-1], flush=True)
    text = _report(n_params, dp_peak, rows)
    print(text)
    if args.out:
        # BENCH_REVISION: the commit, when run from an export of it (no .git there)
        Path(args.out).write_text(text + f"\nRevision: {os.environ.get('BENCH_REVISION') or revision()}.\n")


def _worst(results):
    """The slowest rank's step, the largest rank's memory (ranks hold about the same)."""
    out = {k: max(r[k] for r in results) for k in results[0]}
    out["total"] = max(r["state"] + r["saved"] for r in results)
    return out


def _report(n_params, dp_peak, rows):
    fsdp = next((r for r in rows if r["name"].startswith("FSDP2 (") and "error" not in r), None)
    lines = [
        f"# Memory and step time, Partita vs FSDP2 and DDP ({datetime.date.today().isoformat()})",
        "",
        f"GPT {N_LAYER} layers x {N_EMBD} ({N_HEAD} heads, vocabulary {VOCAB}, {n_params / 1e6:.2f} M parameters), "
        f"global batch {BATCH} x {SEQ} tokens, 4 gloo ranks on a shared 2-core CPU (`torch.set_num_threads(1)` per "
        f"rank), fp32, AdamW. Partita plans for cluster `{CLUSTER}` (its measured calibration); a data-parallel "
        f"plan (every weight replicated) is estimated at {_fmt_mib(dp_peak)} MiB per rank.",
        "",
        "Memory is measured on the CPU (no CUDA here, so no allocator peak): per rank, parameters + gradients + "
        "AdamW state + activations saved for backward (unique storages; Partita: `partitioner.measure_memory`; "
        "FSDP2 and DDP: the saved storages at the end of forward, at the size they then have, since FSDP2 frees "
        "its gathered weights after forward). The largest rank is shown, and the slowest rank's median step. "
        "The machine is shared: `load` is the 1-minute load average when the run started (2 cores; above 2, "
        "other jobs took CPU time from the ranks, and wall step times are comparable only between rows of "
        "similar load). So the step is also given as CPU seconds (`time.process_time`, the rank's threads, "
        "the largest rank's median), which another job's load changes far less; the step ratio uses it. "
        f"Partita's step-time estimate prices cluster `{CLUSTER}` (`cpu`: the compute of one process with guessed "
        "links, not 4 ranks sharing 2 cores; a `partitioner calibrate --ranks 4` file: measured with 4 ranks busy).",
        "",
        "| run | budget | recompute | state MiB | saved MiB | total MiB | estimate MiB (state + saved) | "
        "step s (wall) | CPU s per step | est. step s | wall / est. | memory / FSDP2 | CPU step / FSDP2 | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | | | could not run: {r['error']} | | | | | | | | | | |")
            continue
        est = _fmt_mib(r["est_state"] + r["est_saved"]) if "est_state" in r else "-"
        ratio_m = f"{r['total'] / (fsdp['total']):.2f}" if fsdp and r["name"].startswith("Partita") else ""
        ratio_t = f"{r['cpu_s'] / fsdp['cpu_s']:.2f}" if fsdp and r["name"].startswith("Partita") else ""
        lines.append(
            f"| {r['name']} | {_fmt_mib(r['budget']) + ' MiB' if r.get('budget') else '-'} | {r.get('modes', '-')} | "
            f"{_fmt_mib(r['state'])} | {_fmt_mib(r['saved'])} | {_fmt_mib(r['total'])} | {est} | "
            f"{r['step_s']:.2f} | {r['cpu_s']:.2f} | {r['est_step_s']:.3f} | {r['step_s'] / r['est_step_s']:.2f} | "
            f"{ratio_m} | {ratio_t} | {r['load']:.1f} |"
            if "est_state" in r
            else f"| {r['name']} | - | - | {_fmt_mib(r['state'])} | {_fmt_mib(r['saved'])} | {_fmt_mib(r['total'])} "
            f"| - | {r['step_s']:.2f} | {r['cpu_s']:.2f} | - | - | | | {r['load']:.1f} |"
        )
    lines.append("")
    for r in rows:
        if "est_saved" in r:
            lines.append(
                f"- {r['name']}: saved estimated {_fmt_mib(r['est_saved'])} MiB vs measured {_fmt_mib(r['saved'])} "
                f"MiB ({(r['est_saved'] - r['saved']) / max(r['saved'], 1) * 100:+.1f}%), state estimated "
                f"{_fmt_mib(r['est_state'])} vs {_fmt_mib(r['state'])} MiB; counted at the end of forward "
                f"{_fmt_mib(r['after_forward'])} MiB; estimated peak {_fmt_mib(r['est_peak'])} MiB."
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
