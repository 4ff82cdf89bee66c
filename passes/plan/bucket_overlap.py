"""The part of the bucketed gradient reductions that backward's compute hides, as the runtime runs them.

**What the runtime does** (:class:`runtime.grad_sync.GradientBuckets`): in backward, a parameter
gradient whose only moves are reductions joins the bucket of its reduction signature; a bucket
holding :data:`passes.core.bucket_sizes.BUCKET_BYTES` or more is launched at once, asynchronously, while
backward goes on; at the end of backward the open buckets are launched and every one is waited
for. A ZeRO-3 weight's gradient (its edge regathers) is not held in a bucket: it is launched at
once, alone, the same way. A launch that reduce-scatters first waits for the reduce-scatters in
flight (the runtime holds one flat input at a time). So a launched reduction runs beside the
backward compute that follows it, and only what is still sending when backward's compute ends,
or what a reduce-scatter's launch waits for, is exposed.

**The price** (:func:`credit_bucket_overlap`, on a solved plan's records, in graph order; the same
grouping as :func:`passes.plan.collective_calls.group_calls`). Backward is walked in reverse
program order as a timeline on one link: each record's backward compute (``compute_s -
forward_s``: its gradient ops and, for a recomputed record, its rerun), then its synchronous
collectives (its other backward entries, the rerun's forward entries, regathers), which hold the
link. Each bucketed gradient joins its signature's bucket; a bucket that reaches the bucket size
is queued on the link, and so is each ZeRO-3 gradient as its record's backward makes it; a
reduce-scatter queued first waits for the queue up to the last reduce-scatter in it (exposed).
The queue sends only while compute runs, one reduction after the other; at the end of backward
the open buckets are queued and the rest of the queue sends with nothing left to hide it.
The credited entries' ``time_s`` become their share of that exposed rest (each scaled by the
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
    """The link the asynchronous reductions share: a queue of ``[seconds still to send, ends in a
    reduce-scatter]`` in launch order, and the seconds backward waited for it."""

    def __init__(self):
        self.queue: list = []
        self.waited = 0.0

    @property
    def queued(self) -> float:
        return sum(seconds for seconds, _ in self.queue)

    def send_during(self, compute_s: float) -> None:
        while self.queue and compute_s > 0:
            sent = min(compute_s, self.queue[0][0])
            self.queue[0][0] -= sent
            compute_s -= sent
            if self.queue[0][0] <= 0:
                self.queue.pop(0)

    def launch(self, seconds: float, scatter: bool) -> None:
        """Queue a reduction; one that reduce-scatters first waits for the reduce-scatters in
        flight (the runtime holds one flat input at a time), and so for all queued before them."""
        if scatter:
            last = max((k for k, (_, s) in enumerate(self.queue) if s), default=-1)
            self.waited += sum(sec for sec, _ in self.queue[: last + 1])
            del self.queue[: last + 1]
        self.queue.append([seconds, scatter])


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


def _alone_positions(records: list, mesh_shape) -> set:
    """``(record index, entry index)`` of the backward entries of ZeRO-3 weights' gradients that
    the runtime reduces at once, alone and asynchronously (a weight used by one op whose gradient
    needs only reductions: :class:`runtime.grad_sync.GradientBuckets`, ``regather``)."""
    from passes.core.placements import parse_spec
    from passes.plan.bucket_memory import reduction_signature

    by_name = {r["name"]: r for r in records}
    users: dict = {}
    for r in records:
        for name in r.get("inputs") or ():
            users[name] = users.get(name, 0) + 1
    found = set()
    for i, r in enumerate(records):
        grads = r.get("grads") or []
        for j, c in enumerate(r.get("comm") or ()):
            k = c.get("input")
            if c["phase"] != "bwd" or not c.get("bucketed") or k is None or k >= len(grads) or grads[k] is None:
                continue
            param = by_name.get(r["inputs"][k])
            if param is None or param.get("kind") != "param" or not param.get("regather") or users[param["name"]] != 1:
                continue
            grad, src = parse_spec(grads[k], len(mesh_shape)), parse_spec(param["out"][0], len(mesh_shape))
            if reduction_signature(grad, src, mesh_shape) is not None:
                found.add((i, j))
    return found


def _edges(rec: dict, i: int, positions: set) -> dict:
    """The record's entries at ``positions``, by input edge (in their order)."""
    by_edge: dict = {}
    for j, c in enumerate(rec.get("comm") or ()):
        if (i, j) in positions:
            by_edge.setdefault(c["input"], []).append(c)
    return by_edge


def credit_bucket_overlap(records: list, mesh_shape, axis_names) -> BucketOverlap:
    """Credit the bucketed gradient reductions of ``records`` (a plan without a pipeline) with the
    backward compute that runs beside them (the module docstring)."""
    positions = _bucketed_positions(records, mesh_shape, axis_names)
    alone = _alone_positions(records, mesh_shape)
    bucketed, link, synchronous, launched = [], _Link(), 0.0, 0
    open_bytes: dict = {}  # signature -> (bytes, seconds) of the bucket filling
    for i in reversed(range(len(records))):
        rec = records[i]
        link.send_during(max(0.0, (rec.get("compute_s") or 0.0) - (rec.get("forward_s") or 0.0)))
        for entries in _edges(rec, i, positions).values():
            # a signature of several moves sends them in turn: only the last one is asynchronous
            signature = tuple((c["axis"], c["kind"]) for c in entries)
            size, seconds = open_bytes.get(signature, (0.0, 0.0))
            size, seconds = size + entries[0]["bytes"], seconds + _full(entries[-1])
            synchronous += sum(_full(c) for c in entries[:-1])
            bucketed += entries
            if size >= bucket_sizes.BUCKET_BYTES:
                link.launch(seconds, signature[-1][1] == "reduce_scatter")
                launched += 1
                size, seconds = 0.0, 0.0
            open_bytes[signature] = (size, seconds)
        for entries in _edges(rec, i, alone).values():  # ZeRO-3: launched at once, alone
            synchronous += sum(_full(c) for c in entries[:-1])
            link.launch(_full(entries[-1]), entries[-1]["kind"] == "reduce_scatter")
            bucketed += entries
            launched += 1
    total = sum(_full(c) for c in bucketed)
    if total <= 0:
        return BucketOverlap()
    exposed = synchronous + link.waited + link.queued + sum(seconds for _, seconds in open_bytes.values())
    scale = min(1.0, exposed / total)
    for c in bucketed:
        c["time_s"] = _full(c) * scale
    logger.debug("bucketed gradient reductions: %.6f s of %.6f s hidden by backward's compute", total - exposed, total)
    return BucketOverlap(total, total * scale, launched)
