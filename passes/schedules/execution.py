"""Symbolic execution of a schedule: what each action waits for, and when everything runs.

Every rank runs its list in order; a send is buffered (it never waits); a receive completes only
once its matching send has been issued; in a compute-only schedule an action waits for its
dependency on another rank instead. Each action waits for at most one action of another rank
(:meth:`ScheduleIndex.remote_wait`), and once that has run it stays run (readiness is monotone),
so advancing every rank as far as it can until nothing moves reaches the same fixed point in any
order (:func:`execute`, a worklist over flat positions in :func:`execute_flat`). The checker
reads deadlocks off the ranks stuck there; the simulator and :meth:`Schedule.grid` read the
start and end times.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from passes.schedules.actions import Action, ActionKind, format_action

if TYPE_CHECKING:
    from passes.schedules.schedule import Schedule

logger = logging.getLogger(__name__)


class ScheduleIndex:
    """Where each action sits, and what each action waits for on another rank."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.lowered = schedule.has_communication

    @functools.cached_property
    def where(self) -> dict:
        """Action -> [(rank, step), ...] (built on first use: a plainly valid compute-only
        schedule, :func:`plainly_valid`, is simulated without it)."""
        where = defaultdict(list)
        for rank, acts in enumerate(self.schedule.actions):
            for step, a in enumerate(acts):
                where[a].append((rank, step))
        return where

    @functools.cached_property
    def _messages(self) -> tuple:
        """The k-th receive on channel (a, b) matches the k-th send on it: (sends, receives: channel
        -> positions in order; the k of each receive's position)."""
        sends, recvs, number = defaultdict(list), defaultdict(list), {}
        owner = self.schedule.stage_to_rank
        for rank, acts in enumerate(self.schedule.actions):
            for step, a in enumerate(acts):
                if a.peer is not None and a.peer < self.schedule.num_stages:  # a send or receive
                    key = (rank, owner[a.peer]) if a.is_send else (owner[a.peer], rank)
                    if a.is_recv:
                        number[(rank, step)] = len(recvs[key])
                    (sends if a.is_send else recvs)[key].append((rank, step))
        return sends, recvs, number

    @property
    def sends(self) -> dict:
        return self._messages[0]

    @property
    def recvs(self) -> dict:
        return self._messages[1]

    @property
    def recv_number(self) -> dict:
        return self._messages[2]

    @functools.cached_property
    def positions(self) -> dict:
        """(kind, stage, microbatch) -> the first (rank, step) holding such an action (a send or
        receive's peer left out of the key)."""
        first: dict = {}
        for r, acts in enumerate(self.schedule.actions):
            for i, a in enumerate(acts):
                first.setdefault((a.kind, a.stage, a.microbatch), (r, i))
        return first

    @functools.cached_property
    def waits(self) -> list:
        """waits[rank][step]: :meth:`remote_wait` of every action (computed once per schedule; for
        a compute-only schedule from two tables of first positions, the same answers)."""
        s = self.schedule
        if self.lowered:
            return [[self.remote_wait(r, i) for i in range(len(acts))] for r, acts in enumerate(s.actions)]
        F, B, I = ActionKind.F, ActionKind.B, ActionKind.I  # noqa: E741
        first = self.positions
        owner, stages = s.stage_to_rank, s.num_stages
        out = []
        for r, acts in enumerate(s.actions):
            row: list = []
            for a in acts:
                wait = None
                st, mb = a.stage, a.microbatch
                if a.kind is F and 0 < st < stages and owner[st - 1] != r:
                    wait = first.get((F, st - 1, mb)) or f"{format_action(Action(F, st - 1, mb))}, which no rank runs"
                elif (a.kind is B or a.kind is I) and st < stages - 1 and owner[st + 1] != r:
                    wait = (
                        first.get((B, st + 1, mb))
                        or first.get((I, st + 1, mb))
                        or f"the backward of stage {st + 1} microbatch {mb}, which no rank runs"
                    )
                row.append(wait)
            out.append(row)
        return out

    @functools.cached_property
    def flat(self) -> tuple:
        """The schedule as flat lists, positions numbered rank by rank: (offset of each rank's
        first action, each action's remote wait as a position, -1 for none, -2 for one that never
        runs; each action's ``is_compute``)."""
        offsets, n = [], 0
        for acts in self.schedule.actions:
            offsets.append(n)
            n += len(acts)
        wait = [
            -1 if w is None else -2 if isinstance(w, str) else offsets[w[0]] + w[1] for row in self.waits for w in row
        ]
        compute = [a.is_compute for acts in self.schedule.actions for a in acts]
        return offsets, wait, compute

    def first(self, action):
        found = self.where.get(action)
        return found[0] if found else None

    def backward(self, stage, mb):
        """Position of ``B`` or ``I`` of (stage, mb), whichever exists."""
        return self.first(Action(ActionKind.B, stage, mb)) or self.first(Action(ActionKind.I, stage, mb))

    def remote_wait(self, rank, step):
        """The one action on another rank that (rank, step) waits for: a position, None (no
        wait), or a string naming what it waits for when nobody runs it (waits forever)."""
        s = self.schedule
        a = s.actions[rank][step]
        owner = s.stage_to_rank
        if a.is_recv:
            if a.peer >= s.num_stages:
                return f"a message from stage {a.peer}, which does not exist"
            key = (owner[a.peer], rank)
            k = self.recv_number[(rank, step)]
            sends = self.sends.get(key, [])
            if k < len(sends):
                return sends[k]
            return f"message #{k} from rank {key[0]} to rank {rank}, which rank {key[0]} never sends"
        if self.lowered or not a.is_compute or a.stage >= s.num_stages:
            return None
        if a.kind == ActionKind.F and a.stage > 0 and owner[a.stage - 1] != rank:
            dep = Action(ActionKind.F, a.stage - 1, a.microbatch)
            return self.first(dep) or f"{format_action(dep)}, which no rank runs"
        if a.is_backward and a.stage < s.num_stages - 1 and owner[a.stage + 1] != rank:
            return (
                self.backward(a.stage + 1, a.microbatch)
                or f"the backward of stage {a.stage + 1} microbatch {a.microbatch}, which no rank runs"
            )
        return None


