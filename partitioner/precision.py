"""Mixed precision as part of the plan: the dtype ops compute in and the dtype gradients reduce in.

``precision="bf16"`` (or ``"fp16"``) keeps the parameters, their gradients and the optimizer
state in fp32 (the master copies the optimizer steps) and runs the model under
``torch.autocast``: each op on autocast's low-precision list (matmuls, convolutions, attention)
casts its inputs to the compute dtype, so the weights it uses are low-precision compute copies
derived from the fp32 masters. The model is captured under the same autocast, so the graph's
values carry the dtypes that run: the cost model prices bf16 FLOPs, bytes and communication from
them, and the lowered program, run under the same autocast, computes exactly that.

Gradient reductions of parameters happen in ``reduce`` (fp32 by default; the gradients autocast
hands back to fp32 parameters are fp32). FSDP2's ``MixedPrecisionPolicy(param_dtype,
reduce_dtype)`` is accepted too; as in FSDP2, its ``reduce_dtype=None`` means ``param_dtype``.
fp16 needs loss scaling: :func:`grad_scaler` gives a ``GradScaler`` whose overflow check spans
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Precision", "grad_scaler"]

_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype = torch.float32
    """The dtype autocast computes matmuls, convolutions and attention in (fp32: no autocast)."""
    reduce: torch.dtype = torch.float32
    """The dtype parameter gradients are reduced in across ranks."""

    @classmethod
    def build(cls, value) -> Precision:
        """From ``None``/``"fp32"``, ``"bf16"``, ``"fp16"``, a Precision, or FSDP2's MixedPrecisionPolicy."""
        if value is None:
            return cls()
        if isinstance(value, Precision):
            return value
        if isinstance(value, str):
            dtype = _NAMES.get(value.lower())
            if dtype is None:
                raise ValueError(
                    f"precision must be one of 'fp32', 'bf16', 'fp16' (or a MixedPrecisionPolicy), got {value!r}"
                )
            return cls(compute=dtype)
        if hasattr(value, "param_dtype") and hasattr(value, "reduce_dtype"):  # FSDP2's MixedPrecisionPolicy
            compute = value.param_dtype or torch.float32
            return cls(compute=compute, reduce=value.reduce_dtype or compute)
        raise TypeError(
            f"precision must be a string, a Precision or a MixedPrecisionPolicy, got {type(value).__name__}"
        )

    @property
    def autocast_dtype(self):
        """The dtype to capture and run under ``torch.autocast``; None for fp32."""
        return None if self.compute == torch.float32 else self.compute

    @property
    def grad_reduce_dtype(self):
        """The dtype parameter gradients are cast to for their reductions; None: their own (fp32)."""
        return None if self.reduce == torch.float32 else self.reduce

    @property
    def grad_reduce_bytes(self) -> int | None:
        dtype = self.grad_reduce_dtype
        return None if dtype is None else torch.empty((), dtype=dtype).element_size()

    def to_dict(self) -> dict:
        return {"compute": str(self.compute).removeprefix("torch."), "reduce": str(self.reduce).removeprefix("torch.")}

    @classmethod
    def from_dict(cls, data) -> Precision:
        if not data:
            return cls()
        return cls(compute=getattr(torch, data["compute"]), reduce=getattr(torch, data["reduce"]))

    def __str__(self) -> str:
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        text = names[self.compute]
        return text if self.reduce == torch.float32 else f"{text} (gradients reduced in {names[self.reduce]})"


def grad_scaler(device: str = "cpu", **kwargs):
    """A ``torch.amp.GradScaler`` for fp16 training whose inf/NaN check is all-reduced over every
    rank (``torch.distributed``'s default group), so all ranks skip or take a step together:
    each rank sees only its own shards' gradients. Use it as any GradScaler::

        scaler = partitioner.grad_scaler()
        scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device, **kwargs)
