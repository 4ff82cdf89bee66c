"""The names a model's state goes by, read off the model (on ``meta`` too).

* :func:`tied_names`: the other FQNs of each tied Parameter (GPT-2's ``transformer.wte.weight``
  and ``lm_head.weight`` are one tensor), found by identity;
* :func:`checkpoint_names`: the keys an HF checkpoint holds parameters under where transformers
  renames them between model and file (GPT-NeoX's ``lm_head.weight`` is ``embed_out.weight``
  in its files), as transformers' own ``revert_weight_conversion`` gives them, key by key. Only
  one-to-one renamings come out; conversions that merge several checkpoint tensors into one
  parameter (fused MoE experts) do not.
"""

from __future__ import annotations

import torch

__all__ = ["tied_names", "checkpoint_names"]


def tied_names(model: torch.nn.Module) -> dict:
    """FQN -> the other FQNs of the same Parameter (tied weights; works on ``meta``)."""
    by_tensor: dict = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(fqn)
    return {fqn: [o for o in names if o != fqn] for names in by_tensor.values() if len(names) > 1 for fqn in names}


def checkpoint_names(model: torch.nn.Module) -> dict:
    """FQN -> the key an HF checkpoint holds it under, for the keys transformers renames (see the
    module docstring); {} for a model transformers does not rename."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    out = {}
    for fqn, tensor in model.state_dict(keep_vars=True).items():
        saved = list(revert_weight_conversion(model, {fqn: tensor}))
        if len(saved) == 1 and saved[0] != fqn:
            out[fqn] = saved[0]
    return out
