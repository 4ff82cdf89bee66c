"""An autocast state entered and left by two calls of a lowered program (fx graphs have no
``with``): the region a model runs under another autocast state than the program's
(:mod:`passes.capture.autocast_regions`) is emitted between :func:`enter_autocast` and
:func:`exit_autocast`."""

from __future__ import annotations

import torch

__all__ = ["enter_autocast", "exit_autocast"]


def enter_autocast(device_type: str, dtype, enabled: bool, cache_enabled) -> torch.autocast:
    """Enter the state; the returned context is left by :func:`exit_autocast`."""
    context = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    context.__enter__()
    return context


def exit_autocast(context: torch.autocast) -> None:
    context.__exit__(None, None, None)
