"""A model too big for one process's memory cap trains when Partita shards it over 4 ranks.

Each process gets the same cap on its private (anonymous) memory with ``RLIMIT_DATA``;
file-backed pages of the checkpoint, opened with ``mmap``, do not count, as on a machine where
the weights sit on disk. The model is built on ``meta`` (no memory) and its weights come from a
full checkpoint written once, tensor by tensor.

1. One process: load the whole model and take one AdamW step under the cap. Expected: out of
   memory (parameters + gradients + Adam state are 16 bytes per parameter).
2. 4 gloo ranks, Megatron TP: each rank loads only its shards and takes a few AdamW steps under
   the same cap. Expected: trains; the per-rank parameter bytes are reported against
   total / 4 (bar: <= 1.05 x, plus replicated small tensors).

Usage: ``python benchmarks/memory_cap.py [--cap-gib 1.0] [--out results.md]``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import torch
from bench_common import cap_private_memory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

N_EMBD, N_LAYER, N_HEAD, VOCAB, SEQ, BATCH = 1024, 8, 16, 4096, 64, 4
TP = {"idx": ["R"], "targets": ["R"], "h.*.attn.c_attn.weight": ["S(0)"], "h.*.mlp.c_fc.weight": ["S(0)"],
      "h.*.attn.c_proj.weight": ["S(1)"], "h.*.mlp.c_proj.weight": ["S(1)"], "wte.weight": ["S(1)"],
      "lm_head.weight": ["S(0)"], "h.*.attn.c_attn": ["S(2)"], "h.*.mlp.c_fc": ["S(2)"]}


def _config():
    from partitioner.models import GPTConfig
    return GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD)


def _meta_model():
    from partitioner.models import GPT
    with torch.device("meta"):
        return GPT(_config())


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def write_checkpoint(path):
    """Full weights, made one tensor at a time (the writer never holds optimizer state)."""
    torch.manual_seed(0)
    state = {}
    for name, p in _meta_model().named_parameters():
        state[name] = torch.randn(p.shape) * 0.02 if p.dim() > 1 else torch.zeros(p.shape)
    torch.save(state, path)
    return sum(t.numel() for t in state.values())




def _single(rank, world, path, gib):
    cap_private_memory(gib * 2**30)
    try:
        from partitioner.models import GPT
        model = GPT(_config())
        model.load_state_dict(torch.load(path, mmap=True, weights_only=True))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = _batch()
        model(x, y).backward()
        opt.step()
        return "trained"
    except (MemoryError, RuntimeError) as exc:
        return f"out of memory: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _sharded(rank, world, path, gib, steps):
    cap_private_memory(gib * 2**30)
    import partitioner
    x, y = _batch()
    pm = partitioner.auto_parallelize(_meta_model(), (x, y), mesh=(world,), pins=TP, checkpoint=path, cluster="h100")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = pm(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    replicated = sum(p.numel() * p.element_size() for n, p in pm.named_parameters() if pm.placement_of(n) == "[R]")
    return {"losses": losses, "param_bytes": pm.local_parameter_bytes(), "replicated_bytes": replicated}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from runtime.launch import run_on_ranks

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "full.pt")
        numel = write_checkpoint(path)
        total = numel * 4
        print(f"GPT {N_LAYER} layers x {N_EMBD}: {numel / 1e6:.1f} M parameters, {total / 2**30:.2f} GiB fp32, "
              f"{16 * numel / 2**30:.2f} GiB with gradients and Adam state; cap {args.cap_gib:.2f} GiB per process",
              flush=True)
        single = run_on_ranks(_single, 1, path, args.cap_gib, timeout_s=600)[0]
        print(f"1 process: {single}", flush=True)
        ranks = run_on_ranks(_sharded, 4, path, args.cap_gib, args.steps, timeout_s=1200)
    r0 = ranks[0]
    bound = 1.05 * total / 4 + r0["replicated_bytes"]
    ratio = r0["param_bytes"] / (total / 4)
    lines = [
        "| run | result |", "|---|---|",
        f"| 1 process, whole model | {single} |",
        f"| 4 ranks, Megatron TP | trained {args.steps} steps, losses {', '.join(f'{v:.4f}' for v in r0['losses'])} |",
        f"| parameter bytes per rank | {r0['param_bytes'] / 2**20:.1f} MiB = {ratio:.3f} x total/4 "
        f"({r0['replicated_bytes'] / 2**20:.2f} MiB replicated); bound 1.05 x total/4 + replicated = "
        f"{bound / 2**20:.1f} MiB: {'PASS' if r0['param_bytes'] <= bound else 'FAIL'} |",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(
            f"# Memory cap ({datetime.date.today().isoformat()})\n\nMachine: 2-core CPU, gloo. Reproduce: "
            f"`python benchmarks/memory_cap.py`.\n\nGPT {N_LAYER} layers x {N_EMBD} ({numel / 1e6:.1f} M parameters, "
            f"{total / 2**30:.2f} GiB fp32); private-memory cap (RLIMIT_DATA) {args.cap_gib:.2f} GiB per process.\n\n"
            + table + "\n")


if __name__ == "__main__":
    main()
