"""The cluster a name stands for, and ``"cpu"``: this machine, measured once and cached.

``get_cluster`` turns what a user passes as ``cluster=`` (a preset name, a cluster file's path,
a spec's dict, a :class:`~partitioner.cluster.ClusterSpec`) into a spec. The presets describe
GPUs from vendor figures; ``"cpu"`` is the machine this process runs on, which no preset can
describe, so it is measured.

How ``"cpu"`` is measured
-------------------------
A job's step on a CPU is priced with the same cost model as everywhere else, so the figures it
needs are those ``partitioner calibrate`` fits (:mod:`partitioner.calibration`): matmul rates by
shape, memory bandwidth, the per-op overhead of a lowered program, the rates of activations,
norms and attention, the optimizer's step, and every collective the runtime issues. Collectives
are timed **with all of the job's ranks working at once** (a collective's cost depends on how
many ranks take part); compute on as many ranks at once as the machine has cores (a rank with a
core to itself), and the cores are recorded (``cores_per_node``): where the ranks outnumber them,
the planner prices the sharing (:mod:`partitioner.core_sharing`: every rank computing at once
gets its share of a core; a pipeline's ranks take turns on the cores in its simulated step).
Guessing the links from memory bandwidth, or leaving out the ops no roofline reaches, put the
estimate 1.3-2.5x under the measured step.

1. **Once per rank count.** The figures depend on how many ranks share the machine, so the
   cache holds one cluster file per count: ``$XDG_CACHE_HOME/partita/cpu_cluster-<R>ranks.json``
   (``~/.cache`` by default). A file ``cpu_cluster.json`` there (``partitioner calibrate
   --as-cpu`` writes it) is what ``"cpu"`` means for every count: the full calibration wins.
2. **Quick sizes.** The measurement runs :data:`partitioner.calibration.sizes.QUICK_SIZES`, the full
   calibration's code on fewer sizes and shorter loops (about half a minute for 2 ranks on a
   2-core machine, where the full one takes two or three); progress goes to the
   ``partitioner`` logger.
3. **Where the ranks come from.** Inside a job (:func:`job_cluster`, called by
   ``auto_parallelize`` on every rank) the job's own ranks measure over its process group: rank
   0 finds the cache, or every rank measures and rank 0 fits and writes it; rank 0's spec is
   broadcast, so all ranks plan from the same figures. Outside one (``plan()``, the CLI) ``R``
   local gloo ranks are forked for the measurement (:func:`partitioner.calibration.measure.measure`),
   ``R`` the plan's device count, at most :data:`MAX_FORKED_RANKS`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from partitioner.calibration.calibrate import write_cluster_file
from partitioner.calibration.fit import fit
from partitioner.calibration.measure import measure, measure_in_group
from partitioner.calibration.measure_compute import host_cores
from partitioner.calibration.sizes import QUICK_SIZES
from partitioner.cluster import PRESETS, ClusterSpec, LinkSpec, load_cluster_file

__all__ = ["get_cluster", "cpu_cluster", "job_cluster", "for_memory_budget", "installed_cpu_path", "MAX_FORKED_RANKS"]

logger = logging.getLogger(__name__)

MAX_FORKED_RANKS = 8
"""The most ranks forked to measure ``"cpu"`` for a plan made outside a job."""


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "partita"


def installed_cpu_path() -> Path:
    """Where ``partitioner calibrate --as-cpu`` installs the cluster ``"cpu"`` means for every rank count."""
    return _cache_dir() / "cpu_cluster.json"


def measured_cpu_path(ranks: int) -> Path:
    """The cache of the quick measurement with ``ranks`` ranks."""
    return _cache_dir() / f"cpu_cluster-{ranks}ranks.json"


def _cached_cpu(ranks: int) -> ClusterSpec | None:
    for path in (installed_cpu_path(), measured_cpu_path(ranks)):
        if path.exists():
            try:
                return load_cluster_file(path)
            except ValueError as exc:
                logger.warning("ignoring the cached CPU cluster %s (%s); measuring again", path, exc)
    return None


def _store(spec: ClusterSpec, samples: dict, ranks: int, started: float) -> ClusterSpec:
    path = measured_cpu_path(ranks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_cluster_file(path, spec, samples, ranks)
        logger.warning(
            "measured this CPU for %d ranks in %.1f s (%s cores); cached in %s: later jobs read it",
            ranks,
            time.perf_counter() - started,
            spec.cores_per_node,
            path,
        )
    except OSError as exc:
        logger.warning("could not cache the CPU cluster in %s (%s): the next job measures again", path, exc)
    return spec


def _announce(ranks: int, how: str) -> None:
    logger.warning(
        "measuring this CPU for %d ranks (%s, about 30-60 s, once: cached in %s; "
        "`python -m partitioner calibrate --as-cpu` runs the full calibration)",
        ranks,
        how,
        measured_cpu_path(ranks),
    )


def cpu_cluster(ranks: int | None = None, *, refresh: bool = False) -> ClusterSpec:
    """This machine as a cluster of ``ranks`` local ranks (default: one per core), outside a job:
    the installed or cached file, else a quick measurement on forked gloo ranks (cached)."""
    ranks = max(2, int(ranks or os.cpu_count() or 2))
    forked = min(ranks, MAX_FORKED_RANKS)
    spec = None if refresh else _cached_cpu(forked)
    if spec is not None:
        return spec
    _announce(forked, f"{forked} forked gloo ranks")
    started = time.perf_counter()
    samples = measure(forked, QUICK_SIZES, say=logger.info)
    return _store(_named_cpu(fit(samples, ranks=forked)), samples, forked, started)


def _named_cpu(spec: ClusterSpec) -> ClusterSpec:
    return dataclasses.replace(spec, name="cpu", notes=spec.notes + " (quick sizes: partitioner.local_cluster)")


def job_cluster(cluster) -> ClusterSpec:
    """``cluster`` for a running job, the same spec on every rank. Collective: every rank of the
    default process group calls it. ``"cpu"`` is measured by the job's ranks where not cached."""
    import torch.distributed as dist

    if not (isinstance(cluster, str) and cluster.lower() == "cpu"):
        return get_cluster(cluster)
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    box: list = [_cached_cpu(max(2, local)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None and world >= 2:
        if rank == 0:
            _announce(local, f"this job's {world} ranks")
        started = time.perf_counter()
        samples = measure_in_group(QUICK_SIZES)
        if rank == 0:
            box = [_store(_named_cpu(fit(samples, ranks=local)), samples, local, started)]
        dist.broadcast_object_list(box, src=0)
    return box[0] if box[0] is not None else _single_rank_cpu()


def _single_rank_cpu() -> ClusterSpec:
    """A one-rank job's CPU (no collectives to measure, none to price): the compute figures
    measured in this process, not cached."""
    from partitioner.calibration.fit import fit_compute
    from partitioner.calibration.measure_compute import compute_samples

    sizes = dict(QUICK_SIZES, trials=1)
    compute = fit_compute(compute_samples(sizes))
    link = LinkSpec(bandwidth=compute["memory_bandwidth"] / 8, latency_s=0.0)
    spec = ClusterSpec(
        name="cpu",
        **compute,  # every compute figure fit_compute gives is a field of the spec
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        devices_per_node=1,
        intra_node=link,
        inter_node=link,
        collective_overhead_s=0.0,
        cores_per_node=host_cores(),
        notes="compute measured in a one-rank job (partitioner.local_cluster); no link measured",
    )
    return spec


def get_cluster(cluster, *, ranks: int | None = None) -> ClusterSpec:
    """A ClusterSpec from a preset name (``h100``, ``h200``, ``a100``, ``cpu``), the path of a
    cluster file (``partitioner calibrate``), a spec's dict or a spec. ``ranks``: the local rank
    count ``"cpu"`` is measured for (see the module docstring)."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, dict):
        return ClusterSpec.from_dict(cluster)
    key = str(cluster).lower()
    if key == "cpu":
        return cpu_cluster(ranks)
    if key not in PRESETS:
        if isinstance(cluster, os.PathLike) or key.endswith(".json") or os.path.isfile(str(cluster)):
            return load_cluster_file(cluster)
        raise ValueError(
            f"unknown cluster {cluster!r}: choose one of {sorted(PRESETS) + ['cpu']}, the path of a cluster file "
            "(`python -m partitioner calibrate --out FILE`) or a partitioner.ClusterSpec"
        )
    return PRESETS[key]


def for_memory_budget(cluster, memory_budget) -> ClusterSpec:
    """The cluster a CPU job run by ``auto_parallelize`` under ``memory_budget`` is priced with:
    there glibc's mmap threshold is fixed (``runtime/host_memory.py``) and every large allocation
    is a fresh mapping, so where a fresh page has a measured cost :attr:`ClusterSpec.fresh_allocations`
    is set; without a budget the spec as given. (``partitioner.plan`` alone changes no allocator:
    it prices what it is given.)"""
    spec = get_cluster(cluster)
    if memory_budget is None or spec.fresh_page_s_per_byte <= 0 or spec.fresh_allocations:
        return spec
    return dataclasses.replace(spec, fresh_allocations=True)
