"""The global view of a rank's local state: DTensors for checkpoints, local pieces for training.

A parallel model's parameters are plain local tensors (this rank's pieces). Saved as they are,
``torch.distributed.checkpoint`` (DCP) would take every rank's piece for the whole tensor. So the
state a checkpoint sees is the *global* view, and loading turns it back into local pieces:

* :class:`TensorLayout` says how one tensor is stored: the mesh, the placement, the whole
  shape and the strided layout of fused projections. ``to_global(local)`` is a ``DTensor`` over
  the job's ``DeviceMesh`` wrapping the local piece (no copy); a strided tensor or an inner-cut one
  (:class:`passes.core.placements.InnerShard`; its shard is not
  one block) is gathered whole (a collective), and a tensor on a 1-device mesh is given as it is:
  DCP stores such plain tensors once, as replicated. ``to_local(value)`` takes a DTensor of any
  layout (gathered if not this one, then sliced), a whole tensor (sliced) or this rank's piece
  (kept) and returns this rank's piece.
* Every parallel model registers its parameters here (parameter -> layout and FQNs, weakly).
  :func:`shard_optimizer_state` hooks an optimizer so that its ``state_dict()`` returns the state
  tensors shaped like a parameter in that parameter's global view (scalars such as Adam's
  ``step`` stay plain) and its ``load_state_dict()`` accepts any of the forms above. That is
  what ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` need.
* An optimizer over a parallel model's parameters gets these hooks by itself at its first
  ``step()`` (a process-wide optimizer step pre-hook, installed with the first registered
  model, checks each optimizer once). ``set_state_dict`` steps a fresh optimizer before loading
  (to create its state), so the hooks are in place when it loads; call
  :func:`shard_optimizer_state` yourself to load into an optimizer that has not stepped
  through ``Optimizer.load_state_dict`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from passes.core.placements import InnerShard, Shard, local_shape
from runtime.collectives import MeshComm
from runtime.tensor_shards import gather_tensor, shard_tensor

__all__ = [
    "TensorLayout",
    "register_parameters",
    "parameter_fqns",
    "layout_of",
    "shard_optimizer_state",
    "ordered_params",
]


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor is stored on this rank."""

    comm: MeshComm
    spec: tuple
    """One placement per mesh axis."""
    global_shape: tuple
    strided: dict = field(default_factory=dict)
    """Mesh axis -> pieces, for fused projections stored in the strided layout."""

    @classmethod
    def from_local(cls, comm: MeshComm, spec, local: torch.Tensor, strided=None) -> TensorLayout:
        """The layout of ``local`` (this rank's piece), its whole shape implied by the even split."""
        shape = list(local.shape)
        for axis, p in enumerate(spec):
            if isinstance(p, Shard):
                shape[p.dim] *= comm.shape[axis]
        return cls(comm, tuple(spec), tuple(shape), dict(strided or {}))

    @property
    def local_shape(self) -> tuple:
        return tuple(local_shape(self.global_shape, self.spec, self.comm.shape))

    @property
    def as_dtensor(self) -> bool:
        """Whether the global view is a DTensor (else the whole tensor, gathered)."""
        inner = any(type(p) is InnerShard for p in self.spec)  # DTensor cuts outer axis first only
        return not self.strided and not inner and self.comm.device_mesh is not None

    @property
    def sharded(self) -> bool:
        return self.local_shape != tuple(self.global_shape)

    def to_global(self, local: torch.Tensor):
        """A DTensor over the job's mesh wrapping ``local``, or the whole tensor (a collective)."""
        from torch.distributed.tensor import DTensor

        if not self.as_dtensor:
            return gather_tensor(local, self.spec, self.comm, self.strided)
        shape = torch.Size(self.global_shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self.comm.device_mesh, list(self.spec), run_check=False, shape=shape, stride=stride
        )

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's piece, on every rank of the mesh (a collective)."""
        return gather_tensor(local, self.spec, self.comm, self.strided, whole_shape=self.global_shape)

    def empty_global(self, dtype: torch.dtype, device=None):
        """An uninitialised tensor of the global view's kind (a target for a checkpoint to load into)."""
        if not self.as_dtensor:
            return torch.empty(self.global_shape, dtype=dtype, device=device)
        return self.to_global(torch.empty(self.local_shape, dtype=dtype, device=device))

    def to_local(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's piece of ``value``: a DTensor (any mesh or placement), the whole tensor, or
        already this rank's piece. ``what`` names the value in errors."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            if value.device_mesh == self.comm.device_mesh and tuple(value.placements) == self.spec:
                return value.to_local()
            value = value.full_tensor()  # another layout: a collective over its mesh
        if tuple(value.shape) == tuple(self.global_shape):
            return shard_tensor(value, self.spec, self.comm, self.strided)
        if tuple(value.shape) == self.local_shape:
            return value
        raise ValueError(
            f"{what}: got shape {tuple(value.shape)}; expected the whole tensor {tuple(self.global_shape)} "
            f"or this rank's piece {self.local_shape}"
        )


# -- the registry of parallel parameters -------------------------------------------------------

_PARAMETERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Parameter -> (layout, [FQNs])
_STEP_HOOK: list = []  # the handle of the process-wide optimizer step pre-hook, once installed


def register_parameters(named) -> None:
    """``named``: (FQN, Parameter, TensorLayout) of a parallel model; tied names share one entry."""
    for fqn, param, layout in named:
        entry = _PARAMETERS.get(param)
        if entry is None:
            _PARAMETERS[param] = (layout, [fqn])
        elif fqn not in entry[1]:
            entry[1].append(fqn)
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_hook_on_first_step))


