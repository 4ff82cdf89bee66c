"""The schedule simulator: replay a valid schedule with durations to give timelines and the bubble.

:func:`simulate` runs the same symbolic execution as the checker
(:func:`passes.schedules.execution.execute_flat`) with per-stage durations in seconds.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from passes.schedules.actions import Action, ActionKind
from passes.schedules.checker import checked_index, deadlock_issues, raise_for_issues
from passes.schedules.execution import execute_flat
from passes.schedules.schedule import Schedule
from passes.schedules.shared_cores import SharedCores, execute_shared

logger = logging.getLogger(__name__)

StageTime = float | Mapping[int, float] | Callable[[int], float]


@dataclass(frozen=True)
class TimedAction:
    rank: int
    step: int
    """Index of the action in its rank's list."""
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class _Timed:
    """A simulation's start and end of every action, at the flat positions of :attr:`ScheduleIndex.flat`."""

    schedule: Schedule
    start: tuple
    end: tuple


@dataclass(frozen=True)
class SimulationResult:
    makespan: float
    """Seconds from the first start to the last end: one training step."""
    busy: dict
    """rank -> seconds spent computing."""
    _timed: _Timed = field(repr=False, compare=False)

    @functools.cached_property
    def timelines(self) -> dict:
        """rank -> tuple of :class:`TimedAction`, the rank's compute actions in order (seconds);
        built on first use (the configuration search reads only the makespan and busy times)."""
        timed, n, out = self._timed, 0, {}
        for r, acts in enumerate(timed.schedule.actions):
            out[r] = tuple(
                TimedAction(r, i, a, timed.start[n + i], timed.end[n + i]) for i, a in enumerate(acts) if a.is_compute
            )
            n += len(acts)
        return out

    def idle_fraction(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan if self.makespan > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: ``1 - sum(busy) / (ranks * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time, all ranks: ``(p-1)/m`` for GPipe and 1F1B with uniform
        stages, ``(p-1)/(v m)`` for interleaved 1F1B (the usual way to quote the bubble)."""
        busy = sum(self.busy.values())
        return (len(self.busy) * self.makespan - busy) / busy if busy > 0 else 0.0


def _per_stage(value: StageTime, what: str, num_stages: int) -> list:
    if callable(value):
        times = [float(value(s)) for s in range(num_stages)]
    elif isinstance(value, Mapping):
        missing = [s for s in range(num_stages) if s not in value]
        if missing:
            raise ValueError(f"{what} has no time for stages {missing}")
        times = [float(value[s]) for s in range(num_stages)]
    else:
        times = [float(value)] * num_stages
    bad = [s for s, t in enumerate(times) if not t >= 0]
    if bad:
        raise ValueError(f"{what} must be >= 0 seconds, got {[times[s] for s in bad]} for stages {bad}")
    return times


def _with_sends(schedule: Schedule) -> Schedule:
    """``schedule`` lowered with its sends and receives, kept on it (as its checked index is: the
    configuration search replays one schedule with many stage times)."""
    lowered = schedule.__dict__.get("_with_sends")
    if lowered is None:
        from passes.schedules.lowering import add_communication

        lowered = add_communication(schedule)
        object.__setattr__(schedule, "_with_sends", lowered)
    return lowered


def _transfer(transfers: list | None, action: Action) -> float:
    """Seconds of a send or receive across its boundary (the lower of its stage and its peer)."""
    if transfers is None or action.peer is None:
        return 0.0
    boundary = min(action.stage, action.peer)
    return transfers[boundary] if boundary < len(transfers) else 0.0


def simulate(
    schedule: Schedule,
    forward_time: StageTime,
    backward_time: StageTime,
    weight_time: StageTime | None = None,
    comm_time: float = 0.0,
    sync_time: StageTime | None = None,
    cores: int | SharedCores | None = None,
    transfer_time: StageTime | None = None,
) -> SimulationResult:
    """Replay a valid schedule with durations in seconds.

    Times are per stage: a number (every stage), a dict ``{stage: seconds}`` or a callable
    ``stage -> seconds``. ``backward_time`` is the full backward ``B``; a split backward takes
    ``I = B - W`` and ``W = weight_time`` (default ``B / 2``). ``comm_time`` is added to every
    dependency that crosses ranks. ``sync_time``: the stage's parameter-gradient reduction, once
    per step, after its rank's last action (:class:`runtime.pipeline.PipelineRunner` moves the
    held sums once the rank has issued everything: no other stage waits for them); it counts as
    busy time of the rank. A receive blocks its rank until the message arrives. ``transfer_time``:
    per boundary ``s`` (between stages ``s`` and ``s + 1``), the seconds a send or a receive of one
    message across it takes on its rank (a CPU host's gloo messages cost CPU; the schedule is
    lowered with :func:`add_communication` for them where it has no sends); None: sends and
    receives take no time. ``cores``: the busy ranks share that many cores (an int, or
    :class:`SharedCores` with the slowdown of time-sliced cores), each at ``min(1, cores / busy)``
    of a core (:mod:`passes.schedules.shared_cores`: ranks that outnumber a CPU host's cores);
    None: every rank has a device of its own. Raises ``ValueError`` (as :func:`assert_valid`) for
    an invalid schedule.
    """
    sharing = SharedCores(cores) if isinstance(cores, int) else cores
    transfers = None if transfer_time is None else _per_stage(transfer_time, "transfer_time", schedule.num_stages)
    if transfers is not None and not any(transfers):
        transfers = None
    if transfers is not None and not schedule.has_communication:
        schedule = _with_sends(schedule)
    index = checked_index(schedule)
    S = schedule.num_stages
    fwd = _per_stage(forward_time, "forward_time", S)
    bwd = _per_stage(backward_time, "backward_time", S)
    wgt = [b / 2 for b in bwd] if weight_time is None else _per_stage(weight_time, "weight_time", S)
    over = [s for s in range(S) if wgt[s] > bwd[s]]
    if over:
        raise ValueError(f"weight_time exceeds backward_time (B = I + W) for stages {over}")
    table = {ActionKind.F: fwd, ActionKind.B: bwd, ActionKind.W: wgt, ActionKind.I: [b - w for b, w in zip(bwd, wgt)]}
    syncs = [0.0] * S if sync_time is None else _per_stage(sync_time, "sync_time", S)

    offsets, _, compute = index.flat
    durations = [
        table[a.kind][a.stage] if a.is_compute else _transfer(transfers, a) for acts in schedule.actions for a in acts
    ]
    synced = [sum(syncs[s] for s in schedule.stages_of(r)) for r in range(schedule.num_ranks)]
    if sharing is None:
        start, end, ptr = execute_flat(schedule, index, durations, comm_time)
    else:
        start, end, ptr, finish = execute_shared(schedule, index, durations, comm_time, sharing, synced)
    if any(ptr[r] < len(acts) for r, acts in enumerate(schedule.actions)):
        raise_for_issues(schedule, deadlock_issues(schedule, index))
    stops = offsets[1:] + [len(end)]
    if sharing is None:
        finish = [max(end[offsets[r] : stops[r]], default=0.0) + synced[r] for r in range(schedule.num_ranks)]
    makespan = max([e for e, c in zip(end, compute) if c] + finish, default=0.0)
    busy = {r: sum(durations[offsets[r] : stops[r]]) + synced[r] for r in range(schedule.num_ranks)}
    return SimulationResult(makespan, busy, _Timed(schedule, tuple(start), tuple(end)))
