"""``save_pretrained``: a parallel model's shards written as a HuggingFace checkpoint directory.

What ``PreTrainedModel.save_pretrained`` writes, and ``from_pretrained`` reads strictly:
safetensors files (``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` and
``model.safetensors.index.json`` mapping each tensor to its file, once the tensors pass
``max_shard_size``), the model's ``config.json`` (and ``generation_config.json``), under the
model's own names, without the non-persistent buffers (rotary ``inv_freq``) and with each tied
weight once, under the name HF keeps (``model.embed_tokens.weight``, not ``lm_head.weight``).
Which names those are is :class:`PretrainedLayout`, recorded from the model when it was
parallelized (``partitioner.pretrained.pretrained_layout``).

The gather is rank-parallel:

1. Every rank lists the names it holds (under the saved name or a tied alias) with their whole
   shapes and dtypes; pipeline ranks exchange those lists along the pipeline axis, and each
   name is written by the first stage that holds it.
2. Every rank cuts the same file list from them: per stage, the names in the model's order,
   a new file whenever the next tensor would pass ``max_shard_size`` (a tensor larger than it
   gets a file of its own). Files are numbered across stages; a stage's files are handed to its
   ranks in turn (file ``i`` of a stage to the rank at stage-mesh index ``i mod size``).
3. For each file of its stage, in order, the stage's ranks gather each tensor whole (a
   collective over the stage mesh: no other rank takes part), and only the file's writer keeps
   it; the writer writes the file once its tensors are in. So each rank holds at most one
   file's tensors, and the files are written by as many ranks as there are files.
4. Rank 0 writes the index and the configuration; a barrier, and the directory is complete.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["PretrainedLayout", "PretrainedIO", "write_pretrained", "parse_size"]

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class PretrainedLayout:
    """What a checkpoint of the model holds, recorded from the model before it was parallelized."""

    names: tuple
    """The tensor names saved, in the model's ``state_dict()`` order: persistent parameters and
    buffers, each tied weight once."""
    aliases: dict = field(default_factory=dict)
    """Saved name -> the other FQNs of the same tensor (a pipeline stage may hold it under one)."""
    saved_as: dict = field(default_factory=dict)
    """Saved name -> the key the files hold it under, where the two differ (HF's renamings)."""
    non_persistent: frozenset = frozenset()
    """Buffers the model's ``state_dict()`` leaves out (computed by the model, in no checkpoint)."""
    config: object = None
    """The model's configuration (``save_pretrained(directory)`` writes ``config.json``), or None."""
    generation_config: object = None
    """The model's generation configuration (written as ``generation_config.json``), or None."""


def parse_size(value) -> int:
    """Bytes from an int or a string like ``"5GB"``, ``"200MiB"``, ``"50KB"`` (HF's notation)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, scale in units.items():
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    if text.isdigit():
        return int(text)
    raise ValueError(f"max_shard_size={value!r}: expected bytes or a size like '5GB', '200MiB'")


class PretrainedIO:
    """``save_pretrained`` for a module with ``state_layouts()`` (FQN -> (local tensor,
    ``TensorLayout``)) and ``_pipeline_position()`` ((group, coordinate, size) of the pipeline
    axis; a module without one is its only stage)."""

    def attach_pretrained(self, layout: PretrainedLayout | None) -> None:
        """Record what ``save_pretrained`` writes (``auto_parallelize`` does, from the model)."""
        object.__setattr__(self, "_pretrained", layout)

    def save_pretrained(self, directory, *, max_shard_size="5GB") -> Path:
        """Write this model as a HuggingFace checkpoint directory (see the module docstring); a
        collective: every rank calls it. Returns the directory."""
        layout = getattr(self, "_pretrained", None)
        if layout is None:
            raise ValueError(
                "save_pretrained needs the layout of the model this was parallelized from; build it with "
                "partitioner.auto_parallelize (or attach_pretrained(partitioner.pretrained.pretrained_layout(model)))"
            )
        held = self.state_layouts()  # type: ignore[attr-defined]
        return write_pretrained(
            directory,
            held,
            layout,
            max_shard_size=max_shard_size,
            pipeline=self._pipeline_position(),  # type: ignore[attr-defined]
            stage_index=_stage_mesh_index(held),
        )


def _stage_mesh_index(layouts: dict) -> tuple:
    """(this rank's index on its stage mesh, the stage mesh's size), from any held tensor's layout."""
    for _, layout in layouts.values():
        comm = layout.comm
        index = 0
        for coord, n in zip(comm.coords, comm.shape):
            index = index * n + coord
        return index, math.prod(comm.shape)
    return 0, 1


def write_pretrained(
    directory, held: dict, layout: PretrainedLayout, *, max_shard_size="5GB", pipeline=(None, 0, 1), stage_index=(0, 1)
) -> Path:
    """Write ``held`` (FQN -> (this rank's tensor, its ``TensorLayout``, or None for a whole
    tensor)) as a HuggingFace directory. ``pipeline``: (process group, coordinate,
    size) of the pipeline axis; ``stage_index``: (this rank's index, size) on its stage mesh.
    Without a process group (one process, whole tensors), the same steps run alone."""
    folder = Path(directory)
    limit = parse_size(max_shard_size)
    mine = {}  # saved name -> the FQN this rank holds it under
    for name in layout.names:
        fqn = next((n for n in [name, *layout.aliases.get(name, [])] if n in held), None)
        if fqn is not None:
            mine[name] = fqn
    owners = _owners({name: _shape_and_dtype(*held[fqn]) for name, fqn in mine.items()}, pipeline)
    absent = [n for n in layout.names if n not in owners]
    if absent:
        raise ValueError(
            f"save_pretrained: no rank holds {absent[:5]} ({len(absent)} in all): the captured model does not "
            "use them, so they were never loaded; a checkpoint without them would not load strictly"
        )
    files = _cut_files(layout.names, owners, limit)
    folder.mkdir(parents=True, exist_ok=True)
    for number, (stage, names) in enumerate(files):
        if stage != pipeline[1]:
            continue
        writer = sum(1 for s, _ in files[:number] if s == stage) % stage_index[1]
        tensors = {}
        for name in names:
            tensor, tensor_layout = held[mine[name]]
            whole = tensor.detach() if tensor_layout is None else tensor_layout.whole(tensor.detach())  # a collective
            if writer == stage_index[0]:
                tensors[layout.saved_as.get(name, name)] = whole.detach().to("cpu").contiguous()
        if writer == stage_index[0]:
            from safetensors.torch import save_file

            save_file(tensors, str(folder / _file_name(number, len(files))), metadata={"format": "pt"})
    if _rank() == 0:
        _write_index_and_config(folder, files, owners, layout)
    _barrier()
    logger.info("save_pretrained: %d tensors in %d files under %s", len(layout.names), len(files), folder)
    return folder


def _shape_and_dtype(tensor: torch.Tensor, tensor_layout) -> tuple:
    """(whole shape, dtype name) of a held tensor."""
    shape = tuple(tensor.shape) if tensor_layout is None else tuple(tensor_layout.global_shape)
    return shape, str(tensor.dtype)


def _owners(entries: dict, pipeline) -> dict:
    """Saved name -> (first pipeline coordinate holding it, shape, dtype), agreed along the pipeline axis."""
    group, coord, size = pipeline
    parts: list = [entries]
    if size > 1:
        parts = [None] * size
        dist.all_gather_object(parts, (coord, entries), group=group)
        parts = [p[1] for p in sorted(parts, key=lambda p: p[0])]
    owners: dict = {}
    for stage, part in enumerate(parts):
        for name, (shape, dtype) in part.items():
            owners.setdefault(name, (stage, shape, dtype))
    return owners


def _nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * getattr(torch, dtype.removeprefix("torch.")).itemsize


def _cut_files(names, owners: dict, limit: int) -> list:
    """[(stage, [names])] in write order (see the module docstring, step 2)."""
    files: list = []
    for stage in sorted({owners[n][0] for n in names}):
        current, size = [], 0
        for name in (n for n in names if owners[n][0] == stage):
            nbytes = _nbytes(owners[name][1], owners[name][2])
            if current and size + nbytes > limit:
                files.append((stage, current))
                current, size = [], 0
            current.append(name)
            size += nbytes
        if current:
            files.append((stage, current))
    return files


def _file_name(number: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{number + 1:05d}-of-{count:05d}.safetensors"


def _write_index_and_config(folder: Path, files: list, owners: dict, layout: PretrainedLayout) -> None:
    if len(files) > 1:
        weight_map = {name: _file_name(i, len(files)) for i, (_, names) in enumerate(files) for name in names}
        total = sum(_nbytes(owners[n][1], owners[n][2]) for n in weight_map)
        params = sum(_nbytes(owners[n][1], "torch.uint8") for n in weight_map)  # element counts
        weight_map = {layout.saved_as.get(n, n): file for n, file in weight_map.items()}
        index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for config in (layout.config, layout.generation_config):
        if config is not None:
            config.save_pretrained(str(folder))  # type: ignore[attr-defined]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
