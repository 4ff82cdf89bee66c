"""Bar 1 on fixed-duration kernels: the executor's bubbles against the formulas, without CPU noise.

Part of ``benchmarks/pipeline.py`` (its ``--fixed`` section; also runnable alone). The model is
``benchmarks/timed_kernels.TimedLayers``: layers whose forward, input-gradient and
weight-gradient kernels each take exactly ``layer_ms`` of wall-clock time (sleeping, as a GPU
kernel leaves the host free), ``4 p`` of them so every stage holds 4 (interleaved: 2 per virtual
stage). Partita plans and runs it like any model (``auto_parallelize(..., pipeline=...)``), so
everything the executor does besides the kernels (the interpreter, autograd, posting, sending
and waiting on messages through gloo) is in the measurement, and nothing else is.

For each schedule and p in (2, 4): ``warmup`` + ``steps`` ``train_step``s between barriers; the
measured idle fraction of each timed step (``idle_fraction(measured_timeline)``), median
reported, against the closed forms with m = 8 microbatches:

* GPipe, 1F1B: ``(p-1)/(m+p-1)``; interleaved (v = 2): ``((p-1)/v)/(m+(p-1)/v)``;
* ZB-H1 (F = I = W): ``(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W))`` = ``(p-1)/(3m+p-1)``

(each schedule's ``bubble`` in the registry ``passes.schedules.SCHEDULES``).

Beside them, the same schedule simulated (``passes.schedules.simulate``) with the
nominal durations (equal to the closed form: a check of both), and with the message latency
measured in the same steps added to every dependency between ranks: what gloo on this machine
adds to the formula. Latency of a message = the end of the action producing it on one rank to the
end of the receive that waited for it on the other (both on one host clock).

Usage: ``python benchmarks/pipeline_fixed_kernels.py [--layer-ms 10] [--steps 8]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from passes.schedules import SCHEDULES  # noqa: E402 - after the path is set

M, V, WIDTH, MB = 8, 2, 64, 4


def closed_form(schedule: str, p: int, m: int = M, v: int = V) -> float:
    return SCHEDULES[schedule].bubble(p, m, v)


def stages_per_rank(schedule: str) -> int:
    return V if SCHEDULES[schedule].virtual else 1


def _message_latencies(traces: list) -> list:
    """Seconds from a producing compute action's end to the end of the receive that waited for
    it, for every receive that did wait (traces: one per rank, on one host clock)."""
    from passes.schedules import parse_action
    ends = {}
    for trace in traces:
        for text, _, end in trace:
            a = parse_action(text)
            if a.kind.value in ("F", "B", "I"):    # what a message leaves after (W sends nothing)
                ends[("F" if a.kind.value == "F" else "B", a.stage, a.microbatch)] = end
    out = []
    for trace in traces:
        for text, start, end in trace:
            a = parse_action(text)
            if a.is_recv and end - start > 5e-5:
                key = ("F" if a.kind.value == "RECV_F" else "B", a.peer, a.microbatch)
                if key in ends and end >= ends[key]:
                    out.append(end - ends[key])
    return out


def run_fixed(rank, world, schedule, steps, warmup, layer_ms):
    import torch.distributed as dist
    from timed_kernels import TimedLayers

    import partitioner
    from runtime.pipeline_trace import idle_fraction, measured_timeline

    torch.manual_seed(0)
    model = TimedLayers(4 * world, WIDTH, layer_ms, layer_ms, layer_ms)
    x, target = torch.randn(M * MB, WIDTH), torch.randn(M * MB, WIDTH)
    pipeline = {"degree": world, "schedule": schedule, "microbatches": M, "virtual_stages": stages_per_rank(schedule)}
    runner = partitioner.auto_parallelize(model, (x, target), mesh=(world,), pipeline=pipeline, cluster="cpu")
    idles, latencies, timelines, step_s = [], [], [], []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        runner.train_step((x, target))
        elapsed = time.perf_counter() - t0
        traces = [None] * world
        dist.all_gather_object(traces, runner.trace)
        timeline = measured_timeline(runner)
        if i >= warmup:
            idles.append(idle_fraction(timeline))
            latencies += _message_latencies(traces)
            timelines.append(timeline)
            step_s.append(elapsed)
    k = sorted(range(len(idles)), key=lambda j: idles[j])[len(idles) // 2]
    return {"idles": idles, "latencies": latencies, "timeline": timelines[k], "step_s": step_s,
            "layers": [list(run) for run in runner.plan["layers"]], "schedule_text": str(runner.schedule)}


def measure(schedules=tuple(SCHEDULES), ranks=(2, 4), steps=8, warmup=2, layer_ms=10.0, log=print) -> list:
    from passes.schedules import parse_schedule, simulate
    from runtime.launch import run_on_ranks

    rows = []
    for p in ranks:
        for schedule in schedules:
            t = time.perf_counter()
            r = run_on_ranks(run_fixed, p, schedule, steps, warmup, layer_ms, timeout_s=600,
                             collective_timeout_s=120)[0]
            sched = parse_schedule(r["schedule_text"])
            stage_ms = 4 * layer_ms / stages_per_rank(schedule) / 1e3
            latency = statistics.median(r["latencies"]) if r["latencies"] else 0.0
            nominal = simulate(sched, stage_ms, 2 * stage_ms).bubble_fraction
            with_latency = simulate(sched, stage_ms, 2 * stage_ms, comm_time=latency).bubble_fraction
            idle = statistics.median(r["idles"])
            form = closed_form(schedule, p)
            rows.append({"schedule": schedule, "p": p, "m": M, "layer_ms": layer_ms, "idle": idle, "idles": r["idles"],
                         "formula": form, "ratio": idle / form, "simulated": nominal,
                         "simulated_latency": with_latency, "latency_ms": latency * 1e3,
                         "step_s": statistics.median(r["step_s"]), "layers": r["layers"],
                         "timeline": r["timeline"], "run_s": time.perf_counter() - t})
            log(f"fixed kernels p={p} {layer_ms:g} ms {schedule}: idle {idle:.4f} formula {form:.4f} ratio {idle / form:.3f} "
                f"(latency {latency * 1e3:.2f} ms, {time.perf_counter() - t:.0f} s)")
    by = {(row["p"], row["schedule"]): row for row in rows}
    for row in rows:
        row["bar"] = row["ratio"] <= 1.1
        other = by.get((row["p"], "1f1b"))
        if row["schedule"] == "zb-h1" and other is not None:
            row["below_1f1b"] = row["idle"] < other["idle"]
            row["bar"] = row["bar"] and row["below_1f1b"]
    return rows


def table(rows) -> str:
    lines = ["| p | kernel ms | schedule | stages (layers) | measured idle (min / median / max) | formula | measured/formula | "
             "bar 1 (<= 1.1) | simulated, nominal durations | simulated + measured message latency | "
             "median message latency (ms) | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = ""
        if "below_1f1b" in r:
            note = "; below 1F1B" if r["below_1f1b"] else "; NOT below 1F1B"
        stages = " / ".join(",".join(map(str, run)) for run in r["layers"])
        lines.append(f"| {r['p']} | {r['layer_ms']:g} | {r['schedule']} | {stages} | {min(r['idles']):.4f} / {r['idle']:.4f} / "
                     f"{max(r['idles']):.4f} | {r['formula']:.4f} | {r['ratio']:.3f} | "
                     f"{'PASS' if r['bar'] else 'FAIL'}{note} | {r['simulated']:.4f} | {r['simulated_latency']:.4f} | "
                     f"{r['latency_ms']:.2f} | {r['step_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args(argv)
    rows = measure(args.schedules.split(","), tuple(int(p) for p in args.ranks.split(",")), args.steps,
                   args.warmup, args.layer_ms)
    print(table(rows))


if __name__ == "__main__":
    main()
