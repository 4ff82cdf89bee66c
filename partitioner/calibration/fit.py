"""Fitting (step 4 of :mod:`partitioner.calibration`): the cluster whose cost model best reproduces
the samples, every fit on relative error (each sample weighted by ``1 / t**2``)."""

from __future__ import annotations

import logging
import math
import os
import platform
import statistics

from partitioner.calibration.sizes import COLLECTIVES
from partitioner.cluster import ClusterSpec, LinkSpec

logger = logging.getLogger(__name__)


def weighted_lstsq(rows: list, times: list, keep: list) -> list:
    """Least squares of ``times`` on the ``keep`` columns of ``rows``, each row weighted by
    ``1 / t``; the dropped columns' coefficients are 0."""
    import numpy as np

    a = np.array([[r[j] for j in keep] for r in rows], dtype=float)
    t = np.array(times, dtype=float)
    w = 1.0 / t
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(a * w[:, None] / scale, t * w, rcond=None)
    coef = coef / scale
    full = [0.0] * len(rows[0])
    for j, c in zip(keep, coef):
        full[j] = float(c)
    return full


def _fit_nonnegative(rows: list, times: list, fixed_columns: list) -> tuple[list, list]:
    """Fit all columns; while a coefficient comes out negative, drop a fixed-cost column (a
    negative one first, else the last still kept) and refit. Without fixed columns every slope is
    positive (each a line through the origin through positive samples). Returns (coefficients,
    kept columns)."""
    keep = list(range(len(rows[0])))
    while True:
        coef = weighted_lstsq(rows, times, keep)
        kept_fixed = [j for j in fixed_columns if j in keep]
        if all(c >= 0 for c in coef) or not kept_fixed:
            return coef, keep
        negative = [j for j in kept_fixed if coef[j] < 0]
        keep.remove(negative[0] if negative else kept_fixed[-1])


def collective_design(kind: str, n: int, payload: float) -> list:
    """The row of the collective fit for one sample: [1, steps, wire bytes of kind 0, ...]."""
    from passes.plan.cost_model import _STEPS, _WIRE

    row = [1.0, float(_STEPS[kind](n))] + [0.0] * len(COLLECTIVES)
    row[2 + COLLECTIVES.index(kind)] = _WIRE[kind](n) * payload
    return row


def fit_compute(samples: dict) -> dict:
    """The compute fields of the ClusterSpec (``op_overhead_s``, ``view_overhead_s``,
    ``memory_bandwidth``, ``peak_flops``, the curves, rates and optimizer steps) from the compute
    samples."""
    elementwise, chains = samples["elementwise"], samples["chains"]
    if len(elementwise) < 2 or len(chains) < 2 or not samples["matmul"]:
        raise ValueError("calibrate: the fit needs elementwise and program times at two sizes or more, and matmuls")
    ew, _ = _fit_nonnegative([[1.0, s["bytes"]] for s in elementwise], [s["s"] for s in elementwise], [0])
    call, per_byte = ew
    (_, per_op), _ = _fit_nonnegative([[1.0, s["ops"]] for s in chains], [s["s"] for s in chains], [0])
    views = samples.get("view_chains", [])  # absent from files written before views were priced
    per_view = _fit_nonnegative([[1.0, s["ops"]] for s in views], [s["s"] for s in views], [0])[0][1] if views else 0.0
    peaks, curves = {}, {}
    for dtype in sorted({s["dtype"] for s in samples["matmul"]}):
        rates: dict = {}  # intensity -> achieved FLOP/s (the mean where shapes share one)
        for s in samples["matmul"]:
            if s["dtype"] == dtype:
                rates.setdefault(matmul_intensity(s), []).append(s["flops"] / max(s["s"] - call, 1e-12))
        peaks[dtype] = max(max(r) for r in rates.values())
        curves[dtype] = _curve(rates, peaks[dtype])
    if "float32" not in peaks:
        raise ValueError("calibrate: the fit needs float32 matmul times (the default for other dtypes)")
    passes = samples.get("contraction_passes", [])
    # per byte, the median over sizes (one noisy size must not set it; a relative least-squares
    # line through the origin follows the cheapest sample)
    fresh = sorted(max(s["s"] - s["kept_s"], 0.0) / s["bytes"] for s in samples.get("fresh", []))
    fresh_per_byte = statistics.median(fresh) if fresh else 0.0
    return {
        "op_rates": op_rates(samples.get("ops", []), per_op / 2),
        "optimizer_steps": optimizer_steps(samples.get("optimizer", [])),
        "op_overhead_s": per_op / 2,
        "view_overhead_s": per_view / 2,
        "memory_bandwidth": 1.0 / per_byte,
        "peak_flops": {**{d: peaks["float32"] for d in ("bfloat16", "float16")}, **peaks},
        "matmul_curve": curves,
        "forward_curve": pass_curves(passes, "forward_s", 1, per_op / 2, peaks, fixed=1),
        "backward_curve": pass_curves(passes, "backward_s", 2, per_op / 2, peaks),
        "weight_curve": pass_curves(passes, "weight_s", 1, per_op / 2, peaks),
        "fresh_page_s_per_byte": max(fresh_per_byte, 0.0),
    }


