"""Cluster descriptions: what one device computes and how fast mesh axes talk.

The cost model prices everything in seconds from these numbers (decision 4 in docs/ARCHITECTURE.md):

* compute: ``flops / (peak_flops[dtype] * matmul_efficiency)`` for contractions (or the
  fraction of peak ``matmul_curve`` gives at the op's FLOPs per byte, where measured; their
  forward as a training step runs it at ``forward_curve``, their backward and weight-pass
  products at ``backward_curve`` and ``weight_curve``), and
  ``bytes / memory_bandwidth`` for memory-bound ops (the larger of the two wins); an op with a
  measured rate (``op_rates``: attention, activations, normalisations) computes at that rate;
  plus ``op_overhead_s`` per op (the framework's dispatch; 0 in the GPU presets) and
  ``view_overhead_s`` per view, and
  ``fresh_page_s_per_byte`` per byte of each large tensor an op allocates where
  ``fresh_allocations`` (a CPU job under a memory budget);
* a collective on a mesh axis of size n: ``collective_overhead_s + steps * latency_s +
  wire_bytes / (bandwidth * collective_efficiency[kind])`` on the link the axis runs over. An
  axis whose process groups stay inside one node uses ``intra_node``; otherwise ``inter_node``;
* a copy between a device and its host's memory (offloaded optimizer state): ``latency_s +
  bytes / bandwidth`` on ``host_link`` (PCIe on the GPU presets; none on a CPU, whose copies run
  at its memory bandwidth);
* the optimizer's step: the bytes it reads and writes per parameter element at
  ``memory_bandwidth`` (where measured, ``optimizer_steps``: a fixed cost per tensor plus the bytes
  at the step's own rate), or at ``host_memory_bandwidth`` for state offloaded to the host (the
  presets: a DGX node's two sockets of 8-channel DDR5-4800, 614 GB/s, or DDR4-3200 on A100's,
  410 GB/s, shared by its 8 GPUs).

Presets (``h100``, ``h200``, ``a100``) use vendor figures for SXM parts with NVLink inside an
8-GPU node and one InfiniBand NIC per GPU across nodes. ``cpu`` is this machine: the compute
figures measured by the job's ranks, once per rank count, and cached
(:mod:`partitioner.local_cluster`, which also resolves names: ``get_cluster``). ``partitioner
calibrate`` (:mod:`partitioner.calibration`) measures the same figures on more sizes into a cluster
file; ``get_cluster(path)`` reads it (``--as-cpu`` also makes it ``cpu``). This module is data
only: it imports nothing of Partita's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "LinkSpec",
    "ClusterSpec",
    "cluster_file_dict",
    "load_cluster_file",
    "PRESETS",
    "parse_bytes",
]

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
    op_overhead_s: float = 0.0
    """Fixed cost of one op that computes (dispatch, Python): what dominates tiny ops on CPUs."""
    view_overhead_s: float = 0.0
    """Fixed cost of one view (reshape, transpose, split: no data moved) in forward, and again in
    backward where a gradient passes it: dispatch and autograd's view node, which an fx program
    on a CPU pays per view (about 10 us on the 2-core CPU, like an elementwise op's); 0 in the GPU
    presets and in files written before it was measured."""
    collective_efficiency: dict = field(default_factory=dict)
    """Fraction of the link bandwidth each collective kind reaches (absent: 1.0)."""
    matmul_curve: dict = field(default_factory=dict)
    """Per dtype, the fraction of ``peak_flops`` a contraction reaches as a function of its
    arithmetic intensity (FLOPs per byte of its inputs and output): ``[[intensity, fraction],
    ...]`` in increasing intensity, read piecewise linearly in log intensity, flat beyond the
    ends (:func:`passes.plan.cost_model.matmul_fraction`). Measured by ``partitioner calibrate``;
    empty (the presets): ``matmul_efficiency`` for every shape."""
    forward_curve: dict = field(default_factory=dict)
    """Per dtype, as :attr:`matmul_curve` (fractions of ``peak_flops`` by the product's intensity):
    the rate of a contraction's forward product as a training step runs it, timed as a linear
    layer's forward recording for autograd, its bias added, its operands read from beyond the
    core's cache and its output kept (``partitioner calibrate``:
    :mod:`partitioner.calibration.measure_backward`); empty (the presets, files written before
    it): :attr:`matmul_curve`."""
    backward_curve: dict = field(default_factory=dict)
    """Per dtype, as :attr:`matmul_curve` (fractions of ``peak_flops`` by the forward product's
    intensity): the rate of each of a contraction's backward products (input and weight
    gradients, priced at the forward's FLOPs each), timed as autograd runs a linear layer's
    backward (``partitioner calibrate``: :mod:`partitioner.calibration.measure_backward`); empty
    (the presets): :attr:`matmul_curve`."""
    weight_curve: dict = field(default_factory=dict)
    """As :attr:`backward_curve`, for the weight gradient's product alone, as a zero-bubble ``W``
    pass computes it (:func:`passes.plan.cost_model.weight_pass_time`); empty: :attr:`matmul_curve`."""
    op_rates: dict = field(default_factory=dict)
    """Per dtype, by op name (``aten.gelu``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention``,
    ``aten.scaled_dot_product_attention:causal``, as :func:`passes.rules.base.rate_key` gives it):
    the rate, in the op rule's counted FLOPs per
    second, at which that op's forward and backward run on this device, for ops that reach neither
    the matmul curve nor memory bandwidth (a fused attention's blocked kernel; on a CPU, the
    ``erf``, ``exp`` and ``tanh`` of activations and the several passes of a normalisation).
    A rate is one number, or for attention a grid over (sequence length, head dimension),
    ``{"axes": [[lengths], [head dims]], "rates": [[...], ...]}``, read at the op's shape
    (:func:`passes.plan.cost_model.measured_rate`). Measured by ``partitioner calibrate`` (every op it
    times, forward and backward through autograd); empty (the presets): the roofline for every op."""
    optimizer_steps: dict = field(default_factory=dict)
    """By optimizer (``"adam"``, ``"sgd"``): ``{"tensor_s": seconds per parameter tensor,
    "bandwidth": bytes per second}`` of its step, priced as ``tensor_s + bytes /
    bandwidth`` per parameter (bytes: :func:`passes.plan.cost_model.optimizer_step_bytes`) in place
    of ``bytes / memory_bandwidth``. Measured by ``partitioner calibrate`` (torch's optimizer on
    CPU steps one tensor at a time, tens of microseconds of Python each, and streams its state
    from DRAM at a fraction of the rate cache-resident ops reach); empty (the presets): the
    memory-bound step."""
    fresh_page_s_per_byte: float = 0.0
    """Seconds per byte of a large allocation that is a fresh mapping (the kernel zero-fills
    its pages on first touch): measured by ``partitioner calibrate`` with glibc's mmap
    threshold fixed; priced only when :attr:`fresh_allocations`."""
    fresh_allocations: bool = False
    """Whether the job priced gets every allocation of ``MMAP_THRESHOLD`` bytes or more as a fresh
    mapping: a CPU job under a memory budget, where ``auto_parallelize`` fixes glibc's mmap
    threshold (``runtime/host_memory.py``; :func:`for_memory_budget`)."""
    prefetch_overlap: float = 1.0
    """The fraction of the shorter of a prefetched all-gather and the compute it runs beside that
    running them together hides (:func:`passes.lower.prefetch_gathers.credit_prefetch`): 1.0 where the
    collective has its own engine and link (the GPU presets); measured by ``partitioner
    calibrate`` on CPUs, where the gather's transfers and reductions run on threads that compete
    with the compute for the same cores."""
    arrival_wait: list = field(default_factory=list)
    """``[[seconds of compute, extra seconds], ...]``: how much longer a collective call takes when
    the ranks computed that long since their previous one than after the short burst the
    collective fit was measured after (the first point, extra 0): ranks sharing cores progress
    unevenly, so the longer the compute between two calls, the further apart the ranks arrive at
    the second. Read piecewise linearly, flat beyond the ends
    (:func:`passes.plan.cost_model.arrival_wait`). Measured by ``partitioner calibrate``; empty (the
    presets): nothing added."""
    host_link: LinkSpec | None = None
    """The link between a device and its host's memory (PCIe on the GPU presets), over which
    optimizer state offloaded to the host moves; None: the device's own memory is the host's
    (a CPU), copies run at ``memory_bandwidth``."""

    host_memory_bandwidth: float | None = None
    """Host memory bytes per second available to one device (its share of the host's DRAM
    bandwidth), at which an offloaded optimizer's step runs; None: ``memory_bandwidth`` (a CPU)."""

    cores_per_node: int | None = None
    """The cores one node's ranks compute on, where its ranks can outnumber them (a CPU host: a rank
    computes on one core, one torch thread); None: every device computes on its own (the GPU
    presets, cluster files written before it was recorded). The compute figures are a rank's with
    a core to itself; :mod:`partitioner.core_sharing` prices ranks that share cores."""
    core_share: float = 1.0
    """The share of a core each rank's compute figures assume: 1.0 as measured; less in the spec a
    plan whose ranks outnumber the cores is priced with (:func:`partitioner.core_sharing.shared_cluster`)."""
    time_slice_slowdown: float = 1.0
    """How much more CPU time a rank's work takes while more of the host's ranks are busy than it
    has cores (the cores time-sliced: a rank that gets one back finds its caches holding another
    rank's data) than on a core of its own; >= 1. Measured by ``partitioner calibrate`` where its
    ranks outnumber the cores (:mod:`partitioner.calibration.measure_sharing`); 1.0 elsewhere."""
    message_cpu_s: float = 0.0
    """CPU seconds one point-to-point message (a pipeline's activation or gradient) costs its rank
    at either end beyond its bytes: the call and the transport's threads (gloo on a CPU), which
    ranks sharing cores pay out of their compute's cores. 0 on the GPU presets (a copy engine's)."""
    message_cpu_s_per_byte: float = 0.0
    """CPU seconds per byte of a point-to-point message at either end (the copies through the
    transport); with :attr:`message_cpu_s`, :func:`partitioner.core_sharing.message_cpu_time`."""

    def host(self) -> LinkSpec:
        """:attr:`host_link`, or this device's memory when there is none (see there)."""
        return self.host_link or LinkSpec(bandwidth=self.memory_bandwidth, latency_s=0.0)

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
        """The spec as JSON data; the host's cores and the forward's and backward's curves only where recorded (a
        file or plan written before they were reads back as the same spec, and writes the same JSON)."""
        data = dataclasses.asdict(self)
        for name, default in _UNSET_UNLESS_GIVEN.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ClusterSpec:
        data = dict(data)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"not a ClusterSpec: unknown fields {sorted(unknown)}")
        data["intra_node"] = LinkSpec(**data["intra_node"])
        data["inter_node"] = LinkSpec(**data["inter_node"])
        if data.get("host_link") is not None:
            data["host_link"] = LinkSpec(**data["host_link"])
        from passes.plan.cost_model import check_rate_grid

        for dtype, ops in (data.get("op_rates") or {}).items():
            for op, rate in ops.items():
                if isinstance(rate, dict):
                    check_rate_grid(rate, f"op_rates[{dtype!r}][{op!r}]")
        return cls(**data)


