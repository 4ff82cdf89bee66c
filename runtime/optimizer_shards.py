"""ZeRO-1 weights: used whole, stepped as shards (one reduce-scatter and one all-gather per step).

A ZeRO-1 parameter (plan record ``stored``) has two tensors on each rank:

* the **shard**, the ``nn.Parameter`` the module registers: what ``model.parameters()`` gives the
  user's ``torch.optim`` optimizer (so its state is sharded), what state dicts and checkpoints
  read, and what ``.grad`` holds after a synced backward; placed as the record's ``stored``
  (``Shard`` on the data-parallel axes where the weight is used whole);
* the **compute copy**, a plain leaf tensor placed as the record's ``out``, which the lowered
  program reads; no op gathers it in forward.

One step:

1. **Refresh** (before a forward): every copy whose shard changed since it was last gathered (its
   ``_version``: the optimizer's in-place update, a state-dict load; or never gathered) is
   all-gathered from the shards, such weights together: flat buffers per mesh axis of at most
   ``bucket_sizes.REFRESH_BUCKET_BYTES`` (4 MiB) of gathered weights each, counted as ``all_gather`` in phase
   ``fwd`` (the bytes are the weights', however they are cut). The first forward gathers every copy once.
2. **Backward** accumulates each copy's gradient in the copy's layout, ``Partial`` on the shard's
   axes (lowering makes the weight's edges leave it so: no all-reduce), over every backward of
   the step (``no_sync`` micro-steps included).
3. **Reduce** (at the end of a backward that is not inside ``no_sync``): the copies' gradients
   are reduce-scattered into their shards' ``.grad`` (added to what is there, as ``.grad``
   accumulates), all weights with the same reduction together: one flat reduce-scatter per
   mesh axis (:func:`runtime.grad_sync.flat_reduce`); the copies' gradients are dropped;
   counted as a gradient sync in phase ``bwd``.

So a step that accumulates over any number of micro-steps sends one reduce-scatter and one
all-gather of each ZeRO-1 weight: what the plan prices (``zero1_collectives``).

**Offloaded weights** (record ``offload``) use the same two tensors with the stepped one (the
parameter, or its ZeRO-1 shard) in host memory: ``ParallelModule`` keeps it on the CPU, so the
user's optimizer creates its state there and runs its step there; the refresh copies it to the
device (then gathers it, ZeRO-1), the reduction (an all-reduce where the copy is replicated and
the parameter is not a shard) ends with the gradient copied to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from passes.core import bucket_sizes
from passes.core.placements import is_shard, transition_steps, zero1_grad_spec
from runtime.collectives import MeshComm, _all_gather_single, _strided_order, record_collective
from runtime.grad_sync import flat_reduce, reduce_moves

__all__ = ["ZERO1_KEY", "OptimizerShards"]

ZERO1_KEY = "partita.zero1"
"""Key in a lowered program's meta: ZeRO-1 parameter placeholder -> (compute placement, shard placement)."""


@dataclass
class _Weight:
    shard: torch.nn.Parameter
    compute_spec: tuple
    stored_spec: tuple
    grad_spec: tuple
    strided: dict
    """axis -> pieces where the shard is cut in the strided layout (a fused projection's bias)."""
    device: torch.device
    """Where the compute copy lives (the shard may be in host memory: offloaded)."""
    copy: torch.Tensor | None = None
    version: int | None = None  # the shard's ``_version`` when the copy was last gathered


