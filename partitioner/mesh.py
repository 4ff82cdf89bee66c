"""The logical device mesh a plan is made for: a shape and one name per axis.

``axis`` always means a mesh axis and ``dim`` a tensor dimension. Ranks are laid out
row-major, as ``torch.distributed.device_mesh.init_device_mesh`` does, so the last axis is
the one whose ranks sit closest together (inside a node).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["MeshSpec"]


@dataclass(frozen=True)
class MeshSpec:
    shape: tuple
    """Devices along each axis, e.g. ``(8, 8)``."""
    axis_names: tuple
    """One name per axis; defaults to ``a0, a1, ...``."""

    def __post_init__(self):
        if not self.shape or any((not isinstance(n, int)) or n < 1 for n in self.shape):
            raise ValueError(f"mesh shape {self.shape!r} must be a non-empty tuple of positive ints")
        if len(self.axis_names) != len(self.shape):
            raise ValueError(f"mesh {self.shape} has {len(self.shape)} axes but axis names {self.axis_names}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names must be distinct, got {self.axis_names}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def build(cls, mesh, axis_names=None) -> MeshSpec:
        """From ``(2, 4)``, ``"2x4"``, ``8``, a MeshSpec or a DeviceMesh."""
        if isinstance(mesh, MeshSpec):
            return mesh if axis_names is None else cls(mesh.shape, tuple(axis_names))
        if hasattr(mesh, "mesh") and hasattr(mesh, "mesh_dim_names"):  # a DeviceMesh
            names = axis_names or mesh.mesh_dim_names
            shape = tuple(int(n) for n in mesh.mesh.shape)
            return cls(shape, tuple(names) if names else tuple(f"a{i}" for i in range(len(shape))))
        if isinstance(mesh, str):
            if not re.fullmatch(r"\s*\d+(\s*[x×,]\s*\d+)*\s*", mesh):
                raise ValueError(f"cannot read mesh {mesh!r}: write it like '8x8' or '4'")
            shape = tuple(int(s) for s in re.split(r"[x×,]", mesh))
        elif isinstance(mesh, int):
            shape = (mesh,)
        else:
            shape = tuple(int(n) for n in mesh)
        names = tuple(axis_names) if axis_names else tuple(f"a{i}" for i in range(len(shape)))
        return cls(shape, names)

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names)}

    @classmethod
    def from_dict(cls, data: dict) -> MeshSpec:
        return cls(tuple(data["shape"]), tuple(data["axis_names"]))
