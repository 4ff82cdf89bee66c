"""A whole-model candidate's plan (step 5 of :mod:`partitioner.search`, no pipeline): the intra-op
ILP on the candidate's ``(d, s, t)`` mesh, and for ``recompute="auto"`` the fastest of the plans
with each uniform recomputation of the repeated layers.

Algorithm
---------
With ``recompute="auto"`` the intra-op solver offers every repeated block its kept, selective and
full options in one ILP, a block's options linked (:mod:`passes.plan.recompute`). Under a budget
that binds, that ILP is hard for HiGHS: three times the options and a memory row whose relaxation
is weak (Llama 3 8B on 64 A100s, data 8 x tensor 8: 20-31 CPU seconds per solve, six solves to fit
the walked peak, 139 CPU seconds in all; with the mode fixed the same problems solve in 1-7 CPU
seconds each). So the search plans such a candidate once per mode (:data:`MODES`): ``none``,
``selective`` (where a repeated block holds an attention core) and ``all``, and keeps the plan of
least estimated step. Before each mode, its time bound (the search's :meth:`Bounds.time`: a rerun
adds a forward under ``all``) is compared with the fastest plan so far, and a mode that cannot
beat it is not planned. With one kind of repeated block (the transformer layer) every layer takes
one mode in the linked ILP too; with several kinds this is the best uniform mode.

On that 8B the linked ILP stopped at full recomputation, 3.19 s; planned apart, ``none`` fits at
2.79 s (the least-memory plan after the budget fitting: its estimate adds the overlap credits the
ILP's objective leaves out), ``selective`` is planned and ``all`` is bounded away (2.90 s).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from partitioner.parallel_config import ParallelConfig
from partitioner.search.zero_modes import planner_zero
from partitioner.sharding_plan import ShardingPlan
from passes.plan.plan_intra_op import InfeasibleBudgetError

if TYPE_CHECKING:
    from partitioner.search.planner import Planner

logger = logging.getLogger(__name__)

MODES = ("none", "selective", "all")
"""The uniform recomputations a whole-model ``"auto"`` candidate is planned with, in this order."""


def plan_whole_model(planner: Planner, c: ParallelConfig) -> ShardingPlan:
    """The plan of ``c`` (``c.pipeline == 1``); one planning counted. Raises the last mode's
    :class:`InfeasibleBudgetError` when no mode fits."""
    planner.plannings += 1
    if c.recompute != "auto":
        return _plan_mode(planner, c, c.recompute)
    best, refused = None, None
    for mode in MODES:
        bound = planner.time_bound(replace(c, recompute=mode)) if planner.time_bound is not None else 0.0
        if best is not None and bound >= best[0]:
            logger.info("search: %s: recompute %s not planned, its time bound %.3f s", c.describe(), mode, bound)
            continue
        try:
            made = _plan_mode(planner, c, mode)
        except InfeasibleBudgetError as exc:
            refused = exc
            continue
        except ValueError:
            if mode != "selective":
                raise
            continue  # no repeated block holds an attention core to recompute alone
        step = made.estimate().step_time_s
        logger.info("search: %s with recompute %s: step %.3f s", c.describe(), mode, step)
        if best is None or step < best[0]:
            best = (step, made)
    if best is None:
        assert refused is not None, "a mode either plans or is refused"
        raise refused
    return best[1]


def _plan_mode(planner: Planner, c: ParallelConfig, mode: str) -> ShardingPlan:
    return planner.plan_graph(
        planner.capture(planner.batch),
        planner.name,
        c.stage_mesh_shape,
        c.stage_axis_names,
        recompute=mode,
        zero=planner_zero(c.zero),
        sequence_parallel=c.sequence_parallel,
        config=c,
    )
