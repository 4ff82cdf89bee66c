"""Step 2 of :mod:`partitioner.search`: every configuration of ``N`` devices the search prices
(pipeline x data x tensor degrees with their microbatches, schedules, recomputation and ZeRO
stages; for a long sequence, data x sequence with ring or Ulysses attention)."""

from __future__ import annotations

import logging

from partitioner.parallel_config import ParallelConfig
from partitioner.search.facts import divisors
from partitioner.search.zero_modes import zero_stages

logger = logging.getLogger(__name__)


PIPELINE_SCHEDULES = ("1f1b", "zb-h1", "interleaved")


def sequence_degrees(devices: int, global_batch: int, seq_len: int) -> list:
    """Sequence-parallel degrees ``s > 1`` offered for a long sequence (at least 64 tokens per
    sample of the global batch, or a batch smaller than the devices): ``s`` divides the devices
    and the sequence into ``2 s`` chunks (the causal ring's zig-zag)."""
    if seq_len < 2 or not (seq_len >= 64 * global_batch or global_batch < devices):
        return []
    return [s for s in divisors(devices) if s > 1 and seq_len % (2 * s) == 0]


def enumerate_configs(
    devices,
    global_batch,
    layers,
    devices_per_node,
    *,
    recompute="auto",
    pipelines=True,
    optimizer="adam",
    seq_len=0,
):
    """Every configuration step 2 of :mod:`partitioner.search` lists (pipelined recomputation only
    where ``recompute`` allows it: ``"auto"`` tries ``none`` and ``all``), each with every ZeRO
    stage :func:`zero_stages` allows; for a long sequence (:func:`sequence_degrees`), also
    ``N = d * s`` without a pipeline or tensor axis, ring or Ulysses attention over ``sp``
    (forced modes put the sequence on the last axis and the batch on the others)."""
    out = []
    for s in sequence_degrees(devices, global_batch, seq_len):
        d = devices // s
        if global_batch % d:
            continue
        for algo in ("ring", "ulysses"):
            for z in zero_stages(d * s, 1, optimizer):
                out.append(
                    ParallelConfig(
                        1, d, 1, 1, None, 1, recompute, global_batch, zero=z, sequence=s, sequence_parallel=algo
                    )
                )
    pipe_rc = ("none", "all") if recompute == "auto" else (recompute,)
    for t in divisors(devices):
        if devices_per_node % t and t > 1:
            continue
        if t > devices_per_node:
            continue
        for p in divisors(devices // t):
            d = devices // (t * p)
            if d == 1 and t > 1:
                continue  # the same one-axis stage mesh as (p, t, 1): the solver places it alike
            if p == 1:
                if global_batch % d == 0:
                    for z in zero_stages(d, 1, optimizer):
                        out.append(ParallelConfig(1, d, t, 1, None, 1, recompute, global_batch, zero=z))
                continue
            if not pipelines or p > layers:
                continue
            for m in divisors(global_batch):
                if m < p or (global_batch // m) % d:
                    continue
                for name in PIPELINE_SCHEDULES:
                    v = 2 if name == "interleaved" else 1
                    if name == "interleaved" and (m % p or layers < 2 * p):
                        continue
                    for rc in pipe_rc:
                        if rc == "all" and layers // (p * v) < 2:
                            continue  # a stage of one layer has no repeated block to recompute
                        for z in zero_stages(d, p, optimizer):
                            out.append(ParallelConfig(p, d, t, m, name, v, rc, global_batch, zero=z))
    return out
