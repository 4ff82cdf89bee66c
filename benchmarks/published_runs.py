"""Estimates against published large-scale training runs, and the time to plan them.

For each published run (model shapes, devices, global batch, the configuration it ran and its
achieved throughput; the source named per row in ``RUNS``), in a fresh interpreter:

1. **The published configuration**, planned as given (:func:`partitioner.search.plan_config`
   with its pipeline, data, tensor and sequence degrees, microbatches, schedule and
   recomputation) in its published layout: a run with a tensor degree split its linear layers
   Megatron's way on that axis (``tensor_parallel="1d"``; every such row here ran Megatron-LM,
   Megatron-DeepSpeed or Llama 3's Megatron-style tensor parallelism); its estimated step,
   component by component (compute, exposed communication, pipeline bubble, gradient reduction,
   optimizer step), against the published step time. Free to place every op, the solver may use
   the tensor axis otherwise (Megatron 18.4B's ``tp`` 8 as weights sharded and gathered inside a
   node, FSDP-like, estimated 15% faster than Megatron's layout): that plan is reported beside it
   as *the published degrees* (``published_degrees``).
2. **The search** (``partitioner.plan(model, inputs, devices=N, ...)``, no mesh): the chosen
   configuration, its estimate against the published step time, the planning time (wall and
   CPU seconds) and how many configurations the search priced, bounded away and planned.

The published step time is the row's published throughput turned into seconds per step:

* ``megatron``: Megatron's FLOP count ``96 B s l h^2 (1 + s/6h + V/16lh)`` (four passes,
  recomputation included, as Megatron-LM and Megatron-DeepSpeed report) over the published
  TFLOP/s per GPU times the GPUs;
* ``model``: model FLOPs ``(6 N + 12 l h s)`` per token (PaLM's count, three passes) over the
  published TFLOP/s per GPU times the GPUs (Llama 3's Table 4 reports these);
* ``tokens``: tokens per GPU per step over the published tokens per second per GPU (torchtitan).

Mixture-of-experts rows (HF Mixtral / Qwen3-MoE on ``meta``, ``ep``: the published expert
degree, the experts over ``ep`` data ranks) count ``model`` FLOPs with the *active* parameters
(the non-expert ones plus ``k / E`` of the experts), as Megatron-Core counts the routed experts.

The models are built as the runs computed them where it changes the price: the GPT rows whose
runs predate fused attention kernels (Megatron-LM 2021, BLOOM 2022) compute attention unfused
(``GPTConfig.attention="eager"``: the ``heads x seq^2`` scores written, masked, softmaxed and
dropped out, each a pass over memory, and kept for backward), the others with one fused op.

Everything plans on ``meta`` (nothing is allocated) with the row's cluster preset, bf16 and Adam.

    python benchmarks/published_runs.py --json out.json --markdown out.md
    python benchmarks/published_runs.py --case bloom-176b
    python benchmarks/published_runs.py --case bloom-176b --skip-published   # the search alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import markdown_table  # noqa: E402
from plan_scale import megatron_flops  # noqa: E402

GPT_VOCAB = 51200
MEGATRON = "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, SC'21"
LLAMA3 = "Llama Team, The Llama 3 Herd of Models (2024), Table 4"
TORCHTITAN = "pytorch/torchtitan docs/performance.md (Llama 3, FSDP2 on 64 A100 80GB)"
MCORE_MOE = (
    "NVIDIA Megatron-LM megatron/core/transformer/moe/README.md (MCore v0.9: 468 TFLOPS for Mixtral 8x7B bf16 "
    "training) and its Mixtral 8x7B example (TP1 PP4 EP8, micro-batch 1, seq 4096, no recomputation)"
)
BRIDGE_MOE = (
    "NVIDIA NeMo Megatron-Bridge docs, skills/perf-techniques/moe-hardware-configs (rounded performance bands): "
    "Qwen3 30B on H100 'low-200s TFLOPS/GPU', TP1 EP8 PP1"
)

# family: "gpt" (partitioner.models.gpt_block) or "llama" (HF LlamaForCausalLM on meta).
# attention (gpt): "eager" where the run computed attention unfused (Megatron-LM in 2021 and
# Megatron-DeepSpeed for BLOOM in 2022, before FlashAttention: a batched matmul for q k^T, a fused
# scale-mask-softmax, dropout, a batched matmul with v), "sdpa" (default) for one fused op.
# tp, pp, dp, cp: the published degrees; mb: samples per microbatch per data-parallel rank;
# recompute: the published activation checkpointing; count: how the throughput is counted (above).
RUNS = {
    "megatron-18.4b": dict(
        source=f"{MEGATRON}, Table 1 row 4 (seq 2048, vocab 51,200; 135 TFLOP/s per GPU)",
        family="gpt",
        attention="eager",
        cluster="a100",
        layers=40,
        hidden=6144,
        heads=48,
        vocab=GPT_VOCAB,
        seq=2048,
        devices=256,
        batch=1024,
        tp=8,
        pp=1,
        cp=1,
        mb=4,
        recompute="all",
        tflops=135,
        count="megatron",
    ),
    "megatron-145.6b": dict(
        source=f"{MEGATRON}, Table 1 row 7 (148 TFLOP/s per GPU)",
        family="gpt",
        attention="eager",
        cluster="a100",
        layers=80,
        hidden=12288,
        heads=96,
        vocab=GPT_VOCAB,
        seq=2048,
        devices=1536,
        batch=2304,
        tp=8,
        pp=8,
        cp=1,
        mb=1,
        recompute="all",
        tflops=148,
        count="megatron",
    ),
    "megatron-1t": dict(
        source=f"{MEGATRON}, Table 1 row 10 (163 TFLOP/s per GPU)",
        family="gpt",
        attention="eager",
        cluster="a100",
        layers=128,
        hidden=25600,
        heads=160,
        vocab=GPT_VOCAB,
        seq=2048,
        devices=3072,
        batch=3072,
        tp=8,
        pp=64,
        cp=1,
        mb=1,
        recompute="all",
        tflops=163,
        count="megatron",
    ),
    "bloom-176b": dict(
        source="BigScience, BLOOM: A 176B-Parameter Open-Access Multilingual Language Model (2022), sec. 3.4: "
        "48 nodes of 8 A100 80GB, TP4 PP12 DP8, micro-batch 2, global batch 2048 x 2048 tokens, "
        "about 150 TFLOP/s per GPU in training (156 in the fastest configuration)",
        family="gpt",
        attention="eager",
        cluster="a100",
        layers=70,
        hidden=14336,
        heads=112,
        vocab=250880,
        seq=2048,
        devices=384,
        batch=2048,
        tp=4,
        pp=12,
        cp=1,
        mb=2,
        recompute="all",
        tflops=150,
        count="megatron",
    ),
    "llama3-405b": dict(
        source=f"{LLAMA3}: 8,192 H100, TP8 CP1 PP16 DP64, seq 8,192, batch 2,048 (16M tokens), "
        "430 TFLOP/s per GPU (43% BF16 MFU); sec. 3.3.2: FSDP shards optimizer state and gradients, "
        "weights kept after forward (ZeRO-2)",
        family="llama",
        cluster="h100",
        layers=126,
        hidden=16384,
        heads=128,
        kv_heads=8,
        intermediate=53248,
        vocab=128256,
        seq=8192,
        devices=8192,
        batch=2048,
        tp=8,
        pp=16,
        cp=1,
        mb=1,
        recompute="none",
        zero=2,
        tflops=430,
        count="model",
    ),
    "titan-llama3-8b": dict(
        source=f"{TORCHTITAN}: 8B, local batch 1, seq 8,192, selective op AC, 2,973 tokens/s per GPU (58.2% MFU)",
        family="llama",
        cluster="a100",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        vocab=128256,
        seq=8192,
        devices=64,
        batch=64,
        tp=1,
        pp=1,
        cp=1,
        mb=1,
        recompute="auto",
        zero=3,
        tokens_per_s=2973,
        count="tokens",
    ),
    "titan-llama3-70b": dict(
        source=f"{TORCHTITAN}: 70B, local batch 1, seq 8,192, full AC, 331 tokens/s per GPU (51.7% MFU)",
        family="llama",
        cluster="a100",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        intermediate=28672,
        vocab=128256,
        seq=8192,
        devices=64,
        batch=64,
        tp=1,
        pp=1,
        cp=1,
        mb=1,
        recompute="all",
        zero=3,
        tokens_per_s=331,
        count="tokens",
    ),
    "mcore-mixtral-8x7b": dict(
        source=f"{MCORE_MOE}; 64 H100 (TP1 PP4 EP8, the GPU count of NeMo's reference configuration); global "
        "batch 256 assumed (not stated beside the figure)",
        family="mixtral",
        cluster="h100",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        experts=8,
        top_k=2,
        vocab=32000,
        seq=4096,
        devices=64,
        batch=256,
        tp=1,
        pp=4,
        cp=1,
        ep=8,
        mb=1,
        recompute="none",
        tflops=468,
        count="model",
    ),
    "bridge-qwen3-30b-a3b": dict(
        source=f"{BRIDGE_MOE}; 215 TFLOP/s taken for 'low-200s'; 32 H100 (EP8 over 4 data ranks; the band names no GPU count), seq 4096, "
        "1 sample per GPU",
        family="qwen3_moe",
        cluster="h100",
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        intermediate=768,
        experts=128,
        top_k=8,
        vocab=151936,
        seq=4096,
        devices=32,
        batch=32,
        tp=1,
        pp=1,
        cp=1,
        ep=8,
        mb=1,
        recompute="none",
        tflops=215,
        count="model",
    ),
}


def build(run: dict):
    """The run's model on ``meta`` at its global batch and its example inputs."""
    from partitioner import models

    if run["family"] in ("mixtral", "qwen3_moe"):
        return moe_meta(run)
    if run["family"] == "gpt":
        return models.gpt_block(
            batch=run["batch"],
            seq=run["seq"],
            n_embd=run["hidden"],
            n_head=run["heads"],
            n_layer=run["layers"],
            vocab=run["vocab"],
            attention=run.get("attention", "sdpa"),
        )
    return models.llama_meta(
        n_layer=run["layers"],
        hidden=run["hidden"],
        heads=run["heads"],
        kv_heads=run["kv_heads"],
        intermediate=run["intermediate"],
        vocab=run["vocab"],
        batch=run["batch"],
        seq=run["seq"],
    )


