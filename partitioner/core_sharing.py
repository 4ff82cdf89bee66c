"""Ranks that outnumber a host's cores: what each rank's compute costs, and how many run at once.

A CPU host's ranks each compute on one core (one torch thread: ``runtime.launch`` and torchrun's
default). A cluster that records its cores (:attr:`partitioner.cluster.ClusterSpec.cores_per_node`,
the ``"cpu"`` cluster: this machine's) holds compute figures of a rank with a core to itself
(the calibration times compute on at most that many ranks at once). Two cases share cores:

* **Every rank computes at once** (an intra-op plan: data, tensor or sequence parallel ranks run
  the same program side by side). ``r`` ranks on ``C < r`` cores each get ``C / r`` of a core, so
  the plan is priced with :func:`shared_cluster`: every compute figure slowed by ``r / C``
  and by :attr:`~partitioner.cluster.ClusterSpec.time_slice_slowdown` (the time-sliced cores'
  caches; FLOP/s, memory bandwidth, measured op rates and the optimizer's stream divided by it,
  the fixed costs per op, per tensor and per fresh byte multiplied). Collectives keep their
  figures: they were measured with all of the host's ranks taking part.
* **Ranks take turns** (a pipeline: a stage's rank computes while others wait for its
  activations). Its stages are priced as above for their own rank groups, and the schedule is
  simulated with the busy ranks sharing the cores (:func:`pipeline_cores`, a
  :class:`passes.schedules.SharedCores` for :func:`passes.schedules.simulate`'s ``cores``): while
  ``n`` ranks are busy each runs at ``min(1, C / n)`` of a core, slowed by the time slicing's
  factor while ``n > C``. Its sends and receives cost CPU on both ranks
  (:func:`message_cpu_time`, the simulator's ``transfer_time``).

A spec records the share of a core its figures assume (``core_share``), so pricing an already
shared spec again for the same ranks changes nothing. Only a job on one host is shared this way
(a CPU cluster is one host); a pipeline over several hosts is simulated without the limit.
"""

from __future__ import annotations

import dataclasses
import logging

from partitioner.cluster import ClusterSpec
from passes.schedules import SharedCores

__all__ = ["core_share", "shared_cluster", "pipeline_cores", "stage_plans_cores", "message_cpu_time"]

logger = logging.getLogger(__name__)


def core_share(spec: ClusterSpec, ranks: int) -> float:
    """The share of a core each of ``ranks`` ranks computing at once gets on one of ``spec``'s
    hosts (1.0 where the cores are not recorded or suffice)."""
    cores = spec.cores_per_node
    on_host = min(max(1, int(ranks)), max(1, spec.devices_per_node))
    if not cores or on_host <= cores:
        return 1.0
    return cores / on_host


def shared_cluster(spec: ClusterSpec, ranks: int) -> ClusterSpec:
    """``spec`` as ``ranks`` ranks that all compute at once see it (see the module docstring)."""
    share = core_share(spec, ranks)
    slower = _cpu_time_factor(spec, share) / _cpu_time_factor(spec, spec.core_share)
    if abs(slower - 1.0) < 1e-12:
        return spec
    logger.info(
        "%d ranks share %d cores per host: compute priced at %.2f of a core each (%.2fx a core's time)",
        ranks,
        spec.cores_per_node,
        share,
        1.0 / share,
    )
    steps = {
        name: {**step, "tensor_s": step["tensor_s"] * slower, "bandwidth": step["bandwidth"] / slower}
        for name, step in spec.optimizer_steps.items()
    }
    return dataclasses.replace(
        spec,
        peak_flops={dtype: rate / slower for dtype, rate in spec.peak_flops.items()},
        memory_bandwidth=spec.memory_bandwidth / slower,
        op_overhead_s=spec.op_overhead_s * slower,
        view_overhead_s=spec.view_overhead_s * slower,
        op_rates={
            dtype: {op: _scaled_rate(rate, 1.0 / slower) for op, rate in ops.items()}
            for dtype, ops in spec.op_rates.items()
        },
        optimizer_steps=steps,
        fresh_page_s_per_byte=spec.fresh_page_s_per_byte * slower,
        host_memory_bandwidth=None if spec.host_memory_bandwidth is None else spec.host_memory_bandwidth / slower,
        core_share=share,
    )


def _cpu_time_factor(spec: ClusterSpec, share: float) -> float:
    """Seconds of a rank's work at ``share`` of a core per second on a core of its own: ``1 / share``,
    times the slowdown of time-sliced cores where ``share < 1``."""
    return (1.0 / share) * (spec.time_slice_slowdown if share < 1.0 else 1.0)


def _scaled_rate(rate, factor: float):
    """An ``op_rates`` entry (a number, or a grid ``{"axes", "rates"}`` of nested lists) times ``factor``."""
    if isinstance(rate, dict):
        return {**rate, "rates": _scaled_rate(rate["rates"], factor)}
    if isinstance(rate, list):
        return [_scaled_rate(r, factor) for r in rate]
    return rate * factor


def pipeline_cores(spec: ClusterSpec, pipeline_ranks: int, stage_ranks: int = 1) -> SharedCores | None:
    """How the host's cores are shared by ``pipeline_ranks`` pipeline ranks (each a group of
    ``stage_ranks`` ranks), for :func:`passes.schedules.simulate`'s ``cores``: as many groups as
    compute at once at full speed, and the slowdown of time-sliced cores; None: no sharing (the
    cores are not recorded, suffice for every rank, or the pipeline spans hosts)."""
    cores = spec.cores_per_node
    total = pipeline_ranks * max(1, stage_ranks)
    if not cores or total <= cores or total > spec.devices_per_node:
        return None
    at_once = max(1, cores // max(1, stage_ranks))
    return SharedCores(at_once, spec.time_slice_slowdown) if at_once < pipeline_ranks else None


def message_cpu_time(spec: ClusterSpec, nbytes: float) -> float:
    """CPU seconds a point-to-point message of ``nbytes`` costs its rank at either end (0 for no
    message, and on clusters that record no such cost: the GPU presets)."""
    if nbytes <= 0:
        return 0.0
    return spec.message_cpu_s + nbytes * spec.message_cpu_s_per_byte


def stage_plans_cores(stage_plans, pipeline_ranks: int) -> SharedCores | None:
    """:func:`pipeline_cores` for a pipeline whose stages are ``stage_plans`` (their header's
    cluster and mesh: every stage on a mesh of one size), ``pipeline_ranks`` pipeline ranks."""
    import math

    if not stage_plans:
        return None
    first = stage_plans[0]
    data = first.data if hasattr(first, "data") else first
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        return None
    spec = ClusterSpec.from_dict(cluster)
    return pipeline_cores(spec, pipeline_ranks, math.prod(data["mesh"]["shape"]))
