"""A pipeline's state that no stage holds: the model's names no stage program reads.

A pipeline stage holds the parameters and buffers its own piece of the graph reads, under the
names it reads them by. Two kinds of a model's state are then held by no stage:

* **aliases**: a second name of a tied tensor (XLNet's ``transformer.word_embedding.weight`` and
  ``lm_loss.weight`` are one Parameter) when every stage reads it under the other name. The
  alias is answered with the staged name's tensor, wherever that lives.
* **unread state**: a parameter or persistent buffer the program never reads (XLNet's
  ``mask_emb``, used only with target mappings a training step does not pass). No gradient ever
  reaches it, so no step changes it; the first pipeline rank holds it whole (replicated over its
  stage mesh, the layout a replicated parameter of the first stage has), so that
  ``full_state_dict``, sharded checkpoints and ``save_pretrained`` carry every name of the
  model's ``state_dict()``, as one device's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from passes.core.placements import replicated
from runtime.collectives import MeshComm

__all__ = ["UnstagedState"]


@dataclass
class UnstagedState:
    """What the pipeline runner answers for the model's names no stage holds."""

    names: tuple = ()
    """Every name of the model's ``state_dict()`` (persistent state, tied names each), in its order."""
    aliases: dict = field(default_factory=dict)
    """Name -> the staged name of the same tied tensor."""
    tensors: dict = field(default_factory=dict)
    """Name -> the whole tensor of unread state (on the first pipeline rank; empty on the others)."""
    comm: MeshComm | None = None
    """The first stage's mesh (where the unread tensors are held replicated)."""

    def layouts(self) -> dict:
        """Name -> (tensor, its replicated ``TensorLayout``) of the unread state this rank holds."""
        from runtime.sharded_state import TensorLayout

        if self.comm is None:
            return {}
        spec = replicated(len(self.comm.shape))
        return {name: (t, TensorLayout(self.comm, spec, tuple(t.shape))) for name, t in self.tensors.items()}

    def with_aliases(self, held: dict) -> dict:
        """``held`` (name -> anything) with each alias whose staged name it has, under the alias too."""
        out = dict(held)
        for alias, staged in self.aliases.items():
            if staged in held:
                out.setdefault(alias, held[staged])
        return out

    def in_model_order(self, state: dict) -> dict:
        """``state`` restricted to, and ordered as, the model's ``state_dict()`` names."""
        return {name: state[name] for name in self.names if name in state}

    def load(self, state: dict) -> None:
        """Copy the unread tensors this rank holds out of ``state`` (whole tensors or DTensors)."""
        with torch.no_grad():
            for name, (tensor, layout) in self.layouts().items():
                if name in state:
                    tensor.copy_(layout.to_local(state[name], name))