def _curve(rates: dict, peak: float) -> list:
    """``[[intensity, fraction of peak], ...]`` in increasing intensity from FLOP/s by intensity
    (the mean where shapes share one)."""
    return [[x, sum(r) / len(r) / peak] for x, r in sorted(rates.items())]


def pass_curves(samples: list, key: str, products: int, op_overhead_s: float, peaks: dict, *, fixed: int = 2) -> dict:
    """``ClusterSpec.forward_curve`` (``key="forward_s"``, one product, ``fixed=1``: the op's own
    fixed cost), ``ClusterSpec.backward_curve`` (``"backward_s"``, two products: the input's and
    the weight's gradient, one fixed cost each) or ``ClusterSpec.weight_curve`` (``"weight_s"``,
    the weight's product; its fixed cost and the weight pass's call's,
    :func:`passes.plan.cost_model.weight_pass_time`) from
    :func:`~partitioner.calibration.measure_backward.contraction_pass_samples`: per dtype, the
    fraction of the dtype's matmul peak at which a product of the forward's FLOPs ran beyond
    ``fixed`` times the fixed cost the cost model adds per op (``op_overhead_s``), by the forward
    product's intensity, so the cost model prices every sample at the time it took (the test
    checks it). A sample without ``key`` (a file written before it was measured) or all fixed cost
    (95% or more) rates nothing; a dtype without a float32 peak of its own reads float32's."""
    rates: dict = {}
    for s in samples:
        if key not in s:
            continue
        work = s[key] - fixed * op_overhead_s
        if work <= 0.05 * s[key]:
            continue
        rates.setdefault(s["dtype"], {}).setdefault(matmul_intensity(s), []).append(products * s["flops"] / work)
    return {dtype: _curve(r, peaks.get(dtype, peaks["float32"])) for dtype, r in sorted(rates.items())}


def op_rates(samples: list, op_overhead_s: float) -> dict:
    """``ClusterSpec.op_rates`` from :func:`op_samples`: per dtype and op, the rule's FLOPs of every
    pass over the time the passes took beyond the fixed cost the cost model adds to each
    (``op_overhead_s``). An op timed on one kind of shape keeps the mean over its samples; one
    whose samples carry a ``shape`` (attention: sequence length, head dimension) keeps a grid,
    ``{"axes": [the sorted values of each shape axis], "rates": nested lists}``, the mean at each
    point, so the cost model (:func:`passes.plan.cost_model.measured_rate`) prices every sample at the
    time it was measured in (the test checks it) and interpolates between them. A sample that is
    all fixed cost (95% or more) rates nothing; a grid point left without a rate (its samples all
    fixed cost) takes the rate of the measured point nearest to it in log coordinates."""
    rates: dict = {}
    for s in samples:
        work = s["s"] - s["passes"] * op_overhead_s
        if s["flops"] <= 0 or work <= 0.05 * s["s"]:  # all overhead (tiny sizes): nothing to rate
            continue
        point = tuple(s["shape"]) if s.get("shape") is not None else None
        rates.setdefault(s["dtype"], {}).setdefault(s["op"], {}).setdefault(point, []).append(
            s["flops"] * s["passes"] / work
        )
    return {dtype: {op: _rate_of(points) for op, points in ops.items()} for dtype, ops in rates.items()}


def _rate_of(points: dict):
    """One op's rates by shape (None: no shape) -> its ``op_rates`` entry (see :func:`op_rates`)."""
    if None in points:
        return sum(r for rs in points.values() for r in rs) / sum(len(rs) for rs in points.values())
    means = {p: sum(r) / len(r) for p, r in points.items()}
    axes = [sorted({p[k] for p in means}) for k in range(len(next(iter(means))))]

    def nearest(point):  # a grid point left without a rate: the measured one closest in log space
        def distance(p):
            return sum(math.log(a / b) ** 2 for a, b in zip(point, p))

        return means[min(means, key=distance)]

    def nest(prefix):
        k = len(prefix)
        if k == len(axes):
            point = tuple(prefix)
            return means[point] if point in means else nearest(point)
        return [nest([*prefix, v]) for v in axes[k]]

    return {"axes": axes, "rates": nest([])}


def matmul_intensity(sample: dict) -> float:
    """FLOPs per byte of a matmul sample (inputs and output), as the cost model computes it for a
    contraction (``flops / mem_bytes``); samples without shapes (older files) are ``n x n`` squares."""
    nbytes = sample.get("bytes") or 3 * sample["n"] ** 2 * (4 if sample["dtype"] == "float32" else 2)
    return sample["flops"] / nbytes


