"""What a HuggingFace checkpoint of a model holds, read off the model (on ``meta`` too).

:func:`pretrained_layout` records, when the model is parallelized, the names
``save_pretrained`` writes (:class:`runtime.pretrained_io.PretrainedLayout`), the way
``PreTrainedModel.save_pretrained`` chooses them:

* the keys of ``model.state_dict()`` (parameters and persistent buffers; non-persistent buffers
  such as rotary ``inv_freq`` are left out, as the model leaves them out);
* each tied weight once: HF's ``all_tied_weights_keys`` (tied name -> the name it is tied to)
  drops the tied names (``lm_head.weight``, kept as ``model.embed_tokens.weight``); for a model
  without that map, every name of one Parameter after the first in ``state_dict`` order;
* less the names matching the model's ``_keys_to_ignore_on_save`` patterns;
* each written under the key HF writes it under: transformers renames some weights on the way
  to and from a checkpoint (GPT-NeoX's ``lm_head.weight`` is ``embed_out.weight`` in its files;
  :func:`partitioner.state_names.checkpoint_names`).

The model's ``config`` and ``generation_config`` come along when they can write themselves
(``save_pretrained``).
"""

from __future__ import annotations

import copy
import re

import torch

from partitioner.rebuild_buffers import non_persistent_buffers
from partitioner.state_names import checkpoint_names, tied_names
from runtime.pretrained_io import PretrainedLayout

__all__ = ["pretrained_layout", "hf_config_dict"]


def pretrained_layout(model: torch.nn.Module) -> PretrainedLayout:
    """The checkpoint layout of ``model`` (see the module docstring)."""
    keys = list(model.state_dict(keep_vars=True))
    aliases = tied_names(model)
    hf_tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(hf_tied, dict) and hf_tied:
        dropped = set(hf_tied)
    else:
        dropped, seen = set(), set()
        for name in keys:
            if name in seen:
                dropped.add(name)
            seen.update(aliases.get(name, []))
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_save", None) or [])]
    names = tuple(n for n in keys if n not in dropped and not any(p.search(n) for p in ignored))
    return PretrainedLayout(
        names=names,
        saved_as={n: k for n, k in checkpoint_names(model).items() if n in names},
        aliases={n: aliases[n] for n in names if n in aliases},
        non_persistent=frozenset(non_persistent_buffers(model)),
        config=_config_of(model),
        generation_config=_savable(getattr(model, "generation_config", None)),
    )


def _config_of(model: torch.nn.Module):
    """A copy of the model's HF configuration naming the model's class in ``architectures`` (as
    ``PreTrainedModel.save_pretrained`` writes it), or None."""
    config = _savable(getattr(model, "config", None))
    if config is None:
        return None
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    return config


def _savable(config):
    return config if callable(getattr(config, "save_pretrained", None)) else None


def hf_config_dict(config) -> dict | None:
    """What ``save_checkpoint`` records of a model's HF configuration (None for another model)."""
    return config.to_dict() if callable(getattr(config, "to_dict", None)) else None
