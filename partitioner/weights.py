"""Full weights in, this rank's pieces out: the state loading both build paths share.

``auto_parallelize`` (one program per rank) and the pipeline (one program per stage) load
weights the same way, in three steps:

1. :class:`WeightSource` finds each parameter's or buffer's full tensor by FQN, in this order:
   a given state dict, or a ``torch.save`` checkpoint opened with ``mmap`` (only the slices this
   rank keeps are ever read); the model's own tensors (unless the model lives on ``meta``); the
   constants ``torch.export`` lifted out of the model.
2. :func:`shard_weights` cuts every parameter and buffer placeholder of a captured graph to this
   rank's piece under its planned placement (and strided layout, for fused projections split
   after the matmul), on the target device.
3. :func:`tie_weights` gives tied names (one tensor under several FQNs, GPT-2's ``wte`` and
   ``lm_head``) one local tensor, so the module built from them holds one Parameter; names the
   plan placed differently are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from passes.lower_to_local import strided_parameters
from passes.placements import format_spec, parse_spec
from runtime.parallel_module import shard_tensor

__all__ = ["WeightSource", "LocalWeights", "load_local_weights", "shard_weights", "tie_weights"]


def on_meta(model: torch.nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the ``meta`` device."""
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


class WeightSource:
    """Where full weights come from (see the module docstring for the lookup order)."""

    def __init__(self, model: torch.nn.Module, state_dict=None, checkpoint=None):
        self.model_state = (
            None
            if on_meta(model)
            else {
                **dict(model.named_parameters(remove_duplicate=False)),
                **dict(model.named_buffers(remove_duplicate=False)),
            }
        )
        self.given = state_dict
        if checkpoint is not None:
            self.given = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)

    def tensor(self, fqn: str, exported) -> torch.Tensor:
        """The full value of ``fqn``; ``exported``: the ExportedProgram, for lifted constants."""
        for source in (self.given, self.model_state):
            if source is not None and fqn in source:
                return source[fqn]
        if exported is not None and fqn in exported.constants:
            return exported.constants[fqn]
        raise KeyError(f"no value for {fqn}: pass state_dict= or checkpoint= holding it")


@dataclass
class LocalWeights:
    """This rank's pieces of one captured graph's parameters and buffers."""

    params: dict = field(default_factory=dict)
    """placeholder name -> (FQN, local tensor)"""
    buffers: dict = field(default_factory=dict)
    """placeholder name -> (FQN, local tensor)"""
    global_shapes: dict = field(default_factory=dict)
    """FQN -> the whole tensor's shape"""


def shard_weights(cap, specs: dict, comm, strided: dict, source: WeightSource, device, exported) -> LocalWeights:
    """Cut every parameter and buffer placeholder of ``cap`` to this rank's piece.

    ``specs``: placeholder name -> planned placement; ``strided``: FQN -> {axis: pieces}
    (:func:`passes.lower_to_local.strided_parameters`); ``exported``: where lifted constants live.
    """
    out = LocalWeights()
    with torch.no_grad():
        for table, target in ((cap.params, out.params), (cap.buffers, out.buffers)):
            for placeholder, fqn in table.items():
                full = source.tensor(fqn, exported)
                local = shard_tensor(full.detach(), specs[placeholder], comm, strided.get(fqn)).to(device).clone()
                target[placeholder] = (fqn, local)
                out.global_shapes[fqn] = tuple(full.shape)
    return out


def tie_weights(weights: LocalWeights, groups, specs: dict, strided: dict) -> None:
    """Make each group of tied placeholders share the first one's local tensor (in place).

    ``groups``: lists of placeholder names that are one tensor (:func:`passes.capture.tied_placeholders`);
    names not among ``weights`` are skipped. Raises ``ValueError`` when the plan placed them differently."""
    for names in groups:
        names = [n for n in names if n in weights.params or n in weights.buffers]
        if len(names) < 2:
            continue
        first = names[0]
        table = weights.params if first in weights.params else weights.buffers
        first_fqn, shared = table[first]
        for name in names[1:]:
            fqn = (weights.params if name in weights.params else weights.buffers)[name][0]
            if specs[name] != specs[first] or strided.get(fqn) != strided.get(first_fqn):
                raise ValueError(
                    f"{fqn} and {first_fqn} are one tied tensor but the plan places them differently "
                    f"({format_spec(specs[name])} vs {format_spec(specs[first])}); pin both alike"
                )
            if name in table:
                table[name] = (fqn, shared)


def load_local_weights(cap, records: dict, comm, source: WeightSource, device, *, exported, tied=()) -> tuple:
    """Steps 2 and 3 for one planned graph: ``records`` (node name -> plan record) place its
    placeholders; ``tied``: groups of tied placeholder names. Returns (LocalWeights, placeholder
    name -> spec for every placeholder, FQN -> strided layout)."""
    specs = {  # a ZeRO-1 parameter is stored as its optimizer's shard
        node.name: parse_spec(records[node.name].get("stored") or records[node.name]["out"][0], comm.ndim)
        for node in cap.graph.nodes
        if node.op == "placeholder"
    }
    strided = strided_parameters(cap.graph, records, comm)
    weights = shard_weights(cap, specs, comm, strided, source, device, exported)
    tie_weights(weights, tied, specs, strided)
    return weights, specs, strided
