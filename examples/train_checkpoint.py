"""Checkpoints of the example trainer, one folder per step (``<dir>/step-0000200``).

A parallel job (a module or a pipeline runner from ``auto_parallelize``) saves with
``partitioner.save_checkpoint``: every rank writes its own pieces through
``torch.distributed.checkpoint``, and the folder reloads under another mesh, plan or pipeline.
The one-process run trains the plain model, which ``partitioner.save_checkpoint`` does not
take; it writes ``plain.pt`` (the model's, optimizer's and LR scheduler's state dicts, the torch
RNG state and the extra values) under a temporary name renamed when complete. The newest folder
a job can read is the one with the largest step: with DCP's ``.metadata`` (written last, once
every rank is done) for a parallel job, with ``plain.pt`` for one process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import partitioner

__all__ = ["step_folder", "save_state", "load_state", "latest_state"]

_PLAIN = "plain.pt"


def step_folder(directory, step: int) -> Path:
    return Path(directory) / f"step-{step:07d}"


def save_state(directory, step: int, model, optimizer, scheduler, *, parallel: bool, **extra) -> Path:
    """Save the job's state after ``step``; returns the folder. Every rank calls it."""
    folder = step_folder(directory, step)
    if parallel:
        partitioner.save_checkpoint(folder, model, optimizer, scheduler=scheduler, step=step, **extra)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "extra": dict(extra, step=step),
    }
    torch.save(state, folder / f".{_PLAIN}.tmp")
    os.replace(folder / f".{_PLAIN}.tmp", folder / _PLAIN)
    return folder


def latest_state(directory, *, parallel: bool) -> Path | None:
    """The newest complete checkpoint of this kind in ``directory``, or None. A folder holding
    only the other kind is refused, saying which job wrote it."""
    root = Path(directory)
    if not root.is_dir():
        return None
    mine = ".metadata" if parallel else _PLAIN
    found = [p for p in root.iterdir() if p.name.startswith("step-") and (p / mine).is_file()]
    if found:
        return max(found, key=lambda p: p.name)
    other = [p.name for p in root.iterdir() if (p / (_PLAIN if parallel else ".metadata")).is_file()]
    if other:
        writer, reader = ("one process", "torchrun") if parallel else ("a parallel job", "one process")
        raise SystemExit(
            f"--resume: {directory} holds checkpoints written by {writer} ({sorted(other)[-1]}), which a run on "
            f"{reader} does not read; resume with the kind of job that wrote them, or start a new --checkpoint-dir"
        )
    return None


def load_state(folder, model, optimizer, scheduler, *, parallel: bool) -> dict:
    """Restore the state saved in ``folder``; returns the extra values (``step``, ...)."""
    if parallel:
        return partitioner.load_checkpoint(folder, model, optimizer, scheduler=scheduler)
    state = torch.load(Path(folder) / _PLAIN, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["extra"]
