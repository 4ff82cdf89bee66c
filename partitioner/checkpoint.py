"""Checkpoint and resume: a training job's whole state, saved by every rank, reloadable under
another mesh, plan or pipeline.

``save_checkpoint(path, model, optimizer, **extra)`` writes a folder:

* the model's parameters and buffers and the optimizer's state tensors, through
  ``torch.distributed.checkpoint`` (DCP): every rank writes only its own pieces, as DTensors over
  the job's mesh (the global view of :mod:`runtime.sharded_state`), under the keys
  ``model.<FQN>`` and ``optim.state.<FQN>.<name>`` (DCP's own naming of nested state dicts).
  A tied weight is saved under each of its names, so a layout that holds it under only one
  (a pipeline stage) finds it;
* one small file per rank, ``rank<r>.pt``: the optimizer's parameter groups (learning rates as
  a scheduler left them), its non-tensor state, this rank's random number generators (torch
  CPU and CUDA, Python ``random``, numpy), the dropout step counters of the lowered programs,
  and ``extra``: objects with ``state_dict()`` (an LR scheduler, a stateful sampler) are saved
  through it, anything else (``step=``, ``epoch=``, a data position) as it is (picklable).

A rank writes its file before it enters DCP's save, and DCP writes ``.metadata`` last, once
every rank's data is written: a folder with ``.metadata`` is complete
(:func:`latest_checkpoint` finds the newest one).

``load_checkpoint(path, model, optimizer, **stateful)`` reads DCP's metadata, asks for the
keys this model's layout needs (DCP reads, for each local piece, the saved pieces that overlap
it: that is the resharding), copies them into the local tensors, restores the optimizer, the
stateful objects passed by name (``scheduler=...``), the RNG states and dropout counters, and
returns the extra values. Rank ``r`` reads ``rank<r>.pt`` (rank 0's when the saving job had
fewer ranks).
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import torch
import torch.distributed as dist

from partitioner.pretrained import hf_config_dict
from runtime.sharded_state import ordered_params, parameter_fqns, state_entry_to_global, state_entry_to_local

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint"]

logger = logging.getLogger(__name__)

_MODEL = "model."
_OPTIM = "optim.state."


def save_checkpoint(path, model, optimizer=None, **extra) -> None:
    """Save ``model`` (what ``auto_parallelize`` returned: a parallel module or a pipeline
    runner), ``optimizer`` (over its parameters) and ``extra`` to the folder ``path``. A
    collective: every rank calls it with the same arguments."""
    import torch.distributed.checkpoint as dcp

    layouts = _layouts(model, "save_checkpoint")
    tensors = {_MODEL + fqn: layout.to_global(t.detach()) for fqn, (t, layout) in layouts.items()}
    rank_state: dict = {"world_size": _world()[1], "rng": _rng_state(), "dropout": _dropout_counters(model)}
    layout = getattr(model, "_pretrained", None)  # the HF configuration, for `partitioner convert`
    rank_state["hf_config"] = hf_config_dict(layout.config) if layout is not None else None
    if optimizer is not None:
        optim_tensors, rank_state["optimizer"] = _optimizer_state(optimizer)
        tensors.update(optim_tensors)
    rank_state["extra"] = {name: _save_extra(value) for name, value in extra.items()}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(rank_state, folder / f"rank{_world()[0]}.pt")
    dcp.save(tensors, checkpoint_id=str(folder))


def load_checkpoint(path, model, optimizer=None, **stateful) -> dict:
    """Restore ``model``, ``optimizer``, the objects passed as ``stateful`` (by the names they were
    saved under: ``scheduler=my_scheduler``) and the RNG states from ``path``; returns every extra
    value saved (a stateful object's entry: its state dict). A collective."""
    import torch.distributed.checkpoint as dcp

    layouts = _layouts(model, "load_checkpoint")
    folder = Path(path)
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(
            f"{folder} is not a complete checkpoint (no .metadata): pick one latest_checkpoint finds"
        )
    rank_state = _read_rank_state(folder)
    extras = rank_state.get("extra", {})
    for name in stateful:  # checked before anything is loaded
        if name not in extras or extras[name][0] != "state_dict":
            kinds = sorted(n for n, (kind, _) in extras.items() if kind == "state_dict")
            raise KeyError(f"checkpoint {folder} saved no state dict named {name!r}; it has {kinds}")
    if optimizer is not None and "optimizer" not in rank_state:
        raise KeyError(f"checkpoint {folder} holds no optimizer state (it was saved without an optimizer)")
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata

    targets, model_keys = _model_targets(layouts, saved, folder)  # DCP key -> tensor to load into
    optim_targets: dict = {}
    if optimizer is not None:
        optim_targets = _optimizer_targets(optimizer, saved)
        for entry in optim_targets.values():
            targets.update(entry.values())
    dcp.load(targets, checkpoint_id=str(folder))

    model.load_sharded_state_dict({fqn: targets[key] for fqn, key in model_keys.items()})
    if optimizer is not None:
        _load_optimizer(optimizer, optim_targets, rank_state["optimizer"], folder)
    for name, obj in stateful.items():
        obj.load_state_dict(extras[name][1])
    _set_dropout_counters(model, rank_state.get("dropout", {}))
    if "rng" in rank_state:  # a converted checkpoint (partitioner convert) has no generators
        _set_rng_state(rank_state["rng"])
    return {name: value for name, (_, value) in extras.items()}


def latest_checkpoint(folder) -> Path | None:
    """The complete checkpoint (a sub-folder with DCP's ``.metadata``) under ``folder`` whose name
    ends in the largest number (``step_000120``), or None."""
    root = Path(folder)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if (p / ".metadata").is_file()]

    def number(p: Path) -> tuple:
        digits = re.search(r"(\d+)$", p.name)
        return (int(digits.group(1)) if digits else -1, p.name)

    return max(done, key=number, default=None)


