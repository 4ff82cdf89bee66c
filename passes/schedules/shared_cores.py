"""Symbolic execution on fewer cores than ranks: the busy ranks share the cores (processor sharing).

:func:`passes.schedules.execution.execute_flat` gives every rank a device of its own. Ranks of a
CPU host that outnumber its cores take turns on them (:mod:`partitioner.core_sharing`): the
operating system time-slices the ranks that have work, a few milliseconds each, so over an
action's span every busy rank progresses at an equal share of the cores. Here:

* an action is ready once its rank's previous action is done and its remote dependency has
  finished plus ``comm_time``; it starts at once (no queue for a core);
* while ``n`` ranks are busy, each progresses at ``min(1, cores / n)`` of a core, and while
  ``n > cores`` (the cores time-sliced) their work also takes ``slowdown`` times its CPU time
  alone (:attr:`SharedCores.slowdown`: a rank that gets a core back finds its caches refilled
  by another rank's data; measured by the calibration, 1.0 where not);
* an action of no duration (a send or receive without a price) ends when it starts; a priced
  send or receive (:func:`passes.schedules.simulate`'s ``transfer_time``: the CPU a gloo message
  takes on its rank) is work like any other;
* after its last action a rank runs its tail (``tails[rank]``: the once-per-step gradient
  reduction and optimizer step) as work too.

The simulation is event driven: between two events (an action ending, a dependency's message
arriving) the set of busy ranks is fixed, so every busy rank's remaining work falls linearly;
the next event is the earliest of those ends and arrivals. With ``cores`` at least the ranks and
``slowdown`` 1, every action runs at full speed: :func:`execute_flat`'s times.
The result has the shape of :func:`execute_flat`'s, plus each rank's finish (its tail's end).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from passes.schedules.execution import ScheduleIndex
    from passes.schedules.schedule import Schedule

logger = logging.getLogger(__name__)

_TAIL = -1
"""A rank's tail (its list done) in place of a flat position."""
_EPS = 1e-12


@dataclass(frozen=True)
class SharedCores:
    """How a host's ranks share its cores, for :func:`passes.schedules.simulate`'s ``cores``."""

    cores: int
    """How many ranks compute at once at full speed."""
    slowdown: float = 1.0
    """CPU time of work done while more ranks are busy than cores, over its CPU time alone (>= 1)."""

    def __post_init__(self):
        if self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        if not self.slowdown >= 1.0:
            raise ValueError(f"the slowdown of time-sliced cores must be >= 1, got {self.slowdown}")


class _SharedRun:
    """One execution's state: times per flat position, each rank's progress and current work."""

    def __init__(self, schedule: Schedule, index: ScheduleIndex, durations: list, comm_time: float, sharing):
        self.offsets, self.wait, _ = index.flat
        ranks = schedule.num_ranks
        self.stops = [self.offsets[r] + len(schedule.actions[r]) for r in range(ranks)]
        self.durations, self.comm_time, self.sharing = durations, comm_time, sharing
        self.start = [0.0] * len(self.wait)
        self.end = [-1.0] * len(self.wait)  # -1: not finished
        self.ptr = list(self.offsets)
        self.left: dict = {}  # busy rank -> (position or _TAIL, work left in seconds alone)
        self.arriving: dict = {}  # rank -> time its next action's message arrives
        self.blocked: dict = {}  # position not finished yet -> ranks waiting on it
        self.finish = [-1.0] * ranks
        self.tails: list = [0.0] * ranks
        self.now = 0.0

    def offer(self, rank: int) -> None:
        """Start ``rank``'s next action (or its tail) now, or note what it waits for."""
        i = self.ptr[rank]
        if i >= self.stops[rank]:
            if self.finish[rank] < 0 and rank not in self.left:
                self.left[rank] = (_TAIL, self.tails[rank])
            return
        w = self.wait[i]
        if w == -2:
            return
        if w >= 0:
            if self.end[w] < 0:
                self.blocked.setdefault(w, []).append(rank)
                return
            if self.end[w] + self.comm_time > self.now + _EPS:
                self.arriving[rank] = self.end[w] + self.comm_time
                return
        self.start[i] = self.now
        self.left[rank] = (i, self.durations[i])

    def rate(self) -> float:
        busy = sum(1 for _, work in self.left.values() if work > _EPS)
        if busy <= self.sharing.cores:
            return 1.0
        return self.sharing.cores / busy / self.sharing.slowdown

    def complete(self, rank: int) -> None:
        item, _ = self.left.pop(rank)
        if item == _TAIL:
            self.finish[rank] = self.now
            return
        self.end[item] = self.now
        self.ptr[rank] = item + 1
        for waiting in self.blocked.pop(item, []):
            self.offer(waiting)
        self.offer(rank)

    def run(self, tails: list) -> list:
        """Execute to the fixed point; each rank's finish time (-1: it never finished its list)."""
        self.tails = tails
        for rank in range(len(self.finish)):
            self.offer(rank)
        while self.left or self.arriving:
            done = [r for r, (_, work) in self.left.items() if work <= _EPS]
            if done:  # items of no work end when they start (and may start others)
                for r in sorted(done):
                    if r in self.left:
                        self.complete(r)
                continue
            rate = self.rate()
            step = min([work / rate for _, work in self.left.values()] + [t - self.now for t in self.arriving.values()])
            self.now += step
            self.left = {r: (item, work - step * rate) for r, (item, work) in self.left.items()}
            for r, t in sorted(self.arriving.items()):
                if t <= self.now + _EPS:
                    del self.arriving[r]
                    self.offer(r)
        return self.finish


def execute_shared(
    schedule: Schedule, index: ScheduleIndex, durations: list, comm_time: float, sharing: SharedCores, tails: list
) -> tuple:
    """(start, end, how far each rank got, each rank's finish: its tail's end) of ``schedule``
    run with its busy ranks sharing ``sharing.cores`` cores (see the module docstring)."""
    state = _SharedRun(schedule, index, durations, comm_time, sharing)
    finish = state.run(list(tails))
    return state.start, state.end, [state.ptr[r] - state.offsets[r] for r in range(schedule.num_ranks)], finish
