"""Pipeline parallelism: measured bubbles against the formulas, step time against torch.

One run per schedule (GPipe, 1F1B, interleaved 1F1B with v=2, ZB-H1), each on p=2 gloo ranks
(written for a 2-core machine: one rank per core, 1 compute thread each; ``--pin`` pins each
rank to its own core), m=8 microbatches, a GPT of 8 layers sized so one microbatch's stage
forward is tens of ms on one CPU core.

1. **Bubble.** After warm-up, several ``runner.train_step``s are timed; the measured timeline
   (``runtime.pipeline_trace.measured_timeline``) of each gives an idle fraction
   (``idle_fraction``: the share of rank-time between the first compute start and the last
   compute end not spent in F/B/I/W); the median over these late steps is reported, and the
   step with the median idle is drawn. Formula: ``(p-1)/(m+p-1)`` for GPipe and 1F1B;
   ``((p-1)/v)/(m+(p-1)/v)`` for interleaved; for ZB-H1 the cost-model simulation
   (``simulated_timeline``). Bar: measured / formula <= 1.1, and ZB-H1 below 1F1B.
   Beside them: the same schedule replayed (``passes.schedules.simulate``) with the
   *measured* median F / B / I / W durations per stage, which separates what the schedule
   and the real stage times imply from what the runtime adds (waits on messages, overhead).
2. **Against torch.distributed.pipelining.** The same GPT (same weights) is cut by hand at the
   layer boundaries of ``runner.plan["layers"]`` into ``PipelineStage``s (stage 0: embeddings
   + its blocks; last stage: its blocks + ln_f + lm_head, loss through the schedule's
   ``loss_fn``), run with the matching schedule class and the same microbatches:
   ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` (2 stages per rank, looped
   like Partita's), and for ZB-H1 ``ScheduleInterleavedZeroBubble`` with one stage per rank
   (its ZB1P schedule; with one stage per rank it is ZB-H1). Partita and torch steps alternate
   (ABAB..., the order flipped each round) so background load hits both alike. A step is
   forward + backward of all microbatches (no optimizer step), between two barriers; gradients
   are cleared before each. Bar: Partita / torch median step time <= 1.0.

3. **Diagnostics** (to say why a bar fails from measurements): per-action median durations of
   both runtimes; each timed step replayed with its own per-action durations and instant
   messages (what the compute alone implies); the share of rank-time lost to late starts
   (an action ready, its message due, not yet started); gloo point-to-point latency of one
   stage-boundary activation with the ranks idle or computing (``p2p_latency``).
4. ``--hf-check``: HF GPT2 with eager attention as 4 stages on 2 ranks: Partita trains it;
   torch's tracer ``pipeline()`` split of the same model is run too and its error reported.

Beside the measured step: the estimate, the schedule simulated with the stage plans' estimates
(``partitioner.pipeline_simulation.simulated_timeline``), priced for ``--cluster`` (default ``cpu``; a
cluster file from ``python -m partitioner calibrate --ranks 2`` prices this machine's 2 ranks).

Usage: ``python benchmarks/pipeline.py [--steps 12] [--warmup 2] [--cluster FILE] [--hf-check] [--out-dir benchmarks/results]``
(about 3 minutes on 2 quiet cores).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from passes.schedules import SCHEDULES  # noqa: E402 - after the path is set

P, M, V = 2, 8, 2
# GPT: 8 layers; batch = M microbatches of MB sequences
N_LAYER, N_EMBD, N_HEAD, VOCAB, SEQ, MB = 8, 192, 8, 256, 128, 4


def formula(schedule: str, p: int = P, m: int = M, v: int = V) -> float | None:
    """The closed form for GPipe / 1F1B / interleaved; None for ZB-H1, whose reference on the
    GPT is the cost-model simulation (its stages' I and W are not equal)."""
    return None if schedule == "zb-h1" else SCHEDULES[schedule].bubble(p, m, v)


# --------------------------------------------------------------------------- torch side


class TorchStage(nn.Module):
    """A hand-cut stage of partitioner.models.GPT: [embeddings] + blocks [+ ln_f + lm_head]."""

    def __init__(self, gpt, layers, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.h = nn.ModuleList(gpt.h[i] for i in layers)
        if last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def _loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def torch_schedule(gpt, layers, schedule: str, rank: int):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )
    n = len(layers)
    mine = [s for s in range(n) if s % P == rank]          # looped, as Partita's stage_to_rank
    stages = []
    for s in mine:
        module = TorchStage(gpt, layers[s], s == 0, s == n - 1)
        stages.append(PipelineStage(module, s, n, torch.device("cpu")))
    # torch's counterpart of each of Partita's schedules (ZB-H1: its ZB1P, one stage per rank)
    one_stage = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    stage_list = {"interleaved": ScheduleInterleaved1F1B, "zb-h1": ScheduleInterleavedZeroBubble}
    if schedule in one_stage:
        sched = one_stage[schedule](stages[0], M, loss_fn=_loss_fn)
    else:
        sched = stage_list[schedule](stages, M, loss_fn=_loss_fn)
    modules = [st.submod for st in stages]
    trace = []
    for st in stages:
        _record(st, trace)
    return sched, modules, (0 in mine), (n - 1 in mine), trace


def _record(stage, trace):
    """Wrap a PipelineStage's compute entry points to log (action, start, end) like Partita's
    interpreter: F, B (full backward), I (input-gradient-only backward), W."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    s = stage.stage_index

    def forward_one_chunk(chunk, *args, **kwargs):
        t0 = time.perf_counter()
        out = fwd(chunk, *args, **kwargs)
        trace.append((f"{s}F{chunk}", t0, time.perf_counter()))
        return out

    def backward_one_chunk(chunk, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        t0 = time.perf_counter()
        out = bwd(chunk, *args, **kwargs)
        trace.append((f"{s}{'B' if full else 'I'}{chunk}", t0, time.perf_counter()))
        return out

    def backward_weight_one_chunk(chunk, *args, **kwargs):
        t0 = time.perf_counter()
        out = wgt(chunk, *args, **kwargs)
        trace.append((f"{s}W{chunk}", t0, time.perf_counter()))
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


# --------------------------------------------------------------------------- one schedule


def _per_stage_medians(timelines):
    """stage -> kind -> median seconds over every action of the given measured timelines."""
    from passes.schedules import parse_action
    acc = {}
    for timeline in timelines:
        for rows in timeline.values():
            for text, s, e in rows:
                a = parse_action(text)
                acc.setdefault(a.stage, {}).setdefault(a.kind.value, []).append(e - s)
    return {s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in acc.items()}


def _replay(runner, means, comm_time=0.0):
    """The schedule replayed with the measured median durations per stage and kind (and
    ``comm_time`` seconds on every dependency between ranks)."""
    from passes.schedules import simulate
    S = runner.schedule.num_stages
    fwd = {s: means[s]["F"] for s in range(S)}
    if all("B" in means[s] for s in range(S)):
        bwd = {s: means[s]["B"] for s in range(S)}
        wgt = None
    else:
        bwd = {s: means[s]["I"] + means[s]["W"] for s in range(S)}
        wgt = {s: means[s]["W"] for s in range(S)}
    res = simulate(runner.schedule, fwd, bwd, wgt, comm_time=comm_time)
    return {r: [(str(t.action), t.start, t.end) for t in tl] for r, tl in res.timelines.items()}


def _late_starts(timeline):
    """Share of rank-time (as ``idle_fraction`` counts it) that actions started later than they
    could have: each action is ready once its rank's previous action ended and, for a
    dependency on another rank (F of stage s-1 -> F of s; backward of s+1 -> backward of s),
    the producer ended; what lies between ready and start is time spent waiting for a message
    that was already due (transfer, progress of the communication threads, the interpreter's
    own work). Ranks' clocks are aligned by the barrier before the step."""
    from passes.schedules import parse_action

    def key(text):
        a = parse_action(text)
        return ("bwd" if a.kind.value in ("B", "I") else a.kind.value), a.stage, a.microbatch

    end_of = {key(t): (r, e) for r, rows in timeline.items() for t, _, e in rows}
    first = min(s for rows in timeline.values() for _, s, _ in rows)
    last = max(e for rows in timeline.values() for *_, e in rows)
    late = 0.0
    for rank, rows in timeline.items():
        prev = first
        for text, start, end in sorted(rows, key=lambda x: x[1]):
            kind, stage, mb = key(text)
            dep = ("F", stage - 1, mb) if kind == "F" else ("bwd", stage + 1, mb) if kind == "bwd" else None
            ready = prev
            if dep in end_of and end_of[dep][0] != rank:
                ready = max(ready, end_of[dep][1])
            late += max(start - ready, 0.0)
            prev = end
    return late / ((last - first) * len(timeline))


def _replay_actual(schedule, timeline):
    """Idle fraction of the schedule replayed with this step's own duration for every action
    and instant messages: what the measured compute alone implies, variance included."""
    from passes.schedules.execution import execute
    from runtime.pipeline_trace import idle_fraction
    took = {text: e - s for rows in timeline.values() for text, s, e in rows}
    run = execute(schedule, lambda a: took.get(str(a), 0.0) if a.is_compute else 0.0)
    replay = {r: [(str(a), run.start[(r, i)], run.end[(r, i)]) for i, a in enumerate(acts) if a.is_compute]
              for r, acts in enumerate(schedule.actions)}
    return idle_fraction(replay)


def _grads_to_none(params):
    for p in params:
        p.grad = None


def run_schedule(rank, world, schedule, steps, warmup, pin, cluster="cpu"):
    import torch.distributed as dist

    import partitioner
    from partitioner.models import gpt_demo
    from partitioner.pipeline_simulation import simulated_timeline
    from runtime.pipeline_trace import measured_timeline

    if pin and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    model, (ids, targets) = gpt_demo(M * MB, SEQ, n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD,
                                     vocab_size=VOCAB)
    reference = copy.deepcopy(model)
    t0 = time.perf_counter()
    pipeline = {"degree": P, "schedule": schedule, "microbatches": M,
                "virtual_stages": V if SCHEDULES[schedule].virtual else 1}
    runner = partitioner.auto_parallelize(model, (ids, targets), mesh=(P,), pipeline=pipeline, cluster=cluster)
    build_s = time.perf_counter() - t0
    layers = [tuple(run) for run in runner.plan["layers"]]
    sched, modules, first, last, torch_trace = torch_schedule(reference, layers, schedule, rank)
    ours_params = list(runner.parameters())
    torch_params = [p for m in modules for p in m.parameters()]

    def ours():
        return runner.train_step((ids, targets)).item()

    def theirs():
        torch_trace.clear()
        losses = [] if last else None
        if first:
            sched.step(ids, target=targets if last else None, losses=losses)
        else:
            sched.step(target=targets if last else None, losses=losses)
        return torch.stack(losses).mean().item() if last else float("nan")

    times = {"partita": [], "torch": []}
    traces = {"partita": [], "torch": []}     # every timed step's compute actions, this rank
    loss = {}
    fns = {"partita": ours, "torch": theirs}
    for i in range(warmup + steps):
        order = ("partita", "torch") if i % 2 == 0 else ("torch", "partita")
        for who in order:
            _grads_to_none(ours_params if who == "partita" else torch_params)
            dist.barrier()
            start = time.perf_counter()
            loss[who] = fns[who]()
            dist.barrier()
            if i >= warmup:
                times[who].append(time.perf_counter() - start)
                traces[who].append(list(runner.trace) if who == "partita"
                                   else [(a, s - start, e - start) for a, s, e in torch_trace])
    # measured_timeline reads runner.trace (the last train_step's); feed it each timed step's
    ours_tl = []
    for trace in traces["partita"]:
        runner.trace = trace
        ours_tl.append(measured_timeline(runner))
    parts = [None] * world
    dist.all_gather_object(parts, traces["torch"])
    torch_tl = [{r: parts[r][k] for r in range(world)} for k in range(steps)]
    return {
        "schedule": schedule, "layers": layers, "build_s": build_s,
        "partita_s": times["partita"], "torch_s": times["torch"],
        "loss_partita": loss["partita"], "loss_torch": loss["torch"],
        "ours_tl": ours_tl, "torch_tl": torch_tl, "simulated": simulated_timeline(runner),
        "schedule_obj": str(runner.schedule), "torch_class": type(sched).__name__,
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def summarize(r, schedule_text):
    """Idle fractions over the timed steps; the representative step (median idle) for pictures;
    median per-action durations and the replay of the schedule with them."""
    from passes.schedules import parse_schedule
    from runtime.pipeline_trace import idle_fraction

    class _Runner:    # what _replay needs
        schedule = parse_schedule(schedule_text)

    ours = [idle_fraction(tl) for tl in r["ours_tl"]]
    theirs = [idle_fraction(tl) for tl in r["torch_tl"]]
    k = sorted(range(len(ours)), key=lambda i: ours[i])[len(ours) // 2]
    kt = sorted(range(len(theirs)), key=lambda i: theirs[i])[len(theirs) // 2]
    r["idle_steps"], r["idle_torch_steps"] = ours, theirs
    r["idle"], r["idle_last"], r["idle_torch"] = statistics.median(ours), ours[-1], statistics.median(theirs)
    r["rep_step"], r["measured"], r["torch_measured"] = k, r["ours_tl"][k], r["torch_tl"][kt]
    r["means"] = _per_stage_medians(r["ours_tl"])
    r["torch_means"] = _per_stage_medians(r["torch_tl"])
    r["replay"] = _replay(_Runner, r["means"])
    r["idle_sim"] = idle_fraction(r["simulated"])
    r["idle_replay"] = idle_fraction(r["replay"])
    for who, tls, steps in (("", r["ours_tl"], r["partita_s"]), ("torch_", r["torch_tl"], r["torch_s"])):
        r[who + "late"] = statistics.median(_late_starts(tl) for tl in tls)
        spans = [max(e for rows in tl.values() for *_, e in rows) - min(s for rows in tl.values() for _, s, _ in rows)
                 for tl in tls]
        r[who + "outside_ms"] = 1e3 * statistics.median([t - sp for t, sp in zip(steps, spans)])
    r["idle_replay_actual"] = statistics.median(_replay_actual(_Runner.schedule, tl) for tl in r["ours_tl"])
    r["torch_idle_replay_actual"] = statistics.median(_replay_actual(_Runner.schedule, tl) for tl in r["torch_tl"])
    return r


def p2p_latency(rank, world, reps=10):
    """gloo point-to-point latency of one stage-boundary activation (MB x SEQ x N_EMBD fp32),
    from rank 0's isend to rank 1's recv returning (one host, one clock). Cases: both ranks
    idle; the sender computing 50 ms right after its isend while the receiver computes
    ``busy`` ms before posting its recv (as the pipeline interpreters do)."""
    import torch.distributed as dist
    x, a = torch.randn(MB, SEQ, N_EMBD), torch.randn(256, 256)

    def spin(seconds):
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            a @ a

    out = {}
    for sender_busy, receiver_busy in ((0.0, 0.0), (0.05, 0.0), (0.05, 0.01), (0.05, 0.03)):
        lat = []
        for i in range(reps):
            dist.barrier()
            if rank == 0:
                sent = torch.tensor([time.perf_counter()], dtype=torch.float64)
                work = dist.isend(x, 1, tag=i)
                spin(sender_busy)
                work.wait()
                dist.send(sent, 1, tag=1000 + i)
            else:
                buf, sent = torch.empty_like(x), torch.empty(1, dtype=torch.float64)
                spin(receiver_busy)
                dist.recv(buf, 0, tag=i)
                got = time.perf_counter()
                dist.recv(sent, 0, tag=1000 + i)
                lat.append(got - sent.item())
        if rank == 1:
            out[(sender_busy, receiver_busy)] = 1e3 * statistics.median(lat[2:])
    return out


# --------------------------------------------------------------------------- HF GPT2 check


def hf_gpt2_check(rank, world):
    """HF GPT2 (4 layers) as a 4-stage interleaved pipeline on 2 ranks (2 stages per rank).
    Partita: ``auto_parallelize`` + one ``train_step`` (eager attention). torch: the tracer
    ``pipeline()`` split at every layer, ``build_stage`` and ``ScheduleInterleaved1F1B``, the
    loss through ``loss_fn`` (eager and sdpa attention)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        ScheduleInterleaved1F1B,
        SplitPoint,
        pipeline,
    )

    import partitioner
    from partitioner.models import hf_gpt2

    def first_line(e):
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"

    out = {}
    model, batch = hf_gpt2(batch=8, seq=16, n_layer=4, attn="eager")
    try:
        runner = partitioner.auto_parallelize(model, batch, mesh=(2,), cluster="cpu",
                                              pipeline={"degree": 2, "schedule": "interleaved", "microbatches": 4,
                                                        "virtual_stages": 2})
        out["partita eager"] = f"trains (loss {runner.train_step(batch).item():.4f})"
    except Exception as e:  # noqa: BLE001 -- report whatever fails, do not hide it
        out["partita eager"] = first_line(e)
    for attn in ("eager", "sdpa"):
        dist.barrier()
        model, batch = hf_gpt2(batch=8, seq=16, n_layer=4, attn=attn)
        ids = batch["input_ids"]
        try:
            pipe = pipeline(model, mb_args=(), mb_kwargs={"input_ids": ids[:2]},
                            split_spec={f"transformer.h.{i}": SplitPoint.BEGINNING for i in (1, 2, 3)})
            stages = [pipe.build_stage(s, torch.device("cpu")) for s in (rank, rank + 2)]
            sched = ScheduleInterleaved1F1B(stages, 4, loss_fn=lambda o, t: _loss_fn(o[0] if isinstance(o, tuple) else o, t))
            if rank == 0:
                sched.step(input_ids=ids)
            else:
                sched.step(target=ids, losses=[])
            out[f"torch {attn}"] = "trains"
        except Exception as e:  # noqa: BLE001 -- the point is to report torch's error
            out[f"torch {attn}"] = first_line(e)
    return out


# --------------------------------------------------------------------------- report


def _fmt_means(means):
    return {s: {k: round(v * 1e3, 1) for k, v in d.items()} for s, d in sorted(means.items())}


def _median(xs):
    return statistics.median(xs)


def _git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="timed steps per system (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--out-dir", default=None, help="write <date>-pipeline.md/.svg/.json here")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--pin", action="store_true", help="pin each rank to its own core (sched_setaffinity)")
    ap.add_argument("--hf-check", action="store_true", help="also try HF GPT2 (eager attention) in both")
    ap.add_argument("--cluster", default="cpu", help="what the stage plans are priced for: cpu, a preset or a cluster file")
    ap.add_argument("--no-fixed", dest="fixed", action="store_false",
                    help="skip bar 1 on fixed-duration kernels (benchmarks/pipeline_fixed_kernels.py)")
    args = ap.parse_args(argv)

    from runtime.launch import run_on_ranks
    from runtime.pipeline_trace import chrome_trace, step_seconds, timeline_svg

    # the code measured: HEAD, and whether the tree differed from it before this run wrote results
    args.code = _git("rev-parse", "--short", "HEAD") + (
        " plus uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no") else "")
    wall = time.perf_counter()
    load_before = os.getloadavg()
    results = []
    for schedule in args.schedules.split(","):
        t = time.perf_counter()
        out = run_on_ranks(run_schedule, P, schedule, args.steps, args.warmup, args.pin, args.cluster, timeout_s=600,
                           collective_timeout_s=300)
        r = out[0]
        # step time: the same on both ranks up to the barrier; take the slower rank's
        r["partita_s"] = [max(a, b) for a, b in zip(out[0]["partita_s"], out[1]["partita_s"])]
        r["torch_s"] = [max(a, b) for a, b in zip(out[0]["torch_s"], out[1]["torch_s"])]
        r["loss_torch"] = out[P - 1]["loss_torch"]
        summarize(r, r["schedule_obj"])
        r["run_s"] = time.perf_counter() - t
        r["estimate_s"] = step_seconds(r["simulated"])
        results.append(r)
        print(f"{schedule}: {r['run_s']:.1f} s; Partita measured {_median(r['partita_s']):.3f} s/step, estimated "
              f"{r['estimate_s']:.3f} s/step ({args.cluster}): measured/estimate "
              f"{_median(r['partita_s']) / r['estimate_s']:.2f}", flush=True)
    hf = run_on_ranks(hf_gpt2_check, 2, timeout_s=300, collective_timeout_s=30) if args.hf_check else None
    fixed = None
    if args.fixed:
        import pipeline_fixed_kernels
        schedules = args.schedules.split(",")
        fixed = pipeline_fixed_kernels.measure(schedules, ranks=(2, 4), layer_ms=10.0)
        # the same at 4x longer kernels: a cost fixed per message shrinks relative to the formula
        fixed += pipeline_fixed_kernels.measure(schedules, ranks=(2,), layer_ms=40.0, steps=4, warmup=1)
        print(pipeline_fixed_kernels.table(fixed))
    latency = run_on_ranks(p2p_latency, 2, timeout_s=120)[1]
    load_after = os.getloadavg()
    wall = time.perf_counter() - wall

    by = {r["schedule"]: r for r in results}
    rows = []
    for r in results:
        f = formula(r["schedule"])
        ref = f if f is not None else r["idle_sim"]
        ratio = r["idle"] / ref if ref > 0 else float("inf")
        bar1 = ratio <= 1.1
        note = ""
        if r["schedule"] == "zb-h1" and "1f1b" in by:
            below = r["idle"] < by["1f1b"]["idle"]
            bar1 = bar1 and below
            note = f"; 1F1B measured {by['1f1b']['idle']:.3f} ({'below' if below else 'NOT below'})"
        ours, theirs = _median(r["partita_s"]), _median(r["torch_s"])
        rows.append({
            "schedule": r["schedule"], "layers": r["layers"], "idle": r["idle"],
            "formula": f"{f:.3f}" if f is not None else f"sim {r['idle_sim']:.3f}", "ref": ref,
            "ratio": ratio, "sim": r["idle_sim"], "replay": r["idle_replay"], "idle_torch": r["idle_torch"], "bar1": bar1, "note": note,
            "ours": ours, "theirs": theirs, "step_ratio": ours / theirs, "bar2": ours / theirs <= 1.0,
            "estimate": r["estimate_s"],
            "torch_class": r["torch_class"],
            "spread": (min(r["partita_s"]), max(r["partita_s"]), min(r["torch_s"]), max(r["torch_s"])),
        })

    header = ("| schedule | stages (layers) | measured idle | formula | measured/formula | bar 1 (<= 1.1) | "
              "cost-model sim | replay of measured durations | torch measured idle | Partita s/step | Partita estimate s/step | "
              "measured/estimate | torch s/step | torch class | "
              "Partita/torch | bar 2 (<= 1.0) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        lines.append(
            f"| {row['schedule']} | {' / '.join(','.join(map(str, l)) for l in row['layers'])} | {row['idle']:.3f} | "
            f"{row['formula']} | {row['ratio']:.2f} | {'PASS' if row['bar1'] else 'FAIL'}{row['note']} | "
            f"{row['sim']:.3f} | {row['replay']:.3f} | {row['idle_torch']:.3f} | {row['ours']:.3f} | {row['estimate']:.3f} | "
            f"{row['ours'] / row['estimate']:.2f} | {row['theirs']:.3f} | "
            f"{row['torch_class']} | {row['step_ratio']:.3f} | {'PASS' if row['bar2'] else 'FAIL'} |")
    table = "\n".join(lines)
    print(table)
    print(f"wall {wall:.0f} s, load {load_before} -> {load_after}")
    for r in results:
        print(r["schedule"], "idle per timed step, Partita:", [round(x, 3) for x in r["idle_steps"]],
              "torch:", [round(x, 3) for x in r["idle_torch_steps"]])
        print(f"    late starts (waiting on due messages), share of rank-time: Partita {r['late']:.3f}, torch "
              f"{r['torch_late']:.3f}; replay of each step's own durations (median over steps): Partita "
              f"{r['idle_replay_actual']:.3f}, torch {r['torch_idle_replay_actual']:.3f}; step time outside the compute span ms: Partita {r['outside_ms']:.1f}, "
              f"torch {r['torch_outside_ms']:.1f}")
        print("   median action ms, Partita:", _fmt_means(r["means"]), "torch:", _fmt_means(r["torch_means"]))
        print("   ",
              "partita:", [round(x, 3) for x in r["partita_s"]], "torch:", [round(x, 3) for x in r["torch_s"]],
              "loss:", r["loss_partita"], r["loss_torch"])
    print("p2p latency ms (sender busy s, receiver busy s):", latency)
    if hf:
        print("HF GPT2 eager:", hf)

    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for r in results:
            step = args.warmup + r["rep_step"] + 1
            timelines = {f"{r['schedule']} Partita measured (step {step} of {args.warmup + args.steps})": r["measured"],
                         f"{r['schedule']} simulated (cost model)": r["simulated"],
                         f"{r['schedule']} torch.distributed.pipelining measured": r["torch_measured"],
                         f"{r['schedule']} replay (Partita's median durations)": r["replay"]}
            (out / f"{args.date}-pipeline-{r['schedule']}.svg").write_text(timeline_svg(timelines))
            (out / f"{args.date}-pipeline-{r['schedule']}.json").write_text(chrome_trace(timelines))
        raw = {r["schedule"]: {k: r[k] for k in ("layers", "partita_s", "torch_s", "idle", "idle_last", "idle_steps",
                                                 "idle_torch_steps", "idle_sim", "idle_replay", "idle_torch",
                                                 "loss_partita", "loss_torch", "torch_class", "build_s", "run_s", "late",
                                                 "torch_late", "outside_ms", "torch_outside_ms", "idle_replay_actual",
                                                 "torch_idle_replay_actual", "estimate_s")}
               | {"means_ms": {s: {k: v * 1e3 for k, v in d.items()} for s, d in r["means"].items()},
                  "torch_means_ms": {s: {k: v * 1e3 for k, v in d.items()} for s, d in r["torch_means"].items()}}
               for r in results}
        if fixed:
            for p, ms in sorted({(r["p"], r["layer_ms"]) for r in fixed}):
                timelines = {f"{r['schedule']}, p={p}, {ms:g} ms kernels, measured (median-idle step)":
                             r["timeline"] for r in fixed if (r["p"], r["layer_ms"]) == (p, ms)}
                (out / f"{args.date}-pipeline-fixed-p{p}-{ms:g}ms.svg").write_text(timeline_svg(timelines))
                (out / f"{args.date}-pipeline-fixed-p{p}-{ms:g}ms.json").write_text(chrome_trace(timelines))
            raw["fixed_kernels"] = [{k: v for k, v in r.items() if k != "timeline"} for r in fixed]
        _write_markdown(out / f"{args.date}-pipeline.md", args, table, rows, results, raw, hf, wall,
                        load_before, load_after, latency, fixed)
    return rows


def _write_markdown(path, args, table, rows, results, raw, hf, wall, load_before, load_after, latency, fixed=None):
    def ms(means):
        return "; ".join(f"{s}: " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in d.items()) for s, d in sorted(means.items()))

    diag = [("| schedule | Partita idle per timed step (min / median / max) | torch idle (min / median / max) | "
            "replay of each step's own durations, Partita / torch | late starts (due messages), Partita / torch | "
            "median action ms, Partita | median action ms, torch | Partita s/step min-max | torch s/step min-max |"),
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        i, t = r["idle_steps"], r["idle_torch_steps"]
        diag.append(
            f"| {r['schedule']} | {min(i):.3f} / {statistics.median(i):.3f} / {max(i):.3f} | "
            f"{min(t):.3f} / {statistics.median(t):.3f} / {max(t):.3f} | "
            f"{r['idle_replay_actual']:.3f} / {r['torch_idle_replay_actual']:.3f} | {r['late']:.3f} / {r['torch_late']:.3f} | "
            f"{ms(r['means'])} | {ms(r['torch_means'])} | {min(r['partita_s']):.3f}-{max(r['partita_s']):.3f} | "
            f"{min(r['torch_s']):.3f}-{max(r['torch_s']):.3f} |")
    lat = ["| sender computes after isend | receiver computes before recv | isend -> recv returns (median ms) |",
           "|---|---|---|"]
    for (sb, rb), v in latency.items():
        lat.append(f"| {sb * 1e3:.0f} ms | {rb * 1e3:.0f} ms | {v:.2f} |")
    losses = ", ".join(f"{r['schedule']} {r['loss_partita']:.6f} / {r['loss_torch']:.6f}" for r in results)
    text = [
        f"# Pipeline parallelism: bubbles and step time ({args.date})",
        "",
        (f"Reproduce: `python benchmarks/pipeline.py --out-dir benchmarks/results --date {args.date}"
        f"{' --hf-check' if hf else ''}` ({wall:.0f} s here)."),
        "",
        f"Code: commit {args.code}.",
        "",
        (f"Machine: {os.cpu_count()}-core CPU VM, Python {platform.python_version()}, torch {torch.__version__}; "
        f"p={P} gloo ranks on the 2 cores, one rank per core (1 compute thread each, "
        f"{'pinned with sched_setaffinity' if args.pin else 'not pinned'}); gloo's communication threads share "
        f"the same 2 cores. The machine is shared with other work: load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after."),
        "",
        f"Model: `partitioner.models.GPT`, {N_LAYER} layers, n_embd {N_EMBD}, {N_HEAD} heads, vocab {VOCAB}, "
        f"seq {SEQ}; batch {M * MB} = m={M} microbatches of {MB} sequences. A step is forward + backward of all "
        f"microbatches (no optimizer step), between two barriers, gradients cleared before it; {args.warmup} "
        f"warm-up + {args.steps} timed steps per system, Partita and torch alternating step by step (order "
        "flipped every round); medians reported. Losses (Partita / torch, same weights and batch): " + losses + ".",
        "",
        "## Results",
        "",
        ("Bar 1: measured idle / formula <= 1.1 (the measured idle is the median over the timed steps of "
        "`idle_fraction(measured_timeline)`; formula (p-1)/(m+p-1) for GPipe and 1F1B, ((p-1)/v)/(m+(p-1)/v) "
        "for interleaved; for ZB-H1 the cost-model simulation `simulated_timeline`, and ZB-H1 must be below "
        "1F1B's measured idle). Bar 2: Partita / torch.distributed.pipelining median step time <= 1.0; torch's "
        "stages are the same GPT cut by hand at `runner.plan['layers']` (stage 0 with the embeddings, the last with "
        "ln_f + lm_head, the loss in the schedule's `loss_fn`); for zb-h1 torch runs `ScheduleInterleavedZeroBubble` "
        "with one stage per rank (its ZB1P, the same F/I/W order as ZB-H1 here). "
        "'replay of measured durations' is the schedule replayed by `simulate` with Partita's median F/B/I/W "
        "per stage and instant messages."),
        "",
        table,
        "",
        "## Diagnostics",
        "",
        ("Where the idle time comes from. 'replay of each step's own durations': every timed step replayed "
        "through Partita's schedule with that step's measured duration for each action and instant messages "
        "(torch's actions are replayed in Partita's order, an approximation where its order differs); what the "
        "compute alone implies, its variance included. 'late starts': the share of rank-time between an action "
        "being ready (its rank free, its producer on the other rank finished) and starting: waiting on a message "
        "already due. The two add up to about the measured idle."),
        "",
        "\n".join(diag),
        "",
        ("gloo point-to-point latency of one stage-boundary activation "
        f"({MB}x{SEQ}x{N_EMBD} fp32, {MB * SEQ * N_EMBD * 4 / 1024:.0f} KiB) on this machine (`p2p_latency`):"),
        "",
        "\n".join(lat),
        "",
    ]
    if fixed:
        import pipeline_fixed_kernels
        ps = sorted({(r["p"], r["layer_ms"]) for r in fixed})
        text += [
            "## Bar 1 on fixed-duration kernels (`benchmarks/pipeline_fixed_kernels.py`)",
            "",
            ("The same executor on `benchmarks/timed_kernels.TimedLayers`: 4 layers per stage, each layer's forward, "
             "input-gradient and weight-gradient kernel taking exactly 10 ms of wall-clock time (about the GPT's "
             "own layer time here; sleeping, so the CPU stays free for gloo, as a GPU kernel leaves the host free), "
             "m=8, on 2 and 4 gloo ranks; then 40 ms kernels on 2 ranks, to see which part of the excess is a "
             "fixed cost per message. What varies from the formula is then only what the executor adds: the interpreter, "
             "autograd, posting and sending messages and waiting for them. ZB-H1's formula with F = I = W is "
             "(p-1)/(3m+p-1). 'simulated, nominal durations' replays the schedule with the kernels' durations "
             "(it reproduces the closed forms); '+ measured message latency' adds the median latency measured in "
             "the same steps (a producing action's end to the end of the receive that waited for it) to every "
             "dependency between ranks."),
            "",
            pipeline_fixed_kernels.table(fixed),
            "",
            "Timelines: " + ", ".join(f"`{args.date}-pipeline-fixed-p{p}-{ms:g}ms.svg`/`.json`" for p, ms in ps) + ".",
            "",
        ]
    if hf:
        text += ["## HF GPT2 with eager attention, 4 stages on 2 ranks (interleaved, 2 stages per rank)", ""]
        for key in hf[0]:
            text.append(f"- {key}: rank 0: `{hf[0][key]}`; rank 1: `{hf[1][key]}`")
        text.append("")
    names = ", ".join(f"`{args.date}-pipeline-{r['schedule']}.svg`/`.json`" for r in results)
    text += [f"Timelines ({names}): Partita measured (the timed step with the median idle), the cost-model "
             "simulation, torch measured (its median-idle step; F/B/I/W timed by wrapping `PipelineStage`'s "
             "`forward_one_chunk` / `backward_one_chunk` / `backward_weight_one_chunk`), and the replay of Partita's "
             "median durations. Raw numbers: `" + path.with_suffix(".raw.json").name + "`.", ""]
    path.write_text("\n".join(text))
    path.with_suffix(".raw.json").write_text(json.dumps(raw, indent=1, default=str))


if __name__ == "__main__":
    main()