class OptimizerShards:
    """The ZeRO-1 weights of one ``ParallelModule`` (see the module docstring)."""

    def __init__(self, comm: MeshComm, deferred):
        self.comm = comm
        self.deferred = deferred  # the module's DeferredSyncs: no reduction while it defers
        self.reduce_dtype: torch.dtype | None = None
        self._weights: dict = {}  # id(shard) -> _Weight
        self._armed = False

    def __bool__(self) -> bool:
        return bool(self._weights)

    def add(self, shard: torch.nn.Parameter, compute_spec, stored_spec, name: str, strided=None, device=None) -> None:
        """``device``: where the compute copy lives (default: the shard's device)."""
        compute_spec, stored_spec = tuple(compute_spec), tuple(stored_spec)
        held = self._weights.get(id(shard))
        if held is not None:
            if (held.compute_spec, held.stored_spec) != (compute_spec, stored_spec):
                raise ValueError(
                    f"{name} is a ZeRO-1 weight used as {compute_spec} with its shard {stored_spec} in one "
                    f"program and as {held.compute_spec} / {held.stored_spec} in another; plan both alike"
                )
            return
        strided = {a: f for a, f in (strided or {}).items() if is_shard(stored_spec[a])}
        grad_spec = zero1_grad_spec(compute_spec, self.comm.shape)
        where = torch.device(device) if device is not None else shard.device
        self._weights[id(shard)] = _Weight(shard, compute_spec, stored_spec, grad_spec, strided, where)

    def copy_of(self, shard: torch.nn.Parameter) -> torch.Tensor:
        """The compute copy of ``shard`` (call :meth:`refresh` first)."""
        w = self._weights[id(shard)]
        assert w.copy is not None, "refresh() before reading a compute copy"
        return w.copy

    def copies(self) -> list:
        return [w.copy for w in self._weights.values() if w.copy is not None]

    # -- refresh: shards -> compute copies ------------------------------------------------------
    def refresh(self) -> None:
        """All-gather the compute copies whose shards changed: per mesh axis, flat buffers of at
        most :data:`passes.core.bucket_sizes.REFRESH_BUCKET_BYTES` of gathered weights each (a
        larger weight alone), so the buffers alive beside the copies stay bounded whatever the
        model's size."""
        stale = [w for w in self._weights.values() if w.copy is None or w.version != w.shard._version]
        groups: dict = {}
        for w in stale:
            steps = [s for s in transition_steps(w.stored_spec, w.compute_spec) if self.comm.shape[s[0]] > 1]
            groups.setdefault((tuple(a for a, _, _ in steps), w.shard.dtype), []).append((w, steps))
        with torch.no_grad():
            for (axes, _), members in groups.items():
                for bucket in self._buckets(members, axes):
                    self._refresh_bucket(bucket, axes)

    def _buckets(self, members: list, axes: tuple) -> list:
        """``members`` in order, cut where the gathered bytes would pass the bucket size."""
        factor = 1
        for axis in axes:
            factor *= self.comm.shape[axis]
        buckets, current, size = [], [], 0
        for member in members:
            nbytes = member[0].shard.numel() * member[0].shard.element_size() * factor
            if current and size + nbytes > bucket_sizes.REFRESH_BUCKET_BYTES:
                buckets.append(current)
                current, size = [], 0
            current.append(member)
            size += nbytes
        return buckets + ([current] if current else [])

    def _refresh_bucket(self, members: list, axes: tuple) -> None:
        pieces = [w.shard.detach().to(w.device, non_blocking=True) for w, _ in members]
        for j, axis in enumerate(axes):
            dims = [steps[j][1].dim for _, steps in members]
            pieces = self._gather(pieces, axis, dims, [w.strided.get(axis) for w, _ in members])
        for (w, _), whole in zip(members, pieces):
            if w.copy is None:  # its own storage (not the shard's, where nothing moved)
                w.copy = whole.clone(memory_format=torch.contiguous_format).requires_grad_(True)
                w.copy.register_post_accumulate_grad_hook(self._arm)
            else:
                w.copy.copy_(whole)
            w.version = w.shard._version

    def _gather(self, pieces: list, axis: int, dims: list, strided: list) -> list:
        """One flat all-gather on ``axis`` of every piece; each piece joined along its ``dims``
        (and put back in order where it was cut in the strided layout)."""
        n, name = self.comm.shape[axis], self.comm.axis_names[axis]
        flat = torch.cat([p.reshape(-1) for p in pieces])
        out = flat.new_empty((n * flat.numel(),))
        record_collective("all_gather", name, out.numel() * out.element_size(), "fwd")
        _all_gather_single(out, flat, group=self.comm.groups[axis])
        blocks = out.view(n, -1)
        joined, offset = [], 0
        for p, d, f in zip(pieces, dims, strided):
            size = p.numel()
            whole = torch.cat([blocks[r, offset : offset + size].view(p.shape) for r in range(n)], dim=d)
            joined.append(_strided_order(whole, d, f, n, inverse=True) if f else whole)
            offset += size
        return joined

    # -- reduce: compute copies' gradients -> shards' gradients ---------------------------------
    def flush(self) -> None:
        """Reduce the copies' gradients into the shards now, outside backward: for a caller whose
        step is several backward calls made while ``deferred`` defers (a pipeline stage's ``B`` /
        ``W`` actions, :class:`runtime.pipeline.PipelineRunner`)."""
        self._reduce()

    def _arm(self, _copy) -> None:
        if not self._armed:
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)
            self._armed = True

    def _reduce(self) -> None:
        """End of a backward: outside ``no_sync``, reduce every copy's gradient into its shard's,
        the weights with the same reduction together (one flat collective per mesh axis)."""
        self._armed = False
        if self.deferred.deferring:
            return
        groups: dict = {}  # reduction signature -> [(weight, its gradient, its per-weight moves)]
        for w in self._weights.values():
            if w.copy is None or w.copy.grad is None:
                continue
            grad, w.copy.grad = w.copy.grad, None
            moves = reduce_moves(transition_steps(w.grad_spec, w.stored_spec), self.comm, w.strided)
            if moves is None:  # nothing to reduce (no axis of more than one device)
                self._add(w, grad.clone())
                continue
            groups.setdefault(moves[0], []).append((w, grad, moves[1]))
        with torch.no_grad():
            for key, members in groups.items():
                grads = [g.to(self.reduce_dtype or g.dtype) for _, g, _ in members]
                _, finish = flat_reduce(grads, key, [mine for *_, mine in members], self.comm)
                for (w, grad, _), piece in zip(members, finish()):
                    self._add(w, piece.to(grad.dtype))

    @staticmethod
    def _add(w: _Weight, piece: torch.Tensor) -> None:
        """Add a reduced gradient piece to the shard's ``.grad`` (its own storage, on the shard's
        device: an offloaded shard's gradient goes to the host)."""
        piece = piece.clone() if piece._base is not None else piece
        piece = piece.to(w.shard.device)
        if w.shard.grad is None:
            w.shard.grad = piece
        else:
            w.shard.grad.add_(piece)
