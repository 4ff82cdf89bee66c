"""What the analysis pass knows about a node: :class:`NodeInfo`, kept in ``node.meta["partita.info"]``.

A bottom-layer module (docs/ARCHITECTURE.md, "Layers"): it imports nothing of Partita's at run
time, so the rules, the planners and the runtime read a node's shapes, kind and names from here
while :mod:`passes.analysis.analyze`, which writes it, may import them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

__all__ = ["META_KEY", "NodeInfo", "Saves", "info", "grad_flows"]

META_KEY = "partita.info"


@dataclass(frozen=True)
class Saves:
    """What one op keeps for backward."""

    inputs: tuple = ()
    """Positions (in :func:`passes.rules.tensor_input_nodes` order) of the inputs it saves."""
    outputs: tuple = ()
    """Indices of its outputs it saves."""
    extra_bytes: float = 0.0
    """Bytes of the other tensors it saves, at the graph's (global) shapes."""
    alias: int | None = None
    """The input position whose storage its output shares (a view), or None."""


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


def grad_flows(producer: fx.Node, consumer: fx.Node) -> bool:
    """Whether backward sends a gradient along the edge ``producer -> consumer``: the producer
    needs one and the consumer passes one back (its own value leads to an output,
    :mod:`passes.analysis.gradient_reach`). The graph's output node passes back whatever
    reaches it."""
    if not info(producer).requires_grad:
        return False
    return consumer.op == "output" or info(consumer).requires_grad
