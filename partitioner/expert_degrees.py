"""The expert degree in the configuration search: which degrees, and their bounds.

A mixture-of-experts layer (:mod:`passes.capture.experts_op`) may split its stacked experts over
some of the data-parallel ranks: *expert parallelism* over data ranks, as DeepSeek-V3 trains
(its experts over 64 of the data ranks). A configuration's expert degree ``e``
(:attr:`partitioner.parallel_config.ParallelConfig.expert`) divides its data degree ``d`` and
every MoE layer's expert count; its data ranks are laid out as two mesh axes, ``dp``
(``d / e``) and ``ep`` (``e``), the batch split over both and every MoE layer's experts over
``ep`` (the solver is held to that axis: ``expert_parallel="on"`` with an expert axis).

Enumerated (:func:`with_expert_degrees`): for every configuration without a pipeline or sequence
axis and with ``d > 1``, each such ``e > 1`` beside ``e = 1``; ``"on"`` keeps only ``e > 1``,
``"off"`` only ``e = 1``. The degree is the search's decision (:func:`solver_mode`): where the
configuration's degrees offer an expert axis, ``e = 1`` plans the experts unsplit (the solver's
``"off"``), so the configuration says what runs; elsewhere (pipelines, sequence axes) the stage
solvers keep ``expert_parallel`` as given and may split experts on an axis of their choosing.

Bounds (the search's steps 3 and 4):

* **memory**: an expert weight is ``1/e`` per rank on ``ep``; ZeRO on ``dp`` may cut that
  further by ``d / e`` (:func:`expert_state`), and no expert weight splits on ``tp`` (the experts
  op keeps them whole there);
* **traffic**: per MoE layer and microbatch, four all-to-alls (dispatch and combine, forward and
  backward) of the rank's ``T k H`` pair rows (``T`` its tokens), ``(e - 1) / e`` on the wire
  over the link ``ep`` crosses (:func:`dispatch_seconds`); the expert weights' gradients are
  reduced over ``d / e`` ranks instead of ``d`` (:func:`data_synced_params`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

from passes.analysis.analyze import info
from passes.capture.experts_op import MOE_OP

logger = logging.getLogger(__name__)

__all__ = [
    "ExpertFacts",
    "with_expert_degrees",
    "solver_mode",
    "expert_state",
    "dispatch_seconds",
    "data_synced_params",
]


@dataclass
class ExpertFacts:
    """The model's mixture-of-experts layers, as the bounds need them (none: ``experts == 0``)."""

    experts: int = 0
    """The greatest common divisor of the MoE layers' expert counts (0: no MoE layer)."""
    layers: int = 0
    """MoE layers in the model."""
    shapes: dict = field(default_factory=dict)
    """Expert weight shape -> how many expert weights have it."""
    params: int = 0
    """Expert weight elements in the model."""
    layer_params: int = 0
    """Expert weight elements of one MoE layer (the largest)."""
    pair_bytes_per_sample: float = 0.0
    """Bytes of the ``T k H`` (token, expert) pair rows of all MoE layers, per sample."""

    @classmethod
    def of(cls, cap, batch: int) -> ExpertFacts:
        nodes = [n for n in cap.graph.nodes if n.op == "call_function" and n.target is MOE_OP]
        facts = cls()
        seen: set = set()
        for node in nodes:
            tokens, k = info(node.args[1]).shape
            hidden = info(node.args[0]).shape[-1]
            elem = _itemsize(info(node.args[0]).dtype)
            facts.experts = math.gcd(facts.experts, int(info(node.args[3]).shape[0]))
            facts.layers += 1
            facts.pair_bytes_per_sample += tokens * k * hidden * elem / batch
            in_layer = 0
            for weight in node.args[3:5]:
                shape = tuple(info(weight).shape)
                in_layer += math.prod(shape)
                if weight not in seen:
                    seen.add(weight)
                    facts.shapes[shape] = facts.shapes.get(shape, 0) + 1
                    facts.params += math.prod(shape)
            facts.layer_params = max(facts.layer_params, in_layer)
        return facts


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype or torch.float32).element_size()


def degrees(data: int, experts: int) -> list:
    """Expert degrees ``e > 1`` a data degree offers: ``e`` divides ``data`` and the experts."""
    if experts <= 1:
        return []
    return [e for e in range(2, data + 1) if data % e == 0 and experts % e == 0]


def with_expert_degrees(configs: list, facts: ExpertFacts, mode: str) -> list:
    """``configs`` with the expert degrees the module docstring enumerates, by ``mode``
    (``expert_parallel``): ``"auto"`` each configuration and its expert variants, ``"on"`` the
    variants only, ``"off"`` the configurations as they are. A model without MoE layers keeps
    ``configs``."""
    if not facts.experts or mode == "off":
        return list(configs)
    out = []
    for c in configs:
        variants = [replace(c, expert=e) for e in degrees(c.data, facts.experts)] if offers_degrees(c, facts) else []
        out += variants if mode == "on" else [c, *variants]
    return out


def offers_degrees(c, facts: ExpertFacts) -> bool:
    """Whether ``c``'s degrees offer an expert axis (module docstring)."""
    return c.pipeline == 1 and c.sequence == 1 and bool(degrees(c.data, facts.experts))


def solver_mode(c, facts: ExpertFacts, mode: str) -> tuple:
    """``(expert_parallel, expert axis name or None)`` the solver plans ``c`` with: ``"on"`` over
    ``ep`` for an expert degree, ``"off"`` for ``e = 1`` where the degrees offered one, else
    ``mode`` as given."""
    if c.expert > 1:
        return "on", "ep"
    if mode == "auto" and offers_degrees(c, facts):
        return "off", None
    return mode, None


def expert_state(facts: ExpertFacts, c, stage: int, whole: float, bytes_per_param: int) -> float:
    """Bytes of the expert weights' state per device under ``c`` (``c.expert > 1``), for a ZeRO
    ``stage`` on the data axes that keeps ``whole`` bytes per element whole there (the rest of
    ``bytes_per_param`` sharded): ``1/e`` of each on ``ep``, its sharded part cut again by ``dp``."""
    per_rank = facts.params / c.expert
    if stage == 0:
        return per_rank * bytes_per_param
    return per_rank * whole + per_rank / max(1, c.data // c.expert) * bytes_per_param


def data_synced_params(facts: ExpertFacts, c, params: int) -> float:
    """Parameter elements whose gradient sync over the data axes costs as a sync over all ``d``
    ranks: the expert weights of an expert axis sync over ``d / e`` ranks only, weighed by the
    ratio of the two rings' wire shares."""
    if c.expert <= 1 or c.data <= 1:
        return float(params)
    rest = c.data // c.expert
    ratio = ((rest - 1) / rest) / ((c.data - 1) / c.data)
    return params - facts.params * (1.0 - ratio)


def dispatch_seconds(facts: ExpertFacts, c, spec, microbatch: float) -> float:
    """Seconds of one microbatch's expert all-to-alls (module docstring) on the ``ep`` link."""
    if c.expert <= 1 or not facts.layers:
        return 0.0
    shape = (c.pipeline, c.data // c.expert, c.expert, c.sequence, c.tensor)
    link = spec.link_for_axis(shape, 2)
    local = facts.pair_bytes_per_sample * microbatch / (c.data * c.sequence)
    wire = (c.expert - 1) / c.expert * local / link.bandwidth  # every MoE layer's rows together
    fixed = spec.collective_overhead_s + (c.expert - 1) * link.latency_s
    return 4 * (wire + fixed * facts.layers)