_UNSET_UNLESS_GIVEN = {
    "cores_per_node": None,
    "core_share": 1.0,
    "forward_curve": {},
    "view_overhead_s": 0.0,
    "backward_curve": {},
    "weight_curve": {},
    "time_slice_slowdown": 1.0,
    "message_cpu_s": 0.0,
    "message_cpu_s_per_byte": 0.0,
}
"""Fields :meth:`ClusterSpec.to_dict` leaves out at their defaults."""


def _gpu(name, fp32, bf16, hbm_bw, mem_gib, nvlink, ib, pcie, notes, host_bw=614e9 / 8):
    return ClusterSpec(
        host_link=LinkSpec(bandwidth=pcie, latency_s=10e-6),
        host_memory_bandwidth=host_bw,
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
    "h100": _gpu("h100", 67e12, 989e12, 3.35e12, 80, 450e9, 50e9, 50e9,
                 "H100 SXM: NVLink4 450 GB/s per direction, 400 Gb/s InfiniBand per GPU, PCIe 5 x16 to the host"),
    "h200": _gpu("h200", 67e12, 989e12, 4.8e12, 141, 450e9, 50e9, 50e9,
                 "H200 SXM: H100 compute, 141 GB HBM3e at 4.8 TB/s"),
    "a100": _gpu("a100", 19.5e12, 312e12, 2.0e12, 80, 300e9, 25e9, 25e9,
                 "A100 SXM 80GB: NVLink3 300 GB/s per direction, 200 Gb/s InfiniBand per GPU, PCIe 4 x16 to the host",
                 host_bw=410e9 / 8),
}
# fmt: on


def cluster_file_dict(spec: ClusterSpec, **extra) -> dict:
    """A cluster file's content: the spec under ``"cluster"``, with what it was fitted from."""
    return {"cluster": spec.to_dict(), **extra}


def load_cluster_file(path) -> ClusterSpec:
    """A ClusterSpec from a JSON file: a cluster file (``partitioner calibrate``) or a bare spec."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read cluster file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"cluster file {path} is not JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("cluster"), dict):
        data = data["cluster"]
    try:
        return ClusterSpec.from_dict(data)
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(
            f"cluster file {path} holds no cluster description ({type(exc).__name__}: {exc}); "
            "write one with `python -m partitioner calibrate --out FILE`"
        ) from None
