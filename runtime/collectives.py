"""Collectives on local tensors, with autograd, and a counter of what they send.

:class:`MeshComm` is this rank's view of the device mesh: one process group per mesh axis
and its coordinate on each. :func:`run_steps` performs the per-axis moves of
:func:`passes.placements.transition_steps` on a local tensor:

=========  ====================================================  =======================
move       what happens                                          collective
=========  ====================================================  =======================
S(d)->R    gather the pieces along d in coordinate order          all_gather
S(d)->S(e) cut along e, swap pieces, join along d                  all_to_all
P->R       sum (or max) the partial values                         all_reduce
P->S(d)    sum, each rank keeps its piece along d                  reduce_scatter
R->S(d)    keep this rank's piece along d                          (local)
R->P       coordinate 0 keeps the value, the others hold zeros     (local)
=========  ====================================================  =======================

:class:`Reshard` (an ``nn.Module``, so the lowered program prints it readably) moves a
tensor from its producer's placement to the placement its consumer needs; its backward
moves the gradient from the placement the consumer produces to the dual of the producer's
placement, exactly the moves the cost model priced. Every collective reports its kind, mesh
axis, payload bytes and phase to the active :class:`CommCounter` objects, so tests can check
that the runtime sends what the plan says; those that sync a parameter's gradient (the
backward of an edge whose input is a parameter, and the gradient buckets) are also counted
apart, as gradient syncs.

A parameter edge's backward can be deferred (``ParallelModule.no_sync``, through the
``deferred`` object set on the edge, :class:`runtime.grad_sync.DeferredSyncs`): the incoming
gradient is kept, unreduced, instead of being moved, and added to the next synced one before
its moves, which are linear, so one collective sends the sum.
"""

from __future__ import annotations

import contextlib
import pickle
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from passes.placements import (
    dual_spec,
    format_spec,
    gradient_shrinks,
    is_partial,
    is_shard,
    split_size,
    split_start,
    transition_steps,
)

if TYPE_CHECKING:
    from runtime.grad_sync import DeferredSyncs, GradientBuckets

__all__ = [
    "MeshComm",
    "CommCounter",
    "run_steps",
    "start_steps",
    "gather_first",
    "PendingMoves",
    "Reshard",
    "record_collective",
    "grad_sync_scope",
    "all_reduce_",
    "on_rank0",
]

_COUNTERS: list = []
_GRAD_SYNC = [0]  # > 0 while the collectives being recorded sync parameter gradients


@contextlib.contextmanager
def grad_sync_scope():
    """Collectives recorded inside count as gradient syncs (:attr:`CommCounter.grad_sync`)."""
    _GRAD_SYNC[0] += 1
    try:
        yield
    finally:
        _GRAD_SYNC[0] -= 1


