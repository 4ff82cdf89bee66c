"""A HuggingFace checkpoint directory as a source of this rank's slices, read lazily.

``auto_parallelize(model, ..., checkpoint="path/to/hf_dir")`` with the model on ``meta``: each
rank reads, for each parameter, only the block its plan keeps, straight from the files.

Layouts read (what ``PreTrainedModel.save_pretrained`` writes):

* ``model.safetensors``: one file holding every tensor;
* ``model-0000k-of-0000N.safetensors`` with ``model.safetensors.index.json``, whose
  ``weight_map`` names the file of each tensor;
* a single ``.safetensors`` file given by path.

Each file is opened once with ``safetensors.safe_open`` (a memory map); a tensor is read through
``get_slice``: for a rank's piece (:func:`runtime.tensor_shards.shard_runs`: per dim the runs of
positions it keeps) one block per run is copied out of the mapping and the blocks are joined.
``bytes_read`` counts the bytes copied out; a rank's count is its shard's bytes in the
checkpoint's dtype (a replicated weight counts whole), never the whole checkpoint. The operating
system reads the mapped file in pages, so a column block of a row-major tensor brings in the
pages its rows lie on.

A name the checkpoint lacks is an error naming it and the file it was looked for in (the index
file when the index maps no file to it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from runtime.tensor_shards import read_runs, shard_runs

__all__ = ["SafetensorsCheckpoint", "is_safetensors_checkpoint", "SINGLE_FILE", "INDEX_FILE"]

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_safetensors_checkpoint(path) -> bool:
    """Whether ``path`` is a ``.safetensors`` file or a directory holding one of the layouts above."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".safetensors"
    return (p / INDEX_FILE).is_file() or (p / SINGLE_FILE).is_file()


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint, by name, read slice by slice (see the module docstring)."""

    def __init__(self, path):
        p = Path(path)
        if p.is_file():
            self.directory, self.where = p.parent, p.name
            self.weight_map = {name: p.name for name in self._handle(p.name).keys()}
        elif (p / INDEX_FILE).is_file():
            self.directory, self.where = p, INDEX_FILE
            self.weight_map = dict(json.loads((p / INDEX_FILE).read_text())["weight_map"])
        elif (p / SINGLE_FILE).is_file():
            self.directory, self.where = p, SINGLE_FILE
            self.weight_map = {name: SINGLE_FILE for name in self._handle(SINGLE_FILE).keys()}
        else:
            raise FileNotFoundError(
                f"checkpoint={str(path)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}: pass a directory "
                "save_pretrained wrote, a .safetensors file, or a torch.save file"
            )
        self.bytes_read = 0
        """Bytes copied out of the files so far (the pieces read, in the checkpoint's dtype)."""

    def _handle(self, file: str):
        handles = self.__dict__.setdefault("_handles", {})
        if file not in handles:
            from safetensors import safe_open

            path = self.directory / file
            if not path.is_file():
                raise FileNotFoundError(f"{self.where} in {self.directory} names {file}, which does not exist")
            handles[file] = safe_open(str(path), framework="pt", device="cpu").__enter__()
        return handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def missing(self, name: str) -> str:
        """The error for a tensor the checkpoint lacks, naming where it was looked for."""
        file = self.weight_map.get(name)
        if file is None:
            return f"{name} is not in the checkpoint: {self.where} in {self.directory} maps no file to it"
        return f"{name} is not in the checkpoint: {self.where} names {self.directory / file}, which lacks it"

    def _slice(self, name: str):
        file = self.weight_map.get(name)
        if file is None or name not in self._handle(file).keys():
            raise KeyError(self.missing(name))
        return self._handle(file).get_slice(name)

    def shape(self, name: str) -> tuple:
        return tuple(self._slice(name).get_shape())

    def read_piece(self, name: str, spec, comm, strided=None) -> torch.Tensor:
        """This rank's piece of ``name`` under ``spec`` (as :func:`runtime.tensor_shards.shard_tensor`
        cuts it), reading only its blocks."""
        sliced = self._slice(name)
        shape = tuple(sliced.get_shape())
        runs = shard_runs(shape, spec, comm, strided)
        if not shape:  # a scalar: get_slice takes no index
            piece = self._handle(self.weight_map[name]).get_tensor(name)
        else:
            piece = read_runs(lambda index: sliced[index], runs)
        self.bytes_read += piece.numel() * piece.element_size()  # safetensors returns the stored dtype
        return piece

    def read_whole(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (for offline conversion; counted in ``bytes_read``)."""
        self._slice(name)  # the error naming the file, for a name the checkpoint lacks
        tensor = self._handle(self.weight_map[name]).get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        for handle in self.__dict__.pop("_handles", {}).values():
            handle.__exit__(None, None, None)