def layout_of(param: torch.Tensor) -> TensorLayout | None:
    entry = _PARAMETERS.get(param)
    return entry[0] if entry is not None else None


def parameter_fqns(param: torch.Tensor) -> list:
    """Every FQN a parallel model holds ``param`` under (several for tied weights); [] if none."""
    entry = _PARAMETERS.get(param)
    return list(entry[1]) if entry is not None else []


# -- optimizers ------------------------------------------------------------------------------


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.state_dict()`` give the global view of its state tensors and
    ``optimizer.load_state_dict()`` take it back (see the module docstring). Idempotent; returns
    the optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard_optimizer_state: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_partita_state_hooks", None) is not None:
        return optimizer
    if not any(p in _PARAMETERS for p in ordered_params(optimizer)):
        raise ValueError(
            f"the {type(optimizer).__name__} holds no parameter of a parallel model: build it over "
            "the parameters of the module (or pipeline runner) auto_parallelize returned"
        )
    optimizer._partita_state_hooks = (  # type: ignore[attr-defined]
        optimizer.register_state_dict_post_hook(_state_to_global),
        optimizer.register_load_state_dict_pre_hook(_state_to_local),
    )
    return optimizer


def _hook_on_first_step(optimizer, args, kwargs) -> None:
    """Process-wide step pre-hook: the first step of an optimizer over parallel parameters
    installs the state hooks (checked again only if its parameter count changes)."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if getattr(optimizer, "_partita_checked", None) == count:
        return None
    optimizer._partita_checked = count
    if any(p in _PARAMETERS for p in ordered_params(optimizer)):
        shard_optimizer_state(optimizer)
    return None


def ordered_params(optimizer) -> list:
    """The parameters in the order ``Optimizer.state_dict()`` numbers them."""
    seen, out = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _ids(optimizer) -> dict:
    """Parameter id number in ``state_dict()`` -> the parameter (as ``Optimizer.state_dict`` numbers them)."""
    ids, seen, start = {}, set(), 0
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"], start):
            if id(p) not in seen:
                seen.add(id(p))
                ids[i] = p
        start += len(group["params"])
    return ids


def state_entry_to_global(optimizer, param, entry: dict) -> dict:
    """One parameter's optimizer state with its parameter-shaped tensors in their global view."""
    layout, fqns = _PARAMETERS[param]
    out = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if tuple(value.shape) != tuple(param.shape):
                if layout.sharded:
                    raise ValueError(
                        f"{type(optimizer).__name__} keeps {key!r} of shape {tuple(value.shape)} for "
                        f"{fqns[0]} (this rank's piece: {tuple(param.shape)}); only state shaped like its "
                        "parameter, or scalars, can be saved for a sharded parameter"
                    )
                out[key] = value
                continue
            value = layout.to_global(value)
        out[key] = value
    return out


def state_entry_to_local(param, entry: dict) -> dict:
    """One parameter's optimizer state back to this rank's pieces (from any form ``to_local`` takes)."""
    layout, fqns = _PARAMETERS[param]
    out = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            value = layout.to_local(value, f"optimizer state {key!r} of {fqns[0]}")
        out[key] = value
    return out


def _state_to_global(optimizer, state_dict: dict) -> dict:
    params = _ids(optimizer)
    state = {}
    for key, entry in state_dict["state"].items():  # in the order the parameters first stepped: alike on every rank
        param = params.get(key) if isinstance(key, int) else None
        state[key] = state_entry_to_global(optimizer, param, entry) if param in _PARAMETERS else entry
    return {**state_dict, "state": state}


def _state_to_local(optimizer, state_dict: dict) -> dict | None:
    saved = [k for g in state_dict["param_groups"] for k in g["params"]]
    current = [p for g in optimizer.param_groups for p in g["params"]]
    if len(saved) != len(current):
        return None  # Optimizer.load_state_dict raises its own error for mismatched groups
    by_key = dict(zip(saved, current))
    state = {}
    for key, entry in state_dict["state"].items():
        param = by_key.get(key)
        state[key] = state_entry_to_local(param, entry) if param is not None and param in _PARAMETERS else entry
    return {**state_dict, "state": state}
