"""The error a model that cannot be captured raises (every step of ``passes.capture`` raises it)."""

from __future__ import annotations

__all__ = ["CaptureError"]


class CaptureError(RuntimeError):
    """The model could not be captured as a graph (``partial_graph``: what export got to)."""

    partial_graph: str = ""
