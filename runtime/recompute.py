"""Checkpointed regions: a recomputed layer of the lowered program (activation checkpointing).

Lowering (:func:`passes.lower.lower_to_local.outline_recomputed`) moves the nodes of each layer the
plan recomputes into a :class:`CheckpointRegion`, a submodule holding them as an
``fx.GraphModule`` (``body``) and calling it through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: forward keeps only the
region's inputs, and backward reruns the whole body (early stopping off, so every collective
inside, resharding and the ops' own, runs again in the same order on every rank) to get the
tensors autograd needs.

Dropout masks must be the same in the rerun. :class:`runtime.local_ops.RankDropout` (and
``RankAttention``) key their masks by a call counter; the region snapshots the counters of its
dropout modules when the forward starts, sets them back to that snapshot for the recompute
and restores the live values afterwards, so the rerun draws the masks the forward drew and
later forwards are unaffected (the default generator's state is also restored, as
``checkpoint`` does with ``preserve_rng_state``). Without autograd (``no_grad``, evaluation)
the body runs directly.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from runtime.local_ops import RankDropout

__all__ = ["CheckpointRegion"]


@contextlib.contextmanager
def _counters_at(modules: list, snapshot: list):
    live = [m.calls for m in modules]
    for m, calls in zip(modules, snapshot):
        m.calls = calls
    try:
        yield
    finally:
        for m, calls in zip(modules, live):
            m.calls = calls


class CheckpointRegion(torch.nn.Module):
    """One recomputed layer: ``body`` runs under non-reentrant activation checkpointing."""

    def __init__(self, body: torch.fx.GraphModule, layer: str):
        super().__init__()
        self.body = body
        self.layer = layer
        self._dropouts = [m for m in body.modules() if isinstance(m, RankDropout)]

    def _contexts(self):
        snapshot = [m.calls for m in self._dropouts]
        return contextlib.nullcontext(), _counters_at(self._dropouts, snapshot)

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        with set_checkpoint_early_stop(False):
            return checkpoint(self.body, *args, use_reentrant=False, context_fn=self._contexts)

    def extra_repr(self) -> str:
        return f"{self.layer}: recomputed in backward"
