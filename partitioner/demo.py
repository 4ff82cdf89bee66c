"""The main job: a GPT auto-parallelized on 4 local gloo ranks, trained next to one process.

``python -m partitioner demo`` (or ``make demo``):

1. builds a small GPT (2 layers, 256 wide) and a character-level corpus made of Partita's own
   source files (real text, no download);
2. trains it for a few AdamW steps in this process: the single-device reference;
3. forks 4 gloo ranks; each calls ``auto_parallelize(model, batch, mesh=(2, 2))``: rank 0 plans
   with the cost model measured on this CPU and broadcasts the plan, every rank lowers it
   and slices its parameters; rank 0 prints the plan table, every rank dumps its program
   under ``out/demo/``; then the same steps run on the same batches;
4. prints both loss curves side by side and the largest difference;
5. shows what the same GPT, and a larger one, would be given on a 2x4 mesh of H100s (planned
   here without devices) beside this CPU's plan, with the two clusters' numbers and why the
   choices differ (:mod:`partitioner.demo_clusters`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

__all__ = ["main", "corpus_batches"]


def corpus_batches(steps: int, batch: int, seq: int, seed: int = 0):
    """``steps`` (input, target) batches of byte tokens from Partita's own source text."""
    root = Path(__file__).resolve().parent.parent
    text = b"".join(
        p.read_bytes() for d in ("partitioner", "passes", "runtime") for p in sorted((root / d).glob("*.py"))
    )
    data = torch.tensor(list(text), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        out.append((x, y))
    return out


LAYERS, WIDTH, HEADS = 2, 256, 8


def _build(seq):
    from partitioner.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH))


def _rank_main(rank, world, batches, seq, lr, out_dir, mesh):
    import partitioner

    model = _build(seq)
    pm = partitioner.auto_parallelize(model, batches[0], mesh=mesh, verbose=(rank == 0))
    if rank == 0:
        print(pm.plan.summary(), flush=True)
    partitioner.dump(pm, out_dir)
    losses, seconds = _train(pm, batches, lr)
    return {
        "losses": losses,
        "seconds": seconds,
        "param_bytes": pm.local_parameter_bytes(),
        "plan": pm.plan.to_json() if rank == 0 else None,
    }


def _train(model, batches, lr):
    """AdamW over ``batches``; (losses, seconds). The same loop for one process and for a rank."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, start = [], time.perf_counter()
    for x, y in batches:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partitioner demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="out/demo")
    args = parser.parse_args(argv)
    from runtime.launch import run_on_ranks

    torch.set_num_threads(1)
    batches = corpus_batches(args.steps, args.batch, args.seq)
    print(
        f"[demo] single-process reference: {args.steps} AdamW steps on batches of {args.batch}x{args.seq} byte tokens",
        file=sys.stderr,
        flush=True,
    )
    reference = _build(args.seq)
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    ref_losses, ref_seconds = _train(reference, batches, args.lr)
    print("[demo] 4 gloo ranks, mesh (2, 2): planning, lowering, training ...", file=sys.stderr, flush=True)
    results = run_on_ranks(_rank_main, 4, batches, args.seq, args.lr, args.out, (2, 2), timeout_s=600)
    par = results[0]["losses"]
    print(f"\n{'step':>4}  {'1 process':>12}  {'4 ranks':>12}  {'|diff|':>10}")
    for step, (a, b) in enumerate(zip(ref_losses, par, strict=True)):
        print(f"{step:>4}  {a:12.6f}  {b:12.6f}  {abs(a - b):10.2e}")
    worst = max(abs(a - b) for a, b in zip(ref_losses, par, strict=True))
    same = all(r["losses"] == par for r in results)
    print(f"\nlargest loss difference {worst:.2e}; every rank saw the same losses: {same}")
    print(
        f"parameters per rank: {results[0]['param_bytes'] / 2**20:.2f} MiB of {total / 2**20:.2f} MiB "
        f"({results[0]['param_bytes'] / total:.2f} of the model)"
    )
    print(
        f"time for {args.steps} steps: 1 process {ref_seconds:.2f} s, 4 ranks {results[0]['seconds']:.2f} s "
        f"(gloo on {torch.get_num_threads()}-thread CPU processes)"
    )
    print(f"partitioned programs and the plan: {Path(args.out).resolve()}")
    from partitioner.demo_clusters import comparison
    from partitioner.sharding_plan import ShardingPlan

    print(
        comparison(
            ShardingPlan.from_json(results[0]["plan"]),
            n_layer=LAYERS,
            n_embd=WIDTH,
            n_head=HEADS,
            batch=args.batch,
            seq=args.seq,
        )
    )
    return 0 if worst < 1e-3 and same else 1
