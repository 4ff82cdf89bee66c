"""A training run for the two-host test (tests/test_two_hosts.py): one torchrun job per host.

Run on each host (tests/test_two_hosts.py gives the flags and says why each is there)::

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank R --rdzv-backend c10d \\
        --rdzv-endpoint HOST_A:PORT tests/two_host_train.py OUT

Every rank builds the same small HF GPT-2 (seeded), auto-parallelizes it on a (2, 2) mesh that
spans both hosts (gloo) and trains ``--steps`` steps of AdamW on fixed token batches. Global
rank 0 saves to ``OUT/result.pt``: the loss of each step, the whole gradients of step 1 and the
whole parameters after the last step. :func:`reference_run` is the same training on one process.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for torchrun's workers

from partitioner import models  # noqa: E402

BATCH, SEQ, VOCAB = 4, 16, 128
LR, ADAM_EPS = 1e-2, 1e-3  # as the parity tests (tests/parity_utils.py explains the eps)


def build():
    """The model, example inputs and one token batch per step (all seeded)."""
    model, inputs = models.hf_gpt2(batch=BATCH, seq=SEQ, vocab=VOCAB)
    return model, inputs


def batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(steps)]


def train(model, steps: int, grads_of) -> dict:
    """``steps`` AdamW steps of ``model``; ``grads_of(model)`` gives the whole gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses, first_grads = [], None
    for ids in batches(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        if first_grads is None:
            first_grads = grads_of(model)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": first_grads}


def reference_run(steps: int) -> dict:
    """The same training on one process: losses, step-1 gradients, final parameters."""
    model, _ = build()
    run = train(model, steps, lambda m: {k: p.grad.detach().clone() for k, p in m.named_parameters()})
    run["params"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return run


def main() -> None:
    import torch.distributed as dist

    import partitioner

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--collective-timeout-s", type=float, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    model, inputs = build()
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100")
    run = train(pm, args.steps, lambda m: m.full_grads())
    params = pm.full_state_dict()
    if dist.get_rank() == 0:
        run["params"] = params
        torch.save(run, args.out / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
