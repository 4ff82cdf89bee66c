"""Fine-tune a HuggingFace causal LM from its checkpoint directory, auto-parallelized by Partita.

On N devices (gloo on CPUs, NCCL on GPUs: each rank takes GPU ``LOCAL_RANK``)::

    torchrun --nproc-per-node 4 examples/finetune_hf.py --model path/to/hf_dir --out finetuned \\
        --data corpus.txt --steps 200 --batch 8 --seq 256
    torchrun --nproc-per-node 4 examples/finetune_hf.py --model path/to/hf_dir --out finetuned --mesh 2x2
    torchrun --nproc-per-node 4 examples/finetune_hf.py --model hf_dir --out finetuned --mesh 2x2 --pipeline 1f1b

``--model`` is what ``save_pretrained`` writes (``model.safetensors``, or sharded files with
``model.safetensors.index.json``) with its ``config.json``. The steps:

1. the model is built from the config on ``meta`` (no weights anywhere yet);
2. ``partitioner.auto_parallelize(model, batch, checkpoint=model_dir)`` plans it (without
   ``--mesh``: the whole configuration is searched) and each rank reads only its own slices of
   the safetensors files (the bytes are logged);
3. AdamW with a warm-up and cosine schedule trains it; rank 0 shows a tqdm bar and appends one
   JSON line per step to ``--metrics`` (``<out>/metrics.jsonl``): loss, tokens/s, the step time
   beside the plan's estimate, the peak memory beside the plan's estimate;
4. every ``--checkpoint-every`` steps ``partitioner.save_checkpoint`` writes the whole job
   (model, optimizer, schedule, generators, data position) under ``--checkpoint-dir``, and
   ``--resume`` continues from the newest one (under any mesh or pipeline);
5. at the end ``save_pretrained(--out)`` gathers the shards rank-parallel into an HF directory
   that ``AutoModelForCausalLM.from_pretrained`` loads.

Data: ``--data`` a text file, tokenized with the model directory's tokenizer when it has one
(else its bytes, modulo the vocabulary); without it, tokens from a seeded generator (a smoke
test). Step ``s`` always sees the same global batch (windows drawn from ``(seed, s)``), so a
resumed run continues exactly where the saved one stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_vit import _pipeline_estimate, lr_lambda, parse_mesh, peak_memory_bytes, setup_distributed  # noqa: E402

import partitioner  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF checkpoint directory (what save_pretrained writes)")
    p.add_argument("--out", required=True, help="where save_pretrained writes the fine-tuned model")
    p.add_argument("--data", help="a text file to train on (default: seeded random tokens, a smoke test)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's eps")
    p.add_argument("--warmup", type=float, default=0.05, help="fraction of the steps spent warming up")
    p.add_argument("--mesh", help="e.g. 2x2 (default: the configuration is searched)")
    p.add_argument("--pipeline", default="none", help="a schedule (gpipe, 1f1b, ...) or auto: mesh axis 0 is stages")
    p.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (fp32 master weights)")
    p.add_argument("--cluster", help="the cost model's devices (default: the ones this job runs on)")
    p.add_argument("--checkpoint-dir", help="save_checkpoint folders go here (step_0000100, ...)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--stop-after", type=int, help="stop after this step, as a preempted job would (--resume goes on)")
    p.add_argument("--metrics", help="JSON lines, one per step (default: <out>/metrics.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def token_stream(args, vocab: int) -> torch.Tensor:
    """The training tokens (see the module docstring)."""
    if args.data is None:
        return torch.randint(0, vocab, (max(4096, 4 * args.batch * (args.seq + 1)),), generator=_gen(args.seed))
    text = Path(args.data).read_text()
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(args.model)(text)["input_ids"]
    except (OSError, ValueError):  # no tokenizer in the directory
        ids = [b % vocab for b in text.encode()]
    return torch.tensor(ids, dtype=torch.long)


def batch_at(tokens: torch.Tensor, args, step: int, device) -> dict:
    """Global batch ``step``: ``--batch`` windows of ``--seq`` tokens at offsets drawn from (seed, step)."""
    starts = torch.randint(0, len(tokens) - args.seq, (args.batch,), generator=_gen(args.seed * 100_003 + step))
    ids = torch.stack([tokens[s : s + args.seq] for s in starts.tolist()]).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def make_optimizer(params, args, total_steps: int) -> tuple:
    optimizer = torch.optim.AdamW(params, lr=args.lr, eps=args.adam_eps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, args.warmup))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def build(args, example: dict, device):
    """The parallel model, loaded from ``--model`` on every rank's slices, and (step seconds,
    memory bytes) the plan estimates."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    options = dict(checkpoint=args.model, precision=args.precision, device=device)
    if args.cluster:
        options["cluster"] = args.cluster
    if args.mesh:
        options["mesh"] = parse_mesh(args.mesh, dist.get_world_size())
    if args.pipeline != "none":
        options["pipeline"] = {"degree": options["mesh"][0]}
        if args.pipeline != "auto":
            options["pipeline"]["schedule"] = args.pipeline
    pm = partitioner.auto_parallelize(model, example, **options)
    if hasattr(pm, "train_step"):
        step_s, memory, _ = _pipeline_estimate(pm)
    else:
        est = pm.plan.estimate()
        step_s, memory = est.step_time_s, est.memory_bytes
    return pm, step_s, memory


