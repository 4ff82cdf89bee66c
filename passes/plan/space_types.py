"""The strategy space's data: one node's choice under an option, decision groups, the costs
between groups, and the space the ILP solves (:func:`passes.plan.strategy_space.build_space` builds it)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from passes.capture.blocks import Blocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeChoice:
    """One node's placements under one option of its group."""

    strategy: object
    """The Strategy (None for placeholders, getitem and outputs)."""
    out: tuple
    """A spec per output."""
    ins: tuple
    """The spec each tensor input must arrive in (None: metadata only / no data)."""
    compute_s: float = 0.0
    """Forward + backward compute."""
    weight_grad_s: float = 0.0
    """The part of ``compute_s`` that computes parameter gradients (a contraction's weight
    product); what a zero-bubble schedule can defer to its W pass."""
    extra_s: float = 0.0
    """The op's own collectives (``AxisStrategy.extra``), forward and backward."""
    inbound_s: float = 0.0
    """Resharding into this node inside its group (followers only)."""
    memory: float = 0.0
    forward_s: float = 0.0
    """The forward part of ``compute_s``: what recomputing the node (activation checkpointing)
    runs again."""
    forward_comm_s: float = 0.0
    """The forward part of ``extra_s + inbound_s``: the collectives a recomputation repeats."""
    regather: bool = False
    """A parameter stored sharded whose copies gathered for use are freed after forward and
    gathered again for backward (ZeRO-3), instead of being kept for backward (ZeRO-2)."""
    stored: tuple | None = None
    """ZeRO-1: the placement of the shard the optimizer steps (``Shard`` on the data-parallel axes
    where the compute copy ``out[0]`` is replicated); None: the parameter is stored as used."""
    offload: bool = False
    """The tensor the optimizer steps (the parameter, or its ZeRO-1 shard) lives in host memory with
    its gradient and optimizer state; the device keeps a compute copy and its gradient."""
    host_memory: float = 0.0
    """Bytes of host memory the option holds (offloaded optimizer state, parameter and gradient)."""


@dataclass
class Group:
    leader: fx.Node
    members: list
    options: list
    """options[i][node] -> NodeChoice for each member."""
    cost: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Seconds per option (all members, times ``count``); priced once the groups are formed."""
    memory: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Bytes per option, likewise."""
    host_memory: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Host-memory bytes per option (offloaded optimizer state), likewise."""
    count: int = 1

    def choice(self, i: int, node) -> NodeChoice:
        return self.options[i][node]


@dataclass
class EdgeCost:
    """Cost between two groups, factored through placement classes."""

    src: int
    dst: int
    src_class: np.ndarray
    """option of src -> class index."""
    dst_class: np.ndarray
    matrix: np.ndarray
    """[src classes, dst classes] seconds (already multiplied by occurrence counts)."""
    memory: np.ndarray | None = None
    """[src classes, dst classes] bytes of the buffers the edge makes that backward keeps (a
    weight gathered for use and saved by its matmul), likewise multiplied; None: none."""

    def full(self) -> np.ndarray:
        return self.matrix[np.ix_(self.src_class, self.dst_class)]

    def full_memory(self) -> np.ndarray:
        if self.memory is None:
            return np.zeros((len(self.src_class), len(self.dst_class)))
        return self.memory[np.ix_(self.src_class, self.dst_class)]


@dataclass
class StrategySpace:
    groups: list
    edges: list
    group_of: dict
    """representative node -> group index."""
    blocks: Blocks
    mesh_shape: tuple
    cluster: object
    pruned: int = 0
    """Options dropped by the ``max_options`` cap (0: the space is complete)."""
    grad_reduce_bytes: int | None = None
    """Bytes per element parameter gradients are reduced in (None: the parameter's own dtype)."""
    optimizer: str | None = None
    """The optimizer the plan is made for (``"adam"``, ``"sgd"``, None)."""
    regather_activations: bool = False
    """Activations gathered for an op that keeps them are kept as their shard and gathered again
    in backward (:mod:`passes.plan.activation_regather`)."""
    microbatches: int = 1
    """The microbatches of a step the graph runs (a pipeline stage): parameter gradients are
    summed over them (:func:`passes.plan.cost_model.grad_accumulate_time`)."""