# -- the model ---------------------------------------------------------------------------------


def _layouts(model, caller: str) -> dict:
    if not hasattr(model, "state_layouts") or not hasattr(model, "load_sharded_state_dict"):
        raise TypeError(
            f"{caller}: model must be what partitioner.auto_parallelize returned (a parallel module or "
            f"a pipeline runner), got {type(model).__name__}; for another module use torch.distributed.checkpoint"
        )
    return model.state_layouts()


def _model_targets(layouts: dict, saved, folder) -> tuple:
    """(DCP key -> empty global view to load into, FQN -> the key its value comes from). A name
    the checkpoint lacks is read under another name of the same tied tensor."""
    aliases: dict = {}
    for fqn, (tensor, _) in layouts.items():
        aliases.setdefault(id(tensor), []).append(fqn)
    targets, keys = {}, {}
    for fqn, (tensor, layout) in layouts.items():
        found = next((_MODEL + a for a in [fqn, *aliases[id(tensor)]] if _MODEL + a in saved), None)
        if found is None:
            near = sorted(k[len(_MODEL) :] for k in saved if k.startswith(_MODEL))[:5]
            raise KeyError(f"checkpoint {folder} has no value for {fqn} (it holds e.g. {near}): not this model's")
        if found not in targets:
            targets[found] = layout.empty_global(saved[found].properties.dtype, tensor.device)
        keys[fqn] = found
    return targets, keys


# -- the optimizer -------------------------------------------------------------------------------


def _fqns(param, optimizer) -> list:
    fqns = parameter_fqns(param)
    if not fqns:
        raise ValueError(
            f"the {type(optimizer).__name__} holds a parameter (shape {tuple(param.shape)}) of no parallel "
            "model: save_checkpoint / load_checkpoint take an optimizer over the parallel model's parameters"
        )
    return fqns


def _optimizer_state(optimizer) -> tuple:
    """(DCP key -> global view of each state tensor, this rank's record: groups and the rest)."""
    tensors, other, groups = {}, {}, []
    for param in ordered_params(optimizer):
        fqns = _fqns(param, optimizer)
        entry = state_entry_to_global(optimizer, param, optimizer.state.get(param, {}))
        for fqn in fqns:  # every name of a tied weight: a layout holding only one finds it
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{_OPTIM}{fqn}.{name}"] = value
                else:
                    other.setdefault(fqn, {})[name] = value
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({**hyper, "params": [_fqns(p, optimizer)[0] for p in group["params"]]})
    return tensors, {"param_groups": groups, "other": other}


