"""Bytes and seconds as the plan's tables and messages print them.

A bottom module of ``partitioner/`` (docs/ARCHITECTURE.md, "Layers"): the plan value
(:mod:`partitioner.sharding_plan`) and its table (:mod:`partitioner.plan_table`) both print
with these, so neither imports the other for its units (``sharding_plan`` keeps the names
``_fmt_bytes`` / ``_fmt_time`` for the modules that import them from there).
"""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_time"]


def fmt_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, two decimals (``1.50 MiB``, ``12 B``)."""
    n = float(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float) -> str:
    """``s`` seconds in s, ms or us, as the plan table prints them."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"