def moe_meta(run: dict):
    """An HF mixture-of-experts model of the run's shapes on ``meta`` (bf16) and its inputs."""
    import torch
    import transformers

    sizes = dict(
        num_hidden_layers=run["layers"],
        hidden_size=run["hidden"],
        num_attention_heads=run["heads"],
        num_key_value_heads=run["kv_heads"],
        num_experts_per_tok=run["top_k"],
        vocab_size=run["vocab"],
        max_position_embeddings=run["seq"],
        use_cache=False,
    )
    if run["family"] == "mixtral":
        cfg = transformers.MixtralConfig(
            **sizes, intermediate_size=run["intermediate"], num_local_experts=run["experts"]
        )
        cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(
            **sizes, head_dim=128, moe_intermediate_size=run["intermediate"], num_experts=run["experts"]
        )
        cls = transformers.Qwen3MoeForCausalLM
    with torch.device("meta"):
        model = cls(cfg).to(torch.bfloat16)
    ids = torch.zeros(run["batch"], run["seq"], dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": torch.zeros_like(ids)}


def active_params(model, run: dict) -> float:
    """Parameters one token uses: all but the experts, plus ``k / E`` of the experts."""
    unique = {id(p): (n, p) for n, p in model.named_parameters()}.values()
    experts = sum(p.numel() for n, p in unique if ".experts." in n)
    total = sum(p.numel() for _, p in unique)
    return total - experts + experts * run.get("top_k", 1) / run.get("experts", 1)


def published_step_s(run: dict, params: float) -> float:
    """The published throughput as seconds per step (the module docstring's three counts)."""
    tokens = run["batch"] * run["seq"]
    if run["count"] == "megatron":
        flops = megatron_flops(run["batch"], run["seq"], run["layers"], run["hidden"], run["vocab"], 4)
        return flops / (run["tflops"] * 1e12 * run["devices"])
    if run["count"] == "model":
        flops = (6 * params + 12 * run["layers"] * run["hidden"] * run["seq"]) * tokens
        return flops / (run["tflops"] * 1e12 * run["devices"])
    return tokens / run["devices"] / run["tokens_per_s"]


def published_layout(run: dict) -> dict:
    """The planning options that fix the published layout: Megatron's tensor parallelism on the
    tensor axis where the run had one (none otherwise: data parallelism needs no option)."""
    return {"tensor_parallel": "1d"} if run["tp"] > 1 else {}


def published_config(run: dict):
    from partitioner.parallel_config import ParallelConfig

    dp = run["devices"] // (run["tp"] * run["pp"] * run["cp"])
    pipelined = run["pp"] > 1
    return ParallelConfig(
        pipeline=run["pp"],
        data=dp,
        tensor=run["tp"],
        microbatches=run["batch"] // (dp * run["mb"]) if pipelined else 1,
        schedule="1f1b" if pipelined else None,
        recompute=run["recompute"],
        global_batch=run["batch"],
        zero=run.get("zero", 0 if pipelined else 1),
        sequence=run["cp"],
        sequence_parallel="ring" if run["cp"] > 1 else "auto",
        expert=run.get("ep", 1),
    )


def components(plan) -> dict:
    """The plan's estimate, component by component (busiest rank, seconds)."""
    est = plan.estimate()
    cfg = plan.config
    return {
        "config": cfg.to_dict() if cfg is not None else None,
        "describe": cfg.describe() if cfg is not None else "",
        "step_s": est.step_time_s,
        "compute_s": est.compute_s,
        "comm_s": est.comm_s,
        "bubble_s": est.bubble_s,
        "grad_sync_s": est.grad_sync_s,
        "optimizer_s": est.optimizer_s,
        "memory_gib": est.memory_bytes / 2**30,
        "tflops": est.tflops_per_device,
        "mfu": est.mfu,
    }


def run_case(name: str, *, search: bool = True, published: bool = True) -> dict:
    import torch

    import partitioner
    from partitioner.search import plan_config

    torch.set_num_threads(1)
    run = RUNS[name]
    model, inputs = build(run)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    row: dict = {"run": name, "params": params, "published": run}
    row["published_step_s"] = published_step_s(run, active_params(model, run) if "experts" in run else params)
    options = dict(cluster=run["cluster"], precision="bf16", optimizer="adam")
    if published:
        layouts = {"published_config": published_layout(run)}
        if layouts["published_config"]:
            layouts["published_degrees"] = {}
        for key, layout in layouts.items():
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                row[key] = components(plan_config(model, inputs, published_config(run), **options, **layout))
            except Exception as exc:  # noqa: BLE001 - reported in the table (over budget, say)
                row[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            row[key]["seconds"] = time.perf_counter() - t0
            row[key]["cpu_s"] = time.process_time() - c0
    if search:
        t0, c0 = time.perf_counter(), time.process_time()
        plan = partitioner.plan(model, inputs, devices=run["devices"], **options)
        row["search"] = components(plan)
        row["search"]["seconds"] = time.perf_counter() - t0
        row["search"]["cpu_s"] = time.process_time() - c0
        row["search"]["load_1min"] = os.getloadavg()[0]
        row["search"]["table"] = {k: v for k, v in plan.data["search"].items() if k != "rows"}
        row["search"]["explain"] = plan.explain()
    return row


def _fresh(name: str, extra: list) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--case", name, *extra], capture_output=True, text=True, check=False, timeout=3600
    )
    if out.returncode != 0:
        return {"run": name, "error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cfg(c: dict | None) -> str:
    if not c:
        return "-"
    text = f"p{c['pipeline']} d{c['data']} t{c['tensor']}"
    if c.get("sequence", 1) > 1:
        text += f" cp{c['sequence']} {c.get('sequence_parallel')}"
    if c.get("expert", 1) > 1:
        text += f" ep{c['expert']}"
    if c["pipeline"] > 1:
        text += f", m={c['microbatches']} {c['schedule']}"
    return text + f", rc {c['recompute']}, ZeRO {c.get('zero')}"


def _parts(e: dict) -> str:
    return (
        f"compute {e['compute_s']:.2f}, comm {e['comm_s']:.2f}, bubble {e['bubble_s']:.2f}, "
        f"grad sync {e['grad_sync_s']:.2f}, optimizer {e['optimizer_s']:.2f}"
    )


COLUMNS = [
    ("run", "l"),
    ("GPUs", "r"),
    ("published step (s)", "r"),
    ("published config (its layout): estimate (s), ratio, components (s)", "l"),
    ("planned in (s)", "r"),
    ("published degrees (solver's layout): estimate (s), ratio", "l"),
    ("search: chosen", "l"),
    ("estimate (s)", "r"),
    ("ratio", "r"),
    ("search wall / CPU (s)", "r"),
    ("priced / bounded out / planned", "l"),
]


def _published_text(pub: dict, meas: float, *, parts: bool) -> str:
    if "error" in pub:
        return f"error: {pub['error'][:160]}"
    if not pub:
        return "-"
    text = f"{pub['step_s']:.2f}, **{pub['step_s'] / meas:.2f}**"
    return text + f", {_parts(pub)} ({_cfg(pub['config'])})" if parts else text


def markdown(results: list) -> str:
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["run"], f"error: {r['error'][-300:]!r}"])
            continue
        meas = r["published_step_s"]
        pub = r.get("published_config", {})
        pub_text = _published_text(pub, meas, parts=True)
        free_text = _published_text(r.get("published_degrees", {}), meas, parts=False)
        s = r.get("search")
        if s:
            counts = s["table"]["counts"]
            priced = sum(counts.values())
            search = [
                _cfg(s["config"]),
                f"{s['step_s']:.2f}",
                f"**{s['step_s'] / meas:.2f}**",
                f"{s['seconds']:.1f} / {s['cpu_s']:.1f}",
                f"{priced} / {counts.get('over budget', 0)} / {s['table']['plannings']}",
            ]
        else:
            search = ["-"] * 5
        published = [f"{r['run']} ({r['params'] / 1e9:.1f} B)", r["published"]["devices"], f"{meas:.2f}", pub_text]
        rows.append(published + [f"{pub.get('seconds', 0):.1f}", free_text] + search)
    return "\n".join(markdown_table(COLUMNS, rows)) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help="run one row here and print JSON")
    ap.add_argument("--only", nargs="*", help="rows to run (default: all)")
    ap.add_argument("--skip-published", action="store_true", help="the search alone")
    ap.add_argument("--skip-search", action="store_true", help="the published configuration alone")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--markdown", help="write the results table here")
    args = ap.parse_args()
    extra = [f for f, on in (("--skip-published", args.skip_published), ("--skip-search", args.skip_search)) if on]
    if args.case:
        row = run_case(args.case, search=not args.skip_search, published=not args.skip_published)
        print(json.dumps(row))
        return
    results = []
    for name in args.only or list(RUNS):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results.append(_fresh(name, extra))
        print(json.dumps(results[-1])[:600], file=sys.stderr, flush=True)
        if args.json:  # after every row: a long run's finished rows are kept
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    table = markdown(results)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
