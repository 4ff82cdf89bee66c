"""Checks on the inputs a user hands a parallel model at run time.

A tensor on the ``meta`` device has a shape and no data: planning accepts it (capture only needs
shapes), but running a step on one fails deep inside the lowered program with torch's "Cannot copy
out of meta tensor". The check here names the input instead, before any collective is issued (so
no rank waits on a peer that failed)."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


def refuse_meta_inputs(args, kwargs) -> None:
    """Raise a ``ValueError`` naming the first input tensor on the ``meta`` device."""
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    for path, value in leaves:
        if isinstance(value, torch.Tensor) and value.is_meta:
            name = pytree.keystr(path[1:]) if path else "?"
            raise ValueError(
                f"input {name} is a tensor on the meta device (shape {tuple(value.shape)}, no data): a "
                "parallel model runs on real inputs. Make the batch outside `with torch.device('meta')` "
                "(building the model there is fine: its weights come from checkpoint=)."
            )