def train_step(pm, batch: dict) -> torch.Tensor:
    if hasattr(pm, "train_step"):  # a pipeline runner: forward and backward over its microbatches
        return pm.train_step(batch)
    loss = pm(**batch).loss
    loss.backward()
    return loss.detach()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.pipeline != "none" and not args.mesh:
        raise SystemExit("--pipeline needs --mesh (its first axis becomes the stages)")
    rank, world, device = setup_distributed()
    if not dist.is_initialized():  # one process: a group of one, so the same path runs
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from transformers import AutoConfig

    tokens = token_stream(args, AutoConfig.from_pretrained(args.model).vocab_size)
    pm, est_step_s, est_memory = build(args, batch_at(tokens, args, 0, device), device)
    optimizer, scheduler = make_optimizer(pm.parameters(), args, args.steps)
    start = 0
    if args.resume and args.checkpoint_dir and (found := partitioner.latest_checkpoint(args.checkpoint_dir)):
        start = partitioner.load_checkpoint(found, pm, optimizer, scheduler=scheduler)["step"]
    metrics = Path(args.metrics or Path(args.out) / "metrics.jsonl")
    if rank == 0:
        metrics.parent.mkdir(parents=True, exist_ok=True)
        print(f"[finetune] {world} ranks; read {pm.checkpoint_bytes_read} bytes of {args.model} on rank 0", flush=True)
    from tqdm import tqdm

    end = min(args.steps, args.stop_after or args.steps)
    bar = tqdm(range(start, end), initial=start, total=args.steps, disable=rank != 0, desc="fine-tune")
    last = {}
    for step in bar:
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = train_step(pm, batch_at(tokens, args, step, device))
        optimizer.step()
        scheduler.step()
        seconds = time.perf_counter() - t0
        last = {
            "step": step + 1,
            "loss": float(loss),
            "lr": scheduler.get_last_lr()[0],
            "tokens_per_s": args.batch * args.seq / seconds,
            "step_s": seconds,
            "estimated_step_s": est_step_s,
            "peak_memory_bytes": peak_memory_bytes(device),
            "estimated_memory_bytes": est_memory,
        }
        if rank == 0:
            bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:.0f}")
            with metrics.open("a") as f:
                f.write(json.dumps(last) + "\n")
        if args.checkpoint_dir and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            folder = Path(args.checkpoint_dir) / f"step_{step + 1:07d}"
            partitioner.save_checkpoint(folder, pm, optimizer, scheduler=scheduler, step=step + 1)
    if end == args.steps:
        pm.save_pretrained(args.out)
    return last


if __name__ == "__main__":
    main()
