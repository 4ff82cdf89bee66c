"""Placement specs: one DTensor placement per mesh axis, and what they imply for a tensor.

A *spec* is a tuple with one ``Shard(dim)`` / ``Replicate()`` / ``Partial()`` per mesh axis
(DTensor's vocabulary, decision 2 in docs/ARCHITECTURE.md). A dim sharded on several axes is split by
the product of their sizes, outer axis first, except on an axis placed :class:`InnerShard`
(``"Si(d)"``): that axis cuts its dim inside all the others, as the last digit of a rank's block
index (3D tensor parallelism's weights, split over the rows axis too, so that gathering them along
it is one contiguous all-gather). This module holds the pure helpers: text form
(``"S(0)"``, ``"R"``, ``"P"``), local shapes and the divisibility test that decides whether a
spec is admissible for a shape (Partita shards evenly, so lowering never pads).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "rank_local_shape",
    "split_size",
    "split_start",
    "Shard",
    "InnerShard",
    "Replicate",
    "Partial",
    "Placement",
    "R",
    "P",
    "Spec",
    "format_placement",
    "parse_placement",
    "format_spec",
    "parse_spec",
    "local_shape",
    "shard_degree",
    "total_shard_degree",
    "gradient_shrinks",
    "spec_fits",
    "replicated",
    "is_shard",
    "is_partial",
    "dual_spec",
    "zero1_grad_spec",
    "transition_steps",
]

R = Replicate()
P = Partial()
Spec = tuple  # tuple[Placement, ...], one per mesh axis


class InnerShard(Shard):
    """``Shard(dim)`` cut innermost: among the mesh axes that shard ``dim``, this one splits the
    block the others leave (the least significant digit of a rank's block index; the others keep
    their outer-first order). So gathering or reduce-scattering it is one contiguous collective
    while the others stay. Equal only to itself (``InnerShard(0) != Shard(0)``)."""

    def __eq__(self, other):
        return type(other) is InnerShard and other.dim == self.dim

    def __hash__(self):
        return hash(("InnerShard", self.dim))

    def __repr__(self):
        return f"InnerShard({self.dim})"

    __str__ = __repr__


def format_placement(p: Placement) -> str:
    if type(p) is InnerShard:
        return f"Si({p.dim})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "R"


_PLACEMENT_RE = re.compile(
    r"^\s*(?:(Si|InnerShard)\((-?\d+)\)|(S|Shard)\((-?\d+)\)|(R|Replicate)(?:\(\))?|(P|Partial)(?:\((\w*)\))?)\s*$"
)


def parse_placement(text) -> Placement:
    """``"S(0)"``, ``"Shard(0)"``, ``"Si(0)"`` (:class:`InnerShard`), ``"R"``, ``"P"``,
    ``"P(max)"`` or a Placement object."""
    if isinstance(text, Placement):
        return text
    m = _PLACEMENT_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read placement {text!r}: use 'S(dim)', 'Si(dim)', 'R' or 'P'")
    if m.group(1):
        return InnerShard(int(m.group(2)))
    if m.group(3):
        return Shard(int(m.group(4)))
    if m.group(5):
        return R
    return Partial(m.group(7) or "sum")


def format_spec(spec: Sequence[Placement]) -> str:
    return "[" + ", ".join(format_placement(p) for p in spec) + "]"


def parse_spec(value, ndim: int) -> Spec:
    """A spec from a list of placements/strings, or a string like ``"[S(0), R]"``."""
    if isinstance(value, str):
        body = value.strip()
        if body[:1] + body[-1:] in ("[]", "()"):
            body = body[1:-1]
        items = [s for s in re.split(r",\s*(?![^()]*\))", body) if s.strip()]
    else:
        items = list(value)
    spec = tuple(parse_placement(v) for v in items)
    if len(spec) != ndim:
        raise ValueError(f"placement {value!r} has {len(spec)} entries; the mesh has {ndim} axes")
    return spec


def replicated(ndim: int) -> Spec:
    return (R,) * ndim


def is_shard(p) -> bool:
    """``isinstance(p, Shard)``, fast (placement classes have a slow metaclass check)."""
    return type(p) in _SHARD_TYPES


_SHARD_TYPES = {Shard} | {cls for cls in Shard.__subclasses__()}


def shard_degree(spec: Spec, mesh_shape: Sequence[int], dim: int) -> int:
    """How many pieces tensor dim ``dim`` is cut into under ``spec``."""
    k = 1
    for p, n in zip(spec, mesh_shape):
        if type(p) in _SHARD_TYPES and p.dim == dim:
            k *= n
    return k


def spec_fits(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim exists and divides evenly by its shard degree."""
    degrees = {}
    for p, n in zip(spec, mesh_shape):
        if type(p) in _SHARD_TYPES:
            if not (0 <= p.dim < len(shape)):
                return False
            degrees[p.dim] = degrees.get(p.dim, 1) * n
    return all(shape[d] % k == 0 for d, k in degrees.items())


