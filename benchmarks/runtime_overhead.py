"""Runtime overhead of Partita's lowered programs, measured in one run against its anchors.

1. **4 gloo ranks, Megatron TP**: an HF LLaMA (built from a config) with the standard Megatron
   plan: q/k/v/gate/up column-parallel, o/down row-parallel, everything else replicated.
   Partita runs it as pinned placements lowered to per-rank fx programs; the anchor is PyTorch's
   DTensor ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on the same
   modules. Bar: Partita / DTensor step time <= 1.0.
2. **1 rank**: Partita's lowered program on a 1-device mesh against the plain model.
   Bar: <= 1.05.

Two sizes: a small model, where per-op framework overhead dominates (Partita runs a flat aten
program; DTensor propagates placements per op in Python), and a medium one, where compute
dominates and both should cost the same. A step is forward, backward and an AdamW step; the
median of the timed steps after warm-up is reported. Beside Partita's measured step: its plan's
estimate (``plan.estimate().step_time_s``) priced for ``--cluster`` (a preset or a cluster file
from ``python -m partitioner calibrate``; the pins fix the placements, so only the estimate
changes with it). Usage: ``python benchmarks/runtime_overhead.py [--steps 12] [--cluster FILE]
[--sizes small] [--out results.md]``.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {  # name: (layers, hidden, heads, kv heads, ffn, vocab, batch, seq)
    "small (overhead-bound)": (4, 256, 8, 4, 704, 1024, 4, 64),
    "medium (compute-bound)": (4, 512, 8, 4, 1408, 1024, 8, 128),
}
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, BATCH, SEQ = SIZES["small (overhead-bound)"]


def use_size(name):
    global LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, BATCH, SEQ
    LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, BATCH, SEQ = SIZES[name]
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def build():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=VOCAB,
                      max_position_embeddings=SEQ, use_cache=False)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, {"input_ids": ids, "labels": ids.clone()}


def timed_steps(model, batch, params, steps):
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for _ in range(steps):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        out = model(**batch)
        loss = out.loss if hasattr(out, "loss") else out["loss"]
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    warm = max(2, steps // 4)
    return statistics.median(times[warm:]), loss.item()


def megatron_pins(world):
    pins = {"input_ids": ["R"], "labels": ["R"]}
    pins.update({f"model.layers.*.*.{name}.weight": ["S(0)"] for name in COLUMN})
    pins.update({f"model.layers.*.*.{name}.weight": ["S(1)"] for name in ROW})
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                "model.layers.*.input_layernorm.weight", "model.layers.*.post_attention_layernorm.weight"):
        pins[key] = ["R"]
    # how the weights are used, not only where they are stored (else the solver may gather them)
    pins.update({f"model.layers.*.*.{name}": ["S(2)"] for name in COLUMN})
    pins.update({f"model.layers.*.*.{name}": ["P"] for name in ROW})
    pins.update({"model.layers.*.input_layernorm": ["R"], "model.layers.*.post_attention_layernorm": ["R"]})
    return pins


def _tp_rank(rank, world, steps, size, cluster="h100"):
    use_size(size)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import partitioner

    model, batch = build()
    pm = partitioner.auto_parallelize(model, batch, mesh=(world,), pins=megatron_pins(world), cluster=cluster)
    ours, our_loss = timed_steps(pm, batch, pm.parameters(), steps)
    estimate = pm.plan.estimate().step_time_s

    ref, _ = build()
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(LAYERS):
        for name in COLUMN:
            sub = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj")) else "mlp"
            plan[f"model.layers.{i}.{sub}.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(ref, mesh, plan)
    theirs, their_loss = timed_steps(ref, batch, ref.parameters(), steps)
    return {"ours": ours, "dtensor": theirs, "our_loss": our_loss, "dtensor_loss": their_loss, "estimate": estimate,
            "local_mib": pm.local_parameter_bytes() / 2**20}


def _one_rank(rank, world, steps, size, cluster="h100"):
    use_size(size)
    import partitioner
    model, batch = build()
    plain, _ = build()
    pm = partitioner.auto_parallelize(model, batch, mesh=(1,), cluster=cluster)
    ours, _ = timed_steps(pm, batch, pm.parameters(), steps)
    base, _ = timed_steps(plain, batch, plain.parameters(), steps)
    ours2, _ = timed_steps(pm, batch, pm.parameters(), steps)   # interleave to damp drift
    return {"ours": min(ours, ours2), "plain": base, "estimate": pm.plan.estimate().step_time_s}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None, help="also write the table as markdown here")
    parser.add_argument("--cluster", default="h100",
                        help="what Partita's estimate is priced for: a preset or a cluster file (default: h100)")
    parser.add_argument("--sizes", default=",".join(s.split()[0] for s in SIZES),
                        help="comma-separated sizes to run (small, medium)")
    args = parser.parse_args(argv)
    from runtime.launch import run_on_ranks

    lines = ["| size | case | ours | ours s/step | estimate s/step | measured/estimate | anchor | anchor s/step | "
             "ratio | bar | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for size in [s for s in SIZES if s.split()[0] in args.sizes.split(",")]:
        use_size(size)
        desc = (f"LLaMA {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads ({KV_HEADS} kv), ffn {FFN}, vocab {VOCAB}; "
                f"batch {BATCH}x{SEQ}")
        print(f"{size}: {desc}; {args.steps} steps (median after warm-up)", flush=True)
        tp = run_on_ranks(_tp_rank, 4, args.steps, size, args.cluster, timeout_s=1200)
        ours = statistics.median(r["ours"] for r in tp)
        theirs = statistics.median(r["dtensor"] for r in tp)
        one = run_on_ranks(_one_rank, 1, args.steps, size, args.cluster, timeout_s=1200)[0]
        for case, a, ta, est, b, tb, bar in (
                ("Megatron TP, 4 gloo ranks", "Partita lowered program", ours, tp[0]["estimate"],
                 "DTensor parallelize_module", theirs, 1.0),
                ("1 rank", "Partita lowered program", one["ours"], one["estimate"], "plain model", one["plain"], 1.05)):
            ratio = ta / tb
            lines.append(f"| {size} | {case} | {a} | {ta:.4f} | {est:.4f} | {ta / est:.2f} | {b} | {tb:.4f} | "
                         f"{ratio:.3f} | <= {bar} | {'PASS' if ratio <= bar else 'FAIL'} |")
            print(f"  {case}: measured {ta:.4f} s/step, estimated {est:.4f} s/step ({args.cluster}): "
                  f"measured/estimate {ta / est:.2f}", flush=True)
        notes.append(f"- {size}: {desc}. Losses after the timed steps: Partita {tp[0]['our_loss']:.6f}, "
                     f"DTensor {tp[0]['dtensor_loss']:.6f}; parameters per rank {tp[0]['local_mib']:.2f} MiB.")
    table = "\n".join(lines)
    print(table)
    print("\n".join(notes))
    if args.out:
        header = (f"# Runtime overhead ({datetime.date.today().isoformat()})\n\n"
                  f"Machine: 2-core CPU shared with other work (timings are noisy), gloo, 1 thread per rank. "
                  f"Reproduce: `python benchmarks/runtime_overhead.py --steps {args.steps} --cluster {args.cluster}`."
                  f"\n\n"
                  f"Step = forward + backward + AdamW; median of {args.steps} steps after warm-up. Both runs use "
                  f"the same Megatron placements (Partita: pinned weights and linear outputs).\n\n")
        Path(args.out).write_text(header + table + "\n\n" + "\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
