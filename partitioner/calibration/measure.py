"""The whole measurement: every rank's samples (:func:`rank_samples`) on forked gloo ranks or the
running job's own, repeated passes merged by their median."""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from collections.abc import Callable

from partitioner.calibration.measure_collectives import arrival_samples, collective_call, overlap_sample
from partitioner.calibration.measure_compute import compute_samples, fresh_rank, on_own_cores
from partitioner.calibration.measure_sharing import message_samples, time_slice_sample
from partitioner.calibration.sizes import COLLECTIVES, DEFAULT_SIZES
from partitioner.calibration.timing import timed_after

logger = logging.getLogger(__name__)


def rank_samples(rank: int, world: int, sizes: dict, progress: bool = False) -> dict:
    """One rank's part of :func:`measure` (``sizes``: every key of ``DEFAULT_SIZES``)."""
    import torch
    import torch.distributed as dist

    from runtime.collectives import _all_gather_single, _reduce_scatter_single

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def mean(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / world

    def say(message: str) -> None:
        if rank == 0 and progress:
            print(f"[partita calibrate] {message}", file=sys.stderr, flush=True)

    seconds, trials = sizes["seconds"], sizes["trials"]
    out = _compute_on_own_cores(rank, world, sizes, say)
    out["collectives"] = []
    a = torch.randn(96, 96)
    start = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    per_mm = (time.perf_counter() - start) / 20
    count = max(1, int(slowest(sizes["burst"] / per_mm)))  # every rank computes the same burst

    def burst():
        for _ in range(count):
            torch.mm(a, a)

    groups = [(world, None)]
    if world >= 4 and world % 2 == 0:  # pairs as well: two ring step counts per kind at two group sizes
        pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        groups.append((2, pairs[rank // 2] if rank < 2 * (world // 2) else None))
    for n, group in groups:
        if n < 2 or (group is None and n != world):
            continue
        me = dist.get_rank(group) if group is not None else rank
        for kind in COLLECTIVES:
            for payload in sizes["payloads"]:
                fn = collective_call(
                    kind, payload, n, me, group, torch, dist, _all_gather_single, _reduce_scatter_single
                )
                t = timed_after(burst, fn, seconds, trials, slowest, mean)
                out["collectives"].append({"kind": kind, "n": n, "payload": payload, "s": t})
                say(
                    f"{kind} on {n} ranks, {payload} bytes, after {sizes['burst'] * 1e3:g} ms of work: {t * 1e6:.1f} us"
                )
    out["arrival"] = arrival_samples(a, per_mm, (sizes["burst"], *sizes["waits"]), trials, mean, slowest)
    say(
        "a tiny all-reduce after "
        + ", ".join(f"{x['compute_s'] * 1e3:.2f} ms of matmuls: {x['s'] * 1e3:.2f} ms" for x in out["arrival"])
    )
    payload = max([p for p in sizes["payloads"] if p <= 1 << 21] or [min(sizes["payloads"])])  # a weight's size
    out["overlap"] = overlap_sample(rank, world, payload, a, per_mm, trials, mean, slowest)
    o = out["overlap"]
    say(
        f"all-gather of {o['payload']} bytes started before {o['compute_s'] * 1e3:.2f} ms of matmuls: "
        f"{o['both_s'] * 1e3:.2f} ms together, {o['gather_s'] * 1e3:.2f} ms alone"
    )
    _sharing_samples(rank, world, out, say)
    return out


def _sharing_samples(rank: int, world: int, out: dict, say) -> None:
    """The messages' CPU and the slowdown of time-sliced cores (:mod:`~partitioner.calibration.measure_sharing`)."""
    start = time.perf_counter()
    out["messages"] = message_samples(rank)
    out["time_slice"] = time_slice_sample(rank, world, out["cores"])
    say(
        "a message's CPU per end: "
        + ", ".join(f"{m['bytes']} bytes {m['s'] * 1e6:.0f} us" for m in out["messages"])
        + (
            f"; work with every rank busy {out['time_slice']['shared_s'] / out['time_slice']['alone_s']:.2f}x "
            "its CPU time on a core of its own"
            if out["time_slice"]
            else ""
        )
        + f" ({time.perf_counter() - start:.1f} s)"
    )


def _compute_on_own_cores(rank: int, world: int, sizes: dict, say) -> dict:
    """The compute samples of a rank with a core to itself (:func:`on_own_cores`): rank 0's view,
    with ``out["cores"]``, the cores the ranks share."""
    cores, out = on_own_cores(rank, world, lambda slowest: compute_samples(sizes, slowest, say))
    if world > cores:
        say(f"{world} ranks on {cores} cores: compute timed on {cores} ranks at once")
    return {**(out or {}), "cores": cores}


def measure(
    ranks: int = 2,
    sizes: dict | None = None,
    *,
    progress: bool = False,
    timeout_s: float = 900,
    repeats: int = 1,
    say: Callable[[str], None] | None = None,
) -> dict:
    """Run the measurements on ``ranks`` local gloo ranks; returns the samples (rank 0's view of
    the slowest rank): ``{"matmul": [...], "elementwise": [...], "collectives": [...], ...}``.
    With ``repeats`` > 1 the whole set is measured that many times, one pass after another, and
    every figure is the median over the passes (:func:`median_samples`): a machine whose speed
    drifts for a while (a shared host's other tenants) spoils one pass, not the calibration."""
    from runtime.launch import run_on_ranks

    if ranks < 2:
        raise ValueError(f"calibrate: ranks must be >= 2 to measure collectives, got {ranks}")
    if repeats < 1:
        raise ValueError(f"calibrate: repeats must be >= 1, got {repeats}")
    merged = dict(DEFAULT_SIZES, **(sizes or {}))
    unknown = set(merged) - set(DEFAULT_SIZES)
    if unknown:
        raise ValueError(f"calibrate: unknown size keys {sorted(unknown)}; known: {sorted(DEFAULT_SIZES)}")
    passes = []
    for k in range(repeats):
        if repeats > 1 and say is not None:
            say(f"pass {k + 1} of {repeats} (load average {os.getloadavg()[0]:.1f})")
        out = run_on_ranks(rank_samples, ranks, merged, progress, timeout_s=timeout_s, collective_timeout_s=120)[0]
        out["fresh"] = run_on_ranks(fresh_rank, ranks, merged, timeout_s=timeout_s, collective_timeout_s=120)[0]
        passes.append(out)
    return median_samples(passes)


def measure_in_group(sizes: dict | None = None, *, progress: bool = False) -> dict:
    """:func:`measure` by the ranks of the running job's default process group (collective: every
    rank calls it), without forking: rank 0's view of the slowest rank. The fresh-allocation
    samples are left out (they fix glibc's mmap threshold, which a running job must not have
    changed under it), so ``fresh_page_s_per_byte`` fits to 0. The job's random number generator
    is left as it was: the samples' random operands come from a forked state (ranks draw different
    amounts, and the user's next draws must not depend on whether a measurement ran)."""
    import torch
    import torch.distributed as dist

    merged = dict(DEFAULT_SIZES, **(sizes or {}))
    with torch.random.fork_rng(devices=[]):
        return rank_samples(dist.get_rank(), dist.get_world_size(), merged, progress)


def median_samples(passes: list):
    """One set of samples from several passes of the same measurements: the structure of the
    first, every number the median over the passes, each number on its own (sizes, counts and
    shapes are equal in every pass, so only the times change; two times of one sample, such as
    an overlap sample's alone and together, can come from different passes); anything else
    (names, flags, tuples) as the first pass has it."""
    first = passes[0]
    if isinstance(first, dict):
        return {key: median_samples([p[key] for p in passes]) for key in first}
    if isinstance(first, list):
        if any(len(p) != len(first) for p in passes):
            raise ValueError("calibrate: passes measured different sample lists; cannot merge them")
        return [median_samples(list(column)) for column in zip(*passes)]
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    return statistics.median(passes) if isinstance(first, float) else statistics.median_low(passes)