def total_shard_degree(spec: Spec, mesh_shape: Sequence[int]) -> int:
    """By how much sharding shrinks the tensor (the product over sharded axes)."""
    k = 1
    for p, n in zip(spec, mesh_shape):
        if type(p) in _SHARD_TYPES:
            k *= n
    return k


def gradient_shrinks(grad: Spec | None, grad_dst: Spec | None, mesh_shape: Sequence[int]) -> bool:
    """Whether moving a gradient placed ``grad`` (as its consumer makes it) to ``grad_dst`` (where
    its parameter's storage needs it) leaves each device a smaller piece: a reduce-scatter onto a
    weight stored sharded (ZeRO-2 / ZeRO-3), on any axis, whatever the other axes do."""
    if grad is None or grad_dst is None:
        return False
    return total_shard_degree(grad_dst, mesh_shape) > total_shard_degree(grad, mesh_shape)


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple:
    return tuple(size // shard_degree(spec, mesh_shape, dim) for dim, size in enumerate(shape))


def split_size(size: int, pieces: int, index: int) -> int:
    """The size of piece ``index`` when ``size`` is cut into ``pieces`` (``torch.tensor_split``)."""
    return size // pieces + (1 if index < size % pieces else 0)


def split_start(size: int, pieces: int, index: int) -> int:
    """Where piece ``index`` of ``size`` cut into ``pieces`` starts."""
    return index * (size // pieces) + min(index, size % pieces)


def rank_local_shape(shape, spec, mesh_shape, coords) -> tuple:
    """The piece of a tensor of ``shape`` placed ``spec`` that the rank at ``coords`` holds: a cut
    dim that does not divide is split like ``torch.tensor_split``, axis by axis in the order the
    moves from ``Replicate`` cut it (the first ranks one element more)."""
    local = list(shape)
    for axis, _p, q in transition_steps(replicated(len(mesh_shape)), tuple(spec)):
        if is_shard(q) and mesh_shape[axis] > 1:
            local[q.dim] = split_size(local[q.dim], mesh_shape[axis], coords[axis])
    return tuple(local)


def is_partial(p) -> bool:
    return isinstance(p, Partial)


def dual_spec(spec):
    """The placement a tensor's gradient must reach: Shard stays, R and P need R."""
    if spec is None:
        return None
    return tuple(p if is_shard(p) else R for p in spec)


def zero1_grad_spec(spec, mesh_shape):
    """Where the edges of a weight with a compute copy (ZeRO-1, or offloaded) leave its gradient:
    the dual of the copy's placement, but ``Partial`` on every axis of more than one device where
    the copy is replicated (reduced once per step, into the tensor the optimizer steps)."""
    return tuple(P if not is_shard(p) and n > 1 else q for p, n, q in zip(spec, mesh_shape, dual_spec(spec)))


@functools.lru_cache(maxsize=1 << 14)
def transition_steps(src: Spec, dst: Spec) -> tuple:
    """The per-axis moves that turn a tensor placed ``src`` into ``dst``: ``(axis, from, to)``.

    Outer axis first (:func:`_outer_first_steps`), except on :class:`InnerShard` axes, which cut
    their dim innermost: the moves run with those axes taken as the last ones of the mesh, first
    the inner shards that change leave (each one contiguous gather, the innermost cut), then the
    rest reaches ``dst`` with ``dst``'s inner shards cut last (a ``P -> Si`` one reduce-scatter).
    """
    src, dst = tuple(src), tuple(dst)
    inner_src = {a for a, p in enumerate(src) if type(p) is InnerShard}
    inner_dst = {a for a, p in enumerate(dst) if type(p) is InnerShard}
    if not inner_src and not inner_dst:
        return _outer_first_steps(src, dst)
    leaving = {a for a in inner_src if dst[a] != src[a]}
    mid = tuple(R if a in leaving else p for a, p in enumerate(src))
    return _innermost_last(src, mid, inner_src) + _innermost_last(mid, dst, inner_dst)


def _innermost_last(src: Spec, dst: Spec, inner: set) -> tuple:
    """:func:`_outer_first_steps` with the axes ``inner`` moved to the end of the mesh."""
    order = [a for a in range(len(src)) if a not in inner] + sorted(inner)
    steps = _outer_first_steps(tuple(src[a] for a in order), tuple(dst[a] for a in order))
    return tuple((order[a], p, q) for a, p, q in steps)


@functools.lru_cache(maxsize=1 << 14)
def _outer_first_steps(src: Spec, dst: Spec) -> tuple:
    """The per-axis moves from ``src`` to ``dst`` when every dim is cut outer axis first.

    Layout convention: a dim sharded on several axes is cut outer axis first, so a rank's
    block index along it is the mixed-radix number of its coordinates on those axes (outer
    digit most significant). A move that adds or removes ``Shard(d)`` on axis ``a`` is only
    contiguous when no inner axis ``b > a`` currently shards ``d``; such inner shards are
    gathered first and cut again afterwards. Order:

    1. inner to outer: every shard that changes is gathered (``S->R``) or exchanged (``S->S'``);
       an exchange onto a dim that an outer axis still has to cut or uncut is a gather instead
       (step 3 cuts it): the outer move would gather it again, and until then the dim would be
       cut on both axes, which a dim smaller than their product cannot be (``[S(1), S(0)] ->
       [R, S(1)]`` of a dim 1 of size 2);
    2. outer to inner: partials reduce-scattered (``P->S``), so that a partial also summed on
       another axis is summed there at its scattered size (HSDP's order);
    3. outer to inner: partials are reduced (``P->R``) and new shards cut (``R->S``),
       ``R->P`` keeps one rank's share.

    The cost model prices exactly these moves and the runtime performs exactly these moves,
    so estimated and counted communication agree.
    """
    n = len(src)
    cur = list(src)
    steps = []

    def move(axis, to):
        steps.append((axis, cur[axis], to))
        cur[axis] = to

    def clear_inner(axis, dim):
        for b in reversed(range(axis + 1, n)):
            if is_shard(cur[b]) and cur[b].dim == dim:
                clear_inner(b, dim)
                move(b, R)

    def outer_moves_dim(axis, dim):  # an outer axis still to move that cuts ``dim`` before or after
        cuts = lambda p: is_shard(p) and p.dim == dim  # noqa: E731
        return any(cur[b] != dst[b] and (cuts(cur[b]) or cuts(dst[b])) for b in range(axis))

    for a in reversed(range(n)):
        p, q = cur[a], dst[a]
        if is_shard(p) and p != q:
            clear_inner(a, p.dim)
            if is_shard(q) and not outer_moves_dim(a, q.dim):
                clear_inner(a, q.dim)
                move(a, q)
            else:
                move(a, R)
    for a in range(n):  # reduce-scatters first: a partial reduced on another axis is then smaller
        if is_partial(cur[a]) and is_shard(dst[a]):
            clear_inner(a, dst[a].dim)
            move(a, dst[a])
    for _ in range(2):  # a second sweep re-cuts inner shards that an outer move cleared
        for a in range(n):
            p, q = cur[a], dst[a]
            if p == q:
                continue
            if is_shard(q):
                clear_inner(a, q.dim)
            if is_partial(p) and is_partial(q):
                move(a, R)
            move(a, q)
    assert tuple(cur) == tuple(dst), (src, dst, cur)
    return tuple(steps)
