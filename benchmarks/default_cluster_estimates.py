"""Estimated against measured step with the default ``cluster="cpu"``, interleaved rounds, one command.

The issue's GPT rows, run the way a user first runs them: ``auto_parallelize`` with no mesh (the
configuration search chooses; for d512 on 2 ranks it chooses a 2-stage pipeline), AdamW, seq
128, 4 layers, and ``cluster="cpu"`` as a first job meets it: no calibration installed (a fresh
cache folder, so the job's own ranks measure the quick figures,
:mod:`partitioner.local_cluster`).

How it measures
---------------
1. **Each job starts once and stays up.** Its ranks plan, warm up (two steps) and then wait on a
   queue. The jobs start one after another (the second once the first is ready), so no job's
   measurement of ``"cpu"`` or its planning runs beside another job's.
2. **Interleaved rounds.** Round ``r`` runs ``--steps`` timed steps of job A, then of job B
   (A/B/A/B ...): a slow spell of this shared machine lands on both rows, not on one row's every
   sample. A waiting job's ranks block on their queue and use no CPU.
3. **A step** is what a user's loop runs: ``zero_grad``, forward and backward (a pipeline's
   ``train_step``: every microbatch, the held gradient reductions), ``optimizer.step()``, timed
   on each rank between two barriers; the step's time is the slowest rank's. A round's figure is
   the median of its steps; the row's figure the median over the rounds, with their min and max.
4. **The estimate** is the plan's: ``plan.estimate().step_time_s`` (optimizer step included) for an
   intra-op plan; for a pipeline, its schedule simulated with the stage plans' estimates
   (:func:`partitioner.pipeline_simulation.stage_times`), the gradient reductions and optimizer
   step included (the simulation's makespan), its messages priced on the link and as CPU on each
   rank (:func:`partitioner.pipeline_simulation.runner_messages`), the busy ranks sharing the
   host's cores where they outnumber them, slowed by the measured time slicing
   (:mod:`partitioner.core_sharing`). The job's plan (``runner_plan``) is printed beside it: the
   same number.
5. **CPU time per action** (``time.thread_time()`` on the rank's main thread, one torch thread
   per rank), beside the seconds the plan prices for it: per stage ``F``, ``I``, ``W`` (or ``B``),
   its sends and receives (priced at a message's CPU at one end; the thread's time leaves out
   gloo's own threads, which the price counts), every rank's optimizer step and the step's CPU
   outside its actions (:data:`OUTSIDE`, not priced apart) for a pipeline,
   forward / backward / optimizer for an intra-op plan (its communication is priced in the
   estimate, not timed apart). On a busy machine the wall-clock step is not comparable to the
   estimate; a thread's CPU time is much less distorted (what another process does is not
   counted), although cores shared with other work still run it slower (caches, SMT siblings).
   For a pipeline the schedule is also replayed as the estimate simulates it with those CPU
   times in place of the prices (:func:`cpu_replay`, no time-slicing slowdown: the CPU times
   include it): the step a quiet machine would take if every action cost its CPU time.

Usage: ``PYTHONPATH=. python benchmarks/default_cluster_estimates.py [--rounds 5] [--steps 4]
[--out FILE.json]`` (about 3-5 minutes on the 2-core machine when nothing else runs). On a machine
other jobs share, ``--cpu-time-calibration`` times the measurement of ``"cpu"`` in thread CPU time
too, so the prices and the CPU time per action share one clock (the wall-clock rows then say
nothing: compare the per-action table and the replay).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import markdown_table  # noqa: E402

BAND = (0.8, 1.25)
JOBS = ((2, 512, 8), (4, 256, 8))
"""``(ranks, width, batch)`` of the GPT jobs (seq 128, 4 layers, 8 heads, vocabulary 1024)."""


def _action_kind(action) -> str:
    return str(action.kind).rpartition(".")[2]


def _pipeline_prices(runner) -> dict:
    """``"<stage><kind>"`` -> seconds priced per action (sends and receives: a message's CPU at its
    end), and ``"step"``: the simulated makespan, as :func:`partitioner.pipeline_simulation.simulated_timeline`
    simulates it."""
    from partitioner.core_sharing import stage_plans_cores
    from partitioner.pipeline_simulation import runner_messages, stage_times
    from passes.schedules import simulate

    f, b, w, sync = stage_times(runner)
    link_s, message_cpu_s = runner_messages(runner)
    kinds = {_action_kind(a) for acts in runner.schedule.actions for a in acts}
    prices = {}
    for s in f:
        prices[f"{s}F"] = f[s]
        if "B" in kinds:
            prices[f"{s}B"] = b[s]
        if "W" in kinds:
            prices[f"{s}I"], prices[f"{s}W"] = b[s] - w[s], w[s]
        for kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
            if kind in kinds:
                prices[f"{s}{kind}"] = message_cpu_s
    stages = [plan.estimate() for plan in runner.plan["stages"]]
    for actions in runner.schedule.actions:  # every rank's optimizer step: the stages it holds
        held = sorted({int(a.stage) for a in actions})
        prices[_optimizer_key(held)] = sum(stages[s].optimizer_s for s in held)
    cores = stage_plans_cores(runner.plan["stages"], runner.schedule.num_ranks)
    prices["step"] = simulate(
        runner.schedule, f, b, w, comm_time=link_s, sync_time=sync, cores=cores, transfer_time=message_cpu_s
    ).makespan
    prices["link_s"] = link_s
    return prices


def _optimizer_key(stages) -> str:
    return "optimizer (stage " + ", ".join(str(s) for s in stages) + ")"


def _intra_op_prices(pm) -> dict:
    est = pm.plan.estimate()
    records = pm.plan.to_dict()["records"]
    forward = sum(r.get("forward_s", 0.0) for r in records)
    return {
        "forward": forward,
        "backward": est.compute_s - forward,
        "optimizer": est.optimizer_s,
        "communication": est.comm_s,
        "step": est.step_time_s,
    }


OUTSIDE = "train_step outside its actions"
"""The CPU seconds of a pipeline's ``train_step`` beyond its actions (the interpreter's loop, the
receives posted, the held reductions and the loss broadcast): not priced apart."""


def _timed_pipeline(runner, cpu: dict):
    """Wrap the runner's action interpreter: CPU seconds per ``<stage><kind>`` into ``cpu``, and
    their sum over the step in ``runner.bench_in_actions`` (for :data:`OUTSIDE`)."""
    run = runner._run
    runner.bench_in_actions = 0.0

    def timed(action, step, posted):
        t0 = time.thread_time()
        run(action, step, posted)
        spent = time.thread_time() - t0
        cpu.setdefault(f"{action.stage}{_action_kind(action)}", []).append(spent)
        runner.bench_in_actions += spent

    runner._run = timed


def _step(pm, opt, ids, targets, cpu: dict) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad()
    if hasattr(pm, "train_step"):
        pm.bench_in_actions, t0 = 0.0, time.thread_time()
        pm.train_step((ids, targets))
        cpu.setdefault(OUTSIDE, []).append(time.thread_time() - t0 - pm.bench_in_actions)
    else:
        t0 = time.thread_time()
        loss = pm(ids, targets)
        t1 = time.thread_time()
        loss.backward()
        cpu.setdefault("forward", []).append(t1 - t0)
        cpu.setdefault("backward", []).append(time.thread_time() - t1)
    t0 = time.thread_time()
    opt.step()
    key = _optimizer_key(sorted(int(s) for s in pm.stages)) if hasattr(pm, "train_step") else "optimizer"
    cpu.setdefault(key, []).append(time.thread_time() - t0)
    dist.barrier()
    return time.perf_counter() - start


def _slowest(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def job_rank(rank, world, width, batch, steps, commands, replies):
    """One rank of a GPT job: plan, warm up, then run ``steps`` timed steps per ``"run"``."""
    import torch
    import torch.distributed as dist

    import partitioner
    from partitioner.models import gpt_demo

    torch.set_num_threads(1)
    model, (ids, targets) = gpt_demo(batch, 128, n_layer=4, n_embd=width, n_head=8, vocab_size=1024)
    t0 = time.perf_counter()
    pm = partitioner.auto_parallelize(model, (ids, targets), cluster="cpu")
    planned_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    pipelined = hasattr(pm, "train_step")
    prices = _pipeline_prices(pm) if pipelined else _intra_op_prices(pm)
    cpu: dict = {}
    if pipelined:
        _timed_pipeline(pm, cpu)
    for _ in range(2):
        _step(pm, opt, ids, targets, cpu)
    if rank == 0:
        label = f"pipeline {pm.schedule.name}" if pipelined and hasattr(pm.schedule, "name") else type(pm).__name__
        cluster = (pm.plan["stages"][0].data if pipelined else pm.plan.data)["cluster"]
        figures = ("cores_per_node", "time_slice_slowdown", "message_cpu_s", "message_cpu_s_per_byte")
        ready = {
            "planned_s": planned_s,
            "kind": label,
            "prices": prices,
            "cluster": {k: cluster.get(k) for k in figures},
        }
        if pipelined:  # for the replay of the schedule with the measured CPU times (:func:`cpu_replay`)
            from partitioner.core_sharing import stage_plans_cores
            from passes.schedules import format_schedule

            from partitioner.pipeline_plan import runner_plan

            ready["schedule"] = format_schedule(pm.schedule)
            ready["cores"] = stage_plans_cores(pm.plan["stages"], pm.schedule.num_ranks)
            ready["plan_step"] = runner_plan(pm).estimate().step_time_s  # what the job's plan says
        else:
            ready["core_share"] = pm.plan.data["cluster"].get("core_share", 1.0)
        replies.put(("ready", ready))
    while commands[rank].get() == "run":
        cpu.clear()
        times = [_slowest(_step(pm, opt, ids, targets, cpu)) for _ in range(steps)]
        medians = {k: statistics.median(v) for k, v in cpu.items()}
        parts: list = [None] * world
        dist.all_gather_object(parts, medians)
        if rank == 0:
            replies.put(("round", {"steps_s": times, "cpu_s": parts}))
    return None


class Job:
    """A GPT job's ranks, started in a thread (``run_on_ranks`` blocks until they exit)."""

    def __init__(self, ranks: int, width: int, batch: int, steps: int):
        ctx = multiprocessing.get_context("fork")
        self.name = f"GPT d{width}, batch {batch}, searched, {ranks} ranks"
        self.ranks = ranks
        self.commands = [ctx.Queue() for _ in range(ranks)]
        self.replies = ctx.Queue()
        self.error: list = []
        self.rounds: list = []

        def target():
            from runtime.launch import run_on_ranks

            try:
                run_on_ranks(
                    job_rank,
                    ranks,
                    width,
                    batch,
                    steps,
                    self.commands,
                    self.replies,
                    timeout_s=3600,
                    collective_timeout_s=1800,
                )
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                self.error.append(exc)
                self.replies.put(("failed", str(exc)))

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        self.ready = self._reply("ready")

    def _reply(self, expected: str) -> dict:
        kind, payload = self.replies.get(timeout=3600)
        if kind != expected:
            raise RuntimeError(f"{self.name}: {kind}: {payload}")
        return payload

    def run_round(self) -> dict:
        for q in self.commands:
            q.put("run")
        result = self._reply("round")
        self.rounds.append(result)
        return result

    def stop(self) -> None:
        for q in self.commands:
            q.put("stop")
        self.thread.join(timeout=120)


