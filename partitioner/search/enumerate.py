"""Step 2 of :mod:`partitioner.search`: every configuration of ``N`` devices the search prices
(pipeline x data x tensor degrees with their microbatches, schedules, recomputation and ZeRO
stages; for a long sequence, a sequence axis with ring or Ulysses attention too: data x sequence
alone, or combined with the pipeline and tensor axes)."""

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


CONTEXT_COMBINED_MAX = 16
"""The largest sequence degree combined with a pipeline or a tensor axis (context parallelism
as Llama 3 ran it: CP 16 at 128K tokens), offered for a long sequence only (at least 64 tokens
per sample of the global batch; a batch smaller than the devices alone gets the pure split);
the pure ``N = d * s`` split tries every degree."""


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
    ``N = d * s`` without a pipeline or tensor axis, and ``N = p * d * s * t`` with a pipeline or a
    tensor axis for ``s`` up to :data:`CONTEXT_COMBINED_MAX`, ring or Ulysses attention over
    ``sp`` (ring only beside a tensor axis; forced modes put the sequence on ``sp``, ring's heads
    on ``tp`` and the batch on the other axes)."""
    out = []
    sequences = sequence_degrees(devices, global_batch, seq_len)
    for s in sequences:
        d = devices // s
        if global_batch % d:
            continue
        for algo in ("ring", "ulysses"):
            for z in zero_stages(d * s, optimizer):
                out.append(
                    ParallelConfig(
                        1, d, 1, 1, None, 1, recompute, global_batch, zero=z, sequence=s, sequence_parallel=algo
                    )
                )
    pipe_rc = ("none", "all") if recompute == "auto" else (recompute,)
    combined = [s for s in sequences if s <= CONTEXT_COMBINED_MAX and seq_len >= 64 * global_batch]
    for s in [1] + combined:
        for t in divisors(devices // s):
            if t > devices_per_node or (t > 1 and devices_per_node % t):
                continue
            for p in divisors(devices // (s * t)):
                d = devices // (s * t * p)
                if s == 1 and d == 1 and t > 1:
                    continue  # the same one-axis stage mesh as (p, t, 1): the solver places it alike
                if s > 1 and p == 1 and t == 1:
                    continue  # the pure sequence split above
                if p > 1 and (not pipelines or p > layers):
                    continue
                out += _degree_configs(p, d, t, s, global_batch, layers, recompute, pipe_rc, optimizer)
    return out


def _degree_configs(p, d, t, s, global_batch, layers, recompute, pipe_rc, optimizer) -> list:
    """The configurations of degrees ``(p, d, t, s)``: without a pipeline one (per ZeRO stage and
    sequence algorithm) when ``d`` divides the batch; with one, every microbatch count
    ``m >= p`` whose microbatches ``d`` ranks share, each schedule and recomputation."""
    # Ulysses turns the sequence split into a head split: beside a tensor axis's heads it would nest
    algos = ("auto",) if s == 1 else ("ring", "ulysses") if t == 1 else ("ring",)
    out = []
    if p == 1:
        if global_batch % d == 0:
            for algo in algos:
                for z in zero_stages(d * s, optimizer):
                    out.append(
                        ParallelConfig(
                            1, d, t, 1, None, 1, recompute, global_batch, zero=z, sequence=s, sequence_parallel=algo
                        )
                    )
        return out
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
                for algo in algos:
                    for z in zero_stages(d * s, optimizer):
                        out.append(
                            ParallelConfig(
                                p, d, t, m, name, v, rc, global_batch, zero=z, sequence=s, sequence_parallel=algo
                            )
                        )
    return out
