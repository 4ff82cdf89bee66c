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

Weight gathers (a layer whose weights are stored sharded, FSDP): the lowered program starts the
gathers of each layer's weights while the layer before it computes
(:func:`passes.lower.prefetch_gathers.prefetch_gathers`), and the rerun does the same backwards:
when a layer's rerun begins, it starts the gathers of the layer rerun after it (the one before it
in the program, :meth:`CheckpointRegion.set_rerun_next`), from the weight shards that layer was
called with in its forward; that layer's edges then take the gathered copies
(:func:`runtime.prefetch.take_prefetched`) instead of gathering on the spot. The same collectives
run in the same order on every rank, counted when issued.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from runtime.local_ops import RankDropout
from runtime.prefetch import issue

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
        self.prefetch_sources: list = []
        """``(argument index, edge)`` per weight edge of the body whose gather can start ahead (set
        by :func:`passes.lower.prefetch_gathers.prefetch_gathers`)."""
        self._rerun_next: list = [None]
        self._shards: list = []  # the weight shards of the last forward, one per prefetch source

    def set_rerun_next(self, region) -> None:
        """The layer whose rerun follows this one's in backward (the one before it in the
        program), or None: this layer's rerun starts that layer's weight gathers."""
        self._rerun_next = [region]

    def _start_next_gathers(self) -> None:
        region = self._rerun_next[0]
        if region is None:
            return
        for (_, edge), shard in zip(region.prefetch_sources, region._shards):
            if edge.pending is None:
                edge.pending = (shard, shard._version, issue(edge, shard, "fwd"))

    @contextlib.contextmanager
    def _rerun(self, snapshot: list):
        self._start_next_gathers()
        with _counters_at(self._dropouts, snapshot):
            yield

    def _contexts(self):
        snapshot = [m.calls for m in self._dropouts]
        return contextlib.nullcontext(), self._rerun(snapshot)

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        self._shards = [args[k] for k, _ in self.prefetch_sources]
        with set_checkpoint_early_stop(False):
            return checkpoint(self.body, *args, use_reentrant=False, context_fn=self._contexts)

    def extra_repr(self) -> str:
        return f"{self.layer}: recomputed in backward"