def cpu_replay(ready: dict, actions: dict) -> float | None:
    """A pipeline's schedule simulated as the estimate is (the busy ranks sharing the host's cores),
    with each action's measured CPU seconds in place of its price (a boundary's sends and receives:
    the mean of theirs), each rank's measured optimizer step as its tail, the link's priced time
    between ranks, and no slowdown for time-sliced cores (the CPU seconds measured there include
    it); an intra-op plan's forward, backward and optimizer CPU seconds over the ranks' share of
    a core, plus its priced communication: the step a quiet machine would take if the work cost
    what it cost in CPU time. On a loaded machine it tells a wrong timeline model from wrong
    prices."""
    import dataclasses

    from passes.schedules import parse_schedule, simulate

    if "schedule" not in ready:
        parts = [actions.get(k, {}).get("cpu_s") for k in ("forward", "backward", "optimizer")]
        if None in parts:
            return None
        return sum(parts) / ready.get("core_share", 1.0) + ready["prices"]["communication"]
    schedule = parse_schedule(ready["schedule"])
    cpu = {key: a["cpu_s"] for key, a in actions.items()}
    stages = range(schedule.num_stages)
    forward = {s: cpu.get(f"{s}F", 0.0) for s in stages}
    weight = {s: cpu.get(f"{s}W", 0.0) for s in stages}
    backward = {s: cpu.get(f"{s}B", cpu.get(f"{s}I", 0.0) + weight[s]) for s in stages}
    tail = {s: cpu.get(_optimizer_key([s]), 0.0) for s in stages}
    messages = {}
    for s in stages:  # boundary s: stage s sends forward and receives backward, stage s + 1 the other way
        ends = [cpu.get(f"{s}SEND_F"), cpu.get(f"{s}RECV_B"), cpu.get(f"{s + 1}RECV_F"), cpu.get(f"{s + 1}SEND_B")]
        ends = [t for t in ends if t is not None]
        messages[s] = statistics.mean(ends) if ends else 0.0
    cores = ready.get("cores")
    cores = dataclasses.replace(cores, slowdown=1.0) if cores is not None else None
    return simulate(
        schedule,
        forward,
        backward,
        weight,
        comm_time=ready["prices"].get("link_s", 0.0),
        sync_time=tail,
        cores=cores,
        transfer_time=messages,
    ).makespan