def fit(samples: dict, *, ranks: int, name: str = "calibrated", memory_bytes: int | None = None) -> ClusterSpec:
    """The cluster whose cost model best reproduces ``samples`` (see the module docstring)."""
    compute = fit_compute(samples)
    coll = samples["collectives"]
    missing = [k for k in COLLECTIVES if not any(s["kind"] == k for s in coll)]
    if missing:
        raise ValueError(f"calibrate: no samples for {missing}")
    rows = [collective_design(s["kind"], s["n"], s["payload"]) for s in coll]
    coef, _ = _fit_nonnegative(rows, [s["s"] for s in coll], [0, 1])
    overhead, latency = coef[0], coef[1]
    per_wire = dict(zip(COLLECTIVES, coef[2:]))
    bandwidth = 1.0 / per_wire["all_reduce"]
    link = LinkSpec(bandwidth=bandwidth, latency_s=latency)
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks
    return ClusterSpec(
        name=name,
        memory_bytes=int(memory_bytes),
        devices_per_node=ranks,
        intra_node=link,
        inter_node=link,
        collective_overhead_s=overhead,
        matmul_efficiency=1.0,
        **compute,  # every compute figure fit_compute gives is a field of the spec
        prefetch_overlap=prefetch_overlap(samples.get("overlap")),
        arrival_wait=arrival_wait(samples.get("arrival")),
        cores_per_node=samples.get("cores"),
        time_slice_slowdown=time_slice_slowdown(samples.get("time_slice")),
        **message_cpu(samples.get("messages")),
        collective_efficiency={k: per_wire["all_reduce"] / v for k, v in per_wire.items() if k != "all_reduce"},
        notes=f"measured by `partitioner calibrate` on {ranks} gloo ranks of {platform.node() or 'this machine'}",
    )


def optimizer_steps(samples: list) -> dict:
    """``ClusterSpec.optimizer_steps`` from :func:`optimizer_samples`: per optimizer, the line
    ``t = tensors * tensor_s + bytes / bandwidth`` (bytes: what the cost model counts,
    :func:`passes.plan.cost_model.optimizer_step_bytes`) fitted on relative error, both terms >= 0."""
    from passes.plan.cost_model import optimizer_step_bytes

    out = {}
    for name in sorted({s["optimizer"] for s in samples}):
        mine = [s for s in samples if s["optimizer"] == name]
        if len(mine) < 2:
            continue
        rows = [[float(s["tensors"]), s["tensors"] * optimizer_step_bytes(s["numel"], 4, name)] for s in mine]
        times = [s["s"] for s in mine]
        tensor_s, per_byte = weighted_lstsq(rows, times, [0, 1])
        if tensor_s < 0 or per_byte <= 0:  # noise: the one-term line that fits better
            tensor_s, per_byte = min(
                (weighted_lstsq(rows, times, [j]) for j in (0, 1)),
                key=lambda c: sum(((r[0] * c[0] + r[1] * c[1]) / t - 1.0) ** 2 for r, t in zip(rows, times)),
            )
        out[name] = {"tensor_s": max(tensor_s, 0.0), "bandwidth": 1.0 / per_byte if per_byte > 0 else math.inf}
    return out


def arrival_wait(samples: list | None) -> list:
    """``ClusterSpec.arrival_wait`` from :func:`arrival_samples`: per compute length, the time
    inside the all-reduce beyond its time after the shortest (which the collective fit prices), at
    least 0 and never less than after a shorter one."""
    if not samples or len(samples) < 2:
        return []
    ordered = sorted(samples, key=lambda x: x["compute_s"])
    curve, top = [], 0.0
    for x in ordered:
        top = max(top, x["s"] - ordered[0]["s"])
        curve.append([x["compute_s"], top])
    return curve


def time_slice_slowdown(sample: dict | None) -> float:
    """``ClusterSpec.time_slice_slowdown`` from :func:`~partitioner.calibration.measure_sharing.time_slice_sample`:
    the work's CPU time with every rank busy over its time on a core of its own, at least 1; 1.0
    unmeasured (the cores suffice)."""
    if not sample or not sample.get("alone_s"):
        return 1.0
    return max(1.0, sample["shared_s"] / sample["alone_s"])


def message_cpu(samples: list | None) -> dict:
    """``message_cpu_s`` and ``message_cpu_s_per_byte`` of a :class:`ClusterSpec` from
    :func:`~partitioner.calibration.measure_sharing.message_samples`: the line through the smallest and the
    largest message's CPU seconds, both terms >= 0; nothing where unmeasured."""
    if not samples or len(samples) < 2:
        return {}
    small, large = min(samples, key=lambda x: x["bytes"]), max(samples, key=lambda x: x["bytes"])
    per_byte = max(0.0, (large["s"] - small["s"]) / max(large["bytes"] - small["bytes"], 1))
    return {"message_cpu_s": max(0.0, small["s"] - per_byte * small["bytes"]), "message_cpu_s_per_byte": per_byte}


def prefetch_overlap(sample: dict | None) -> float:
    """The fraction of the shorter of a gather and its compute that running them together hid
    (``(compute + gather - both) / min(compute, gather)``, kept within 0-1); 1.0 unmeasured."""
    if not sample:
        return 1.0
    c, g, both = sample["compute_s"], sample["gather_s"], sample["both_s"]
    return min(1.0, max(0.0, (c + g - both) / max(min(c, g), 1e-12)))
