"""The registry: every schedule by the name users give it, with its closed-form costs.

:data:`SCHEDULES` is the one registry of schedules by the names users give (``gpipe``, ``1f1b``,
``interleaved``, ``zb-h1``), each with its activations in flight per stage and its closed-form
bubble; configuration checks, the builder, the automatic choice and the benchmarks read it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from passes.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from passes.schedules.in_flight import stage_in_flight
from passes.schedules.schedule import Schedule

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduleKind:
    """One named schedule: how to generate it and what it costs, in closed form.

    ``make(p, m, v)``: the compute-only schedule for ``p`` ranks, ``m`` microbatches and ``v``
    stages per rank (``v`` used only where ``virtual``). ``in_flight(p, m, v)``: stage -> the
    microbatches whose activations the stage holds at once (what :func:`stage_in_flight` counts
    on the generated schedule). ``bubble(p, m, v)``: the idle share of all ranks' time with
    uniform stages, ``B = 2F`` and, for a split backward, ``I = W = F`` (what :func:`simulate`
    gives for those durations). ``virtual``: needs ``v >= 2``. ``automatic``: weighed by
    :func:`choose_schedule` when the user leaves the schedule open."""

    name: str
    make: Callable[[int, int, int], Schedule]
    in_flight: Callable[[int, int, int], dict]
    bubble: Callable[[int, int, int], float]
    virtual: bool = False
    automatic: bool = False


def _one_f_one_b_bubble(p, m, v):
    return (p - 1) / (m + p - 1)


def _zb_h1_bubble(p, m, v):
    """``(p-1)/(3m+p-1)`` once ``m >= p``; with fewer microbatches the step is the critical path,
    ``2(p+m)-1`` units (F units down the ranks and I units back), which the deferred W no longer covers."""
    return 1.0 - 3 * m / max(3 * m + p - 1, 2 * (p + m) - 1)


SCHEDULES = {
    kind.name: kind
    for kind in (
        ScheduleKind(
            "gpipe",
            lambda p, m, v: gpipe(p, m),
            in_flight=lambda p, m, v: {s: m for s in range(p)},
            bubble=_one_f_one_b_bubble,
        ),
        ScheduleKind(
            "1f1b",
            lambda p, m, v: one_f_one_b(p, m),
            in_flight=lambda p, m, v: {s: min(p - s, m) for s in range(p)},
            bubble=_one_f_one_b_bubble,
            automatic=True,
        ),
        # interleaved holds an irregular count per virtual stage: counted on the generated schedule
        ScheduleKind(
            "interleaved",
            lambda p, m, v: interleaved_1f1b(p, m, v),
            in_flight=lambda p, m, v: stage_in_flight(interleaved_1f1b(p, m, v)),
            bubble=lambda p, m, v: ((p - 1) / v) / (m + (p - 1) / v),
            virtual=True,
        ),
        ScheduleKind(
            "zb-h1",
            lambda p, m, v: zb_h1(p, m),
            in_flight=lambda p, m, v: {s: min(p, m) for s in range(p)},
            bubble=_zb_h1_bubble,
            automatic=True,
        ),
    )
}
"""Name -> :class:`ScheduleKind`, in the order errors list them and :func:`choose_schedule`
breaks ties. GPipe is not automatic: never faster than 1F1B, it keeps all m microbatches'
activations alive."""

AUTO_SCHEDULES = tuple(name for name, kind in SCHEDULES.items() if kind.automatic)
"""The schedules :func:`choose_schedule` weighs (one stage per rank), in tie-break order."""


def schedule_kind(name: str) -> ScheduleKind:
    """The registry entry for ``name`` (case and ``_``/``-`` do not matter); a ``ValueError``
    listing the known names otherwise."""
    key = str(name).lower().replace("_", "-")
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {tuple(SCHEDULES)}")
    return SCHEDULES[key]


def auto_stage_in_flight(p: int, m: int) -> dict:
    """stage -> the activation copies to plan each stage for when the schedule is chosen after
    planning: the most any of :data:`AUTO_SCHEDULES` keeps alive, so whichever wins fits."""
    per = [SCHEDULES[name].in_flight(p, m, 1) for name in AUTO_SCHEDULES]
    return {s: max(d[s] for d in per) for s in range(p)}
