"""Step 5 of :mod:`partitioner.search`, the loop: plan the candidates in order (the usual recipe
first, then those likely to fit by the quick estimate), one planning per set of degrees, pruning by
the time bound and the least planned / quick ratio, stopping at ``max_plans``; refusals over budget
teach the memory bounds a slack, and a plan far above its quick estimate at ZeRO-0 or 2 has its
degrees planned again with ZeRO-1 (from ZeRO-0) or ZeRO-3."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

from partitioner.parallel_config import ParallelConfig
from partitioner.search.bounds import Bounds
from partitioner.search.candidate import LIMIT, SAME_DEGREES, Candidate, degrees_of, fmt_gib, fmt_s
from partitioner.search.pipeline_candidate import stage_set_key
from partitioner.search.planner import Planner
from partitioner.search.runner_ups import RUNNER_UPS, runner_up
from partitioner.search.schedule_twins import price_schedule_twins
from partitioner.search.zero_modes import frees_memory, planner_zero, stage_rank
from partitioner.sharding_plan import ShardingPlan
from passes.plan.plan_intra_op import InfeasibleBudgetError

logger = logging.getLogger(__name__)


FAR_ABOVE = 3.0
"""A plan this many times its quick estimate is planned again with ZeRO-3 (``replan_far_above``)."""


LEAST_RATIO_PLANS = 2
"""Plans of a kind after which its least planned / quick ratio prunes above 1 (``least_ratio``)."""


class PlanningLoop:
    """Step 5 of :mod:`partitioner.search`: plan the candidates in order, best first, until the limit.

    Planning order: the candidates likely to fit first, each group by the quick estimate. Likely
    to fit: the memory bound with its activations scaled by the slack of its kind, the largest
    ratio of a refused plan's least memory to its bound seen so far among candidates of that kind
    (the bound leaves out buffers, copies and transients the solver counts), starting at 1. The
    kinds are whole-model plans and pipelines (:func:`slack_kind`): a whole-model plan's
    transients (the loss over a data rank's whole batch) say nothing of a stage's over one
    microbatch, so a refusal of one kind never reorders the other."""

    def __init__(self, planner: Planner, bounds: Bounds, budget: float, cands: list, max_plans: int):
        self.planner, self.bounds, self.budget, self.cands, self.max_plans = planner, bounds, budget, cands, max_plans
        self.best: Candidate | None = None
        self.least_seen: tuple | None = None  # (memory bound, why) of the least refused over budget
        self.slack: dict = {}  # slack_kind -> the slack learned for that kind (1.0 until a refusal)
        self.queue: list = []
        self.tried: dict = {}  # (p, d, s, t, e) -> (what was planned for them, its memory bound if refused over budget)
        self.refused = 0  # plannings refused over budget count half toward max_plans (they stop early)
        self.limit: float = max_plans  # raised by one for each runner-up planned after the limit
        self.forced: set = set()  # ids of candidates planned past the limit and the one-per-degrees rule
        self.twins: set = set()  # ids of the forced ZeRO twins of plans far above their quick estimates
        self.paired_quick: dict = {}  # zero_pair -> the lesser quick estimate of its ZeRO-0 and ZeRO-1 twins

    def order(self, c: Candidate) -> tuple:
        """Likely to fit first, then by quick estimate and time bound, then by memory bound.
        ZeRO-0 and ZeRO-1 twins (the same configuration but for that) are ranked at the lesser
        of their two quick estimates, which differ only by the gathered weights' bytes against
        the reduced gradients' (an all-reduce is a reduce-scatter and an all-gather), so the one
        with the smaller memory bound, ZeRO-1, is planned first: it has the most room, so its
        plan is the likeliest to come out near its quick estimate (the 405B's p32 d32 t8: 16.5 s
        at ZeRO-1, 21.8 s at ZeRO-0, whose stage solve sent more over ``dp`` to fit), and the
        one-planning-per-degrees rule keeps it. Pipelines only: a whole-model plan's ZeRO-0 lets
        the solver store weights sharded where the budget needs it, and on small models ZeRO-1's
        two calls cost more than its room is worth (a GPT at 4,096 tokens on 8 devices: sp 4 x
        tp 2 at ZeRO-1 3.12 ms, behind sp 2 x tp 4 at ZeRO-0, 3.03 ms)."""
        state = self.bounds.state_per_device(c.config)
        slack = self.slack.get(slack_kind(c.config), 1.0)
        paired = c.config.zero in (0, 1) and c.config.pipeline > 1
        quick = self.paired_quick.get(zero_pair(c.config), c.quick_s) if paired else c.quick_s
        return (state + slack * (c.memory_lb - state) > self.budget, quick, c.time_lb, c.memory_lb)

    def pair_zero_twins(self, cands: list) -> None:
        """Rank each pipelined ZeRO-0 / ZeRO-1 pair at the lesser of their quick estimates (:meth:`order`)."""
        for c in cands:
            if c.config.zero in (0, 1) and c.config.pipeline > 1:
                key = zero_pair(c.config)
                self.paired_quick[key] = min(self.paired_quick.get(key, c.quick_s), c.quick_s)

    def learn_slack(self, c: ParallelConfig, ratio: float) -> None:
        """Raise the slack of ``c``'s kind to ``ratio`` (if higher) and reorder the queue."""
        kind = slack_kind(c)
        self.slack[kind] = max(self.slack.get(kind, 1.0), ratio)
        self.queue.sort(key=self.order)

    def run(self, alive: list, devices_per_node: int) -> Candidate | None:
        """The fastest candidate planned (None: none fits)."""
        self.pair_zero_twins(alive)
        self.queue = sorted(alive, key=self.order)
        seed = rule_of_thumb(self.queue, devices_per_node, self.bounds, self.budget)
        if seed is not None:  # planned first: the best plan is never worse than the usual recipe
            self.queue.remove(seed)
            self.queue.insert(0, seed)
        while True:
            if not self.queue:
                again = runner_up(self.cands, self.best, self.limit - self.max_plans < RUNNER_UPS)
                if again is None:
                    break
                self.limit = self.planner.plannings - self.refused / 2 + 1
                self.forced.add(id(again))
                self.queue.append(again)
            cand = self.queue.pop(0)
            if self.skipped(cand):
                continue
            if id(cand) in self.twins:  # planned again past the limit: it takes no one else's planning
                self.limit += 1
            made = self.plan(cand)
            if made is not None:
                self.take(cand, made)
        return self.best

    def skipped(self, cand: Candidate) -> bool:
        """Whether ``cand`` is left unplanned (its reason set): its time bound is past the best
        step, or its quick estimate times the least planned / quick ratio of its kind is
        (:meth:`least_ratio`), the planning limit is reached, or its degrees were planned already."""
        best = self.best
        if best is not None and cand.time_lb > best.step_time_s:
            cand.status = "pruned"
            cand.reason = f"its time bound {fmt_s(cand.time_lb)} exceeds the best step {fmt_s(best.step_time_s)}"
            return True
        degrees = degrees_of(cand.config)
        if stage_set_cached(self.planner, cand.config):
            return False
        floor = self.least_ratio(cand.config)
        if best is not None and cand.quick_s * floor > best.step_time_s:
            cand.status = "pruned"
            cand.reason = (
                f"its quick estimate {fmt_s(cand.quick_s)} x {floor:.2f} (the least planned / quick ratio of "
                f"{slack_kind(cand.config)} plans here) exceeds the best step {fmt_s(best.step_time_s)}"
            )
            return True
        if id(cand) in self.forced:  # a runner-up or a twin planned again: past the limit and the rule below
            return False
        if self.planner.plannings - self.refused / 2 >= self.limit:
            cand.reason = f"{LIMIT} ({self.max_plans} plannings); quick estimate {fmt_s(cand.quick_s)}"
            return True
        # one planning per set of degrees, and one more after a refusal over budget: a higher
        # ZeRO stage that the solver is asked differently (or the other sequence algorithm)
        tried = self.tried
        if degrees in tried and not (
            tried[degrees][1]
            and stage_rank(cand.config.zero) > stage_rank(tried[degrees][2])
            and planner_zero(cand.config.zero) != planner_zero(tried[degrees][2])
        ):
            cand.reason = f"{SAME_DEGREES} {tried[degrees][0]}; quick estimate {fmt_s(cand.quick_s)}"
            return True
        return False

    def least_ratio(self, c: ParallelConfig) -> float:
        """The least ratio of a plan's step to its quick estimate among the candidates of ``c``'s
        kind (:func:`slack_kind`) planned so far, leaving out plans ``FAR_ABOVE`` theirs (a stage
        solve that fit only by sending activations over ``dp``, planned again by
        :meth:`replan_far_above`), once ``LEAST_RATIO_PLANS`` of them are planned; before that
        at most 1. No plan of the kind came out faster relative to its quick estimate, so a
        candidate whose quick estimate times it exceeds the best step is not expected to win
        (Llama 3 405B on 8,192 H100: its pipelines plan at 1.2-1.6x their quick estimates, and
        each one planned costs a stage solve per stage class). One plan is not enough to go by:
        a first plan pressed for memory (the 405B's p32 d32 t8 at ZeRO-0, 1.58x) would prune
        the ZeRO-1 plan of the same degrees (1.20x). Whole-model plans stay at most 1: their
        quick estimates of sequence splits are coarser (a GPT at 4,096 tokens on 8 devices:
        sp 2 x tp 4 planned at 1.16x, and sp 4 x tp 2, at most 1.04x, would have been pruned)."""
        kind = slack_kind(c)
        ratios = [
            o.step_time_s / o.quick_s
            for o in self.cands
            if o.plan is not None and o.quick_s > 0 and slack_kind(o.config) == kind
        ]
        ratios = [r for r in ratios if r < FAR_ABOVE]
        if kind != "pipeline" or len(ratios) < LEAST_RATIO_PLANS:
            return min(ratios + [1.0])
        return min(ratios)

    def plan(self, cand: Candidate) -> ShardingPlan | None:
        """``cand``'s plan; None when it is refused (over budget: the slack learns from it; or an
        algorithm that cannot run there)."""
        degrees = degrees_of(cand.config)
        retry = degrees in self.tried
        self.tried[degrees] = (
            f"{cand.config.microbatches} microbatches, recompute {cand.config.recompute}, ZeRO {cand.config.zero}",
            False,
            cand.config.zero,
        )
        try:
            return self.planner.plan(cand.config)
        except InfeasibleBudgetError as exc:
            self.refused += 1
            cand.status = "over budget"
            cand.reason = str(exc).split(". ")[0]
            if self.least_seen is None or cand.memory_lb < self.least_seen[0]:
                self.least_seen = (cand.memory_lb, cand.reason)
            needed = re.search(r"\((\d+) bytes\)", str(exc))
            state = self.bounds.state_per_device(cand.config)
            self.tried[degrees] = (self.tried[degrees][0], not retry, cand.config.zero)
            if needed and cand.memory_lb > state:
                self.learn_slack(cand.config, (float(needed.group(1)) - state) / (cand.memory_lb - state))
            return None
        except ValueError as exc:  # a forced ring / Ulysses that cannot run here (heads, masks)
            if cand.config.sequence == 1:
                raise
            self.tried[degrees] = (self.tried[degrees][0], True, -1)  # the other algorithm may
            cand.status, cand.reason = "cannot run", str(exc).split(". ")[0]
            return None

    def take(self, cand: Candidate, made: ShardingPlan) -> None:
        """Record ``cand``'s plan (under the configuration it ran as) and keep the fastest."""
        est = made.estimate()
        self.replan_far_above(cand, est.step_time_s)
        if made.config is not None and made.config.zero != cand.config.zero:
            cand.reason = f"asked ZeRO-{cand.config.zero}; "
            if stage_rank(made.config.zero) > stage_rank(cand.config.zero):
                # the solver had to store weights sharded to fit: the asked stage did not, so its
                # bound was optimistic at least by budget / bound (a refusal, softly)
                state = self.bounds.state_per_device(cand.config)
                if cand.memory_lb > state:
                    self.learn_slack(cand.config, 1.001 * (self.budget - state) / (cand.memory_lb - state))
            cand.config = made.config
        if any(o.plan is not None and o.config == made.config for o in self.cands):
            cand.reason += "the plan of an earlier candidate (the same stage plans)"
            return
        cand.status, cand.plan = "planned", made
        cand.step_time_s, cand.memory_bytes = est.step_time_s, est.memory_bytes
        logger.info(
            "search: %s -> step %s, %s per device",
            cand.config.describe(),
            fmt_s(est.step_time_s),
            fmt_gib(est.memory_bytes),
        )
        if self.best is None or est.step_time_s < self.best.step_time_s:
            self.best = cand
        price_schedule_twins(self, cand)  # its other schedules, from the stages just planned

    def replan_far_above(self, cand: Candidate, step_s: float) -> None:
        """A plan ``FAR_ABOVE`` times its quick estimate or more, at a ZeRO stage that keeps
        gathered weights (0, 2: the solver may then use ``dp`` as a tensor axis to fit, sending
        activations over it in every layer) is planned once more with a stage that frees memory
        and the solver is asked differently: ZeRO-1 (from ZeRO-0: weights whole, the optimizer
        state sharded, as large pipelined runs train) or ZeRO-3 (weights gathered per layer and
        freed): that twin of the same degrees (the best by quick estimate) is planned past the
        limit and the one-planning-per-degrees rule when that quick estimate is below the best
        step found (else the reason says so). It keeps its place in the queue (by quick
        estimate), so a better plan found before its turn still prunes it by its bounds (Llama 3
        405B on 8,192 devices: the whole-model recipe's ZeRO-3 twin, quick 24 s, is pruned once a
        pipeline plans at 16.5 s; sent to the front of the queue it cost a whole-model solve)."""
        config = cand.config
        if cand.quick_s <= 0 or step_s < FAR_ABOVE * cand.quick_s or config.data * config.sequence == 1:
            return
        if planner_zero(config.zero) == planner_zero(3):
            return
        degrees = degrees_of(config)
        twins = [o for o in self.queue if degrees_of(o.config) == degrees and frees_memory(config.zero, o.config.zero)]
        if not twins:
            return
        twin = min(twins, key=lambda o: o.quick_s)
        best = self.best
        if best is not None and twin.quick_s >= best.step_time_s:  # it cannot be expected to win
            cand.reason += (
                f"planned at {step_s / cand.quick_s:.1f}x its quick estimate; ZeRO-{twin.config.zero}'s quick estimate "
                f"{fmt_s(twin.quick_s)} is not below the best step {fmt_s(best.step_time_s)}; "
            )
            return
        self.forced.add(id(twin))
        self.twins.add(id(twin))
        again = f"ZeRO-{twin.config.zero}"
        cand.reason += f"planned at {step_s / cand.quick_s:.1f}x its quick estimate, so planned again with {again}; "
        logger.info(
            "search: %s planned at %.1fx its quick estimate: %s planned in its turn",
            config.describe(),
            step_s / cand.quick_s,
            twin.config.describe(),
        )


def zero_pair(c: ParallelConfig) -> ParallelConfig:
    """What ``c``'s ZeRO-0 and ZeRO-1 twins share: ``c`` with its ZeRO stage left out."""
    return replace(c, zero="auto")


def slack_kind(c: ParallelConfig) -> str:
    """Which memory-bound slack ``c`` learns from and is ordered by: ``"pipeline"`` or ``"whole"``."""
    return "pipeline" if c.pipeline > 1 else "whole"


def rule_of_thumb(cands: list, devices_per_node: int, bounds: Bounds, budget: float) -> Candidate | None:
    """The usual recipe (Megatron's): tensor parallel across the node, the fewest pipeline stages
    whose memory bound fits, one sample per microbatch per data-parallel rank, 1F1B, and
    recomputation in a pipeline; None when no candidate is of that form."""
    widest = max((c.config.tensor for c in cands), default=1)  # once: the list holds thousands
    fits = [
        c
        for c in cands
        if c.memory_lb <= budget
        and c.config.tensor == widest
        and c.config.tensor <= devices_per_node
        and (
            c.config.pipeline == 1
            or (
                c.config.schedule == "1f1b"
                and c.config.recompute == "all"
                and c.config.microbatch_size == c.config.data
            )
        )
    ]
    return min(fits, key=lambda c: (c.config.pipeline, c.quick_s), default=None)


def stage_set_cached(planner: Planner, c: ParallelConfig) -> bool:
    return c.pipeline > 1 and stage_set_key(c) in planner.stage_sets
