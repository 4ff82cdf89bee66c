"""Cluster descriptions: what one device computes and how fast mesh axes talk.

The cost model prices everything in seconds from these numbers (decision 4 in docs/ARCHITECTURE.md):

* compute: ``flops / (peak_flops[dtype] * matmul_efficiency)`` for contractions, and
  ``bytes / memory_bandwidth`` for memory-bound ops (the larger of the two wins);
* a collective on a mesh axis of size n: ``collective_overhead_s + steps * latency_s +
  wire_bytes / bandwidth`` on the link the axis runs over. An axis whose process groups stay
  inside one node uses ``intra_node``; otherwise ``inter_node``.

Presets (``h100``, ``h200``, ``a100``) use vendor figures for SXM parts with NVLink inside an
8-GPU node and one InfiniBand NIC per GPU across nodes. ``cpu`` is measured on this machine
(``calibrate_cpu``) and cached.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LinkSpec", "ClusterSpec", "get_cluster", "calibrate_cpu", "PRESETS", "parse_bytes"]

GiB = 1 << 30


def parse_bytes(value) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"``, ``1e9`` or an int, in bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().replace(" ", "")
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "tib": 1 << 40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "b": 1,
    }
    lower = text.lower()
    for unit in sorted(units, key=len, reverse=True):
        if lower.endswith(unit):
            number = lower[: -len(unit)]
            try:
                return int(float(number) * units[unit])
            except ValueError:
                break
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(
            f"cannot read memory size {value!r}: write it like '80GiB', '512MiB' or a byte count"
        ) from None


@dataclass(frozen=True)
class LinkSpec:
    """One kind of link between devices."""

    bandwidth: float
    """Bytes per second one device sends (one direction) over this link."""
    latency_s: float
    """Seconds per step of a ring collective (one hop)."""


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: identical devices, ``devices_per_node`` to a node."""

    name: str
    peak_flops: dict
    """Dense FLOP/s by dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``)."""
    memory_bandwidth: float
    """Device memory bytes per second."""
    memory_bytes: int
    """Device memory capacity (the default budget)."""
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    collective_overhead_s: float = 10e-6
    """Fixed cost of launching one collective (kernel launch, synchronisation)."""
    matmul_efficiency: float = 0.7
    """Fraction of peak FLOP/s that contractions reach."""
    notes: str = ""

    def flops_for(self, dtype_name: str) -> float:
        return self.peak_flops.get(dtype_name, self.peak_flops["float32"])

    def link_for_axis(self, mesh_shape, axis: int) -> LinkSpec:
        """The link an axis's collectives cross (ranks are laid out row-major on the mesh)."""
        stride = 1
        for n in mesh_shape[axis + 1 :]:
            stride *= n
        span = stride * mesh_shape[axis]
        return self.intra_node if span <= self.devices_per_node else self.inter_node

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ClusterSpec:
        data = dict(data)
        data["intra_node"] = LinkSpec(**data["intra_node"])
        data["inter_node"] = LinkSpec(**data["inter_node"])
        return cls(**data)


def _gpu(name, fp32, bf16, hbm_bw, mem_gib, nvlink, ib, notes):
    return ClusterSpec(
        name=name,
        peak_flops={"float32": fp32, "bfloat16": bf16, "float16": bf16},
        memory_bandwidth=hbm_bw,
        memory_bytes=mem_gib * GiB,
        devices_per_node=8,
        intra_node=LinkSpec(bandwidth=nvlink, latency_s=2e-6),
        inter_node=LinkSpec(bandwidth=ib, latency_s=5e-6),
        notes=notes,
    )


# fmt: off
PRESETS = {
    "h100": _gpu("h100", 67e12, 989e12, 3.35e12, 80, 450e9, 50e9,
                 "H100 SXM: NVLink4 450 GB/s per direction, 400 Gb/s InfiniBand per GPU"),
    "h200": _gpu("h200", 67e12, 989e12, 4.8e12, 141, 450e9, 50e9,
                 "H200 SXM: H100 compute, 141 GB HBM3e at 4.8 TB/s"),
    "a100": _gpu("a100", 19.5e12, 312e12, 2.0e12, 80, 300e9, 25e9,
                 "A100 SXM 80GB: NVLink3 300 GB/s per direction, 200 Gb/s InfiniBand per GPU"),
}
# fmt: on


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "partita" / "cpu_cluster.json"


def calibrate_cpu(*, refresh: bool = False) -> ClusterSpec:
    """Measure this machine: matmul FLOP/s, copy bandwidth, and a loopback-ish link.

    The link figures are a memory-copy estimate (gloo on one host moves data through shared
    memory and TCP loopback), scaled down by a constant; good enough to rank plans on CPUs.
    The result is cached in ``~/.cache/partita/cpu_cluster.json``.
    """
    path = _cache_path()
    if path.exists() and not refresh:
        try:
            return ClusterSpec.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):
            pass
    import torch

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.2:
        torch.mm(a, b)
        reps += 1
    flops = 2 * n**3 * reps / (time.perf_counter() - start)
    src = torch.empty(16 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.2:
        dst.copy_(src)
        reps += 1
    bandwidth = 2 * src.numel() * reps / (time.perf_counter() - start)
    link = LinkSpec(bandwidth=bandwidth / 8, latency_s=50e-6)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spec = ClusterSpec(
        name="cpu",
        peak_flops={"float32": flops, "bfloat16": flops / 4, "float16": flops / 4},
        memory_bandwidth=bandwidth,
        memory_bytes=mem,
        devices_per_node=os.cpu_count() or 1,
        intra_node=link,
        inter_node=link,
        collective_overhead_s=100e-6,
        matmul_efficiency=1.0,
        notes="measured on the local machine by partitioner.cluster.calibrate_cpu",
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec.to_dict(), indent=1))
    except OSError:
        pass
    return spec


def get_cluster(cluster) -> ClusterSpec:
    """A ClusterSpec from a preset name (``h100``, ``h200``, ``a100``, ``cpu``) or a spec."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, dict):
        return ClusterSpec.from_dict(cluster)
    key = str(cluster).lower()
    if key == "cpu":
        return calibrate_cpu()
    if key not in PRESETS:
        raise ValueError(
            f"unknown cluster {cluster!r}: choose one of {sorted(PRESETS) + ['cpu']} or pass a partitioner.ClusterSpec"
        )
    return PRESETS[key]
