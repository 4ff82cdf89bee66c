"""Train a small ViT on Fashion-MNIST (or CIFAR-10), auto-parallelized by Partita.

One process (the model as built, plain PyTorch: the single-device reference)::

    python examples/train_vit.py --epochs 3

Four ranks, gloo on CPUs or NCCL on GPUs (each rank's GPU is ``LOCAL_RANK``)::

    torchrun --nproc-per-node 4 examples/train_vit.py --epochs 3 --mesh 2x2
    torchrun --nproc-per-node 4 examples/train_vit.py --epochs 3 --mesh 2x2 --pipeline 1f1b

Checkpoints and resume (the same command with ``--resume`` continues from the newest checkpoint
in the folder: model, optimizer, LR schedule, RNG and data position; a parallel job's checkpoint,
written by ``partitioner.save_checkpoint``, resumes under another mesh or ``--pipeline`` too)::

    torchrun --nproc-per-node 4 examples/train_vit.py --checkpoint-dir ckpt --checkpoint-every 200
    torchrun --nproc-per-node 4 examples/train_vit.py --checkpoint-dir ckpt --checkpoint-every 200 --resume

How it runs. Every rank builds the same model from the same seed and reads the whole dataset;
the data order of epoch ``e`` is a permutation drawn from ``(seed, e)``, so step ``s`` sees the
same global batch in any run, any world size, and after a resume. With more than one rank the
model goes through ``partitioner.auto_parallelize`` (the plan is printed on rank 0) and every
rank passes the same global batch: the parallel module takes its own piece. ``--pipeline`` makes
the first mesh axis pipeline stages (``auto`` lets the cost model choose the schedule). Test
accuracy is measured after every epoch on the plain model loaded with the trained weights
(``full_state_dict()``, gathered on every rank; a parallel module returns the logits as each
rank's pieces, a pipeline runner only trains), each rank scoring its share of the test batches.

Rank 0 logs every ``--log-every`` steps: the epoch's progress, the loss (and the gradients'
global norm with ``--clip-grad``, from ``partitioner.clip_grad_norm_`` on a parallel job),
samples per second, the peak memory (resident set on CPUs, allocated on a GPU) beside the plan's
estimate, and the measured step time beside the plan's estimated one (the cost model's
``step_time_s``; for a pipeline, its schedule simulated with the stage estimates).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_checkpoint import latest_state, load_state, save_state  # noqa: E402

import partitioner  # noqa: E402
from partitioner.data import DATASETS, load_dataset  # noqa: E402

SCHEDULE_CHOICES = ("none", "auto", "gpipe", "1f1b", "interleaved", "zb-h1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", choices=sorted(DATASETS), default="fashion-mnist")
    p.add_argument("--data-dir", default=None, help="folder of the dataset files (fashion-mnist: the Debian package's)")
    p.add_argument("--subset", type=int, default=0, help="train on the first N images only (0: all)")
    p.add_argument("--test-subset", type=int, default=0, help="evaluate on the first N test images only (0: all)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps in all (0: --epochs decide)")
    p.add_argument("--batch", type=int, default=128, help="global batch (every rank passes it whole)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up, as a fraction of all steps")
    p.add_argument("--clip-grad", type=float, default=0.0, help="clip the global gradient norm to this (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--patch", type=int, default=0, help="patch side (0: a quarter of the image's, 7 or 8)")
    p.add_argument("--mesh", default=None, help="mesh shape such as 2x2 or 4 (default: all ranks on one axis)")
    p.add_argument(
        "--pipeline",
        choices=SCHEDULE_CHOICES,
        default="none",
        help="pipeline schedule; its stages are the first mesh axis (auto: chosen by the cost model)",
    )
    p.add_argument("--microbatches", type=int, default=0, help="pipeline microbatches (0: chosen)")
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME=PLACEMENTS",
        help="fix a placement, one per mesh axis: pixel_values=S(0),R shards the batch on the first axis "
        "(an input, parameter FQN or module path; repeat for more); parallel runs only",
    )
    p.add_argument("--cluster", default=None, help="cost model cluster (default: cpu, measured, on CPUs; h100 on GPUs)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--history", default=None, help="write the per-step losses and the results here (JSON, rank 0)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir (the folder the run wrote its checkpoints to)")
    if args.batch < 1 or args.epochs < 1 or args.steps < 0 or args.log_every < 1:
        p.error("--batch, --epochs and --log-every must be >= 1 and --steps >= 0")
    return args


def parse_pins(items) -> dict:
    """``["pixel_values=S(0),R"]`` -> ``{"pixel_values": ["S(0)", "R"]}``."""
    pins = {}
    for item in items:
        name, sep, placements = item.partition("=")
        if not sep or not name or not placements:
            raise SystemExit(f"--pin {item!r}: write NAME=PLACEMENTS, e.g. pixel_values=S(0),R")
        pins[name] = placements.split(",")
    return pins


def parse_mesh(text, world: int) -> tuple:
    """``"2x2"`` -> (2, 2); None -> (world,). The sizes must multiply to the world size."""
    if text is None:
        return (world,)
    try:
        shape = tuple(int(s) for s in str(text).lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh {text!r}: write the mesh as sizes joined by x, e.g. 2x2 or 4") from None
    if math.prod(shape) != world or min(shape) < 1:
        raise SystemExit(
            f"--mesh {text}: {math.prod(shape)} ranks, but this job has {world} (torchrun --nproc-per-node)"
        )
    return shape


# -- the job ------------------------------------------------------------------------------------


def setup_distributed() -> tuple:
    """(rank, world size, device). Uses the process group the caller made, or makes one when
    launched by torchrun (RANK / WORLD_SIZE / LOCAL_RANK set): NCCL with this rank's GPU, or gloo."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    if not dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return 0, 1, device
    if dist.get_backend() == "nccl":
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def build_model(args, channels: int, image: int, classes: int) -> torch.nn.Module:
    """The ViT, from a config, with the weights the seed gives (the same on every rank)."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(  # type: ignore[call-arg]  # num_labels: a PretrainedConfig argument ViTConfig passes on
        image_size=image,
        patch_size=args.patch or image // 4,
        num_channels=channels,
        num_labels=classes,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(args.seed)
    return ViTForImageClassification(cfg)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of epoch ``epoch``: a permutation drawn from (seed, epoch) alone."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def global_batch(images, labels, args, step: int, steps_per_epoch: int, device) -> dict:
    epoch, i = divmod(step, steps_per_epoch)
    idx = epoch_order(len(labels), args.seed, epoch)[i * args.batch : (i + 1) * args.batch]
    return {"pixel_values": images[idx].to(device), "labels": labels[idx].to(device)}


class Job:
    """The model as it runs (plain, parallel module or pipeline runner) and what to say about it."""

    def __init__(self, model, args, world: int, device, example: dict):
        self.plain = model
        self.kind = "plain"
        self.runner = model
        cluster = args.cluster or ("cpu" if device.type == "cpu" else "h100")
        if world == 1:
            model.to(device)
            est = partitioner.plan(model, example, mesh_shape=(1,), cluster=cluster).estimate()
            self.estimate_s, self.estimate_bytes = est.step_time_s, est.memory_bytes
            self.describe = (
                f"one process, the model as built (not parallelized); the cost model ({cluster}) estimates "
                f"{est.step_time_s * 1e3:.3g} ms per step and {est.memory_bytes / 2**20:.1f} MiB"
            )
            return
        mesh, pins = parse_mesh(args.mesh, world), parse_pins(args.pin)
        if args.pipeline == "none":
            self.kind = "parallel"
            self.runner = partitioner.auto_parallelize(model, example, mesh=mesh, cluster=cluster, pins=pins)
            est = self.runner.plan.estimate()
            self.describe = self.runner.plan.summary()
            self.estimate_s, self.estimate_bytes = est.step_time_s, est.memory_bytes
            return
        self.kind = "pipeline"
        config = {"degree": mesh[0]}
        if args.pipeline != "auto":
            config["schedule"] = args.pipeline
        if args.microbatches:
            config["microbatches"] = args.microbatches
        self.runner = partitioner.auto_parallelize(
            model, example, mesh=mesh, cluster=cluster, pins=pins, pipeline=config
        )
        self.estimate_s, self.estimate_bytes, self.describe = _pipeline_estimate(self.runner)

    def parameters(self):
        return self.runner.parameters()

    def train_step(self, batch: dict) -> torch.Tensor:
        if self.kind == "pipeline":
            return self.runner.train_step(batch)
        loss = self.runner(**batch).loss
        loss.backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients' global norm (over every shard and stage: ``partitioner.clip_grad_norm_``)."""
        if self.kind == "plain":
            return float(torch.nn.utils.clip_grad_norm_(self.plain.parameters(), max_norm))
        return float(partitioner.clip_grad_norm_(self.runner, max_norm))

    def eval_model(self) -> torch.nn.Module:
        """The plain model holding the trained weights (a collective when they are gathered): a
        parallel module returns outputs other than the loss as each rank's pieces, and a
        pipeline runner only trains, so test accuracy is computed on the whole model."""
        if self.kind != "plain":
            self.plain.load_state_dict(self.runner.full_state_dict())
        return self.plain


