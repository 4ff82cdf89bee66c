"""One GPU, bf16: Partita's 1-rank lowered program against the plain model under autocast.

What it checks, in one command, on a machine with a CUDA device:

1. the NCCL path: a 1-rank NCCL process group, ``auto_parallelize`` placing the model on the
   device from ``LOCAL_RANK`` (0 here);
2. parity: the lowered program's loss and gradients against the plain model, both under
   ``torch.autocast(dtype=bfloat16)`` (bf16 tolerances as in tests/test_mixed_precision.py);
3. speed: the median step time (forward, backward, AdamW) of each, their ratio (bar: <= 1.05),
   the plan's estimated step time beside the measured one, and the MFU of each: model FLOPs per
   step (6 x parameters x tokens + attention) over the step time and the GPU's bf16 peak (the
   ``h100``/``h200`` cluster preset that matches the device name).

Without a CUDA device it says so and exits 0 without measuring, unless ``--device cpu`` is given:
then the same steps run on the CPU with gloo (used by the test suite so the script cannot rot).
Usage: ``python benchmarks/gpu_check.py [--steps 20] [--layers 12 --hidden 1024] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def model_flops(model, batch: int, seq: int) -> float:
    """Training FLOPs of one step: 6 per parameter per token, plus attention's 12 * layers * hidden * seq."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    return 6 * params * batch * seq + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq * batch * seq


def timed(step, steps: int, device) -> float:
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] if len(times) > 4 else times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: not run (run it where a GPU is, or pass --device cpu)")
        return 0

    import torch.distributed as dist

    import partitioner
    from partitioner.local_cluster import get_cluster

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    try:
        model, batch = build(args)
        ref = copy.deepcopy(model).to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
        preset = "h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device) else "h100"
        cluster = preset if device.type == "cuda" else "cpu"
        pm = partitioner.auto_parallelize(model.to(device), batch, mesh=(1,), cluster=cluster, precision="bf16")

        # parity, one step
        loss = pm(**batch).loss
        loss.backward()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            expected = ref(**batch).loss
        expected.backward()
        grads = pm.full_grads()
        worst = max(
            ((grads[n] - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item() for n, q in ref.named_parameters()
        )
        print(
            f"loss: partita {loss.item():.6f}, plain {expected.item():.6f}; worst gradient error (norm-wise) {worst:.2e}"
        )
        ok = abs(loss.item() - expected.item()) <= 2**-6 * abs(expected.item()) and worst <= 2**-4

        # speed
        def step_of(module, autocast):
            opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

            def step():
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = module(**batch).loss
                out.backward()
                opt.step()

            return step

        t_plain = timed(step_of(ref, True), args.steps, device)
        t_partita = timed(step_of(pm, False), args.steps, device)  # the program runs under its own autocast
        flops = model_flops(ref, args.batch, args.seq)
        peak = get_cluster(cluster).flops_for("bfloat16")
        print(
            f"step time: partita {t_partita * 1e3:.2f} ms, plain {t_plain * 1e3:.2f} ms, "
            f"ratio {t_partita / t_plain:.3f} (bar <= 1.05)"
        )
        print(
            f"estimate: {pm.plan.estimate().step_time_s * 1e3:.2f} ms (cluster {cluster}), "
            f"measured {t_partita * 1e3:.2f} ms"
        )
        print(
            f"MFU: partita {flops / t_partita / peak:.1%}, plain {flops / t_plain / peak:.1%} "
            f"({flops / 1e12:.2f} TFLOP per step, peak {peak / 1e12:.0f} TFLOP/s)"
        )
        if not ok:
            print("gpu_check: parity FAILED")
            return 1
        return 0
    finally:
        dist.destroy_process_group()
        os.unlink(store)


if __name__ == "__main__":
    sys.exit(main())
