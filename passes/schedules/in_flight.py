"""Activations in flight: how many microbatches' activations a rank or stage holds at once."""

from __future__ import annotations

import logging

from passes.schedules.actions import ActionKind
from passes.schedules.schedule import Schedule

logger = logging.getLogger(__name__)


def peak_in_flight(schedule: Schedule) -> dict:
    """rank -> the most microbatch-stages whose activations the rank holds at once: a forward
    adds one, the ``B`` or ``W`` that finishes with them removes it (activation memory)."""
    peaks = {}
    for rank, acts in enumerate(schedule.actions):
        live = peak = 0
        for a in acts:
            if a.kind == ActionKind.F:
                live += 1
                peak = max(peak, live)
            elif a.kind in (ActionKind.B, ActionKind.W):
                live -= 1
        peaks[rank] = peak
    return peaks


def stage_in_flight(schedule: Schedule) -> dict:
    """stage -> the most of its microbatches whose activations are alive at once: from its
    ``F`` until the ``B`` or ``W`` that finishes with them (``I`` keeps the graph for ``W``).
    A stage's plan must fit that many copies of its saved activations."""
    peaks = {}
    for acts in schedule.actions:
        live = {}
        for a in acts:
            if a.kind == ActionKind.F:
                live[a.stage] = live.get(a.stage, 0) + 1
                peaks[a.stage] = max(peaks.get(a.stage, 0), live[a.stage])
            elif a.kind in (ActionKind.B, ActionKind.W):
                live[a.stage] -= 1
    return dict(sorted(peaks.items()))
