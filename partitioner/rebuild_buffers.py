"""Non-persistent buffers of a model built on ``meta``: computed again, as the model computes them.

A non-persistent buffer (registered with ``persistent=False``: the rotary embedding's
``inv_freq``, a causal mask, ``position_ids``) is in no checkpoint, because the model makes it
itself in ``__init__``. Built on ``meta``, the model made it on ``meta``: a shape, no values. So
loading a checkpoint into a model on ``meta`` has to make those values again.

The choice: the module that owns the buffer is copied (on ``meta``: nothing is allocated),
given real, empty CPU storage (``to_empty``), and the model's own initialisation is run on the
copy's modules: a HuggingFace model's ``_init_weights(module)``, which since transformers 5
recomputes the buffers its ``__init__`` made (``inv_freq`` from the config's RoPE parameters)
precisely so that models loaded on ``meta`` get them back; for any other model, the
``reset_parameters()`` of modules that have one. Only the owning module is materialised (for
rotary embeddings: a few hundred floats, not the model), and the copy is dropped afterwards.
Re-running the owner's ``__init__`` instead would need its constructor arguments, which a
module does not keep.

Every floating buffer of the copy is first filled with NaN (integers with their minimum): a
buffer the initialisation did not write keeps that fill and is refused with an error naming
it and what to do, rather than loaded as garbage.
"""

from __future__ import annotations

import copy
import logging

import torch

__all__ = ["non_persistent_buffers", "rebuild_buffer"]

logger = logging.getLogger(__name__)


def non_persistent_buffers(model: torch.nn.Module) -> set:
    """FQNs of the model's buffers that its ``state_dict()`` leaves out (works on ``meta``)."""
    out = set()
    for name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        out.update(prefix + b for b in module._non_persistent_buffers_set if module._buffers.get(b) is not None)
    return out


def rebuild_buffer(model: torch.nn.Module, fqn: str) -> torch.Tensor:
    """The value of the non-persistent buffer ``fqn`` of ``model`` (on ``meta``), computed on the
    CPU by the model's own initialisation of its owning module (see the module docstring)."""
    owner_name, _, leaf = fqn.rpartition(".")
    owner = model.get_submodule(owner_name)
    made = copy.deepcopy(owner).to_empty(device="cpu")
    with torch.no_grad():
        for buffer in made.buffers():
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
            elif buffer.dtype != torch.bool:  # any fill of a bool is a value: not checked
                buffer.fill_(torch.iinfo(buffer.dtype).min)
        init = getattr(model, "_init_weights", None)
        for module in made.modules():
            if callable(init):
                init(module)
            elif callable(reset := getattr(module, "reset_parameters", None)):
                reset()
    value = made.get_buffer(leaf)
    if _still_filled(value):
        how = "_init_weights" if callable(getattr(model, "_init_weights", None)) else "reset_parameters"
        raise ValueError(
            f"{fqn} is a non-persistent buffer (in no checkpoint) of a model built on meta, and the model's "
            f"{how} does not compute it: build the model with that module on a real device, or pass the "
            f"buffer's value in state_dict={{{fqn!r}: ...}}"
        )
    logger.debug("rebuilt %s (%s) with %s's own initialisation", fqn, tuple(value.shape), type(owner).__name__)
    return value


def _still_filled(value: torch.Tensor) -> bool:
    """Whether ``value`` still holds the fill :func:`rebuild_buffer` put there (unwritten)."""
    if value.is_floating_point():
        return bool(value.isnan().any())
    if value.dtype == torch.bool:
        return False
    return bool((value == torch.iinfo(value.dtype).min).any())
