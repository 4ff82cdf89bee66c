"""The longest sequence that trains on 4 ranks under a per-rank memory cap, and the step time.

A GPT (2 layers, width 128, 4 heads, vocabulary 256, batch 1) trains one AdamW step on 4 gloo
ranks, each process capped on its private (anonymous) memory with ``RLIMIT_DATA`` (as in
``benchmarks/memory_cap.py``). Sequence lengths double from ``--start`` until a run fails (out
of memory on some rank); each length is a fresh forked run. Three ways to split the sequence:

* **Partita**: ``auto_parallelize(..., memory_budget=<the cap>, sequence_parallel="auto")``: the
  solver's own choice among Megatron (head-split) attention, ring and Ulysses;
* **Megatron-SP**: the same model pinned to Megatron tensor parallelism with sequence-parallel
  norms (the parity tests' ``tp_sp`` pins) and ``sequence_parallel="none"``;
* with ``--forced``, also Partita with ``sequence_parallel="ring"`` and ``"ulysses"``;
* **PyTorch context_parallel** (``torch.distributed.tensor.experimental.context_parallel``): the
  attention inputs as sequence-split DTensors; tried once on gloo, and its error is reported
  when it does not run there.

Then the step time at one length every runner trains (``--time-seq``): Partita and Megatron-SP
alternate, ``--reps`` forked runs each of 3 steps; a run's time is the slowest rank's best of its
last two steps (wall clock between barriers), and the figure the median over the runs. The
machine's 2 cores are shared by the 4 ranks (and by whatever else runs), so times are for
comparing runners, not absolute.

Usage: ``python benchmarks/long_sequence.py [--cap-mib 384] [--start 2048] [--out results.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import cap_private_memory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

N_LAYER, N_EMBD, N_HEAD, VOCAB, BATCH = 2, 128, 4, 256, 1
MEGATRON_SP = {
    "idx": ["R"],
    "targets": ["R"],
    "h.*.attn.c_attn.weight": ["S(0)"],
    "h.*.mlp.c_fc.weight": ["S(0)"],
    "h.*.attn.c_proj.weight": ["S(1)"],
    "h.*.mlp.c_proj.weight": ["S(1)"],
    "h.*.attn.c_attn": ["S(2)"],
    "h.*.mlp.c_fc": ["S(2)"],
    "h.*.attn.c_proj": ["P"],
    "h.*.mlp.c_proj": ["P"],
    "h.*.ln_1": ["S(1)"],
    "h.*.ln_2": ["S(1)"],
    "ln_f": ["S(1)"],
}


def _model(seq):
    from partitioner.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    return model, (ids, torch.roll(ids, -1, dims=1))


def _oom(exc) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "memory" in text or "alloc" in text


def _train(rank, world, runner, seq, cap_mib, steps, cluster="h100"):
    """One runner at one length: plan (uncapped: planning is not the step), cap, train."""
    import torch.distributed as dist

    import partitioner

    model, inputs = _model(seq)
    describe = ""
    if runner == "context_parallel":
        return _context_parallel(model, inputs, cap_mib, steps)
    kw = dict(mesh=(world,), cluster=cluster, recompute="none")
    if runner.startswith("partita"):
        mode = runner.partition("_")[2] or "auto"
        pm = partitioner.auto_parallelize(
            model, inputs, memory_budget=int(cap_mib * 2**20), sequence_parallel=mode, **kw
        )
    else:
        pm = partitioner.auto_parallelize(model, inputs, pins=MEGATRON_SP, sequence_parallel="none", **kw)
    att = [r for r in pm.plan.records if "scaled_dot_product_attention" in r["name"]]
    notes = (att[0].get("notes") or {}).get("a0") if att else None
    describe = notes or f"attention {att[0]['out'][0]}" if att else ""
    del model
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    cap_private_memory(cap_mib * 2**20)
    times, status = [], "trained"
    try:
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = pm(*inputs)
            loss.backward()
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
    except (MemoryError, RuntimeError) as exc:
        if not _oom(exc):
            raise
        status = f"out of memory: {str(exc).splitlines()[0][:100]}"
        # the other ranks wait in a collective: leave the job now
        import os

        os._exit(3)
    return {"status": status, "times": times, "loss": loss.item(), "algorithm": describe}


def _context_parallel(model, inputs, cap_mib, steps):
    """PyTorch's context parallelism: the model's buffers sequence-split inside the context."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    ids, targets = inputs
    try:
        with context_parallel(mesh, buffers=[ids, targets], buffer_seq_dims=[1, 1]):
            loss = model(ids, targets)
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - reported as the runner's result
        return {"status": f"does not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", "times": []}
    return {"status": "trained", "times": [], "loss": loss.item()}


