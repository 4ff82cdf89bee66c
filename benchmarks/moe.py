"""Mixture of experts: the largest MoE that fits a per-rank memory cap, with and without expert
parallelism, and measured steps on 4 gloo ranks.

``python benchmarks/moe.py [capacity|steps|equal_memory|measured|all]``:

1. ``capacity``: Mixtral-shaped models (2 layers, hidden 64, expert width 128, top-2, batch 8 x
   16 tokens, fp32 Adam) with 4, 8, ..., 256 experts, planned on 4 devices (mesh (4,),
   ``h100`` figures, so the choice does not depend on this machine) under a per-rank budget:
   for ``expert_parallel="auto"``, ``"off"`` (the experts' storage still free to be ZeRO
   sharded, gathered for use: FSDP's answer) and the replicated plan (``"off"``, the expert
   weights pinned whole), the largest expert count whose plan fits, its parameters and
   estimated peak per rank. Planned on ``meta`` (no routing measured: imbalance
   1.0).
2. ``steps``: the largest model ``"auto"`` fits trains on 4 gloo ranks of this machine (2 AdamW
   steps checked to run; seconds per step, median of 3 after one warm-up), and at the largest
   size the replicated plan fits, the step time of the solver's plan, forced expert parallelism
   and the replicated plan (the same budget): CPU times on a shared 2-core machine, noisy.

3. ``equal_memory``: at each size both fit under the same budget, the estimated step with expert
   parallelism (``"on"``) and without (``"off"``, ZeRO free to shard the experts), ``h100``
   figures: what EP saves or costs at equal memory.
4. ``measured``: on 4 gloo ranks, Partita with EP and without (same budget) and PyTorch FSDP2
   (``fully_shard`` per decoder layer and the root) on the same model and global batch, then
   each runner at its largest size: the peak bytes a rank allocates in one training step
   (``torch.distributed._tools.mem_tracker.MemTracker``, the same tool for every runner:
   parameters, gradients, optimizer state, activations, temporaries), the bytes Partita's
   collectives send, and the median step in wall and CPU seconds (the machine is shared: the
   timings are not a measurement of speed, memory and bytes are).

``steps`` alone uses the largest sizes the capacity part found (96 experts for ``"auto"``, 16
for the replicated plan, 2026-12-02). Results: ``benchmarks/results/2026-12-02-moe.md``,
``benchmarks/results/2026-12-03-moe.md`` (parts 3 and 4).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402

import partitioner  # noqa: E402

MiB = 2**20
BUDGET = 24 * MiB
EXPERTS = (8, 16, 32, 48, 64, 80, 96, 112, 128)
BATCH, SEQ = 8, 16


def build(experts: int, device="cpu"):
    config = transformers.MixtralConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
        vocab_size=256,
        output_router_logits=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.MixtralForCausalLM(config).train()
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


REPLICATED = {"model.layers.*.mlp.experts.*": ["R"]}


def _options(mode) -> dict:
    """``"replicated"``: experts off and their weights stored whole (the replicated plan)."""
    if mode == "replicated":
        return dict(expert_parallel="off", pins=REPLICATED)
    return dict(expert_parallel=mode)


def _plan(experts, mode):
    model, inputs = build(experts, "meta")
    try:
        plan = partitioner.plan(
            model, inputs, mesh=(4,), cluster="h100", memory_budget=BUDGET, recompute="none", **_options(mode)
        )
    except partitioner.InfeasibleBudgetError:
        return None
    return plan


def capacity() -> dict:
    rows, largest = [], {}
    for mode in ("auto", "off", "replicated"):
        for experts in EXPERTS:
            t0 = time.perf_counter()
            plan = _plan(experts, mode)
            if plan is None:
                rows.append((mode, experts, None, None, None, time.perf_counter() - t0))
                break
            params = sum(p.numel() for p in build(experts, "meta")[0].parameters())
            split = sorted(
                {
                    axis
                    for r in plan.records
                    if str(r["target"]).startswith("partita.moe_experts")
                    for axis, note in (r.get("notes") or {}).items()
                    if note.startswith("experts")
                }
            )
            rows.append((mode, experts, params, plan.estimate().memory_bytes, split, time.perf_counter() - t0))
            largest[mode] = (experts, params)
    print(f"budget {BUDGET / MiB:.0f} MiB per rank, mesh (4,)")
    print("| expert_parallel | experts | parameters | est. peak / rank | experts split on | plan s |")
    print("|---|---:|---:|---:|---|---:|")
    for mode, experts, params, peak, split, secs in rows:
        if params is None:
            print(f"| {mode} | {experts} | no plan fits | | | {secs:.1f} |")
        else:
            print(f"| {mode} | {experts} | {params:,} | {peak / MiB:.1f} MiB | {split or '-'} | {secs:.1f} |")
    for other in ("off", "replicated"):
        if "auto" in largest and other in largest:
            ratio = largest["auto"][1] / largest[other][1]
            print(f"largest that fits: auto {largest['auto']}, {other} {largest[other]}; parameter ratio {ratio:.2f}")
    return largest


def equal_memory() -> list:
    """Estimated step with and without expert parallelism under the same per-rank budget, at each
    size both fit (``h100`` figures, planned on ``meta``): the time EP saves or costs at equal memory."""
    rows = []
    print("| experts | EP est. step | EP est. peak | no-EP est. step | no-EP est. peak | no-EP / EP step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for experts in (16, 32, 64):
        ep, off = _plan(experts, "on"), _plan(experts, "off")
        if ep is None or off is None:
            continue
        a, b = ep.estimate(), off.estimate()
        rows.append((experts, a.step_time_s, b.step_time_s))
        print(
            f"| {experts} | {a.step_time_s * 1e6:.0f} us | {a.memory_bytes / MiB:.1f} MiB | "
            f"{b.step_time_s * 1e6:.0f} us | {b.memory_bytes / MiB:.1f} MiB | {b.step_time_s / a.step_time_s:.2f} |",
            flush=True,
        )
    return rows


def _train_worker(rank, world, cfg):
    model, inputs = build(cfg["experts"])
    pm = partitioner.auto_parallelize(
        model,
        inputs,
        mesh=(4,),
        cluster="h100",
        memory_budget=BUDGET,
        recompute="none",
        **_options(cfg["mode"]),
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    times, losses = [], []
    for _ in range(4):
        t0 = time.perf_counter()
        loss = pm(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"step_s": statistics.median(times[1:]), "losses": losses, "mib": pm.local_parameter_bytes() / MiB}


def steps(largest: dict) -> None:
    from runtime.launch import run_on_ranks

    both = min(largest["auto"][0], largest["replicated"][0])
    runs = [("auto", largest["auto"][0]), ("on", both), ("replicated", both), ("auto", both), ("on", both)]
    print("| expert_parallel | experts | parameters on rank 0 | s / step (median) | losses |")
    print("|---|---:|---:|---:|---|")
    for mode, experts in runs:
        out = run_on_ranks(_train_worker, 4, {"mode": mode, "experts": experts}, timeout_s=600)
        r = out[0]
        print(f"| {mode} | {experts} | {r['mib']:.1f} MiB | {r['step_s']:.3f} | {[round(x, 3) for x in r['losses']]} |")


# -- measured on 4 gloo ranks: EP vs no EP at equal memory, and FSDP2 -------------------------------


def _fsdp2(model):
    """PyTorch FSDP2: ``fully_shard`` on each decoder layer and the root (reshard after forward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _measured_worker(rank, world, cfg):
    """One runner on one model: the median step (wall and CPU s) of 3 after a warm-up, the peak
    bytes this rank allocates in one more step (``MemTracker``: parameters, gradients, optimizer
    state, activations and temporaries, the same tool for every runner), the bytes its collectives
    send (Partita's counter) and the plan's estimate."""
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from runtime.collectives import CommCounter

    model, inputs = build(cfg["experts"])
    if cfg["runner"] == "fsdp2":
        net, batch, plan = _fsdp2(model), {k: v[rank * 2 : rank * 2 + 2] for k, v in inputs.items()}, None
    else:
        options = _options(cfg["runner"] if cfg["runner"] != "no-ep" else "off")
        net = partitioner.auto_parallelize(
            model, inputs, mesh=(4,), cluster="h100", memory_budget=BUDGET, recompute="none", **options
        )
        batch, plan = inputs, net.plan
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step():
        loss = net(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step()]  # warm-up: the optimizer state exists from here on
    wall, cpu = [], []
    for _ in range(3):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    tracker = MemTracker()
    tracker.track_external(net, opt)
    with tracker, CommCounter() as counter:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    sent = sum(v for per_axis in counter.as_dict().values() for v in per_axis.values()) if plan is not None else None
    return {
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "peak": peak,
        "sent": sent,
        "losses": losses,
        "est_peak": plan.estimate().memory_bytes if plan is not None else None,
        "est_sent": plan.estimate().total_comm_bytes() if plan is not None else None,
        "load": os.getloadavg()[0],
    }


RUNNERS = {
    "on": "Partita, expert_parallel='on'",
    "no-ep": "Partita, expert_parallel='off' (ZeRO free)",
    "replicated": "Partita, experts replicated",
    "fsdp2": "FSDP2 (fully_shard per layer)",
}


def measured(points) -> list:
    """``points``: (runner, experts) pairs, each run on 4 forked gloo ranks; prints one row each
    (the largest rank's peak, the slowest rank's step) and returns the rows."""
    from runtime.launch import run_on_ranks

    rows = []
    print(
        "| runner | experts | parameters | peak / rank (measured) | est. peak | sent / rank | s / step (wall, CPU) "
        "| load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for runner, experts in points:
        out = run_on_ranks(_measured_worker, 4, {"runner": runner, "experts": experts}, timeout_s=900)
        params = sum(p.numel() for p in build(experts, "meta")[0].parameters())
        row = dict(
            runner=runner,
            experts=experts,
            params=params,
            peak=max(r["peak"] for r in out),
            sent=None if out[0]["sent"] is None else max(r["sent"] for r in out),
            wall_s=max(r["wall_s"] for r in out),
            cpu_s=max(r["cpu_s"] for r in out),
            est_peak=out[0]["est_peak"],
            losses=out[0]["losses"],
            load=out[0]["load"],
        )
        rows.append(row)
        est = f"{row['est_peak'] / MiB:.1f} MiB" if row["est_peak"] else "-"
        sent = f"{row['sent'] / MiB:.2f} MiB" if row["sent"] is not None else "not counted"
        print(
            f"| {RUNNERS[runner]} | {experts} | {params:,} | {row['peak'] / MiB:.1f} MiB | {est} | "
            f"{sent} | {row['wall_s']:.3f}, {row['cpu_s']:.3f} | {row['load']:.1f} |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    found = capacity() if part in ("capacity", "all") else {"auto": (96, 0), "replicated": (16, 0)}
    if part in ("steps", "all"):
        steps(found)
    if part in ("equal_memory", "all"):
        equal_memory()
    if part in ("measured", "all"):
        # equal memory (the same 24 MiB budget, both fit at 64 experts), then each runner's largest
        measured(
            [("on", 64), ("no-ep", 64), ("fsdp2", 64), ("on", 96), ("replicated", 16), ("fsdp2", 96), ("fsdp2", 128)]
        )
