"""Token dropping in mixture-of-experts layers: the one-device semantics of ``expert_capacity=``.

With ``expert_capacity=f`` (:class:`partitioner.PlanOptions`) each expert of an MoE layer computes
at most ``C = ceil(f T k / E)`` of the ``T k`` (token, expert) pairs of one call of the layer
(``T`` tokens, top-``k`` of ``E`` experts); pairs are taken first choices first (every token's
first expert before any token's second), tokens in order inside a choice, and the rest are
dropped: their rows of the layer's output are zero (the token keeps only its residual), and
their router weights get zero gradient.

:func:`token_dropping` runs a model that way on one device: it is the reference a split run is
equal to (loss, every gradient, parameters after optimizer steps). The split run computes the
same keep mask before its experts op, over the whole call's pairs
(:func:`runtime.expert_dispatch.drop_over_capacity`, traced into the graph), so every rank drops
exactly the pairs one device drops; the op skips them, sends none of them by all-to-all and the
plan prices the compute, the all-to-all and the buffers at the pairs kept
(:mod:`passes.rules.experts`).

``C`` depends on the tokens of one call, so a pipeline's microbatches (or gradient accumulation)
would each drop against their own ``T``: ``expert_capacity`` is refused with ``pipeline=`` and in
the configuration search (which may choose a pipeline), with these messages.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from partitioner.options import PlanOptions
from passes.capture.experts_op import experts_as_ops

__all__ = ["token_dropping", "EXPERT_CAPACITY_PER_BATCH", "EXPERT_CAPACITY_SEARCH"]

logger = logging.getLogger(__name__)

EXPERT_CAPACITY_PER_BATCH = (
    "an expert's capacity is a share of one call's tokens, and pipeline microbatches would each drop against "
    "their own; give a mesh without pipeline=, or leave expert_capacity out"
)
EXPERT_CAPACITY_SEARCH = (
    "the search may choose a pipeline, whose microbatches would each drop against their own tokens; give "
    "mesh= (e.g. the searched configuration's) with expert_capacity, or leave expert_capacity out"
)


@contextlib.contextmanager
def token_dropping(model: torch.nn.Module, capacity_factor: float):
    """While inside, ``model``'s MoE layers (HuggingFace experts modules) drop the pairs beyond each
    expert's capacity at ``capacity_factor`` (module docstring), on whatever device it runs.

    Example::

        with partitioner.token_dropping(model, 1.25):
            loss = model(**batch).loss      # what auto_parallelize(..., expert_capacity=1.25) computes
    """
    PlanOptions(expert_capacity=capacity_factor)  # the same validation as the option's
    with experts_as_ops(model, capacity_factor) as patched:
        if not patched:
            raise ValueError(f"{type(model).__name__} has no MoE experts module whose tokens could be dropped")
        yield patched