def _optimizer_targets(optimizer, saved) -> dict:
    """Parameter -> {state name: (DCP key, empty tensor to load into)} for the state the checkpoint
    holds for it (under any of its names), each of the saved kind: the parameter's global view or
    a scalar."""
    from runtime.sharded_state import layout_of

    by_fqn: dict = {}  # FQN -> {state name: DCP key} (state names hold no dot)
    for key, meta in saved.items():
        if key.startswith(_OPTIM) and hasattr(meta, "size"):
            fqn, _, name = key[len(_OPTIM) :].rpartition(".")
            by_fqn.setdefault(fqn, {})[name] = key
    out = {}
    for param in ordered_params(optimizer):
        layout = layout_of(param)
        keys = next((by_fqn[fqn] for fqn in _fqns(param, optimizer) if fqn in by_fqn), {})
        entry = {}
        for name, key in keys.items():
            size, dtype = tuple(saved[key].size), saved[key].properties.dtype
            if layout is not None and size == tuple(layout.global_shape) and size:
                entry[name] = (key, layout.empty_global(dtype, param.device))
            else:
                entry[name] = (key, torch.empty(size, dtype=dtype, device=param.device))
        if entry:
            out[param] = entry
    return out


def _load_optimizer(optimizer, targets: dict, record: dict, folder) -> None:
    groups = record["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint {folder} has {len(groups)} optimizer parameter groups, this {type(optimizer).__name__} "
            f"has {len(optimizer.param_groups)}: build the optimizer with the groups it was saved with"
        )
    ids = {id(p): i for i, p in enumerate(ordered_params(optimizer))}
    state = {}
    for param, entry in targets.items():
        values = {name: loaded for name, (_, loaded) in entry.items()}
        other = next((record["other"][a] for a in _fqns(param, optimizer) if a in record["other"]), {})
        state[ids[id(param)]] = {**state_entry_to_local(param, values), **other}
    param_groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": [ids[id(p)] for p in current["params"]]}
        for saved, current in zip(groups, optimizer.param_groups)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# -- random number generators, dropout counters, extras -----------------------------------------


def _world() -> tuple:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:
        pass
    else:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _programs(model) -> dict:
    """Name -> lowered program: a parallel module's variants, a runner's stages."""
    if hasattr(model, "stages"):
        return {f"stage {k}": stage.program for k, stage in model.stages.items()}
    return {repr(key): program for key, program in model.variants.items()}


def _dropout_counters(model) -> dict:
    """Program -> {module: calls} of the per-rank dropout modules (their masks depend on it)."""
    from runtime.local_ops import RankDropout

    return {
        name: {m: module.calls for m, module in program.named_modules() if isinstance(module, RankDropout)}
        for name, program in _programs(model).items()
    }


def _set_dropout_counters(model, counters: dict) -> None:
    from runtime.local_ops import RankDropout

    for name, program in _programs(model).items():
        saved = counters.get(name, {})
        for m, module in program.named_modules():
            if isinstance(module, RankDropout) and m in saved:
                module.calls = saved[m]


def _save_extra(value) -> tuple:
    """('state_dict', its state dict) for an object that has one, else ('value', the value)."""
    if callable(getattr(value, "state_dict", None)):
        return ("state_dict", value.state_dict())
    return ("value", value)


def _read_rank_state(folder: Path) -> dict:
    rank, world = _world()
    path = folder / f"rank{rank}.pt"
    if not path.is_file():
        path = folder / "rank0.pt"
        logger.info("checkpoint %s has no file for rank %d (saved by fewer ranks): reading rank 0's", folder, rank)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} lacks {path.name}: it was not written by save_checkpoint")
    state = torch.load(path, weights_only=False)
    if state.get("world_size") != world:
        logger.info("checkpoint %s was saved by %s ranks, this job has %d", folder, state.get("world_size"), world)
    return state
