"""Reshapes of a tensor whose pieces differ in size on more than one dim.

A plan made for one batch size serves others (``partitioner/specialize.py``); where the new batch
does not divide the mesh axes cutting it, a rank's piece of an activation has sizes that only the
run knows on the dims those axes cut (:mod:`runtime.uneven_moves`). Lowering writes such a dim's
local size as ``-1``; ``reshape`` infers one ``-1``, not two (a grouped-query attention's
``[B, kv, rep, S, D] -> [B, kv * rep, S, D]`` with the batch and the key-value heads both cut).

:func:`reshape_by_groups` takes the view's *groups* (runs of input dims and output dims with
equal products, :func:`passes.rules.views.view_groups`, static) and, per group with an unknown
output size, that size from the product of the rank's own input sizes of the group over the known
output sizes: exact whatever the piece, as long as a group has at most one unknown output dim
(lowering refuses others, naming the node).
"""

from __future__ import annotations

import math

import torch

__all__ = ["reshape_by_groups"]


def reshape_by_groups(x: torch.Tensor, sizes: list, groups: list) -> torch.Tensor:
    """``x.reshape(sizes)``, each ``-1`` of ``sizes`` computed from ``x``'s sizes in its group
    (``groups``: ``[(input dims, output dims)]`` covering every dim of both shapes)."""
    shape = list(sizes)
    for ins, outs in groups:
        unknown = [d for d in outs if shape[d] == -1]
        if unknown:
            (d,) = unknown  # lowering made sure of one unknown per group
            known = math.prod(shape[o] for o in outs if o != d)
            shape[d] = math.prod(x.shape[i] for i in ins) // max(known, 1)
    return x.reshape(shape)
