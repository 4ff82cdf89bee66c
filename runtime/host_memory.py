"""Host (CPU) tensor memory that follows the live tensors: freed blocks go back to the system.

glibc's ``malloc`` serves a request above its mmap threshold (128 KiB at start) with a mapping
of its own, returned to the system by ``free``. The threshold is dynamic: freeing such a
mapping raises it to that block's size (up to 32 MiB), so from then on blocks up to that size
come from the heap, and a heap with live blocks above freed ones cannot shrink. A training step
frees and allocates activations of a few sizes in turn; with the dynamic threshold the
process's private memory grows well past what is alive at any moment (measured on 4 gloo
ranks, the long-sequence benchmark's GPT at 8,192 tokens: private data (``VmData``) grew by
128-140 MiB per rank over two steps, where the plan estimates a 74 MiB peak and the torch
allocations made during a step peak at 48 MiB above the parameters), and a per-process memory
limit fails a plan whose estimate fits. :func:`return_freed_blocks` fixes the threshold at
128 KiB (which also turns the dynamic adjustment off), so every large tensor is a mapping of its
own and private memory follows the live tensors (the same run: 70 MiB on every rank). The cost
is a fresh mapping, zero-filled by the kernel, per large allocation.

That cost is measured: the runtime benchmark's steps (Megatron TP on 4 gloo ranks, and one
rank) take 17-60% longer with the threshold fixed (small LLaMA on 4 ranks 0.29 s -> 0.34-0.40 s,
one rank 0.09 s -> 0.14-0.15 s). So ``auto_parallelize`` calls it only for a CPU job planned
under a ``memory_budget``, where the process must stay inside what the plan promises; without a
budget, glibc's defaults stay. Other C libraries: nothing to do (the call reports False).
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["return_freed_blocks", "MMAP_THRESHOLD"]

MMAP_THRESHOLD = 128 * 1024
"""Blocks at least this large are mappings of their own (glibc's initial threshold)."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_DONE: list = []


def return_freed_blocks() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` for this process (once); True when
    the C library took it."""
    if _DONE:
        return _DONE[0]
    ok = False
    name = ctypes.util.find_library("c")
    if name:
        try:
            libc = ctypes.CDLL(name)
            ok = bool(getattr(libc, "mallopt", None) and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
        except OSError:
            ok = False
    _DONE.append(ok)
    return ok
