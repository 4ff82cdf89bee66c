"""Symbolic execution on fewer cores than ranks: at most ``cores`` actions compute at once.

:func:`passes.schedules.execution.execute_flat` gives every rank a device of its own. Ranks of a
CPU host that outnumber its cores take turns on them (:mod:`partitioner.core_sharing`), so here an
action that is ready (its rank's previous action done, its remote dependency finished plus
``comm_time``) also needs a free core: list scheduling, the first ready first (ties: the lower
rank), each action on the core that frees first. Sends, receives and actions of no duration take
no core. After its last action a rank runs its tail (``tails[rank]``: the once-per-step gradient
reduction and optimizer step) on a core as well.

The order events are handled in is the order of ready times: an action starts no earlier than it
is ready and everything it makes ready is ready no earlier than it ends, so the times popped
from the heap never decrease and the first ready is always the next served. The result has the
shape of :func:`execute_flat`'s, plus each rank's finish (its tail's end).
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from passes.schedules.execution import ScheduleIndex
    from passes.schedules.schedule import Schedule

logger = logging.getLogger(__name__)

_TAIL = -1
"""The heap's position for a rank's tail (its list done)."""


class _SharedRun:
    """One execution's state: times per flat position, each rank's progress, the cores' free times."""

    def __init__(self, schedule: Schedule, index: ScheduleIndex, durations: list, comm_time: float, cores: int):
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.offsets, self.wait, self.compute = index.flat
        ranks = schedule.num_ranks
        self.stops = [self.offsets[r] + len(schedule.actions[r]) for r in range(ranks)]
        self.durations, self.comm_time = durations, comm_time
        self.start = [0.0] * len(self.wait)
        self.end = [-1.0] * len(self.wait)  # -1: not finished
        self.ptr = list(self.offsets)
        self.clock = [0.0] * ranks
        self.free = [0.0] * cores  # a heap of the times each core frees
        self.blocked: dict = {}  # position not finished yet -> ranks waiting on it
        self.heap: list = []  # (ready time, rank, position or _TAIL)

    def offer(self, rank: int) -> None:
        """Put ``rank``'s next action (or its tail) on the heap at its ready time, or park it on the
        position it waits for; a rank waiting on an action nobody runs stays where it is."""
        i = self.ptr[rank]
        if i >= self.stops[rank]:
            heapq.heappush(self.heap, (self.clock[rank], rank, _TAIL))
            return
        ready, w = self.clock[rank], self.wait[i]
        if w >= 0:
            if self.end[w] < 0:
                self.blocked.setdefault(w, []).append(rank)
                return
            ready = max(ready, self.end[w] + self.comm_time)
        elif w == -2:
            return
        heapq.heappush(self.heap, (ready, rank, i))

    def on_core(self, ready: float, seconds: float) -> float:
        """Start time of ``seconds`` of compute ready at ``ready`` (none: at once, no core)."""
        if seconds <= 0:
            return ready
        begin = max(ready, heapq.heappop(self.free))
        heapq.heappush(self.free, begin + seconds)
        return begin

    def run(self, tails: list) -> list:
        """Execute to the fixed point; each rank's finish time (-1: it never finished its list)."""
        finish = [-1.0] * len(self.clock)
        for rank in range(len(self.clock)):
            self.offer(rank)
        while self.heap:
            ready, rank, i = heapq.heappop(self.heap)
            if i == _TAIL:
                finish[rank] = self.on_core(ready, tails[rank]) + tails[rank]
                continue
            seconds = self.durations[i] if self.compute[i] else 0.0
            self.start[i] = self.on_core(ready, seconds)
            self.end[i] = self.clock[rank] = self.start[i] + self.durations[i]
            self.ptr[rank] = i + 1
            for waiting in self.blocked.pop(i, []):
                self.offer(waiting)
            self.offer(rank)
        return finish


def execute_shared(
    schedule: Schedule, index: ScheduleIndex, durations: list, comm_time: float, cores: int, tails: list
) -> tuple:
    """(start, end, how far each rank got, each rank's finish: its tail's end) of ``schedule``
    run with at most ``cores`` actions computing at once (see the module docstring)."""
    state = _SharedRun(schedule, index, durations, comm_time, cores)
    finish = state.run(list(tails))
    return state.start, state.end, [state.ptr[r] - state.offsets[r] for r in range(schedule.num_ranks)], finish
