"""A training run that survives a lost rank, for the kill-a-rank test (tests/test_checkpoint.py).

Run under torchrun with restarts::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --nproc-per-node 4 \\
        --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT tests/fault_train.py OUT --kill-at 7

Each rank trains ``gpt_demo`` auto-parallelized on a (2, 2) mesh (gloo) for ``--steps`` steps:
AdamW with a step LR schedule, over a small fixed token set shuffled at each epoch and
rolled at each batch from torch's global RNG (:class:`ShuffledBatches`: its position is the
epoch, the batch index and the epoch's order). Every ``--every`` steps it saves a checkpoint
(model, optimizer, scheduler, data position, RNG) to ``OUT/ckpt/step_<n>``. On the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) rank 3 kills itself with SIGKILL as step ``--kill-at``
starts; torchrun stops the others and starts the group again, and every attempt resumes from
the latest complete checkpoint. Rank 0 appends ``attempt step loss`` to ``OUT/losses.txt``
after each step and saves the final parameters, whole, to ``OUT/final.pt``.

:func:`reference_run` is the same training on one process without parallelism or restarts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for torchrun's workers

from partitioner import models  # noqa: E402

BATCH, SEQ, LAYERS, SEQUENCES = 8, 16, 2, 32
SEED = 1234
LR, ADAM_EPS = 1e-2, 1e-3  # as the parity tests (tests/parity_utils.py explains the eps)


class ShuffledBatches:
    """Batches of ``(idx, targets)`` from fixed token rows, reshuffled with ``torch.randperm`` at
    the start of each epoch and rolled by a random shift at each batch (both from torch's global
    RNG, so a resumed run needs it restored); ``state_dict()`` is the data position."""

    def __init__(self, rows: torch.Tensor, batch: int):
        self.rows, self.batch = rows, batch
        self.epoch, self.index, self.order = 0, 0, torch.randperm(len(rows))

    def next(self) -> tuple:
        if self.index * self.batch >= len(self.rows):
            self.epoch, self.index, self.order = self.epoch + 1, 0, torch.randperm(len(self.rows))
        chosen = self.rows[self.order[self.index * self.batch : (self.index + 1) * self.batch]]
        chosen = chosen.roll(int(torch.randint(0, chosen.shape[1], ())), dims=1)  # an "augmentation": RNG every step
        self.index += 1
        return chosen[:, :-1].contiguous(), chosen[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "order": self.order.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self.order = state["epoch"], state["index"], state["order"].clone()


def build():
    """The model, example inputs, optimizer and scheduler factories, and the data (seeded)."""
    model, inputs = models.gpt_demo(batch=BATCH, seq=SEQ, n_layer=LAYERS)
    rows = torch.randint(0, model.cfg.vocab_size, (SEQUENCES, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return model, inputs, rows


def optimizer_for(params):
    opt = torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def reference_run(steps: int) -> tuple:
    """(losses, final parameters) of the same training on one process."""
    model, _, rows = build()
    opt, sched = optimizer_for(model.parameters())
    torch.manual_seed(SEED)
    data = ShuffledBatches(rows, BATCH)
    losses = []
    for _ in range(steps):
        idx, targets = data.next()
        opt.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    import torch.distributed as dist

    import partitioner

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=-1, help="step at which rank 3 dies on the first attempt")
    parser.add_argument("--collective-timeout-s", type=float, default=30)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    rank = dist.get_rank()

    model, inputs, rows = build()
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100")
    opt, sched = optimizer_for(pm.parameters())
    torch.manual_seed(SEED)
    data = ShuffledBatches(rows, BATCH)
    start = 0
    latest = partitioner.latest_checkpoint(args.out / "ckpt")
    if latest is not None:
        start = partitioner.load_checkpoint(latest, pm, opt, scheduler=sched, data=data)["step"]
    for step in range(start, args.steps):
        if attempt == 0 and step == args.kill_at and rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        idx, targets = data.next()
        opt.zero_grad()
        loss = pm(idx, targets)
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0:
            with open(args.out / "losses.txt", "a") as f:
                f.write(f"{attempt} {step} {loss.item()!r}\n")
        if (step + 1) % args.every == 0:
            where = args.out / "ckpt" / f"step_{step + 1:06d}"
            partitioner.save_checkpoint(where, pm, opt, scheduler=sched, data=data, step=step + 1)
    final = pm.full_state_dict()
    if rank == 0:
        torch.save(final, args.out / "final.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
