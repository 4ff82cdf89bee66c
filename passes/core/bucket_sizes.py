"""The sizes at which the runtime cuts its flat collectives, shared with the planner that counts them.

Two runtime mechanisms send many tensors in a few flat buffers: the gradient buckets
(:class:`runtime.grad_sync.GradientBuckets`) and the ZeRO-1 / offload refresh of compute copies
(:class:`runtime.optimizer_shards.OptimizerShards`). How many calls they make depends on these
sizes, and the planner prices those calls (:mod:`passes.plan.collective_calls`,
:mod:`passes.plan.bucket_overlap`): both sides read the one value here, so what the plan counts is
what the run sends.

Readers look the values up on this module when they run (``bucket_sizes.BUCKET_BYTES``), never
copy them at import, so a test that sets a smaller size here changes the planner and the runtime
together.

This module is part of the bottom layer: it imports nothing of Partita's.
"""

from __future__ import annotations

__all__ = ["BUCKET_BYTES", "REFRESH_BUCKET_BYTES"]

BUCKET_BYTES = 25 * 2**20
"""A gradient bucket is reduced once it holds this many gradient bytes (the rest at the end of
backward)."""

REFRESH_BUCKET_BYTES = 4 * 2**20
"""The refresh's flat all-gathers carry at most this many bytes of gathered weights each (a larger
weight alone): the flat output and the joined weights (about twice this) are alive beside the
copies only while one bucket is gathered."""
