"""Mixture of experts: the largest MoE that fits a per-rank memory cap, with and without expert
parallelism, and measured steps on 4 gloo ranks.

``python benchmarks/moe.py [capacity|steps|all]``:

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

``steps`` alone uses the largest sizes the capacity part found (96 experts for ``"auto"``, 16
for the replicated plan, 2026-12-02). Results: ``benchmarks/results/2026-12-02-moe.md``.
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


if __name__ == "__main__":
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    found = capacity() if part in ("capacity", "all") else {"auto": (96, 0), "replicated": (16, 0)}
    if part in ("steps", "all"):
        steps(found)