def _pipeline_estimate(runner) -> tuple:
    """(simulated step seconds, the largest stage's memory estimate, a description)."""
    import passes.schedules as ps

    plans = runner.plan["stages"]
    estimates = [p.estimate() for p in plans]
    durations = ps.stage_durations(estimates, [g.takes_activations for g in runner.stage_graphs])
    step = ps.simulate(runner.schedule, *durations).makespan
    describe = "\n".join(
        [f"pipeline: {runner.schedule.name}, {len(plans)} stages, {runner.microbatches} microbatches"]
        + [f"stage {s}:\n{p.summary()}" for s, p in enumerate(plans)]
    )
    return step, max(e.memory_bytes for e in estimates), describe


@torch.no_grad()
def evaluate(job: Job, images, labels, batch: int, device) -> tuple:
    """(accuracy, mean loss) over the test images: each rank scores every world-th batch with
    the plain model holding the trained weights, and the sums are all-reduced."""
    model = job.eval_model()
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # correct predictions, summed loss
    for start in range(rank * batch, len(labels), world * batch):
        x, y = images[start : start + batch].to(device), labels[start : start + batch].to(device)
        logits = model(pixel_values=x).logits.float()
        sums[0] += (logits.argmax(-1) == y).sum()
        sums[1] += F.cross_entropy(logits, y, reduction="sum")
    if world > 1:
        dist.all_reduce(sums)
    model.train()
    return float(sums[0]) / len(labels), float(sums[1]) / len(labels)


