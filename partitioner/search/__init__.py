"""Choose the whole configuration for N devices: pipeline x data x sequence x tensor degrees, microbatches,
schedule, activation checkpointing and ZeRO stage (``partitioner.plan(..., devices=N)``).

Algorithm
---------
1. **Facts.** The model is captured once at the global batch and analysed: parameter elements,
   forward FLOPs, the repeated layers (their count ``L``, and per layer the bytes backward keeps
   and the bytes of the value entering the next layer).
2. **Enumerate.** Every factorisation ``N = p * d * t`` with ``t`` dividing the cluster's
   ``devices_per_node`` (tensor groups are consecutive ranks, so they stay inside a node) and
   ``p <= L`` (``d = 1 < t`` is left out: its one-axis stage mesh is ``(p, t, 1)``'s);
   without a pipeline (``p = 1``) one microbatch; with one, every number of microbatches
   ``m >= p`` that divides the global batch into microbatches ``d`` data-parallel
   ranks can share, each schedule of ``passes.schedules`` but GPipe (never faster than
   1F1B and heavier) - 1F1B, ZB-H1, and interleaved with 2 stages per rank where ``m`` is a
   multiple of ``p`` and ``L >= 2p`` - and recomputation ``none`` or ``all`` (without a
   pipeline the intra-op solver decides it, ``recompute="auto"``); with ``d > 1`` each with
   every ZeRO stage on ``dp`` (:func:`zero_stages`: 0, 1 with Adam, 2, 3).
   For a long sequence (:func:`sequence_degrees`) also ``N = d * s`` with a sequence axis
   ``sp`` and ring or Ulysses attention forced on it (no pipeline, no tensor axis), and with at
   least 64 tokens per sample context parallelism beside the other axes, ``N = p * d * s * t``
   with ``s`` up to 16 (ring only beside ``tp``, its heads split there). A model with
   mixture-of-experts layers also gets, without a pipeline, each expert degree ``e > 1``
   dividing ``d`` and its expert counts: the experts split over an ``ep`` axis of ``e`` data
   ranks (:mod:`partitioner.expert_degrees`; ``expert_parallel="on"`` keeps only those).
3. **Lower bounds, cheap.** Memory per device: parameter state (weights, gradients, optimizer
   state) by ZeRO stage (:meth:`Bounds.state_per_device`: what the stage keeps whole on ``dp``
   cut by ``tp`` alone, the rest over all ``N`` devices), plus the activations the schedule keeps alive for the layers
   of the first stage, spread over the stage's ``d * t`` devices (with recomputation only each
   layer's input, plus one layer's). Time: training FLOPs (3 forwards, 4 when recomputing) over
   ``N`` devices at the preset's peak times its matmul efficiency, divided by ``1 - bubble``
   with the schedule's closed-form bubble. A candidate whose memory bound exceeds the budget is
   dropped (``over budget``).
4. **Quick estimate.** A closed-form step time (the time bound plus Megatron-style tensor
   all-reduces per layer, the data-parallel traffic of the ZeRO stage: a gradient all-reduce
   once (0), a reduce-scatter and an all-gather once (1), a reduce-scatter once and a weight
   all-gather per microbatch (2) or two (3), and the stage-to-stage sends,
   on the links the mesh axes cross) orders the survivors; it is never reported as a plan's
   estimate.
5. **Plan the survivors with the real planner**, in that order after one seed, the usual
   recipe (tensor parallel across the node, the fewest pipeline stages whose memory bound fits,
   one sample per microbatch per data-parallel rank, 1F1B, recomputation): the intra-op ILP
   (:func:`partitioner.intra_op.plan_captured`) on the ``(d, t)`` mesh, and for a pipeline the
   stages cut at layer boundaries (:mod:`passes.plan.split_stages`), each stage planned with its
   inputs pinned to what the stage before sends and its activations counted for the
   microbatches the schedule keeps alive; identical stages (same position, layers and incoming
   placements) are planned once. The pipeline's step is the schedule simulated with the
   stages' per-microbatch estimates and the point-to-point time of the largest boundary
   message on the link the pipeline axis crosses. 1F1B and ZB-H1 share one set of stage plans
   (planned for the most microbatches either keeps alive: ZB-H1 keeps ``p`` at every stage,
   1F1B ``p - s`` at stage ``s``); :func:`plan_config`, for one given configuration, plans its
   stages for its own schedule. Stop when the next candidate's time
   bound exceeds the best step found, or after ``max_plans`` distinct plannings (each extra
   one costs seconds at large scale; one refused over budget counts half), one per set of
   degrees ``(p, d, t)`` (the best-ranked microbatch count and recomputation for them; 1F1B
   and ZB-H1 come from the same plannings);
   the rest are listed as not planned, with their bounds. A candidate whose quick estimate
   times the least planned / quick ratio of its kind (pipelines, whole model; plans far above
   theirs left out) exceeds the best step is pruned. Once a pipeline is planned, its other
   schedules whose stages are cut differently (interleaved against 1F1B / ZB-H1) are priced
   from the stages just planned (:mod:`partitioner.search.schedule_twins`): planned next when
   expected below the best step, else explained. A candidate left out by that limit
   or by the one-planning-per-degrees rule whose quick estimate times the ratio of a planned
   step to its quick estimate (its own degrees' where they were planned, else the median over
   the planned degrees) still beats the best step is planned past the limit (``RUNNER_UPS`` at
   most); the others whose quick estimate is below the chosen step say what that product is.
   A plan ``FAR_ABOVE`` times its quick estimate or more at ZeRO-0 or 2 (a stage solve that
   fits only by using ``dp`` as a tensor axis) has its degrees planned again with ZeRO-1 or
   ZeRO-3, in that twin's turn (so a better plan found first can still prune it). ZeRO-0 and
   ZeRO-1 twins rank at the lesser of their quick estimates, so ZeRO-1 (the smaller memory
   bound) is planned first. The plannings on meshes of two or more axes keep an op's ``SEARCH_MAX_OPTIONS``
   lowest-compute options (the ILP grows with the square of the options on an edge). Stages
   are planned in turn by :func:`partitioner.stage_boundaries.plan_stages_in_turn`, the loop
   the pipeline builder uses too.
   Candidates likely to fit are planned first: a refusal over budget scales the activations
   in every bound by what that plan really needed, and a plan that fits only because the
   solver stored weights sharded beyond the asked ZeRO stage counts as a refusal of that
   stage (the candidates whose bounds are as tight are planned after the others). A set of
   degrees refused over budget is planned once more, by a higher ZeRO stage the solver is asked differently. The stage
   reaches the solver as ``zero=`` (:func:`planner_zero`), and the configuration records the
   stage the plan's weights use (:func:`zero_stage_of`).
6. The fastest plan that fits is returned with its :class:`ParallelConfig` (``plan.config``)
   and the search's table (``plan.explain()``: runner-ups, their estimates, why they lost).

A pipelined plan is one :class:`ShardingPlan` whose ``data["pipeline"]`` holds the stage plans
(``stage_plans``, shared by ``stage_map``), the schedule and its simulated step;
``plan.estimate()`` then reports the schedule's step (bubble included) and the point-to-point
bytes (``comm_bytes["send_recv"]["pp"]``). The search's captures and stage splits are cached
by microbatch size, so a size is captured once.
"""

from partitioner.search.api import plan_config, search_config
from partitioner.search.enumerate import enumerate_configs
from partitioner.search.facts import ModelFacts, check_devices
from partitioner.search.zero_modes import planner_zero, zero_stage_of, zero_stages

__all__ = [
    "search_config",
    "plan_config",
    "ModelFacts",
    "enumerate_configs",
    "check_devices",
    "planner_zero",
    "zero_stage_of",
    "zero_stages",
]