def on_rank0(work, what: str):
    """Run ``work()`` on rank 0 only and return its result on every rank; if it raises, every
    rank raises that error (never the other ranks waiting for a broadcast that will not come).
    ``what`` names the work in the error the other ranks raise."""
    payload: list = [None]  # filled by rank 0's broadcast on the other ranks
    if dist.get_rank() == 0:
        try:
            payload = [("ok", work())]
        except Exception as exc:  # noqa: BLE001 - re-raised here and on every other rank
            dist.broadcast_object_list([("error", _portable(exc), type(exc).__name__, str(exc))], src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    status, *value = payload[0]
    if status == "ok":
        return value[0]
    error, name, message = value
    note = f" (raised on rank 0 while {what})"
    if error is not None:
        try:
            rebuilt = type(error)(message + note)
        except Exception:  # noqa: BLE001 - an exception type that needs other arguments
            rebuilt = None
        if rebuilt is not None:
            raise rebuilt
    raise RuntimeError(f"{name}: {message}{note}")


def _portable(exc):
    """``exc`` if it survives pickling (to send it to the other ranks), else None."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - unpicklable attributes: the type name and message go instead
        return None


class CommCounter(contextlib.AbstractContextManager):
    """Counts payload bytes and collective calls per (kind, axis name) and per phase while
    active; ``grad_sync``: the part that synced parameter gradients, per (kind, axis name);
    ``grad_sync_calls``: how many collectives sent it (bucketed syncs send many gradients in one).
    The call counts are what the estimate's latency terms price (``Estimate.comm_calls``): a
    count, unlike a time, that a test can compare exactly."""

    def __init__(self):
        self.bytes = defaultdict(lambda: defaultdict(float))
        self.by_phase = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
        self.call_counts = defaultdict(lambda: defaultdict(int))
        self.calls_by_phase = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
        self.grad_sync = defaultdict(lambda: defaultdict(float))
        self.grad_sync_calls = defaultdict(lambda: defaultdict(int))
        self.calls = 0

    def __enter__(self):
        _COUNTERS.append(self)
        return self

    def __exit__(self, *exc):
        _COUNTERS.remove(self)
        return False

    def record(self, kind, axis, nbytes, phase):
        self.bytes[kind][axis] += nbytes
        self.by_phase[phase][kind][axis] += nbytes
        self.call_counts[kind][axis] += 1
        self.calls_by_phase[phase][kind][axis] += 1
        if _GRAD_SYNC[0]:
            self.grad_sync[kind][axis] += nbytes
            self.grad_sync_calls[kind][axis] += 1
        self.calls += 1

    def as_dict(self) -> dict:
        return {k: dict(v) for k, v in self.bytes.items()}

    def phase_dict(self) -> dict:
        return {p: {k: dict(v) for k, v in kinds.items()} for p, kinds in self.by_phase.items()}

    def grad_sync_dict(self) -> dict:
        return {k: dict(v) for k, v in self.grad_sync.items()}

    def calls_dict(self) -> dict:
        """``{kind: {axis name: collective calls}}``."""
        return {k: dict(v) for k, v in self.call_counts.items()}

    def calls_phase_dict(self) -> dict:
        """``{phase: {kind: {axis name: collective calls}}}``."""
        return {p: {k: dict(v) for k, v in kinds.items()} for p, kinds in self.calls_by_phase.items()}


def record_collective(kind, axis_name, nbytes, phase):
    for counter in _COUNTERS:
        counter.record(kind, axis_name, float(nbytes), phase)


class MeshComm:
    """Process groups and coordinates of this rank on a DeviceMesh (or a trivial 1-device mesh)."""

    def __init__(self, device_mesh=None, *, shape=None, axis_names=None):
        if device_mesh is None:
            self.shape = tuple(shape or (1,))
            self.axis_names = tuple(axis_names or [f"a{i}" for i in range(len(self.shape))])
            if any(n != 1 for n in self.shape):
                raise ValueError(f"a mesh of shape {self.shape} needs a DeviceMesh (process groups)")
            self.groups = [None] * len(self.shape)
            self.coords = [0] * len(self.shape)
            self.device_mesh = None
        else:
            self.device_mesh = device_mesh
            self.shape = tuple(int(n) for n in device_mesh.mesh.shape)
            self.axis_names = tuple(device_mesh.mesh_dim_names or [f"a{i}" for i in range(len(self.shape))])
            self.groups = [device_mesh.get_group(i) for i in range(len(self.shape))]
            self.coords = list(device_mesh.get_coordinate())

    @classmethod
    def for_codegen(cls, shape, axis_names, rank: int) -> MeshComm:
        """A rank's coordinates on a mesh without process groups: enough to lower and print
        its program (any mesh size, one process); running it needs real groups."""
        comm = cls.__new__(cls)
        comm.shape, comm.axis_names, comm.device_mesh = tuple(shape), tuple(axis_names), None
        comm.groups = [None] * len(comm.shape)
        coords, rest = [], rank
        for n in reversed(comm.shape):
            coords.append(rest % n)
            rest //= n
        comm.coords = list(reversed(coords))
        return comm

    @property
    def ndim(self):
        return len(self.shape)


# torch >= 2.12 names the single-tensor collectives *_single; older releases *_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_op(p):
    op = getattr(p, "reduce_op", "sum")
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce_(x: torch.Tensor, comm: MeshComm, axis: int, phase: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce on one mesh axis (counted)."""
    if comm.shape[axis] > 1:
        record_collective("all_reduce", comm.axis_names[axis], _nbytes(x), phase)
        dist.all_reduce(x, op=op, group=comm.groups[axis])
    return x


def _strided_order(x, dim, pieces, n, inverse=False):
    """Reorder ``dim`` (``pieces`` equal pieces, each cut in ``n`` blocks) so that block ``c`` of
    every piece lies in the ``c``-th contiguous ``1/n`` of the dim (``inverse``: back)."""
    m = x.shape[dim] // (pieces * n)
    return x.unflatten(dim, (n, pieces, m) if inverse else (pieces, n, m)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def _start_gather(x, axis, p, comm: MeshComm, phase, src_pieces, *, async_op: bool):
    """Start the all-gather of ``x`` (placed ``p`` on ``axis``) along ``p.dim``: (the work, or
    None when synchronous, and ``finish()``, which returns the whole tensor once it is done)."""
    n, name = comm.shape[axis], comm.axis_names[axis]
    inp = x.movedim(p.dim, 0).contiguous()
    out = inp.new_empty((n * inp.shape[0],) + tuple(inp.shape[1:]))
    record_collective("all_gather", name, _nbytes(out), phase)
    work = _all_gather_single(out, inp, group=comm.groups[axis], async_op=async_op)

    def finish(inp=inp):  # ``inp`` stays alive while the work may still read it
        # contiguous in the order of the dims (a later ``view``, e.g. a flattening before a
        # matmul, needs the layout a whole tensor has)
        whole = out.movedim(0, p.dim).contiguous() if p.dim else out
        return _strided_order(whole, p.dim, src_pieces, n, inverse=True) if src_pieces else whole

    return work, finish


def _move(x, axis, p, q, comm: MeshComm, phase, src_pieces=None, dst_pieces=None):
    """One per-axis move. ``src_pieces`` / ``dst_pieces``: the shard of ``p`` / ``q`` is strided
    (rank ``c`` holds block ``c`` of each of that many equal pieces: the layout a split of a
    sharded dim needs, e.g. a fused QKV projection), not one contiguous block."""
    n = comm.shape[axis]
    if n == 1:
        return x
    group, coord, name = comm.groups[axis], comm.coords[axis], comm.axis_names[axis]
    if is_shard(p) and is_shard(q):  # all_to_all: cut along q.dim, join along p.dim
        # a strided q is cut from its strided order; a strided p is put back in order once joined
        record_collective("all_to_all", name, _nbytes(x), phase)
        if dst_pieces:
            x = _strided_order(x, q.dim, dst_pieces, n)
        pieces = torch.stack(x.chunk(n, dim=q.dim), 0).contiguous()
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces, group=group)
        joined = torch.cat(list(received.unbind(0)), dim=p.dim)
        return _strided_order(joined, p.dim, src_pieces, n, inverse=True) if src_pieces else joined
    if is_shard(p):  # all_gather along p.dim
        _work, finish = _start_gather(x, axis, p, comm, phase, src_pieces, async_op=False)
        return finish()
    if is_partial(p) and is_shard(q):  # reduce_scatter along q.dim
        record_collective("reduce_scatter", name, _nbytes(x), phase)
        if dst_pieces:
            x = _strided_order(x, q.dim, dst_pieces, n)
        inp = x.movedim(q.dim, 0).contiguous()
        out = inp.new_empty((inp.shape[0] // n,) + tuple(inp.shape[1:]))
        _reduce_scatter_single(out, inp, op=_reduce_op(p), group=group)
        return out.movedim(0, q.dim)
    if is_partial(p):  # all_reduce
        record_collective("all_reduce", name, _nbytes(x), phase)
        out = x.contiguous().clone()
        dist.all_reduce(out, op=_reduce_op(p), group=group)
        return out
    if is_shard(q):  # local slice
        if dst_pieces:
            x = _strided_order(x, q.dim, dst_pieces, n)
        whole = x.shape[q.dim]  # a dim that does not divide: the first ranks one more (tensor_split)
        return x.narrow(q.dim, split_start(whole, n, coord), split_size(whole, n, coord))
    if is_partial(q):  # keep one rank's share
        return x if coord == 0 or q.reduce_op != "sum" else torch.zeros_like(x)
    raise AssertionError(f"no move from {p} to {q}")


def run_steps(x: torch.Tensor, steps, comm: MeshComm, phase: str, strided_src=None, strided_dst=None) -> torch.Tensor:
    """Perform ``steps``. ``strided_src`` / ``strided_dst``: ``{axis: pieces}`` for the axes whose
    shard is strided in the source / destination placement (see :func:`_move`)."""
    held = dict(strided_src or {})  # axis -> pieces, for the shards now in strided order
    for axis, p, q in steps:
        x = _step(x, axis, p, q, comm, phase, held, strided_dst)
    return x


def _step(x, axis, p, q, comm: MeshComm, phase, held: dict, strided_dst) -> torch.Tensor:
    """One move of :func:`run_steps`; ``held``: axis -> pieces of the shards now strided."""
    src_pieces = held.pop(axis, None) if is_shard(p) else None
    dst_pieces = (strided_dst or {}).get(axis) if is_shard(q) else None
    x = _move(x, axis, p, q, comm, phase, src_pieces, dst_pieces)
    if dst_pieces:
        held[axis] = dst_pieces
    return x


def _sends(move, comm: MeshComm) -> bool:
    axis, p, _q = move
    return comm.shape[axis] > 1 and (is_shard(p) or is_partial(p))


def gather_first(steps, comm: MeshComm) -> bool:
    """True when the first move of ``steps`` that sends data is an all-gather (what
    :func:`start_steps` can leave running)."""
    first = next((m for m in steps or () if _sends(m, comm)), None)
    return first is not None and is_shard(first[1]) and not is_shard(first[2])


class PendingMoves:
    """:func:`run_steps` with its first all-gather in flight: :meth:`wait` finishes it (within a
    timeout) and runs the moves after it."""

    def __init__(self, work, finish, rest, comm, phase, held, strided_dst, what: str):
        self.work, self.finish, self.rest = work, finish, rest
        self.comm, self.phase, self.held, self.strided_dst, self.what = comm, phase, held, strided_dst, what

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        """Finish the moves. ``timeout_s``: a limit on the gather's wait (None: the process
        group's own collective timeout, as for every other collective); a gather that fails or
        does not complete in time raises ``RuntimeError`` naming the tensor."""
        import datetime

        try:
            if timeout_s is None:
                self.work.wait()
            else:
                self.work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            limit = "the process group's timeout" if timeout_s is None else f"{timeout_s:g} s"
            raise RuntimeError(
                f"the prefetched all-gather of {self.what} ({self.phase}) did not complete within {limit}: "
                f"{exc} (a rank of its mesh axis did not reach the same gather: it failed, stalled or runs "
                f"another program)"
            ) from exc
        x = self.finish()
        for axis, p, q in self.rest:
            x = _step(x, axis, p, q, self.comm, self.phase, self.held, self.strided_dst)
        return x


def start_steps(x, steps, comm: MeshComm, phase: str, strided_src=None, strided_dst=None, *, what="a tensor"):
    """Run ``steps`` up to their first all-gather (which :func:`gather_first` must find) and start
    it asynchronously; the rest runs in :meth:`PendingMoves.wait`. ``what`` names the tensor in a
    timeout's error."""
    held = dict(strided_src or {})
    steps = list(steps)
    j = next((j for j, m in enumerate(steps) if _sends(m, comm)), None)
    if j is None:
        raise ValueError(f"start_steps: no move of {steps} sends data")
    for axis, p, q in steps[:j]:
        x = _step(x, axis, p, q, comm, phase, held, strided_dst)
    axis, p, q = steps[j]
    if is_shard(q):
        raise ValueError(f"start_steps: the first move that sends data, {p} -> {q} on axis {axis}, is no all-gather")
    src_pieces = held.pop(axis, None)
    work, finish = _start_gather(x, axis, p, comm, phase, src_pieces, async_op=True)
    return PendingMoves(work, finish, steps[j + 1 :], comm, phase, held, strided_dst, what)


class _ReshardFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        out = module._forward_moves(x)
        # A slice of the input (Replicate -> Shard) or the input itself would leave autograd a
        # view made inside a custom Function, which the model may not modify in place (Falcon's
        # ``mlp_output += attention_output``): hand out a tensor of its own. A parameter that
        # does not move is passed through (no weight is modified in place; a copy would double
        # the weights' memory for the step).
        if out is x and module.param_edge is not None:
            return out
        out = out.clone() if out is x or out._is_view() else out
        if module.regather:  # ZeRO-3: backward gathers the copy again (runtime/regather.py)
            from runtime.regather import remember

            remember(out, module, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        module = ctx.module
        if module.deferred is not None:  # a parameter's gradient sync, held back under no_sync
            grad = module.deferred.take(module, grad)
            if grad is None:
                return None, None
        if module.sync is not None:  # a parameter's gradient sync, bucketed (runtime/grad_sync.py)
            module.sync.add(module.sync_param, grad, module)
            return None, None
        if module.backward_steps is None:
            return None, None
        return module.backward_moves(grad), None


class Reshard(torch.nn.Module):
    """Move a tensor from ``src`` to ``dst``; its gradient from ``grad`` to the dual of ``src``.

    ``strided`` (``{axis: pieces}``): on those axes a ``Shard`` on the consumer's side (``dst``
    forward, ``grad`` backward) is strided: each rank holds its block of every one of ``pieces``
    equal pieces, as a later split of the sharded dim needs (fused QKV). ``src_strided``: the
    same for the producer's side (a parameter loaded in that layout)."""

    def __init__(self, comm: MeshComm, src, dst, grad=None, strided=None, src_strided=None, grad_dst=None):
        super().__init__()
        self.comm = comm
        self.src, self.dst, self.grad = tuple(src), tuple(dst), (tuple(grad) if grad is not None else None)
        self.strided, self.src_strided = dict(strided or {}), dict(src_strided or {})
        # where the gradient arrives: the dual of ``src``, or (a ZeRO-1 weight's edge) ``grad_dst``
        self.grad_dst = tuple(grad_dst) if grad_dst is not None else dual_spec(self.src)
        self.forward_steps = transition_steps(self.src, self.dst)
        self.backward_steps = transition_steps(self.grad, self.grad_dst) if self.grad is not None else None
        # set when this edge's backward joins gradient buckets (ParallelModule._add_variant)
        self.sync: GradientBuckets | None = None
        self.sync_param: torch.Tensor | None = None
        self.param_edge: str | None = None  # set by lowering: the parameter placeholder this edge reads
        self.reduce_dtype: torch.dtype | None = None  # a parameter edge's gradient sync dtype (precision)
        # set when ``no_sync`` may hold back this edge's backward (ParallelModule._add_variant)
        self.deferred: DeferredSyncs | None = None
        self.regather = False  # set by lowering: a ZeRO-3 parameter's edge (runtime/regather.py)
        self.weight_name: str | None = None  # set by lowering: the parameter's FQN (errors, logs)
        self.pending = None  # a prefetched forward gather: (input, its version, PendingMoves)

    @property
    def forward_communicates(self) -> bool:
        """True when the forward moves send anything (a gather, not only local slices)."""
        moves = [m for m in self.forward_steps or () if self.comm.shape[m[0]] > 1]
        return any(is_shard(p) or is_partial(p) for _, p, _ in moves)

    @property
    def backward_communicates(self) -> bool:
        """True when the backward moves send anything (not only local slices and zeros)."""
        moves = [m for m in self.backward_steps or () if self.comm.shape[m[0]] > 1]
        return any(is_shard(p) or is_partial(p) for _, p, _ in moves)

    @property
    def backward_shrinks(self) -> bool:
        """True when the backward leaves each device a smaller piece than it gets (a
        reduce-scatter onto a weight stored sharded): a pipeline stage moves such a gradient in
        every microbatch instead of holding it whole (:mod:`runtime.pipeline`)."""
        return gradient_shrinks(self.grad, self.grad_dst, self.comm.shape)

    def backward_moves(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient moved from the consumer's placement to the dual of the producer's (a
        parameter's edge: counted as a gradient sync)."""
        sync = grad_sync_scope() if self.param_edge is not None else contextlib.nullcontext()
        dtype = self.reduce_dtype if self.param_edge is not None and self.reduce_dtype is not None else grad.dtype
        with sync:
            moved = run_steps(
                grad.to(dtype),
                self.backward_steps,
                self.comm,
                "bwd",
                self._strided_of(self.grad, self.strided),
                self._strided_of(self.grad_dst, self.src_strided),
            )
        moved = moved.to(grad.dtype)
        # a parameter's gradient cut out of a whole one (Replicate -> Shard) is a view: the
        # parameter's .grad would keep the whole gradient's storage alive; keep the piece only
        return moved.clone() if self.param_edge is not None and moved._base is not None else moved

    @property
    def sync_moves(self):
        """The backward's reduction for gradient buckets (:func:`runtime.grad_sync.reduce_moves`):
        None unless every move that sends is ``Partial -> Replicate`` or ``Partial -> Shard``."""
        from runtime.grad_sync import reduce_moves

        return reduce_moves(self.backward_steps, self.comm, self._strided_of(self.grad_dst, self.src_strided))

    @staticmethod
    def _strided_of(spec, strided):
        return {a: f for a, f in strided.items() if spec is not None and is_shard(spec[a])}

    @property
    def prefetchable(self) -> bool:
        """True when the forward's first move that sends data is an all-gather (a weight stored
        sharded): it can start before the program reaches this edge (:mod:`runtime.prefetch`)."""
        return gather_first(self.forward_steps, self.comm)

    def start_forward(self, x, phase: str) -> PendingMoves:
        """The forward moves of ``x`` with the first all-gather left running (see :attr:`prefetchable`)."""
        return start_steps(
            x,
            self.forward_steps,
            self.comm,
            phase,
            self._strided_of(self.src, self.src_strided),
            self._strided_of(self.dst, self.strided),
            what=self.weight_name or self.param_edge or "a tensor",
        )

    def _forward_moves(self, x, phase="fwd"):
        if phase == "fwd" and self.pending is not None:  # started ahead (runtime/prefetch.py)
            from runtime.prefetch import take_prefetched

            out = take_prefetched(self, x)
            if out is not None:
                return out
        return run_steps(
            x,
            self.forward_steps,
            self.comm,
            phase,
            self._strided_of(self.src, self.src_strided),
            self._strided_of(self.dst, self.strided),
        )

    def regather_moves(self, x):
        """The forward moves again, in backward: a ZeRO-3 parameter's copy gathered once more."""
        return self._forward_moves(x, phase="bwd")

    @property
    def is_noop(self) -> bool:
        moves = lambda steps: [s for s in steps or () if self.comm.shape[s[0]] > 1]  # noqa: E731
        return not moves(self.forward_steps) and not moves(self.backward_steps)

    def forward(self, x):
        if not torch.is_grad_enabled() or not x.requires_grad:
            return self._forward_moves(x)
        return _ReshardFn.apply(x, self)

    def extra_repr(self) -> str:
        text = f"{format_spec(self.src)} -> {format_spec(self.dst)}"
        if self.grad is not None:
            text += f"; grad {format_spec(self.grad)} -> {format_spec(self.grad_dst)}"
        if self.strided:
            text += f"; strided shards {self.strided}"
        if self.sync is not None:
            text += "; gradient all-reduce bucketed"
        if self.regather:
            text += "; freed after forward, gathered again in backward (ZeRO-3)"
        return text
