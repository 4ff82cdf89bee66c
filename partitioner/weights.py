"""Full weights in, this rank's pieces out: the state loading both build paths share.

``auto_parallelize`` (one program per rank) and the pipeline (one program per stage) load
weights the same way, in three steps:

1. :class:`WeightSource` gives each parameter's or buffer's piece for this rank by FQN, looked
   up in this order: a given state dict, or ``checkpoint=`` (a ``torch.save`` file opened with
   ``mmap``, or a HuggingFace safetensors directory read slice by slice,
   :mod:`partitioner.safetensors_source`: only the blocks this rank keeps are ever read); the
   model's own tensors (unless the model lives on ``meta``); the constants ``torch.export``
   lifted out of the model. A name the checkpoint lacks is read under another name of the same
   tied tensor (HF checkpoints hold ``lm_head.weight`` tied to the embedding only once). A
   non-persistent buffer of a model on ``meta`` (in no checkpoint: rotary ``inv_freq``) is
   computed again by the model's own initialisation (:mod:`partitioner.rebuild_buffers`);
   anything else missing is an error naming the tensor (and the file it was looked for in).
   Pieces take the dtype the captured graph has for them (a bf16 checkpoint into fp32 master
   weights is cast, as ``from_pretrained`` does).
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

from partitioner.rebuild_buffers import non_persistent_buffers, rebuild_buffer
from partitioner.safetensors_source import SafetensorsCheckpoint, is_safetensors_checkpoint
from partitioner.state_names import checkpoint_names, tied_names
from passes.core.placements import format_spec, parse_spec
from passes.core.plan_records import typed_by_name
from passes.lower.strided_layout import strided_parameters
from runtime.tensor_shards import shard_tensor

__all__ = ["WeightSource", "LocalWeights", "load_local_weights", "shard_weights", "tie_weights"]


def on_meta(model: torch.nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the ``meta`` device."""
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


class WeightSource:
    """Where this rank's pieces come from (see the module docstring for the lookup order)."""

    def __init__(self, model: torch.nn.Module, state_dict=None, checkpoint=None):
        self.model = model
        self.model_state = (
            None
            if on_meta(model)
            else {
                **dict(model.named_parameters(remove_duplicate=False)),
                **dict(model.named_buffers(remove_duplicate=False)),
            }
        )
        self.given = state_dict
        self.pretrained: SafetensorsCheckpoint | None = None
        if checkpoint is not None and is_safetensors_checkpoint(checkpoint):
            self.pretrained = SafetensorsCheckpoint(checkpoint)
        elif checkpoint is not None:
            self.given = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
        self.aliases = tied_names(model)
        # the keys HF renames in its files (GPT-NeoX's embed_out)
        self.renamed = checkpoint_names(model) if self.pretrained is not None else {}
        self._non_persistent = non_persistent_buffers(model)
        self._tied_pieces: dict = {}  # a tied weight is read once per placement

    @property
    def bytes_read(self) -> int | None:
        """Bytes read from a safetensors checkpoint so far (None for other sources)."""
        return self.pretrained.bytes_read if self.pretrained is not None else None

    def piece(self, fqn: str, spec, comm, strided, exported) -> tuple:
        """(this rank's piece of ``fqn``, the whole tensor's shape); ``exported``: the
        ExportedProgram, for lifted constants."""
        names = [fqn, *self.aliases.get(fqn, [])]
        key = (names[0] if len(names) == 1 else min(names), tuple(spec), tuple(sorted((strided or {}).items())))
        if key in self._tied_pieces:
            return self._tied_pieces[key]
        found = self._piece(names, spec, comm, strided, exported)
        if len(names) > 1:
            self._tied_pieces[key] = found
        return found

    def _piece(self, names: list, spec, comm, strided, exported) -> tuple:
        given, pretrained = self.given, self.pretrained
        name = next((n for n in names if given is not None and n in given), None)
        if given is not None and name is not None:
            full = given[name]
        elif pretrained is not None and any(n in pretrained for n in self._saved_names(names)):
            name = next(n for n in self._saved_names(names) if n in pretrained)
            return pretrained.read_piece(name, spec, comm, strided), pretrained.shape(name)
        else:
            full = self._whole(names[0], exported)
        return shard_tensor(full.detach(), spec, comm, strided), tuple(full.shape)

    def _saved_names(self, names: list) -> list:
        """The names a checkpoint may hold ``names`` under: as they are, then as HF renames them."""
        return [*names, *(self.renamed[n] for n in names if n in self.renamed)]

    def _whole(self, fqn: str, exported) -> torch.Tensor:
        if self.model_state is not None and fqn in self.model_state:
            return self.model_state[fqn]
        if exported is not None and fqn in exported.constants and not exported.constants[fqn].is_meta:
            return exported.constants[fqn]
        if fqn in self._non_persistent:
            return rebuild_buffer(self.model, fqn)
        if self.pretrained is not None:
            raise KeyError(self.pretrained.missing(fqn))
        where = "the model is on meta and the state dict lacks it" if self.given is not None else "the model is on meta"
        raise KeyError(f"no value for {fqn}: {where}; pass state_dict= or checkpoint= holding it")

    def close(self) -> None:
        """Release the checkpoint's open files."""
        if self.pretrained is not None:
            self.pretrained.close()


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
    (:func:`passes.lower.strided_layout.strided_parameters`); ``exported``: where lifted constants live.
    """
    out = LocalWeights()
    dtypes = {n.name: n.meta["val"].dtype for n in cap.graph.nodes if n.op == "placeholder" and "val" in n.meta}
    with torch.no_grad():
        for table, target in ((cap.params, out.params), (cap.buffers, out.buffers)):
            for placeholder, fqn in table.items():
                piece, shape = source.piece(fqn, specs[placeholder], comm, strided.get(fqn), exported)
                local = piece.to(device=device, dtype=dtypes.get(placeholder, piece.dtype), copy=True)
                target[placeholder] = (fqn, local)
                out.global_shapes[fqn] = shape
    return out


def tie_weights(weights: LocalWeights, groups, specs: dict, strided: dict) -> None:
    """Make each group of tied placeholders share the first one's local tensor (in place).

    ``groups``: lists of placeholder names that are one tensor (:func:`passes.capture.capture.tied_placeholders`);
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


def load_local_weights(cap, records, comm, source: WeightSource, device, *, exported, tied=()) -> tuple:
    """Steps 2 and 3 for one planned graph: ``records`` (node name -> plan record, typed or as the
    JSON holds it) place its placeholders; ``tied``: groups of tied placeholder names. Returns
    (LocalWeights, placeholder name -> spec for every placeholder, FQN -> strided layout)."""
    records = typed_by_name(records)
    specs = {  # a ZeRO-1 parameter is stored as its optimizer's shard
        node.name: parse_spec(records[node.name].stored or records[node.name].out[0], comm.ndim)
        for node in cap.graph.nodes
        if node.op == "placeholder"
    }
    strided = strided_parameters(cap.graph, records, comm)
    weights = shard_weights(cap, specs, comm, strided, source, device, exported)
    tie_weights(weights, tied, specs, strided)
    return weights, specs, strided