@dataclass
class Execution:
    start: dict
    """(rank, step) -> start time, for every action that ran."""
    end: dict
    stuck: dict
    """rank -> the step it cannot get past (ranks that finished are absent)."""


def execute(
    schedule: Schedule, duration: Callable[[Action], float], comm_time: float = 0.0, index: ScheduleIndex | None = None
) -> Execution:
    """Run every rank's list in order; an action starts when its rank is free and its remote
    dependency (if any) has finished plus ``comm_time``. Stops at the fixed point."""
    index = index or ScheduleIndex(schedule)
    offsets = index.flat[0]
    durations = [duration(a) for acts in schedule.actions for a in acts]
    start, end, ptr = execute_flat(schedule, index, durations, comm_time)
    started, ended = {}, {}
    for rank in range(schedule.num_ranks):
        for i in range(ptr[rank]):
            started[(rank, i)], ended[(rank, i)] = start[offsets[rank] + i], end[offsets[rank] + i]
    stuck = {r: ptr[r] for r in range(schedule.num_ranks) if ptr[r] < len(schedule.actions[r])}
    return Execution(started, ended, stuck)


def execute_flat(schedule: Schedule, index: ScheduleIndex, durations: list, comm_time: float) -> tuple:
    """:func:`execute` on the flat positions of :attr:`ScheduleIndex.flat` (``durations`` >= 0, one per
    position): (start, end, how far each rank got). A worklist: each rank runs until it meets a
    remote dependency that has not finished and waits on that position; finishing an action
    wakes the ranks waiting on it. Every action is visited once, and start times depend only on
    the dependencies, not on the order ranks are advanced: the module docstring's fixed point."""
    offsets, wait, _ = index.flat
    ranks = schedule.num_ranks
    stops = [offsets[r] + len(schedule.actions[r]) for r in range(ranks)]
    start = [0.0] * len(wait)
    end = [-1.0] * len(wait)  # -1: not finished
    ptr = list(offsets)
    clock = [0.0] * ranks
    blocked: dict = {}  # position not finished yet -> ranks waiting on it
    ready = list(range(ranks - 1, -1, -1))
    while ready:
        rank = ready.pop()
        i, stop, now = ptr[rank], stops[rank], clock[rank]
        while i < stop:
            w = wait[i]
            begin = now
            if w >= 0:
                done = end[w]
                if done < 0:
                    blocked.setdefault(w, []).append(rank)
                    break
                if done + comm_time > now:
                    begin = done + comm_time
            elif w == -2:  # waits for an action nobody runs
                break
            start[i] = begin
            end[i] = now = begin + durations[i]
            if i in blocked:
                ready.extend(blocked.pop(i))
            i += 1
        ptr[rank], clock[rank] = i, now
    return start, end, [ptr[r] - offsets[r] for r in range(ranks)]
