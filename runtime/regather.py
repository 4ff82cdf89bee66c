"""ZeRO-3 parameters (and activations): gathered copies freed after forward, gathered again for backward.

A parameter stored sharded is gathered by a :class:`runtime.reshard.Reshard` on every edge
to a consumer that needs it whole (all-gather on the data-parallel axis). When the consumer
saves that copy for backward (a matmul keeps its weight), the copy would stay alive from the
forward to the backward of that layer: ZeRO-2 (FSDP's ``reshard_after_forward=False``). For a
parameter the plan marks ``regather`` (ZeRO-3), the edge instead:

1. registers the copy it returns (:func:`remember`), with the shard it came from;
2. while the program runs, :func:`regather_scope` holds ``saved_tensors_hooks``: when autograd
   saves a tensor whose storage is such a copy (the copy itself, or a view of it such as its
   transpose), the hook keeps only a recipe (the edge, the shard, and the view's size, stride
   and offset), so the copy is freed as soon as forward no longer uses it;
3. when backward unpacks the recipe, the edge gathers the shard again (the same collectives as
   forward, counted in phase ``bwd``) and the view is rebuilt on the new copy. Tensors saved
   from one copy share one regather while its result is alive. The gathered tensor is used as it
   comes when it has the forward copy's size and strides and is its storage's whole from its
   start; else it is copied into that layout first. The recipe rebuilds a view with
   ``as_strided``, whose offset counts from the *storage's* start: on a tensor that is a view
   into a larger buffer (the moves' last step a local slice, ``narrow``, of a gathered buffer:
   same size and strides, storage offset ``coord * block``) it would read rank 0's block on
   every rank. That was the silent wrong answer of serving it uncopied on size and strides alone
   (a fused weight stored on its other dim, ZeRO-3, trained off one device from the second step);
4. **prefetch**: the copies saved are chained in the order forward saved them; backward unpacks
   them in about the reverse order, so when a copy is gathered again, the regather of the copy
   saved just before it is started asynchronously (when its edge's first move that sends data is
   an all-gather: :mod:`runtime.prefetch`, and backward has not gathered that copy already: one
   op saving two parameters, a norm's weight and bias, unpacks them in forward's order), and its
   own unpack waits for it. Usually one regather is in flight at a time (two while a norm's
   weight, gathered on the spot, starts the copy before it ahead and its bias's prefetch is
   still out); the issue order is the backward's, the same on every rank. Every copy is
   gathered again at most once per backward unpacking, as the plan prices.

**Activations** kept as their shard (the plan's ``regather_inputs``,
``passes/plan/activation_regather.py``: Megatron's sequence parallelism) go through the same hooks:
their edge registers the gathered copy with the shard it came from, and backward gathers it
again when unpacking; they are not chained, so never gathered ahead (the plan prices no
prefetch of them). The shard is what stays: hooks already active (a memory probe) see it kept.

Only the outermost hooks see a save: inside a recomputed layer (activation checkpointing,
which holds its own hooks) the rerun keeps its gathered copies until the layer's backward ends,
and the plan prices no regather there. The plan offers ZeRO-3 only where autocast does not save
a low-precision copy instead of the gathered weight (see :mod:`passes.plan.node_options`).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["remember", "regather_scope", "REGATHER_KEY"]

REGATHER_KEY = "partita.regather"
"""``GraphModule.meta`` key: True when some edge of the program regathers in backward."""

_COPIES: dict = {}  # id(copy) -> (weakref to the copy, edge, shard, holder)


def remember(copy: torch.Tensor, edge, shard: torch.Tensor) -> None:
    """Register ``copy``, gathered by ``edge`` from ``shard``, as one backward may gather again."""
    if not _owns_its_storage(copy):
        return  # not a dense buffer of its own: saved views of it could not be rebuilt on a new one
    key = id(copy)

    def forget(_ref, key=key) -> None:
        _COPIES.pop(key, None)

    _COPIES[key] = (weakref.ref(copy, forget), edge, shard, _Holder(copy.size(), copy.stride(), edge, shard))


def _owns_its_storage(t: torch.Tensor) -> bool:
    """``t`` is its storage's whole, from its start: ``as_strided`` offsets on it are offsets in it."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