def _attempt(runner, seq, cap_mib, steps, cluster="h100"):
    from runtime.launch import RankFailure, run_on_ranks

    try:
        results = run_on_ranks(_train, 4, runner, seq, cap_mib, steps, cluster, timeout_s=900, collective_timeout_s=600)
    except RankFailure as exc:
        first = str(exc).splitlines()[0]
        return {"status": "out of memory (a rank left with exit code 3)" if "code 3" in str(exc) else first[:160]}
    r0 = results[0]
    r0["step_s"] = max(min(r["times"][1:] or r["times"]) for r in results) if r0["times"] else None
    return r0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=float, default=384)
    parser.add_argument("--start", type=int, default=2048)
    parser.add_argument("--longest", type=int, default=65536)
    parser.add_argument("--out", default=None)
    parser.add_argument("--forced", action="store_true", help="also Partita with ring / Ulysses forced")
    parser.add_argument("--time-seq", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cluster", default="h100", help="what Partita plans for (h100, cpu: measured here, ...)")
    args = parser.parse_args(argv)
    rows: list = []
    longest: dict = {}
    cp = _attempt("context_parallel", args.start, args.cap_mib, 1)
    rows.append(("context_parallel", args.start, cp["status"], "", ""))
    print(rows[-1], flush=True)
    for runner in ("partita", "megatron_sp") + (("partita_ring", "partita_ulysses") if args.forced else ()):
        seq = args.start
        while seq <= args.longest:
            t0 = time.perf_counter()
            r = _attempt(runner, seq, args.cap_mib, 2, args.cluster)
            wall = time.perf_counter() - t0
            ok = r["status"] == "trained"
            step = f"{r['step_s']:.2f}" if ok and r.get("step_s") else ""
            rows.append((runner, seq, r["status"], r.get("algorithm", ""), step))
            print(rows[-1], f"({wall:.0f} s)", flush=True)
            if not ok:
                break
            longest[runner] = seq
            seq *= 2
    ratio = longest.get("partita", 0) / longest["megatron_sp"] if longest.get("megatron_sp") else float("nan")
    times: dict = {"partita": [], "megatron_sp": []}
    for _ in range(args.reps):
        for runner in times:
            r = _attempt(runner, args.time_seq, args.cap_mib, 3, args.cluster)
            if r["status"] == "trained":
                times[runner].append(r["step_s"])
            print("time", runner, args.time_seq, r["status"], r.get("step_s"), flush=True)
    med = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
    t_ratio = med["partita"] / med["megatron_sp"]
    common = args.time_seq
    lines = ["| runner | sequence | result | attention | step (s) |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    summary = (
        f"Longest sequence trained: Partita {longest.get('partita')}, Megatron-SP {longest.get('megatron_sp')}: "
        f"ratio {ratio:.2f} (bar >= 1.0). Step time at {common} (median of {args.reps} runs): Partita "
        f"{med['partita']:.2f} s ({', '.join(f'{t:.2f}' for t in times['partita'])}), Megatron-SP "
        f"{med['megatron_sp']:.2f} s ({', '.join(f'{t:.2f}' for t in times['megatron_sp'])}): ratio {t_ratio:.2f} "
        f"(bar <= 1.0). "
        f"PyTorch context_parallel on gloo: {cp['status']}."
    )
    table = "\n".join(lines)
    print(table)
    print(summary)
    if args.out:
        Path(args.out).write_text(
            f"# Long sequences ({datetime.date.today().isoformat()})\n\nMachine: 2-core CPU, 4 gloo ranks. Reproduce: "
            f"`python benchmarks/long_sequence.py --cap-mib {args.cap_mib:g} --start {args.start}"
            f"{' --forced' if args.forced else ''} --cluster {args.cluster}`.\n\n"
            f"GPT {N_LAYER} layers x {N_EMBD}, {N_HEAD} heads, vocabulary {VOCAB}, batch {BATCH}, causal; one AdamW "
            f"step (two for the time, the second timed: the slowest rank's wall clock between barriers) under a "
            f"private-memory cap (RLIMIT_DATA) of {args.cap_mib:g} MiB per rank above what the process held after "
            f"planning. Lengths double until a run fails.\n\n" + table + "\n\n" + summary + "\n"
        )


if __name__ == "__main__":
    main()
