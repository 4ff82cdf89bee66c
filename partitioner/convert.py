"""``python -m partitioner convert``: a Partita checkpoint to a HuggingFace directory, and back.

Both run in one process, offline, with every tensor whole in memory (for a job's own output
while it runs, ``save_pretrained`` gathers rank-parallel instead):

* **DCP -> HF** (:func:`dcp_to_hf`): the folder ``save_checkpoint`` (or ``save_sharded``)
  wrote is read whole with ``torch.distributed.checkpoint`` (``no_dist``), only the model's
  tensors (``model.<FQN>``; optimizer state is left). The model's HF configuration comes from
  the checkpoint (``save_checkpoint`` records it for a model built from an HF class) or from
  ``config=`` (an HF directory or a ``config.json``); the model is built from it on ``meta`` to
  learn its checkpoint layout (:func:`partitioner.pretrained.pretrained_layout`: which names,
  each tied weight once, no non-persistent buffers), and the tensors are written by the same
  writer as ``save_pretrained`` (:func:`runtime.pretrained_io.write_pretrained`).
* **HF -> DCP** (:func:`hf_to_dcp`): every tensor of the safetensors files, each tied weight
  under each of its names and the non-persistent buffers computed by the model's own
  initialisation (a Partita checkpoint holds what a parallel model's layout lists), saved as
  ``model.<FQN>`` with a ``rank0.pt`` holding the configuration, so ``load_checkpoint(path,
  model)`` (no optimizer: there is no optimizer state) loads it under any mesh, plan or pipeline.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from partitioner.pretrained import hf_config_dict, pretrained_layout
from partitioner.rebuild_buffers import rebuild_buffer
from partitioner.safetensors_source import SafetensorsCheckpoint
from partitioner.state_names import checkpoint_names, tied_names
from runtime.pretrained_io import write_pretrained

__all__ = ["dcp_to_hf", "hf_to_dcp", "MODEL_PREFIX"]

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model."
"""The prefix of the model's tensors in a checkpoint ``save_checkpoint`` wrote."""


def dcp_to_hf(source, target, *, config=None, max_shard_size="5GB") -> Path:
    """Write the model of the Partita checkpoint ``source`` as an HF directory ``target``."""
    src = Path(source)
    if not (src / ".metadata").is_file():
        raise FileNotFoundError(
            f"{src} is not a complete checkpoint (no .metadata): convert reads what save_checkpoint wrote"
        )
    model = _meta_model(_config(src, config))
    tensors = _read_model_tensors(src)
    layout = pretrained_layout(model)
    stray = sorted(set(tensors) - set(model.state_dict()) - layout.non_persistent - set(tied_names(model)))
    if stray:
        raise ValueError(
            f"{src} holds tensors {type(model).__name__} does not have, e.g. {stray[:5]}: not this model's checkpoint"
        )
    return write_pretrained(
        target, {fqn: (t, None) for fqn, t in tensors.items()}, layout, max_shard_size=max_shard_size
    )


def hf_to_dcp(source, target) -> Path:
    """Write the HF directory ``source`` as a Partita checkpoint ``target`` (model only)."""
    import torch.distributed.checkpoint as dcp

    src, dst = Path(source), Path(target)
    config = _config(src, None)
    model = _meta_model(config)
    checkpoint = SafetensorsCheckpoint(src)
    fqn_of = {saved: fqn for fqn, saved in checkpoint_names(model).items()}  # HF's renamed keys
    tensors = {fqn_of.get(name, name): checkpoint.read_whole(name) for name in checkpoint.weight_map}
    checkpoint.close()
    for fqn, others in tied_names(model).items():
        present = next((n for n in [fqn, *others] if n in tensors), None)
        if present is not None:
            tensors.setdefault(fqn, tensors[present])
    for fqn in pretrained_layout(model).non_persistent:
        tensors[fqn] = rebuild_buffer(model, fqn)
    dst.mkdir(parents=True, exist_ok=True)
    torch.save({"world_size": 1, "extra": {}, "hf_config": hf_config_dict(config)}, dst / "rank0.pt")
    dcp.save({MODEL_PREFIX + k: v.contiguous() for k, v in tensors.items()}, checkpoint_id=str(dst), no_dist=True)
    logger.info("convert: %d tensors of %s into %s", len(tensors), src, dst)
    return dst


def _config(src: Path, given):
    """The HF configuration: ``given`` (a directory or a config.json), else the one ``src`` holds."""
    from transformers import AutoConfig

    if given is not None:
        path = Path(given)
        return AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
    if (src / "config.json").is_file():
        return AutoConfig.from_pretrained(str(src))
    rank_file = src / "rank0.pt"
    recorded = torch.load(rank_file, weights_only=False).get("hf_config") if rank_file.is_file() else None
    if recorded is None:
        raise ValueError(
            f"{src} records no HuggingFace configuration (the model was not an HF model, or the checkpoint "
            "predates it): pass config= (--config) naming an HF directory or its config.json"
        )
    recorded = dict(recorded)
    return AutoConfig.for_model(recorded.pop("model_type"), **recorded)


def _meta_model(config) -> torch.nn.Module:
    """The model class the configuration names (its first ``architectures`` entry), on ``meta``."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    with torch.device("meta"):
        if arch is not None and hasattr(transformers, arch):
            return getattr(transformers, arch)(copy.deepcopy(config))
        return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))


def _read_model_tensors(src: Path) -> dict:
    """FQN -> whole tensor of the model's entries of a DCP checkpoint (``model.<FQN>``, or every
    tensor of a ``save_sharded`` folder)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
    prefixed = (src / "rank0.pt").is_file()  # save_checkpoint's folder (save_sharded's holds bare FQNs)
    chosen = {
        k: m
        for k, m in saved.items()
        if isinstance(m, TensorStorageMetadata) and (k.startswith(MODEL_PREFIX) or not prefixed)
    }
    targets = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in chosen.items()}
    dcp.load(targets, checkpoint_id=str(src), no_dist=True)
    cut = len(MODEL_PREFIX) if prefixed else 0
    return {k[cut:]: v for k, v in targets.items()}