class _Holder:
    """The regathered copy, shared by every tensor saved from one forward copy; ``prev``: the
    holder of the copy saved just before it in forward (the regather expected next)."""

    def __init__(self, size, stride, edge, shard):
        self.size, self.stride = size, stride  # the forward copy's layout, which saved views assume
        self.edge, self.shard = edge, shard
        self.ref: weakref.ref | None = None
        self.prev: _Holder | None = None
        self.chained = False  # linked into its scope's chain
        self.pending = None  # its regather, started ahead (runtime/prefetch.py)
        self.gathered = False  # backward has gathered it again already (never start it ahead after)
        self.shown = None  # an activation's shard as the caller's hooks packed it (a memory probe counts it)

    def get(self) -> torch.Tensor:
        full = self.ref() if self.ref is not None else None
        if full is None:
            from runtime.prefetch import finish

            with torch.no_grad():
                if self.pending is not None:
                    pending, self.pending = self.pending, None
                    gathered = finish(self.edge, pending)
                    del pending  # its gather's buffers go before any copy below
                else:
                    gathered = self.edge.regather_moves(self.shard.detach())
                full = gathered
                if gathered.size() != self.size or gathered.stride() != self.stride or not _owns_its_storage(gathered):
                    full = torch.empty_strided(self.size, self.stride, dtype=gathered.dtype, device=gathered.device)
                    full.copy_(gathered)
                    del gathered
            self.ref = weakref.ref(full)
            self.gathered = True
            self._start_previous()
        return full

    def _start_previous(self) -> None:
        prev, self.prev = self.prev, None
        # a copy backward has gathered already is not the next one: its saves were unpacked before
        # this copy's (one op saving two parameters unpacks them in the order forward saved them)
        if prev is None or prev.pending is not None or prev.gathered:
            return
        if prev.edge.prefetchable:
            from runtime.prefetch import issue

            prev.pending = issue(prev.edge, prev.shard, "bwd")


class _Recipe:
    __slots__ = ("holder", "size", "stride", "offset")

    def __init__(self, holder, t: torch.Tensor):
        self.holder = holder
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def rebuild(self) -> torch.Tensor:
        return self.holder.get().as_strided(self.size, self.stride, self.offset)


def _recipe_for(t: torch.Tensor):
    base = t._base if t._base is not None else t
    entry = _COPIES.get(id(base))
    if entry is None or entry[0]() is not base:
        return None
    return _Recipe(entry[3], t)


class _Outer:
    """What the hooks outside ours made of a tensor we keep (a memory probe, ``save_on_cpu``)."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


def _outer_hooks():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def regather_scope(program) -> contextlib.AbstractContextManager:
    """The hooks above while ``program`` runs, when its plan has ZeRO-3 parameters. Hooks already
    active (the caller's) still see every tensor kept as it is: ours pass it on to theirs."""
    meta = getattr(program, "meta", None) or {}
    if not meta.get(REGATHER_KEY):
        return contextlib.nullcontext()
    outer = _outer_hooks()
    last: list = [None]  # the holder saved last in this forward (the chain of regathers)

    def pack(t):
        recipe = _recipe_for(t)
        if recipe is not None:
            holder = recipe.holder
            if holder.edge.param_edge is None:  # an activation: never gathered ahead; its shard stays
                if outer is not None and holder.shown is None:  # what the caller's hooks see kept
                    holder.shown = outer[0](holder.shard)
            elif not holder.chained:
                holder.prev, holder.chained, last[0] = last[0], True, holder
            return recipe
        return t if outer is None else _Outer(outer[0](t))

    def unpack(packed):
        if isinstance(packed, _Recipe):
            return packed.rebuild()
        return outer[1](packed.packed) if isinstance(packed, _Outer) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
