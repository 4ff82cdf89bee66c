"""Measured against estimated step time after ``partitioner calibrate``: issue 11's table in one run.

1. ``partitioner calibrate --ranks 4`` (three passes, the median of each figure; the runtime and memory benchmarks' rank count), then,
   priced with it: the runtime benchmark's small and medium LLaMA under Megatron TP on 4 gloo
   ranks (forward, backward, AdamW), and the memory benchmark's Partita plans on 4 ranks (no
   budget; a budget below data parallelism's peak; one forcing recomputation; the tightest met).
2. ``partitioner calibrate --ranks 2`` (the pipeline benchmark's), then, priced with it: the
   pipeline benchmark's GPT as 2 stages on 2 ranks, 8 microbatches, 1F1B and GPipe (forward and
   backward of every microbatch, no optimizer step).

Each row: the median measured step after warm-up (the slowest rank's), the plan's estimate
(``plan.estimate().step_time_s``; pipelines: the schedule simulated with the stage estimates,
``runtime.pipeline_trace.simulated_timeline``), measured / estimated, whether that is inside
0.8-1.25, and the 1-minute load average when the row started (the calibrations' too). The
models, plans and measurement are the benchmarks' own (``runtime_overhead.py``, ``memory.py``,
``pipeline.py``), without their anchors (DTensor, FSDP2, DDP, torch's pipelining).

Usage: ``python benchmarks/calibrated_estimates.py [--out FILE.json] [--steps 8]``
(about 6-8 minutes on the 2-core machine; the calibration files are written beside ``--out``,
or to a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BAND = (0.8, 1.25)


def _runtime_rank(rank, world, size, cluster, steps):
    import runtime_overhead as ro

    import partitioner

    ro.use_size(size)
    model, batch = ro.build()
    pm = partitioner.auto_parallelize(model, batch, mesh=(world,), pins=ro.megatron_pins(world), cluster=cluster)
    measured, _ = ro.timed_steps(pm, batch, pm.parameters(), steps)
    return {"measured_s": measured, "estimate_s": pm.plan.estimate().step_time_s}


def _pipeline_rank(rank, world, schedule, cluster, steps):
    import pipeline as pl
    import torch.distributed as dist

    import partitioner
    from partitioner.models import gpt_demo
    from runtime.pipeline_trace import simulated_timeline, step_seconds

    model, (ids, targets) = gpt_demo(
        pl.M * pl.MB, pl.SEQ, n_layer=pl.N_LAYER, n_embd=pl.N_EMBD, n_head=pl.N_HEAD, vocab_size=pl.VOCAB
    )
    pipeline = {"degree": world, "schedule": schedule, "microbatches": pl.M, "virtual_stages": 1}
    runner = partitioner.auto_parallelize(model, (ids, targets), mesh=(world,), pipeline=pipeline, cluster=cluster)
    params = list(runner.parameters())
    times = []
    for _ in range(steps + 2):
        pl._grads_to_none(params)
        dist.barrier()
        start = time.perf_counter()
        runner.train_step((ids, targets))
        dist.barrier()
        times.append(time.perf_counter() - start)
    return {"times": times[2:], "estimate_s": step_seconds(simulated_timeline(runner))}


def _row(benchmark, run, measured, estimate, load, cluster_file):
    ratio = measured / estimate
    return {
        "benchmark": benchmark,
        "run": run,
        "measured_s": measured,
        "estimate_s": estimate,
        "ratio": ratio,
        "in_band": BAND[0] <= ratio <= BAND[1],
        "load": load,
        "cluster": cluster_file,
    }


def _calibrate(path, ranks, say):
    from partitioner.calibrate import calibrate

    load = os.getloadavg()[0]
    start = time.perf_counter()
    calibrate(path, ranks=ranks, name=f"calibrated-{ranks}", repeats=3)
    say(f"calibrated {ranks} ranks in {time.perf_counter() - start:.0f} s (load {load:.1f}) -> {path}")
    return load


def main(argv=None):
    import memory as mem
    import pipeline as pl
    import runtime_overhead as ro

    from runtime.launch import run_on_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (runtime; memory and pipeline use half)")
    ap.add_argument("--out", default=None, help="write the rows and calibration loads here as JSON")
    args = ap.parse_args(argv)
    folder = Path(args.out).parent if args.out else Path(tempfile.mkdtemp(prefix="partita-calibrated-"))
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(message):
        print(f"[{time.perf_counter() - t0:5.0f} s] {message}", flush=True)

    rows, calibrations = [], {}
    cal4, cal2 = str(folder / "cluster-4ranks.json"), str(folder / "cluster-2ranks.json")
    calibrations[cal4] = _calibrate(cal4, 4, say)
    for size in ro.SIZES:
        load = os.getloadavg()[0]
        res = run_on_ranks(_runtime_rank, 4, size, cal4, args.steps, timeout_s=900)
        measured = max(r["measured_s"] for r in res)
        rows.append(
            _row(
                "runtime_overhead",
                f"{size.split()[0]} LLaMA, Megatron TP, 4 ranks",
                measured,
                res[0]["estimate_s"],
                load,
                cal4,
            )
        )
        say(_fmt(rows[-1]))
    mem._use_cluster(cal4)
    _, _, plans = mem._plans()
    for name, _, plan in plans:
        load = os.getloadavg()[0]
        res = run_on_ranks(
            mem.partita_worker, 4, plan.to_dict(), max(3, args.steps // 2), timeout_s=900, collective_timeout_s=600
        )
        worst = mem._worst(res)
        rows.append(_row("memory", f"{name}, 4 ranks", worst["step_s"], worst["est_step_s"], load, cal4))
        say(_fmt(rows[-1]))
    calibrations[cal2] = _calibrate(cal2, 2, say)
    for schedule in ("1f1b", "gpipe"):
        load = os.getloadavg()[0]
        res = run_on_ranks(
            _pipeline_rank, pl.P, schedule, cal2, max(4, args.steps // 2), timeout_s=900, collective_timeout_s=300
        )
        measured = statistics.median(max(ts) for ts in zip(*(r["times"] for r in res)))
        rows.append(
            _row(
                "pipeline",
                f"{schedule}, {pl.P} stages on {pl.P} ranks, {pl.M} microbatches",
                measured,
                res[0]["estimate_s"],
                load,
                cal2,
            )
        )
        say(_fmt(rows[-1]))
    print()
    print(table(rows))
    inside = sum(r["in_band"] for r in rows)
    print(
        f"\n{inside} of {len(rows)} rows inside {BAND[0]}-{BAND[1]}; calibration loads "
        f"{', '.join(f'{Path(k).name} {v:.1f}' for k, v in calibrations.items())}; "
        f"{time.perf_counter() - t0:.0f} s in all"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"rows": rows, "calibration_load": calibrations, "seconds": time.perf_counter() - t0}, indent=1)
            + "\n"
        )


def _fmt(row):
    return (
        f"{row['benchmark']}: {row['run']}: measured {row['measured_s']:.3f} s, estimated "
        f"{row['estimate_s']:.3f} s, ratio {row['ratio']:.2f} (load {row['load']:.1f})"
    )


def table(rows) -> str:
    lines = [
        "| benchmark | run | measured s | estimated s | measured / estimated | in 0.8-1.25 | load |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['benchmark']} | {r['run']} | {r['measured_s']:.3f} | {r['estimate_s']:.3f} | "
            f"{r['ratio']:.2f} | {'yes' if r['in_band'] else 'no'} | {r['load']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
