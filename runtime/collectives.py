"""Collectives on local tensors, and a counter of what they send.

:class:`MeshComm` is this rank's view of the device mesh: one process group per mesh axis
and its coordinate on each. :func:`run_steps` performs the per-axis moves of
:func:`passes.core.placements.transition_steps` on a local tensor:

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

Every collective reports its kind, mesh axis, payload bytes and phase to the active
:class:`CommCounter` objects, so tests can check that the runtime sends what the plan says;
those inside :func:`grad_sync_scope` (a parameter's gradient sync) are also counted apart.
The edge that runs these moves with autograd is :class:`runtime.reshard.Reshard`.
"""

from __future__ import annotations

import contextlib
import pickle
from collections import defaultdict

import torch
import torch.distributed as dist

from passes.core.placements import (
    format_placement,
    is_partial,
    is_shard,
    split_size,
    split_start,
)

__all__ = [
    "MeshComm",
    "CommCounter",
    "run_steps",
    "start_steps",
    "gather_first",
    "PendingMoves",
    "record_collective",
    "grad_sync_scope",
    "all_reduce_",
    "reduce_op_of",
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


def reduce_op_of(p):
    """The ``dist.ReduceOp`` a ``Partial`` placement's values are combined with."""
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


def all_gather_stacked(x: torch.Tensor, comm: MeshComm, axis: int, phase: str) -> torch.Tensor:
    """Every rank's ``x`` on one mesh axis, stacked along a new first dim in coordinate order
    (counted: the gathered bytes)."""
    n = comm.shape[axis]
    if n == 1:
        return x.unsqueeze(0)
    out = x.new_empty(n * x.numel())
    record_collective("all_gather", comm.axis_names[axis], _nbytes(out), phase)
    _all_gather_single(out, x.contiguous().view(-1), group=comm.groups[axis])
    return out.view((n,) + tuple(x.shape))


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
    reading = [inp]  # alive while the work may still read it

    def finish():
        reading.clear()  # the work is done: released before the copy below (passes/plan/move_scratch.py)
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
    if is_partial(p) or is_shard(p) and is_shard(q):
        _check_divides(x, axis, p, q, n)
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
        _reduce_scatter_single(out, inp, op=reduce_op_of(p), group=group)
        return out.movedim(0, q.dim)
    if is_partial(p):  # all_reduce
        record_collective("all_reduce", name, _nbytes(x), phase)
        out = x.contiguous().clone()
        dist.all_reduce(out, op=reduce_op_of(p), group=group)
        return out
    if is_shard(q):  # local slice
        if dst_pieces:
            x = _strided_order(x, q.dim, dst_pieces, n)
        whole = x.shape[q.dim]  # a dim that does not divide: the first ranks one more (tensor_split)
        return x.narrow(q.dim, split_start(whole, n, coord), split_size(whole, n, coord))
    if is_partial(q):  # keep one rank's share
        return x if coord == 0 or q.reduce_op != "sum" else torch.zeros_like(x)
    raise AssertionError(f"no move from {p} to {q}")


def _check_divides(x, axis, p, q, n):
    """An all-to-all or reduce-scatter cuts ``q.dim`` into ``n`` equal pieces: a clear error where
    it does not divide (a placement the plan should not reach), never a wrong shape."""
    if is_shard(q) and x.shape[q.dim] % n:
        raise RuntimeError(
            f"move {format_placement(p)} -> {format_placement(q)} on mesh axis {axis} ({n} ranks): local shape "
            f"{tuple(x.shape)} has dim {q.dim} of size {x.shape[q.dim]}, not divisible by {n}; the placements "
            "on the way shard that dim more ways than it has elements (report this plan)"
        )


def run_steps(
    x: torch.Tensor, steps, comm: MeshComm, phase: str, strided_src=None, strided_dst=None, special=None
) -> torch.Tensor:
    """Perform ``steps``. ``strided_src`` / ``strided_dst``: ``{axis: pieces}`` for the axes whose
    shard is strided in the source / destination placement (see :func:`_move`). ``special``: a
    ``(x, axis, p, q) -> tensor or None`` that performs the moves it returns a tensor for (a dim
    cut into unequal pieces: :mod:`runtime.uneven_moves`)."""
    held = dict(strided_src or {})  # axis -> pieces, for the shards now in strided order
    for axis, p, q in steps:
        moved = special(x, axis, p, q) if special is not None and comm.shape[axis] > 1 else None
        x = moved if moved is not None else _step(x, axis, p, q, comm, phase, held, strided_dst)
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
        self.work = None  # a finished work would keep the gather's input alive
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
