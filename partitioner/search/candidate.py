"""One configuration the search priced (:class:`Candidate`: its bounds, quick estimate, status,
why it lost, its plan once planned), the reasons the planning loop gives for leaving one
unplanned, and how seconds and bytes are printed in those reasons."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from partitioner.parallel_config import ParallelConfig
from partitioner.sharding_plan import ShardingPlan

logger = logging.getLogger(__name__)


@dataclass
class Candidate:
    config: ParallelConfig
    memory_lb: float
    time_lb: float
    quick_s: float
    status: str = "not planned"
    reason: str = ""
    step_time_s: float = math.inf
    """The real plan's estimate (inf until planned)."""
    memory_bytes: float = 0.0
    plan: ShardingPlan | None = field(default=None, repr=False)

    def row(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "status": self.status,
            "reason": self.reason,
            "step_time_s": self.step_time_s if self.plan is not None else None,
            "memory_bytes": self.memory_bytes if self.plan is not None else None,
            "time_lower_bound_s": self.time_lb,
            "memory_lower_bound": self.memory_lb,
            "quick_estimate_s": self.quick_s,
        }


def degrees_of(c) -> tuple:
    return (c.pipeline, c.data, c.sequence, c.tensor, c.expert)


LIMIT = "search limit"
SAME_DEGREES = "these degrees were planned with"


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def fmt_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