def row(job: Job) -> dict:
    """The job's table row: estimate, the median over rounds of each round's median step, the
    rounds' min and max, and per action the median CPU seconds (slowest rank) beside its price."""
    per_round = [statistics.median(r["steps_s"]) for r in job.rounds]
    measured = statistics.median(per_round)
    prices = job.ready["prices"]
    estimate = prices["step"]
    cpu: dict = {}
    for r in job.rounds:
        for rank_medians in r["cpu_s"]:
            for key, value in rank_medians.items():
                cpu.setdefault(key, []).append(value)
    actions = {  # sends and receives priced at a message's CPU at one end
        key: {"cpu_s": statistics.median(values), "priced_s": prices.get(key)} for key, values in sorted(cpu.items())
    }
    return {
        "run": job.name,
        "kind": job.ready["kind"],
        "estimate_s": estimate,
        "measured_s": measured,
        "rounds_s": per_round,
        "ratio": measured / estimate,
        "in_band": BAND[0] <= measured / estimate <= BAND[1],
        "actions": actions,
        "cpu_replay_s": cpu_replay(job.ready, actions),
        "planned_s": job.ready["planned_s"],
        "plan_step_s": job.ready.get("plan_step"),
        "cluster": job.ready.get("cluster"),
    }


def _ratio(cpu_s: float, priced_s: float | None) -> str:
    return f"{cpu_s / priced_s:.2f}" if priced_s else "-"


