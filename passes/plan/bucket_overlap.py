"""The part of the bucketed gradient reductions that backward's compute hides, as the runtime runs them.

**What the runtime does** (:class:`runtime.grad_sync.GradientBuckets`): in backward, a parameter
gradient whose only moves are reductions joins the bucket of its reduction signature; a bucket
holding :data:`passes.core.bucket_sizes.BUCKET_BYTES` or more is launched at once, asynchronously, while
backward goes on; at the end of backward the open buckets are launched and every one is waited
for. So a launched bucket's reduction runs beside the backward compute that follows it, and only
what is still sending when backward's compute ends is exposed.

**The price** (:func:`credit_bucket_overlap`, on a solved plan's records, in graph order; the same
grouping as :func:`passes.plan.collective_calls.group_calls`). Backward is walked in reverse
program order as a timeline on one link: each record's backward compute (``compute_s -
forward_s``: its gradient ops and, for a recomputed record, its rerun), then its synchronous
collectives (its other backward entries, the rerun's forward entries, regathers), which hold the
link. Each bucketed gradient joins its signature's bucket; a bucket that reaches the bucket size
is queued on the link. The queue sends only while compute runs (a synchronous collective waits
for nothing and holds the link: no credit behind it), one bucket after the other; at the end of
backward the open buckets are queued and the rest of the queue sends with nothing left to hide it.
The bucketed entries' ``time_s`` become their share of that exposed rest (each scaled by the
same factor, ``exposed / total``), their full time kept as ``sync_s``; their bytes are unchanged
(what is sent is what the plan counts). The solver prices them in full (an upper bound); the
plan's estimate, made from the records, has the credit. Pipeline stages hold their gradient
syncs until the step's last microbatch (no buckets): not credited here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from passes.core import bucket_sizes

__all__ = ["credit_bucket_overlap", "BucketOverlap"]

logger = logging.getLogger(__name__)


class _Link:
    """The link the asynchronous buckets share: a queue of seconds still to send."""

    def __init__(self):
        self.queued = 0.0

    def send_during(self, compute_s: float) -> None:
        self.queued = max(0.0, self.queued - compute_s)


@dataclass(frozen=True)
class BucketOverlap:
    total_s: float = 0.0
    """The bucketed reductions' full time (what the solver priced)."""
    exposed_s: float = 0.0
    """What is left of it after backward's compute (the estimate's share)."""
    launched_in_backward: int = 0
    """Buckets launched while backward runs (full before its end): the runtime's early launches."""


def _full(entry: dict) -> float:
    """An entry's full time (kept as ``sync_s`` the first time it is credited: crediting twice
    gives the same times)."""
    return entry.setdefault("sync_s", entry["time_s"])


def _bucketed_positions(records: list, mesh_shape, axis_names) -> set:
    """``(record index, entry index)`` of the backward entries sent in gradient buckets, as
    :func:`passes.plan.collective_calls.group_calls` groups them (on the typed records)."""
    from passes.core.plan_records import NodeRecord
    from passes.plan.collective_calls import group_calls

    typed = [NodeRecord.from_dict(r) for r in records]
    _, covered = group_calls(typed, mesh_shape, axis_names)
    return {
        (i, j)
        for i, t in enumerate(typed)
        for j, c in enumerate(t.comm)
        if id(c) in covered and c.phase == "bwd" and c.input is not None
    }


def credit_bucket_overlap(records: list, mesh_shape, axis_names) -> BucketOverlap:
    """Credit the bucketed gradient reductions of ``records`` (a plan without a pipeline) with the
    backward compute that runs beside them (the module docstring)."""
    positions = _bucketed_positions(records, mesh_shape, axis_names)
    bucketed, link, synchronous, launched = [], _Link(), 0.0, 0
    open_bytes: dict = {}  # signature -> (bytes, seconds) of the bucket filling
    for i in reversed(range(len(records))):
        rec = records[i]
        link.send_during(max(0.0, (rec.get("compute_s") or 0.0) - (rec.get("forward_s") or 0.0)))
        mine = [c for j, c in enumerate(rec.get("comm") or ()) if (i, j) in positions]
        by_edge: dict = {}
        for c in mine:
            by_edge.setdefault(c["input"], []).append(c)
        for entries in by_edge.values():
            # a signature of several moves sends them in turn: only the last one is asynchronous
            signature = tuple((c["axis"], c["kind"]) for c in entries)
            size, seconds = open_bytes.get(signature, (0.0, 0.0))
            size, seconds = size + entries[0]["bytes"], seconds + _full(entries[-1])
            synchronous += sum(_full(c) for c in entries[:-1])
            bucketed += entries
            if size >= bucket_sizes.BUCKET_BYTES:
                link.queued += seconds
                launched += 1
                size, seconds = 0.0, 0.0
            open_bytes[signature] = (size, seconds)
        # the record's synchronous collectives hold the link: the queue waits behind them
    total = sum(_full(c) for c in bucketed)
    if total <= 0:
        return BucketOverlap()
    exposed = synchronous + link.queued + sum(seconds for _, seconds in open_bytes.values())
    scale = min(1.0, exposed / total)
    for c in bucketed:
        c["time_s"] = _full(c) * scale
    logger.debug("bucketed gradient reductions: %.6f s of %.6f s hidden by backward's compute", total - exposed, total)
    return BucketOverlap(total, total * scale, launched)
