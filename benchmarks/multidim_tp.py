"""1D vs 2D vs 2.5D vs 3D tensor parallelism: memory, plan quality, measured step time.

Three parts (``python benchmarks/multidim_tp.py [memory|quality|steps|all]``):

1. ``memory``: one transformer layer (GPT block, hidden 8192, 64 heads, sequence 2048, batch 16,
   fp32 Adam) planned on the ``meta`` device for 8 and 64 devices with each algorithm forced
   (``tensor_parallel=``): bytes per device of the weights (parameter + gradient + Adam state),
   of the activations backward keeps (saved activations + gathered buffers) and the peak, as the
   plan estimates them. No devices are needed.
2. ``quality``: GPTs on 64 H100s (2 layers, hidden 16384, 128 heads, sequence 2048, batch 16)
   and 512 H100s (4 layers, hidden 8192, 64 heads, sequence 1024, batch 64), vocabulary 32768,
   8 GPUs per node (an axis whose ranks span more than 8 devices runs on InfiniBand): the
   solver's plan (``"auto"``) against each algorithm forced, all priced by the same cost model
   (estimated step time, communication per device, peak memory, what each linear layer runs).
3. ``steps``: measured seconds per training step (forward, backward, AdamW) of a tiny GPT on
   gloo ranks of this machine: each algorithm forced against 1D on the same number of ranks
   (2D on 4 ranks, 2.5D and 3D on 8), median of the timed steps.

Results: ``benchmarks/results/2026-12-01-multidim_tp.md``.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import partitioner  # noqa: E402
from partitioner import models  # noqa: E402

GiB = 2**30


class OneLayer(nn.Module):
    """One GPT block on ``x``; the loss is the mean square of its output."""

    def __init__(self, n_embd, n_head, seq):
        super().__init__()
        cfg = models.GPTConfig(block_size=seq, n_layer=1, n_head=n_head, n_embd=n_embd)
        self.block = models.GPT(cfg).h[0]

    def forward(self, x):
        return self.block(x).square().mean()


def _meshes(devices: int) -> dict:
    """The mesh each algorithm runs on for ``devices`` (None: the count does not fit its grid)."""
    q = math.isqrt(devices)
    c = round(devices ** (1 / 3))
    return {
        "1d": (devices,),
        "2d": (q, q) if q * q == devices else None,
        "2.5d": (devices // (c * c), c, c) if c**3 == devices else None,
        "3d": (c, c, c) if c**3 == devices else None,
    }


def memory_table() -> list:
    n_embd, n_head, seq, batch = 8192, 64, 2048, 16
    with torch.device("meta"):
        model = OneLayer(n_embd, n_head, seq)
    x = torch.empty(batch, seq, n_embd, device="meta")
    rows = [
        "| devices | algorithm | mesh | weights (GiB) | activations kept (GiB) | peak (GiB) | est. step (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for devices in (8, 64):
        for mode, mesh in _meshes(devices).items():
            if mesh is None:
                rows.append(f"| {devices} | {mode} | needs q x q | | | | |")
                continue
            plan = partitioner.plan(
                model, (x,), mesh_shape=mesh, cluster="h100", tensor_parallel=mode, memory_budget="1TiB"
            )
            est = plan.estimate()
            mem = est.memory
            rows.append(
                f"| {devices} | {mode} | {'x'.join(map(str, mesh))} | {mem.state / GiB:.3f} | {mem.saved / GiB:.3f} | "
                f"{est.memory_bytes / GiB:.3f} | {est.step_time_s * 1e3:.2f} |"
            )
            print(rows[-1], flush=True)
    return rows


def _comm_total(est) -> float:
    return sum(b for axes in est.comm_bytes.values() for b in axes.values())


def quality_table() -> list:
    models_by_devices = {
        64: dict(batch=16, seq=2048, n_embd=16384, n_head=128, n_layer=2, vocab=32768),
        512: dict(batch=64, seq=1024, n_embd=8192, n_head=64, n_layer=4, vocab=32768),
    }
    runs = {
        64: [
            ("auto", (8, 8)),
            ("auto", (4, 4, 4)),
            ("1d", (8, 8)),
            ("2d", (8, 8)),
            ("2.5d", (4, 4, 4)),
            ("3d", (4, 4, 4)),
        ],
        512: [("auto", (64, 8)), ("auto", (8, 8, 8)), ("1d", (64, 8)), ("2.5d", (8, 8, 8)), ("3d", (8, 8, 8))],
    }
    rows = [
        "| H100s | tensor_parallel | mesh | est. step (ms) | comm / device (GiB) | peak memory (GiB) "
        "| linear layers run as |",
        "|---|---|---|---|---|---|---|",
    ]
    for devices, configs in runs.items():
        model, inputs = models.gpt_block(**models_by_devices[devices])
        for mode, mesh in configs:
            t0 = time.perf_counter()
            plan = partitioner.plan(
                model, inputs, mesh_shape=mesh, cluster="h100", tensor_parallel=mode, memory_budget="1TiB"
            )
            est = plan.estimate()
            kinds: dict = {}
            for r in plan.records:
                if r.get("tensor_parallel"):
                    key = f"{r['tensor_parallel']} ({r['tp_roles']})"
                    kinds[key] = kinds.get(key, 0) + 1
            used = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
            rows.append(
                f"| {devices} | {mode} | {'x'.join(map(str, mesh))} | {est.step_time_s * 1e3:.1f} | "
                f"{_comm_total(est) / GiB:.2f} | {est.memory_bytes / GiB:.1f} | {used} |"
            )
            print(rows[-1], f"(planned in {time.perf_counter() - t0:.1f} s)", flush=True)
    return rows


def _step_worker(rank, world, mode, mesh, steps, warmup):
    model, inputs = models.gpt_demo(batch=8, seq=32, n_layer=2, n_embd=64, n_head=4)
    pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, cluster="h100", tensor_parallel=mode)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    times = []
    for step in range(warmup + steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = pm(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.distributed.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steps_table(steps: int = 10, warmup: int = 2) -> list:
    from runtime.launch import run_on_ranks

    load = os.getloadavg()
    rows = [
        f"machine: {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        "(1 / 5 / 15 min) when the runs started; other engineers' jobs share the cores",
        "",
        "| ranks | tensor_parallel | mesh | median step (ms) | vs 1D |",
        "|---|---|---|---|---|",
    ]
    for ranks, configs in (
        (4, [("1d", (4,)), ("2d", (2, 2))]),
        (8, [("1d", (8,)), ("2.5d", (2, 2, 2)), ("3d", (2, 2, 2))]),
    ):
        base = None
        for mode, mesh in configs:
            result = run_on_ranks(_step_worker, ranks, mode, mesh, steps, warmup, timeout_s=600)
            t = max(result)
            base = base or t
            rows.append(f"| {ranks} | {mode} | {'x'.join(map(str, mesh))} | {t * 1e3:.1f} | {t / base:.2f}x |")
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("memory", "all"):
        print("\n".join(memory_table()))
    if what in ("quality", "all"):
        print("\n".join(quality_table()))
    if what in ("steps", "all"):
        print("\n".join(steps_table()))
