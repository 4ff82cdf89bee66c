"""Measured against estimated step time after ``partitioner calibrate``: issue 11's table in one run.

1. ``partitioner calibrate --ranks 4`` (the runtime and memory benchmarks' rank count) and
   ``--ranks 2`` (the pipeline benchmark's), each three passes with the median of every figure.
2. The jobs, priced with the calibration of their rank count: the runtime benchmark's small and
   medium LLaMA under Megatron TP on 4 gloo ranks (forward, backward, AdamW); the memory
   benchmark's Partita plans on 4 ranks (no budget; a budget below data parallelism's peak; one
   forcing recomputation; the tightest met); the pipeline benchmark's GPT as 2 stages on 2
   ranks, 8 microbatches, 1F1B and GPipe (forward and backward of every microbatch, no
   optimizer step; ``--steps`` timed steps: one pipeline step of about a second moves by up to
   20% from the next here, so four were too few for a median).
3. ``--rounds`` rounds (default 3), each running every job once, one after another: this shared
   machine's speed drifts by 10-40% for tens of seconds at a time, so one run of a job can land
   in a slow spell; the rounds spread each job over the whole benchmark.

Each row: the median over the rounds of the measured step (each the median step after warm-up,
the slowest rank's), every round's, the plan's estimate (``plan.estimate().step_time_s``;
pipelines: the schedule simulated with the stage estimates,
``partitioner.pipeline_simulation.simulated_timeline``), measured / estimated, whether that is inside
0.8-1.25, and the highest 1-minute load average a round of the job started at. The models, plans
and measurement are the benchmarks' own (``runtime_overhead.py``, ``memory.py``,
``pipeline.py``), without their anchors (DTensor, FSDP2, DDP, torch's pipelining).

Usage: ``python benchmarks/calibrated_estimates.py [--out FILE.json] [--steps 8] [--rounds 3]``
(about 10 minutes on the 2-core machine; the calibration files are written beside ``--out``,
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
    from partitioner.pipeline_simulation import simulated_timeline
    from runtime.pipeline_trace import step_seconds

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


GPT_JOBS = ((2, 512, 8), (4, 256, 8))
"""``(ranks, width, batch)`` of the GPT jobs run the way a user first runs one: ``auto_parallelize``
with no mesh (the configuration searched), AdamW, seq 128, 4 layers."""


def _gpt_rank(rank, world, width, batch, cluster, steps):
    import torch

    import partitioner
    from partitioner.models import gpt_demo

    model, (ids, targets) = gpt_demo(batch, 128, n_layer=4, n_embd=width, n_head=8, vocab_size=1024)
    pm = partitioner.auto_parallelize(model, (ids, targets), cluster=cluster)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 2):
        torch.distributed.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        if hasattr(pm, "train_step"):  # the search chose a pipeline: timed as its simulation prices
            pm.train_step((ids, targets))  # it, forward and backward without the optimizer step
            times.append(time.perf_counter() - start)
            opt.step()
            continue
        pm(ids, targets).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if hasattr(pm, "train_step"):
        from partitioner.pipeline_simulation import simulated_timeline
        from runtime.pipeline_trace import step_seconds

        estimate = step_seconds(simulated_timeline(pm))
    else:
        estimate = pm.plan.estimate().step_time_s
    return {"measured_s": statistics.median(times[2:]), "estimate_s": estimate}


def _row(benchmark, run, samples, estimate, loads, cluster_file):
    """One table row from a job's rounds: the median measured step over them, its spread, and
    the loads each round started at."""
    measured = statistics.median(samples)
    ratio = measured / estimate
    return {
        "benchmark": benchmark,
        "run": run,
        "measured_s": measured,
        "measured_rounds_s": samples,
        "estimate_s": estimate,
        "ratio": ratio,
        "in_band": BAND[0] <= ratio <= BAND[1],
        "load": max(loads),
        "cluster": cluster_file,
    }


def _calibrate(path, ranks, say):
    from partitioner.calibration.calibrate import calibrate

    load = os.getloadavg()[0]
    start = time.perf_counter()
    calibrate(path, ranks=ranks, name=f"calibrated-{ranks}", repeats=3)
    say(f"calibrated {ranks} ranks in {time.perf_counter() - start:.0f} s (load {load:.1f}) -> {path}")
    return load


def _jobs(cal4, cal2, steps):
    """``(benchmark, run, cluster file, measure)``: ``measure()`` runs the job once on its ranks
    and returns (the measured step, the estimate)."""
    import memory as mem
    import pipeline as pl
    import runtime_overhead as ro

    from runtime.launch import run_on_ranks

    jobs = []
    for ranks, width, batch in GPT_JOBS:

        def gpt_job(ranks=ranks, width=width, batch=batch):
            res = run_on_ranks(_gpt_rank, ranks, width, batch, cal4 if ranks == 4 else cal2, steps, timeout_s=900)
            return max(r["measured_s"] for r in res), res[0]["estimate_s"]

        cluster = cal4 if ranks == 4 else cal2
        jobs.append(("default path", f"GPT d{width}, batch {batch}, searched, {ranks} ranks", cluster, gpt_job))
    for size in ro.SIZES:

        def runtime_job(size=size):
            res = run_on_ranks(_runtime_rank, 4, size, cal4, steps, timeout_s=900)
            return max(r["measured_s"] for r in res), res[0]["estimate_s"]

        jobs.append(("runtime_overhead", f"{size.split()[0]} LLaMA, Megatron TP, 4 ranks", cal4, runtime_job))
    mem._use_cluster(cal4)
    _, _, plans = mem._plans()
    for name, _, plan in plans:

        def memory_job(plan=plan):
            res = run_on_ranks(
                mem.partita_worker, 4, plan.to_dict(), max(3, steps // 2), timeout_s=900, collective_timeout_s=600
            )
            worst = mem._worst(res)
            return worst["step_s"], worst["est_step_s"]

        jobs.append(("memory", f"{name}, 4 ranks", cal4, memory_job))
    for schedule in ("1f1b", "gpipe"):

        def pipeline_job(schedule=schedule):
            res = run_on_ranks(_pipeline_rank, pl.P, schedule, cal2, steps, timeout_s=900, collective_timeout_s=300)
            measured = statistics.median(max(ts) for ts in zip(*(r["times"] for r in res)))
            return measured, res[0]["estimate_s"]

        jobs.append(("pipeline", f"{schedule}, {pl.P} stages on {pl.P} ranks, {pl.M} microbatches", cal2, pipeline_job))
    return jobs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (runtime, pipeline; memory uses half)")
    ap.add_argument("--rounds", type=int, default=3, help="times each job runs, one round of all after another")
    ap.add_argument("--out", default=None, help="write the rows and calibration loads here as JSON")
    ap.add_argument(
        "--default-cluster",
        action="store_true",
        help="price with cluster='cpu' as a user first meets it (measured by the jobs, quick sizes, "
        "in a fresh cache) instead of `partitioner calibrate`",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    folder = Path(args.out).parent if args.out else Path(tempfile.mkdtemp(prefix="partita-calibrated-"))
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(message):
        print(f"[{time.perf_counter() - t0:5.0f} s] {message}", flush=True)

    calibrations = {}
    if args.default_cluster:
        os.environ["XDG_CACHE_HOME"] = str(folder / "cache")  # inherited by the ranks: nothing installed
        cal4 = cal2 = "cpu"
        calibrations["cpu (quick, measured by the jobs)"] = os.getloadavg()[0]
    else:
        cal4, cal2 = str(folder / "cluster-4ranks.json"), str(folder / "cluster-2ranks.json")
        calibrations[cal4] = _calibrate(cal4, 4, say)
        calibrations[cal2] = _calibrate(cal2, 2, say)
    jobs = _jobs(cal4, cal2, args.steps)
    measured: dict = {k: [] for k in range(len(jobs))}
    estimates: dict = {}
    loads: dict = {k: [] for k in range(len(jobs))}
    for r in range(args.rounds):
        for k, (benchmark, run, _, job) in enumerate(jobs):
            loads[k].append(os.getloadavg()[0])
            m, e = job()
            measured[k].append(m)
            if abs(estimates.setdefault(k, e) - e) > 1e-6 * estimates[k]:  # planned afresh each round
                say(
                    f"note: {benchmark} {run}: the estimate moved between rounds ({estimates[k]} -> {e}); "
                    "the first round's is kept"
                )
            say(
                f"round {r + 1}/{args.rounds}: {benchmark}: {run}: measured {m:.3f} s, estimated {e:.3f} s, "
                f"ratio {m / e:.2f} (load {loads[k][-1]:.1f})"
            )
    rows = [
        _row(benchmark, run, measured[k], estimates[k], loads[k], cluster)
        for k, (benchmark, run, cluster, _) in enumerate(jobs)
    ]
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


def table(rows) -> str:
    lines = [
        "| benchmark | run | measured s (median) | measured s per round | estimated s | measured / estimated "
        "| in 0.8-1.25 | load (max) |",
        "|---|---|---:|---|---:|---:|---|---:|",
    ]
    for r in rows:
        rounds = " / ".join(f"{x:.3f}" for x in r.get("measured_rounds_s", [r["measured_s"]]))
        lines.append(
            f"| {r['benchmark']} | {r['run']} | {r['measured_s']:.3f} | {rounds} | {r['estimate_s']:.3f} | "
            f"{r['ratio']:.2f} | {'yes' if r['in_band'] else 'no'} | {r['load']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