def _seconds(priced_s: float | None) -> str:
    return "not priced" if priced_s is None else f"{priced_s:.4f}"


def table(rows: list) -> str:
    steps = [
        [
            r["run"],
            r["kind"],
            f"{r['estimate_s']:.3f}",
            f"{r['measured_s']:.3f}",
            f"{min(r['rounds_s']):.3f}-{max(r['rounds_s']):.3f}",
            f"{r['ratio']:.2f}",
            "yes" if r["in_band"] else "no",
        ]
        for r in rows
    ]
    actions = [
        [r["run"], key, f"{a['cpu_s']:.4f}", _seconds(a["priced_s"]), _ratio(a["cpu_s"], a["priced_s"])]
        for r in rows
        for key, a in r["actions"].items()
    ]
    replays = [
        [r["run"], f"{r['estimate_s']:.3f}", f"{r['cpu_replay_s']:.3f}", f"{r['cpu_replay_s'] / r['estimate_s']:.2f}"]
        for r in rows
        if r.get("cpu_replay_s")
    ]
    step_columns = [
        ("run", "l"),
        ("what ran", "l"),
        ("estimated s", "r"),
        ("measured s (median of rounds)", "r"),
        ("min-max over rounds", "l"),
        ("measured / estimated", "r"),
        ("in 0.8-1.25", "l"),
    ]
    replay_columns = [
        ("run", "l"),
        ("estimated s", "r"),
        ("schedule replayed with CPU s per action", "r"),
        ("replay / estimated", "r"),
    ]
    action_columns = [("run", "l"), ("action", "l"), ("CPU s (median)", "r"), ("priced s", "r"), ("CPU / priced", "r")]
    return "\n".join(
        markdown_table(step_columns, steps)
        + [""]
        + markdown_table(replay_columns, replays)
        + [""]
        + markdown_table(action_columns, actions)
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each runs every job once)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per job per round")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument(
        "--cpu-time-calibration",
        action="store_true",
        help="time the measurement of 'cpu' in thread CPU time, as the actions are (an analysis set-up for a "
        "machine other jobs share: prices and CPU per action in one clock; the wall-clock ratios then mean nothing)",
    )
    ap.add_argument(
        "--keep-cache",
        action="store_true",
        help="use this user's cache of 'cpu' (an installed calibration wins) instead of a fresh one",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        ap.error(f"--rounds and --steps must be >= 1, got {args.rounds} and {args.steps}")
    if not args.keep_cache:  # inherited by the ranks: "cpu" measured by the jobs, as a first job does
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="partita-default-cluster-")
    if args.cpu_time_calibration:  # the ranks are forked from here: they inherit the clock
        import types

        import partitioner.calibration.timing as calibration_timing

        calibration_timing.time = types.SimpleNamespace(perf_counter=time.thread_time)
    t0 = time.perf_counter()

    def say(message):
        print(f"[{time.perf_counter() - t0:5.0f} s] {message} (load {os.getloadavg()[0]:.1f})", flush=True)

    jobs = []
    try:
        for ranks, width, batch in JOBS:
            jobs.append(Job(ranks, width, batch, args.steps))
            ready = jobs[-1].ready
            say(
                f"{jobs[-1].name}: ready ({ready['kind']}, planned in {ready['planned_s']:.0f} s; estimate "
                f"{ready['prices']['step']:.4f} s, the job's plan says {ready.get('plan_step') or ready['prices']['step']:.4f} s; "
                f"'cpu': {ready['cluster']})"
            )
        for r in range(args.rounds):
            for job in jobs:
                step = statistics.median(job.run_round()["steps_s"])
                say(
                    f"round {r + 1}/{args.rounds}: {job.name}: median step {step:.3f} s, "
                    f"estimated {job.ready['prices']['step']:.3f} s"
                )
    finally:
        for job in jobs:
            job.stop()
    rows = [row(job) for job in jobs]
    print()
    print(table(rows))
    inside = sum(r["in_band"] for r in rows)
    print(f"\n{inside} of {len(rows)} rows inside {BAND[0]}-{BAND[1]}; {time.perf_counter() - t0:.0f} s in all")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "seconds": time.perf_counter() - t0}, indent=1) + "\n")


if __name__ == "__main__":
    main()
