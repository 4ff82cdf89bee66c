"""A plan's memory per device, by kind, and its peak: the public names.

The breakdown is computed where the planner needs it, in the compiler's planning phase
(:mod:`passes.plan.memory_peak`, which states the algorithm); this module gives the API its names
(``partitioner.MemoryBreakdown``, ``ShardingPlan.estimate().memory``).
"""

from __future__ import annotations

from passes.plan.memory_peak import MemoryBreakdown, memory_breakdown

__all__ = ["MemoryBreakdown", "memory_breakdown"]