def lr_lambda(total: int, warmup_fraction: float):
    warm = max(1, round(total * warmup_fraction))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    return factor


def peak_memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / max(1, total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def train(args: argparse.Namespace) -> dict:
    """Run the training job on this rank; returns the history (every rank returns the same)."""
    rank, world, device = setup_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)
    images, labels = load_dataset(args.dataset, "train", args.data_dir)
    test_images, test_labels = load_dataset(args.dataset, "test", args.data_dir)
    if args.subset:
        images, labels = images[: args.subset], labels[: args.subset]
    if args.test_subset:
        test_images, test_labels = test_images[: args.test_subset], test_labels[: args.test_subset]
    steps_per_epoch = len(labels) // args.batch
    if steps_per_epoch == 0:
        raise SystemExit(f"--batch {args.batch} is larger than the {len(labels)} training images")
    total = args.steps or args.epochs * steps_per_epoch
    classes = len(DATASETS[args.dataset])
    model = build_model(args, images.shape[1], images.shape[-1], classes)
    job = Job(model, args, world, device, global_batch(images, labels, args, 0, steps_per_epoch, device))
    say(f"{args.dataset}: {len(labels)} training images, {steps_per_epoch} steps of {args.batch} per epoch")
    say(f"{total} steps on {world} rank(s), {job.kind}; the plan:\n{job.describe}")
    optimizer = torch.optim.AdamW(job.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, args.warmup))
    history: dict = {"losses": [], "evals": [], "grad_norms": []}
    start = 0
    if args.resume:
        found = latest_state(args.checkpoint_dir, parallel=job.kind != "plain")
        if found is None:
            say(f"--resume: no checkpoint in {args.checkpoint_dir} yet; starting from step 0")
        else:
            extra = load_state(found, job.runner, optimizer, scheduler, parallel=job.kind != "plain")
            start, history = extra["step"], extra["history"]
            say(f"resumed from {found} at step {start}")
    times: list = []
    t_start = time.perf_counter()
    for step in range(start, total):
        t0 = time.perf_counter()
        loss = job.train_step(global_batch(images, labels, args, step, steps_per_epoch, device))
        if args.clip_grad:
            history["grad_norms"].append(job.clip_grad_norm_(args.clip_grad))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        history["losses"].append(float(loss))
        times.append(time.perf_counter() - t0)
        done = step + 1
        if done % args.log_every == 0 or done == total:
            rate = args.batch * len(times) / sum(times)
            measured = statistics.median(times)
            epoch, in_epoch = divmod(step, steps_per_epoch)
            grad_note = f" (grad norm {history['grad_norms'][-1]:.3f})" if args.clip_grad else ""
            say(
                f"step {done}/{total} epoch {epoch + 1} {_bar(in_epoch + 1, steps_per_epoch)} "
                f"loss {history['losses'][-1]:.4f}{grad_note} | {rate:.0f} samples/s | "
                f"mem {peak_memory_bytes(device) / 2**20:.0f} MiB peak (plan {job.estimate_bytes / 2**20:.1f} MiB) | "
                f"step {measured * 1e3:.1f} ms measured, {job.estimate_s * 1e3:.3g} ms estimated "
                f"(x{measured / job.estimate_s:.1f})",
                flush=True,
            )
            times = []
        if done % steps_per_epoch == 0 or done == total:
            acc, test_loss = evaluate(job, test_images, test_labels, args.batch, device)
            history["evals"].append({"step": done, "test_accuracy": acc, "test_loss": test_loss})
            say(f"step {done}: test accuracy {acc:.4f}, test loss {test_loss:.4f}", flush=True)
        if args.checkpoint_dir and (done == total or args.checkpoint_every and done % args.checkpoint_every == 0):
            path = save_state(
                args.checkpoint_dir,
                done,
                job.runner,
                optimizer,
                scheduler,
                parallel=job.kind != "plain",
                history=history,
            )
            say(f"checkpoint: {path}", flush=True)
    history.update(
        steps=total,
        resumed_from=start,
        time_s=time.perf_counter() - t_start,
        world=world,
        kind=job.kind,
        plan=job.describe,
        estimated_step_s=job.estimate_s,
        test_accuracy=history["evals"][-1]["test_accuracy"] if history["evals"] else None,
    )
    if args.history and rank == 0:
        Path(args.history).write_text(json.dumps(history, indent=1))
    return history


def main(argv=None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
