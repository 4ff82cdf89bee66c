"""The one error lowering raises: the plan does not fit the graph being lowered (or asks for a
layout lowering cannot make); its message names the node and what to pin or change."""

from __future__ import annotations

__all__ = ["LoweringError"]


class LoweringError(ValueError):
    """The plan does not fit the graph being lowered."""
