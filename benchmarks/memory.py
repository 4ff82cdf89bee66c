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

**Sweep** (``--sweep``): the largest GPT that trains on 4 ranks under a fixed per-rank cap
(``--cap-mib``), depth x width (``--depths``, ``--widths``), smallest first, for Partita
(``memory_budget`` = ``--budget-fraction`` x the cap, ``zero="auto"``, ``recompute="auto"``)
and FSDP2 with every block checkpointed. The cap is enforced (``RLIMIT_DATA``, see
:func:`sweep_worker`): an out-of-memory is a real failure. Per point: fits or not, Partita's
estimated peak against the measured one, parameters + gradients + state + saved activations
(estimated and measured), step time in wall and CPU seconds, the load.

Usage: ``python benchmarks/memory.py [--steps 3] [--cluster FILE] [--partita-only] [--out
benchmarks/results/<date>-memory.md]``; ``python benchmarks/memory.py --sweep [--cap-mib 128]
[--steps 2] [--out FILE]`` (appends its section to FILE).
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


def _model(n_layer=N_LAYER, n_embd=N_EMBD, batch=BATCH, seq=SEQ):
    from partitioner import models

    n_head = N_HEAD if n_embd == N_EMBD else max(1, n_embd // 64)
    model, (idx, tgt) = models.gpt_demo(batch=batch, seq=seq, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
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


def _time_steps(step, steps, after_warmup=None):
    import torch.distributed as dist

    step()  # warm-up
    if after_warmup is not None:
        after_warmup()
    times, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu)


def _train_then_hold(net, batch, state, steps, after_warmup=None):
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

    step_s, cpu_s = _time_steps(step, steps, after_warmup)
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


# ----------------------------------------------------------------------------------- the sweep

SWEEP_DEPTHS, SWEEP_WIDTHS, SWEEP_BATCH, SWEEP_SEQ = (4, 8, 12), (256, 384, 512), 8, 64


def _oom(exc) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "memory" in text or "alloc" in text


def sweep_worker(rank, world, runner, size, cap, plan_dict, steps):
    """One runner at one GPT size under the per-rank cap, standing for a device's memory: once
    the model is distributed (the whole model each rank builds first is freed), the rank's
    private data (``RLIMIT_DATA``) may grow by ``cap`` less the bytes of its parameters and
    buffers then (so those, the gradients, AdamW state, activations and every transient the
    step allocates count; building the model, its capture and imports, host work on a GPU, do
    not); an allocation past it is a real out-of-memory, which ends the job (exit code 3)."""
    import gc
    import traceback

    import torch.distributed as dist
    from bench_common import cap_private_memory, process_status, reset_peak_rss

    from runtime.host_memory import return_freed_blocks

    return_freed_blocks()  # both runners: freed tensors leave the process (runtime/host_memory.py)
    depth, width = size
    model, (idx, tgt) = _model(depth, width, SWEEP_BATCH, SWEEP_SEQ)
    if runner == "partita":
        import partitioner
        from partitioner.sharding_plan import ShardingPlan

        net = partitioner.auto_parallelize(model, (idx, tgt), mesh=(world,), plan=ShardingPlan.from_dict(plan_dict))
        net.free_source_weights()  # the whole model each rank built, as fully_shard leaves FSDP2's
        batch, state = (idx, tgt), lambda: [*net.parameters(), *net.buffers()]
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.utils.checkpoint import checkpoint

        mesh = init_device_mesh("cpu", (world,))
        for block in model.h:
            inner = block.forward
            block.forward = lambda x, _f=inner: checkpoint(_f, x, use_reentrant=False)
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
        lo, hi = rank * SWEEP_BATCH // world, (rank + 1) * SWEEP_BATCH // world
        batch, state = (idx[lo:hi].contiguous(), tgt[lo:hi].contiguous()), lambda: list(model.parameters())
    if runner == "partita":
        del model
    gc.collect()
    # the cap stands for a device's memory: it holds the tensors (the shards now, and whatever
    # the step allocates), not the host-side work of building the model (the capture, imports)
    live = {_local(t).untyped_storage().data_ptr(): _local(t).untyped_storage().nbytes() for t in state()}
    base_data = process_status("VmData") - sum(live.values())
    cap_private_memory(cap, since=base_data)
    at_reset = {}

    def restart_peak():  # after the warm-up step: the code pages a step touches are mapped in
        at_reset.update(rss=process_status("VmRSS"), data=process_status("VmData"), ok=reset_peak_rss())

    try:
        opt, step_s, cpu_s, after_forward = _train_then_hold(net, batch, state(), steps, restart_peak)
        # the private data the rank held after the warm-up step, and the most the timed steps added to it
        held, rise = at_reset["data"] - base_data, process_status("VmHWM") - at_reset["rss"]
        out = dict(step_s=step_s, cpu_s=cpu_s, held=held, rise=rise, peak=held + rise)
        opt.zero_grad(set_to_none=True)
        if runner == "partita":
            m = partitioner.measure_memory(net, batch, optimizer=opt)
            est = net.plan.estimate()
            out.update(state=m.state, saved=m.saved_activations, est_state=est.memory.state,
                       est_saved=est.memory.saved, est_peak=est.memory_bytes, est_step_s=est.step_time_s)
        else:
            p, g, s = _state_bytes(model, opt)
            out.update(state=p + g + s, saved=after_forward)
        dist.barrier()
    except (MemoryError, RuntimeError) as exc:
        if not _oom(exc):
            raise
        print(f"rank {rank}: {runner} {size}: out of memory: {str(exc).splitlines()[0][:200]}", flush=True)
        if rank == 0:
            print("".join(traceback.format_tb(exc.__traceback__)[-4:]), flush=True)
        os._exit(3)  # the other ranks wait in a collective: end the job
    return out


def _sweep_plan(size, budget):
    """Partita's plan for one size under ``budget`` bytes per rank (zero and recomputation
    chosen by the solver), or the solver's reason why none fits."""
    import partitioner

    model, batch = _model(*size, SWEEP_BATCH, SWEEP_SEQ)
    try:
        plan = partitioner.plan(model, batch, mesh_shape=(WORLD,), cluster=CLUSTER, memory_budget=budget,
                                zero="auto", recompute="auto")
    except partitioner.InfeasibleBudgetError as exc:
        return None, str(exc).splitlines()[0]
    # the plan as data only: the capture (and the model's weights) are not kept in this process
    return plan.to_dict(), _describe(plan)


def _describe(plan):
    from collections import Counter

    from partitioner.plan_table import weight_storage

    storage = Counter(weight_storage(plan).values())
    modes = ", ".join(sorted({b.get("recompute_mode", "full" if b.get("recompute") else "kept")
                              for b in plan.data["blocks"]}))
    return f"recompute {modes}; weights " + ", ".join(f"{k} {v}" for k, v in sorted(storage.items()))


def sweep(cap_mib, fraction, steps, depths=SWEEP_DEPTHS, widths=SWEEP_WIDTHS):
    """Every (depth, width) for each runner, smallest first; a size is skipped (counted as not
    fitting) once a size no deeper and no wider has failed for that runner."""
    cap = int(cap_mib * 2**20)
    budget = int(fraction * cap)
    sizes = sorted(((d, w) for d in depths for w in widths), key=lambda s: _params(*s))
    rows = []
    for runner in ("partita", "fsdp2_ac"):
        failed = []
        for size in sizes:
            row = dict(runner=runner, depth=size[0], width=size[1], params=_params(*size))
            if any(f[0] <= size[0] and f[1] <= size[1] for f in failed):
                rows.append(dict(row, fits=False, status="not run: a smaller size failed"))
                continue
            plan_dict = None
            if runner == "partita":
                t0 = time.perf_counter()
                plan_dict, why = _sweep_plan(size, budget)
                row["plan_s"] = time.perf_counter() - t0
                if plan_dict is None:
                    failed.append(size)
                    rows.append(dict(row, fits=False, status=f"no plan fits the budget: {why[:160]}"))
                    print(rows[-1], flush=True)
                    continue
                row["plan"] = why
            row["load"] = os.getloadavg()[0]
            result = _run_point(runner, size, cap, plan_dict, steps)
            if "error" in result:
                failed.append(size)
                rows.append(dict(row, fits=False, status=result["error"]))
            else:
                rows.append(dict(row, fits=True, status="trained", **result))
            print(rows[-1], flush=True)
    return rows


def _run_point(runner, size, cap, plan_dict, steps) -> dict:
    """One runner at one size, its ranks forked from a fresh interpreter (``--point``): a process
    that has planned would hand them a heap with free space in it, which their small allocations
    would reuse without counting against the cap. Returns the worst rank's figures, or
    ``{"error": ...}`` (``out of memory`` when a rank ran out under the cap)."""
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(runner=runner, size=list(size), cap=cap, plan=plan_dict, steps=steps), f)
    try:
        done = subprocess.run([sys.executable, __file__, "--point", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("POINT "):
            return json.loads(line[len("POINT "):])
    return {"error": f"exit code {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:200]}"}


def _point(path):
    """``--point FILE``: run one sweep point (see :func:`_run_point`) and print its result."""
    import json

    from runtime.launch import RankFailure, run_on_ranks

    with open(path) as f:
        a = json.load(f)
    try:
        res = run_on_ranks(sweep_worker, WORLD, a["runner"], tuple(a["size"]), a["cap"], a["plan"], a["steps"],
                           timeout_s=1800, collective_timeout_s=600)
        out = _worst(res)
    except RankFailure as exc:
        out = {"error": "out of memory" if "code 3" in str(exc) else str(exc).splitlines()[0][:200]}
    print("POINT " + json.dumps(out), flush=True)


def _params(depth, width):
    """gpt_demo's parameter count: blocks, embeddings (tokens, positions), the untied head."""
    return depth * (12 * width * width + 13 * width) + (2 * VOCAB + SWEEP_SEQ) * width + 2 * width


def _sweep_report(rows, cap_mib, fraction, steps):
    def largest(runner):
        done = [r for r in rows if r["runner"] == runner and r["fits"]]
        return max(done, key=lambda r: r["params"]) if done else None

    best = {k: largest(k) for k in ("partita", "fsdp2_ac")}
    both = [(p, f) for p in rows for f in rows if p["runner"] == "partita" and f["runner"] == "fsdp2_ac"
            and p["fits"] and f["fits"] and (p["depth"], p["width"]) == (f["depth"], f["width"])]
    common = max(both, key=lambda pf: pf[0]["params"]) if both else None
    lines = [
        f"## Largest GPT under a {cap_mib:.0f} MiB cap per rank: Partita vs FSDP2 + activation checkpointing",
        "",
        f"GPT (`gpt_demo`: vocabulary {VOCAB}, width / 64 heads), depth x width over "
        f"{sorted({r['depth'] for r in rows})} x {sorted({r['width'] for r in rows})}, global batch {SWEEP_BATCH} x "
        f"{SWEEP_SEQ} tokens, 4 gloo "
        f"ranks, fp32, AdamW (`torch.optim.AdamW` defaults: on the CPU one tensor at a time), one warm-up step and "
        f"{steps} timed (median). The cap stands for a device's memory: once the model is distributed, each "
        f"rank's private data (`RLIMIT_DATA`) may grow by {cap_mib:.0f} MiB less the bytes of the parameters and "
        "buffers it then holds, so those shards, gradients, AdamW state, activations and every transient of the "
        "step count (building the model, its capture and the imports, host work on a GPU, do not); an "
        "allocation past the cap fails (a real out-of-memory ends the run). Each point's ranks are forked from "
        "a fresh interpreter. Partita: "
        f"`partitioner.plan(memory_budget={fraction:.2f} x the cap, zero=\"auto\", recompute=\"auto\", "
        f"cluster=\"{CLUSTER}\")` (ZeRO-1/2/3 and kept / selective / full recomputation chosen by the solver), "
        "run through `auto_parallelize(plan=...)`; FSDP2: `fully_shard` per block and the root, each block "
        "checkpointed (`torch.utils.checkpoint`, non-reentrant). Both with glibc's mmap threshold fixed "
        "(`runtime/host_memory.py`), so freed tensors leave the process. Memory per rank (the largest rank): "
        "`peak` = `held + rise`: `held` the parameters and buffers the rank held once the model was "
        "distributed plus the private data (`VmData`, what the cap limits) it had added by the end of the "
        "warm-up step, `rise` the most its resident set rose above its "
        "level then during the timed steps (`VmHWM`, restarted after the warm-up; an upper bound: pages of "
        "code a step maps in count too); `state + saved` = parameters + gradients + AdamW state + "
        "activations saved for backward (Partita: `measure_memory`, beside its estimate; FSDP2: counted at the "
        "end of forward). Step: the slowest rank's median, wall and CPU seconds (`time.process_time`); `load` "
        "is the 1-minute load average when the run started (2 cores shared with other jobs).",
        "",
        "| runner | depth x width | parameters | result | plan | peak MiB (est. / measured) | held + rise MiB | "
        "state + saved MiB (est. / measured) | step s (wall) | CPU s per step | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = "Partita" if r["runner"] == "partita" else "FSDP2 + AC"
        head = (f"| {name} | {r['depth']} x {r['width']} | {r['params'] / 1e6:.2f} M | {r['status']} | "
                f"{r.get('plan', '-')} |")
        if not r["fits"]:
            lines.append(head + " | | | | |" + (f" {r['load']:.1f} |" if "load" in r else " |"))
            continue
        est_peak = f"{_fmt_mib(r['est_peak'])} / " if "est_peak" in r else "- / "
        est_state = f"{_fmt_mib(r['est_state'] + r['est_saved'])} / " if "est_state" in r else "- / "
        lines.append(head + f" {est_peak}{_fmt_mib(r['peak'])} | {_fmt_mib(r['held'])} + {_fmt_mib(r['rise'])} | "
                     f"{est_state}{_fmt_mib(r['state'] + r['saved'])} | "
                     f"{r['step_s']:.2f} | {r['cpu_s']:.2f} | {r['load']:.1f} |")
    lines.append("")
    p, f = best["partita"], best["fsdp2_ac"]
    if p and f:
        lines.append(f"- Largest trained: Partita {p['depth']} x {p['width']} ({p['params'] / 1e6:.2f} M), FSDP2 + AC "
                     f"{f['depth']} x {f['width']} ({f['params'] / 1e6:.2f} M): ratio of model sizes "
                     f"{p['params'] / f['params']:.2f} (bar >= 1.0).")
    else:
        lines.append(f"- Largest trained: Partita {p and p['params']}, FSDP2 + AC {f and f['params']}.")
    if common:
        a, b = common
        lines.append(f"- Step time at the largest size both train ({a['depth']} x {a['width']}): Partita "
                     f"{a['cpu_s']:.2f} CPU s ({a['step_s']:.2f} s wall), FSDP2 + AC {b['cpu_s']:.2f} CPU s "
                     f"({b['step_s']:.2f} s wall): ratio {a['cpu_s'] / b['cpu_s']:.2f} CPU, "
                     f"{a['step_s'] / b['step_s']:.2f} wall (bar <= 1.0).")
    return "\n".join(lines)


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
    ap.add_argument("--sweep", action="store_true", help="the largest GPT under --cap-mib per rank (depth x width)")
    ap.add_argument("--cap-mib", type=float, default=128)
    ap.add_argument("--budget-fraction", type=float, default=0.85, help="Partita's memory_budget: this x the cap")
    ap.add_argument("--depths", default=",".join(map(str, SWEEP_DEPTHS)))
    ap.add_argument("--widths", default=",".join(map(str, SWEEP_WIDTHS)))
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)  # one sweep point (internal)
    args = ap.parse_args(argv)
    _use_cluster(args.cluster)
    torch.set_num_threads(1)
    if args.point:
        return _point(args.point)
    if args.sweep:
        depths, widths = (tuple(int(x) for x in v.split(",")) for v in (args.depths, args.widths))
        rows = sweep(args.cap_mib, args.budget_fraction, args.steps, depths, widths)
        text = _sweep_report(rows, args.cap_mib, args.budget_fraction, args.steps)
        print(text)
        if args.out:
            revision_line = f"\nRevision: {os.environ.get('BENCH_REVISION') or revision()}.\n"
            with open(args.out, "a") as f:
                f.write("\n" + text + revision_line)
        return
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
