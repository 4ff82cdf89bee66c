"""Measure one training step's memory on this rank: what the estimate predicts, counted.

:func:`measure_memory` runs one forward and backward of a model (a
:class:`runtime.parallel_module.ParallelModule`, or any ``nn.Module``) on a batch and reports:

* **saved activations**: every tensor autograd keeps for backward passes through a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook during the forward. Tensors are
  counted by *storage*: each distinct storage once, at its full size (a view saves its base's
  storage; two ops saving the same tensor save it once). Storages of the model's parameters and
  buffers (state) and of the batch the caller passed in (inputs) are not activations and are
  left out; with ``by_node=True`` the program runs node by node (``torch.fx.Interpreter``) and
  the bytes are also attributed to the node that made each storage (the per-node comparison
  with the plan's records: a ``reshard_<op>_in<k>`` node is an edge buffer of ``<op>``).
* **state**: parameter bytes and gradient bytes (each distinct tensor once: tied weights are
  one), and optimizer state: the tensors in ``optimizer.state`` when an optimizer is passed,
  else Adam's two moments assumed (twice the parameter bytes).
* **peak**: on CUDA, ``torch.cuda.max_memory_allocated`` over the step (the counter is reset
  first); ``None`` elsewhere.

Nothing here knows the plan or the cost model: the comparison lives in the tests and in
``docs/ARCHITECTURE.md`` ("Memory model").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["MemoryMeasurement", "measure_memory"]


@dataclass
class MemoryMeasurement:
    """Bytes on this rank for one training step (see the module docstring)."""

    parameters: int
    gradients: int
    optimizer_state: int
    saved_activations: int
    """Unique storages saved for backward, parameters, buffers and the caller's batch left out."""
    inputs: int
    """The caller's batch (unique storages)."""
    peak_allocated: int | None = None
    """``torch.cuda.max_memory_allocated`` over the step; None off CUDA."""
    saved_by_node: dict = field(default_factory=dict)
    """Lowered-program node name -> bytes of the saved storages it made (``by_node=True`` only;
    ``""``: made outside the program)."""

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.parameters + self.gradients + self.optimizer_state


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr(), storage.nbytes())


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


class _NodeTracker(fx.Interpreter):
    """Runs a lowered program node by node, noting which node made each storage."""

    def __init__(self, module, made: dict):
        super().__init__(module)
        self.made = made

    def run_node(self, n):
        out = super().run_node(n)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                if t._base is None:  # a new storage (perhaps where a freed one was)
                    self.made[_storage_key(t)] = n.name
                else:
                    self.made.setdefault(_storage_key(t), n.name)
        return out


@contextlib.contextmanager
def _track_nodes(model, made: dict):
    """While active, lowered programs of ``model`` run under :class:`_NodeTracker`."""
    programs = [m for m in model.modules() if isinstance(m, fx.GraphModule)]
    programs += [p for p in getattr(model, "variants", {}).values() if p not in programs]  # a ParallelModule's
    originals = {}
    for program in programs:
        originals[program] = program.forward
        program.forward = lambda *args, _p=program: _NodeTracker(_p, made).run(*args)
    try:
        yield
    finally:
        for program, forward in originals.items():
            program.forward = forward


def _optimizer_bytes(optimizer, param_bytes: int) -> int:
    if optimizer is None:
        return 2 * param_bytes
    tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return _unique_bytes(t for t in tensors if t.dim() > 0)


def measure_memory(model: torch.nn.Module, batch, *, optimizer=None, loss_fn=None, by_node: bool = False):
    """One forward + backward of ``model`` on ``batch`` (a tuple of positional arguments or a
    dict of keyword arguments, as the model is called); returns a :class:`MemoryMeasurement`.

    ``loss_fn(output) -> scalar``: how to get the loss from the model's output (by default: the
    output itself if it is a tensor, ``output["loss"]`` for a mapping, else its first element).
    ``optimizer``: count its state tensors (call after a step, when Adam's moments exist);
    ``None`` assumes Adam (two moments, twice the parameter bytes). Gradients accumulate into
    ``.grad`` as in any backward: clear them first if the measurement should start clean.
    """
    if not isinstance(batch, (tuple, list, dict)):
        raise TypeError(
            f"measure_memory: batch must be a tuple of positional arguments or a dict of keyword "
            f"arguments for the model, got {type(batch).__name__}"
        )
    params = list(model.parameters())
    # ZeRO-1 weights' whole compute copies (the parameters are their shards): state too, and the
    # gradient each holds until backward's end reduce-scatters it (seen as it accumulates)
    copies = list(getattr(model, "compute_copies", lambda: [])())
    copy_grads: dict = {}
    handles = [
        c.register_post_accumulate_grad_hook(lambda t: copy_grads.__setitem__(id(t), t.grad.untyped_storage().nbytes()))
        for c in copies
    ]
    state_keys = {_storage_key(t) for t in params + copies + list(model.buffers())}
    batch_tensors = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    batch_keys = {_storage_key(t) for t in batch_tensors}
    saved: dict = {}  # storage key -> bytes
    made: dict = {}  # storage key -> the lowered program's node that made it (by_node)

    def pack(t):
        if t.layout == torch.strided:
            key = _storage_key(t)
            if key not in state_keys and key not in batch_keys:
                saved.setdefault(key, t.untyped_storage().nbytes())
        return t

    cuda = torch.cuda.is_available() and any(p.is_cuda for p in params)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracking = _track_nodes(model, made) if by_node else contextlib.nullcontext()
    with tracking, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch) if isinstance(batch, dict) else model(*batch)
    loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "measure_memory: the loss must be a scalar tensor; pass loss_fn= to pick it out of the model's output"
        )
    loss.backward()
    for handle in handles:
        handle.remove()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_allocated())
    param_bytes = _unique_bytes(params)
    copy_bytes = _unique_bytes(copies)
    per_node: dict = {}
    if by_node:
        for key, nbytes in saved.items():
            name = made.get(key, "")
            per_node[name] = per_node.get(name, 0) + nbytes
    return MemoryMeasurement(
        parameters=param_bytes + copy_bytes,
        gradients=_unique_bytes(p.grad for p in params if p.grad is not None) + sum(copy_grads.values()),
        optimizer_state=_optimizer_bytes(optimizer, param_bytes),
        saved_activations=sum(saved.values()),
        inputs=_unique_bytes(batch_tensors),
        peak_allocated=peak,
        saved_by_node=per_node,
    )


def _default_loss(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["loss"]
    return out[0]
