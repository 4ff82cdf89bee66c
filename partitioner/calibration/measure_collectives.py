"""Collective samples (step 3 of :mod:`partitioner.calibration`): one call of each kind, the
time inside a tiny all-reduce after longer work (arrival), and a prefetched gather's overlap
with compute."""

from __future__ import annotations

import logging
import statistics
import time

logger = logging.getLogger(__name__)


def arrival_samples(a, per_mm, bursts, trials, mean, agree) -> list:
    """For each ``b`` of ``bursts`` (the collective samples' burst first): runs of matmuls of about
    ``b`` seconds, each followed by a tiny all-reduce, as a step's compute is followed by its next
    collective; ``compute_s``: a run's time, ``s``: the time inside the all-reduce after it (from
    the moment the rank enters it, as the collective samples), each the mean over ``4 trials``
    runs (after one unmeasured) and over ranks."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(2)
    reps = 4 * trials
    out = []
    dist.all_reduce(buf)
    t0 = time.perf_counter()
    for _ in range(50):  # a matmul's time now, every rank busy (``per_mm``, timed at the start, can be far off)
        torch.mm(a, a)
    per_mm = agree((time.perf_counter() - t0) / 50)
    for b in bursts:
        count = max(1, int(b / per_mm))
        work = inside = 0.0
        for i in range(reps + 1):
            t0 = time.perf_counter()
            for _ in range(count):
                torch.mm(a, a)
            t1 = time.perf_counter()
            dist.all_reduce(buf)
            if i:
                work, inside = work + t1 - t0, inside + time.perf_counter() - t1
        out.append({"compute_s": mean(work / reps), "s": mean(inside / reps)})
    return out


def overlap_sample(rank, world, payload, a, per_mm, trials, mean, agree) -> dict:
    """How much of an asynchronous all-gather (a prefetched weight gather) computing beside it
    hides: on every rank at once, the gather of ``payload`` bytes alone, a run of matmuls about as
    long alone, and the gather started before the matmuls and waited for after them (``both``),
    interleaved, each the mean over ``8 trials`` rounds and over ranks."""
    import torch
    import torch.distributed as dist

    from runtime.collectives import _all_gather_single

    numel = max(world, payload // 4 // world * world)
    out, inp = torch.empty(numel), torch.ones(numel // world)

    def gather(async_op=False):
        return _all_gather_single(out, inp, async_op=async_op)

    gather()
    alone = []
    for _ in range(5):
        t0 = time.perf_counter()
        gather()
        alone.append(time.perf_counter() - t0)
    count = max(1, int(agree(statistics.median(alone) / per_mm)))  # matmuls as long as a gather

    def compute():
        for _ in range(count):
            torch.mm(a, a)

    def both():
        work = gather(async_op=True)
        compute()
        work.wait()

    sums = {"compute_s": 0.0, "gather_s": 0.0, "both_s": 0.0}
    rounds = 8 * trials
    for _ in range(rounds):
        for key, fn in (("compute_s", compute), ("gather_s", gather), ("both_s", both)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sums[key] += time.perf_counter() - t0
    return {"payload": payload, **{k: mean(v / rounds) for k, v in sums.items()}}


def collective_call(kind, payload, n, me, group, torch, dist, all_gather, reduce_scatter):
    """One call of ``kind`` moving ``payload`` bytes as :mod:`passes.plan.cost_model` names them
    (all-gather: the gathered buffer; reduce-scatter: the full input; send/recv: what this rank
    sends to the next rank of the ring while it receives from the previous one)."""
    numel = max(n, payload // 4 // n * n)
    if kind == "all_reduce":
        buf = torch.ones(numel)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        out, inp = torch.empty(numel), torch.ones(numel // n)
        return lambda: all_gather(out, inp, group=group)
    if kind == "reduce_scatter":
        inp, out = torch.ones(numel), torch.empty(numel // n)
        return lambda: reduce_scatter(out, inp, group=group)
    if kind == "all_to_all":
        inp, out = torch.ones(numel), torch.empty(numel)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    send, recv = torch.ones(numel), torch.empty(numel)
    peers = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    nxt, prv = peers[(me + 1) % n], peers[(me - 1) % n]

    def exchange():
        works = [dist.isend(send, nxt), dist.irecv(recv, prv)]
        for w in works:
            w.wait()

    return exchange
