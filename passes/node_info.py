"""What the analysis pass knows about a node: :class:`NodeInfo`, kept in ``node.meta["partita.info"]``.

A bottom-layer module (docs/ARCHITECTURE.md, "Layers"): it imports nothing of Partita's at run
time, so the rules, the planners and the runtime read a node's shapes, kind and names from here
while :mod:`passes.analyze`, which writes it, may import them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from passes.saved_tensors import Saves

__all__ = ["META_KEY", "NodeInfo", "info"]

META_KEY = "partita.info"


@dataclass
class NodeInfo:
    kind: str
    """``param``, ``buffer``, ``input``, ``op``, ``output`` or ``ignored``."""
    name: str
    """Parameter / buffer FQN, the user's argument name, or the node name."""
    module_path: str
    """Innermost module that produced the node ("" for the top level)."""
    out_shapes: tuple
    dtype: torch.dtype | None
    """The first tensor output's dtype (None: no tensor output)."""
    flops: float = 0.0
    requires_grad: bool = False
    saved: bool = False
    """Some op keeps this value's storage for backward (it counts as activation memory); views
    are not marked, the value whose storage they share is."""
    saves: Saves | None = None
    """What this op keeps for backward (ops only)."""
    rate_key: str | None = None
    """The name a measured rate of this op is kept under (ops only: :func:`passes.rules.rate_key`)."""

    @property
    def shape(self):
        return self.out_shapes[0] if self.out_shapes else None


def info(node: fx.Node) -> NodeInfo:
    return node.meta[META_KEY]
