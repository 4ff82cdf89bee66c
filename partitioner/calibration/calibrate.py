"""``partitioner calibrate``'s command: measure on local ranks, fit, write the cluster file and say
what was fitted."""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

from partitioner.calibration.fit import fit
from partitioner.calibration.measure import measure
from partitioner.cluster import ClusterSpec, cluster_file_dict

logger = logging.getLogger(__name__)


def write_cluster_file(path, spec: ClusterSpec, samples: dict, ranks: int) -> None:
    machine = {
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "ranks": ranks,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(path).write_text(json.dumps(cluster_file_dict(spec, samples=samples, machine=machine), indent=1) + "\n")


def calibrate(
    path,
    *,
    ranks: int = 2,
    sizes: dict | None = None,
    name: str = "calibrated",
    memory_bytes: int | None = None,
    say: Callable[[str], None] | None = None,
    progress: bool = False,
    repeats: int = 1,
) -> ClusterSpec:
    """Measure on ``ranks`` local ranks (``repeats`` passes, the median of each figure), fit,
    write the cluster file ``path``; returns the spec."""
    say = say or (lambda message: None)
    say(f"measuring on {ranks} gloo ranks (load average {os.getloadavg()[0]:.1f})")
    samples = measure(ranks, sizes, progress=progress, repeats=repeats, say=say)
    spec = fit(samples, ranks=ranks, name=name, memory_bytes=memory_bytes)
    write_cluster_file(path, spec, samples, ranks)
    say(
        f"fitted: matmul {', '.join(f'{d} {v / 1e9:.2f}' for d, v in sorted(spec.peak_flops.items()))} GFLOP/s, "
        f"memory {spec.memory_bandwidth / 1e9:.2f} GB/s, op overhead {spec.op_overhead_s * 1e6:.1f} us, "
        f"view overhead {spec.view_overhead_s * 1e6:.1f} us, "
        f"collective overhead {spec.collective_overhead_s * 1e6:.1f} us + {spec.intra_node.latency_s * 1e6:.1f} us "
        f"per ring step, link {spec.intra_node.bandwidth / 1e9:.2f} GB/s; matmul fraction of peak by FLOPs per byte "
        f"{', '.join(f'{x:.0f}: {y:.2f}' for x, y in spec.matmul_curve.get('float32', []))}; a fresh allocation "
        f"{spec.fresh_page_s_per_byte * 1e9:.2f} ns per byte; a prefetched gather's overlap with compute "
        f"{spec.prefetch_overlap:.2f}; a collective after "
        + ", ".join(f"{x * 1e3:g} ms of work: +{y * 1e3:.2f} ms" for x, y in spec.arrival_wait)
    )
    rates = spec.op_rates.get("float32", {})
    if rates:
        say("float32 op rates: " + ", ".join(f"{op} {_rate_text(r)}" for op, r in sorted(rates.items())))
    for name, step in sorted(spec.optimizer_steps.items()):
        say(f"{name} step: {step['tensor_s'] * 1e6:.1f} us per tensor + bytes at {step['bandwidth'] / 1e9:.2f} GB/s")
    say(f"cluster file written to {path}")
    return spec


def _rate_text(rate) -> str:
    from passes.plan.cost_model import grid_rates

    if not isinstance(rate, dict):
        return f"{rate / 1e9:.2f} GFLOP/s"
    flat = grid_rates(rate)
    return f"{min(flat) / 1e9:.2f}-{max(flat) / 1e9:.2f} GFLOP/s over shapes {' x '.join(map(str, rate['axes']))}"
