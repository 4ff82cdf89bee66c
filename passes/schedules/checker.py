"""The schedule checker: readable errors for a schedule that is wrong or can deadlock.

Dependency rules
----------------
For every microbatch ``m`` and stage ``s`` of ``S`` stages, where "backward" means ``B`` or ``I``:

* ``F(s, m)`` after ``F(s-1, m)``;
* backward ``(s, m)`` after ``F(s, m)`` and after backward ``(s+1, m)`` (the last stage's
  backward needs only its own forward: the loss is computed there);
* ``W(s, m)`` after ``I(s, m)``, on the same rank;
* every ``(s, m)`` has exactly one ``F`` and either one ``B`` or one ``I`` and one ``W``, on the
  rank that owns stage ``s``.

In a lowered schedule (one with sends and receives, see
:func:`passes.schedules.lowering.add_communication`) every dependency between stages on
different ranks travels as a message.

The check
---------
:func:`check_schedule` runs in two parts and returns readable errors naming the rank, the step
(the action's index in that rank's list) and the action.

1. *Static*: every action is in range and on the rank that owns its stage; every compute
   action occurs exactly once; every dependency on the same rank comes earlier in that rank's
   list; every send has a matching receive and vice versa; messages between two ranks are
   matched in order (the k-th receive on rank b from rank a takes the k-th send from a to b,
   as NCCL and untagged gloo do), so the k-th send and the k-th receive must name the same
   message.
2. *Deadlock*: execute all lists symbolically (:mod:`passes.schedules.execution`) to the fixed
   point. If some rank has not finished there, no execution can finish it: each stuck rank is
   reported with the action it waits for and where that one's rank is stuck. If every rank
   finishes, the completion order is a global order that respects every per-rank order and puts
   each send before its receive: the proof that the schedule runs.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from passes.schedules.actions import PEER_OFFSET, Action, ActionKind, format_action
from passes.schedules.execution import Execution, ScheduleIndex, execute
from passes.schedules.schedule import Schedule

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Issue:
    message: str
    rank: int | None = None
    step: int | None = None
    action: Action | None = None

    def __str__(self):
        if self.rank is None:
            return self.message
        where = f"rank {self.rank}" if self.step is None else f"rank {self.rank} step {self.step}"
        if self.action is not None:
            where += f" ({format_action(self.action)})"
        return f"{where}: {self.message}"


def _local_needs(schedule: Schedule, index: ScheduleIndex, a: Action) -> list:
    """Actions that must come earlier on the same rank as ``a`` (those that exist somewhere)."""
    owner, last = schedule.stage_to_rank, schedule.num_stages - 1
    F, B = ActionKind.F, ActionKind.B
    needs = []
    if a.kind == F and a.stage > 0:
        if owner[a.stage - 1] == owner[a.stage]:
            needs.append(Action(F, a.stage - 1, a.microbatch))
        elif index.lowered:
            needs.append(Action(ActionKind.RECV_F, a.stage, a.microbatch, a.stage - 1))
    elif a.is_backward:
        needs.append(Action(F, a.stage, a.microbatch))
        if a.stage < last:
            if owner[a.stage + 1] == owner[a.stage]:
                pos = index.backward(a.stage + 1, a.microbatch)
                if pos:
                    needs.append(schedule.actions[pos[0]][pos[1]])
            elif index.lowered:
                needs.append(Action(ActionKind.RECV_B, a.stage, a.microbatch, a.stage + 1))
    elif a.kind == ActionKind.W:
        needs.append(Action(ActionKind.I, a.stage, a.microbatch))
    elif a.kind == ActionKind.SEND_F:
        needs.append(Action(F, a.stage, a.microbatch))
    elif a.kind == ActionKind.SEND_B:
        pos = index.backward(a.stage, a.microbatch)
        needs.append(schedule.actions[pos[0]][pos[1]] if pos else Action(B, a.stage, a.microbatch))
    return needs


def static_issues(schedule: Schedule, index: ScheduleIndex) -> list:
    issues = []
    S, M, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    for rank, acts in enumerate(schedule.actions):
        for step, a in enumerate(acts):

            def issue(msg, rank=rank, step=step, a=a):
                issues.append(_Issue(msg, rank, step, a))

            if a.stage >= S or a.microbatch >= M:
                issue(f"out of range: the schedule has stages 0..{S - 1} and microbatches 0..{M - 1}")
                continue
            if owner[a.stage] != rank:
                issue(f"stage {a.stage} belongs to rank {owner[a.stage]}, not rank {rank}")
            if not a.is_compute:
                if a.peer != a.stage + PEER_OFFSET[a.kind]:
                    issue(
                        f"{a.kind.value} of stage {a.stage} must have peer stage "
                        f"{a.stage + PEER_OFFSET[a.kind]}, not {a.peer}"
                    )
                    continue
                if not 0 <= a.peer < S:
                    issue(f"peer stage {a.peer} does not exist")
                    continue
                if owner[a.peer] == owner[a.stage]:
                    issue(
                        f"stages {a.stage} and {a.peer} are both on rank {owner[a.stage]}: "
                        "no communication is needed between them"
                    )
                    continue
                if index.first(a.counterpart()) is None:
                    verb = "receives" if a.is_send else "sends"
                    issue(f"no matching {format_action(a.counterpart())}: rank {owner[a.peer]} never {verb} it")
            seen = index.where[a]
            if len(seen) > 1 and seen[0] != (rank, step):
                issue(f"duplicate of rank {seen[0][0]} step {seen[0][1]}")
            for need in _local_needs(schedule, index, a):
                pos = index.first(need)
                if pos is None:
                    if not need.is_compute:  # a missing compute action is reported below
                        issue(f"needs {format_action(need)} earlier on rank {rank}, and there is none")
                elif pos[0] == rank and pos[1] > step:
                    issue(f"needs {format_action(need)}, which rank {rank} runs later (step {pos[1]})")

    kinds = Counter((a.kind, a.stage, a.microbatch) for acts in schedule.actions for a in acts if a.is_compute)
    for s in range(S):
        for mb in range(M):
            n = {k: kinds[(k, s, mb)] for k in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)}
            what = f"stage {s} microbatch {mb}"
            if n[ActionKind.F] == 0:
                issues.append(_Issue(f"{what} has no forward {s}F{mb}", owner[s]))
            # Duplicates are reported at the action; here only which kinds are present matters.
            present = tuple(min(n[k], 1) for k in (ActionKind.B, ActionKind.I, ActionKind.W))
            if present not in ((1, 0, 0), (0, 1, 1)):
                if n[ActionKind.B] and (n[ActionKind.I] or n[ActionKind.W]):
                    msg = f"{what} has both a full backward {s}B{mb} and a split one (I/W)"
                elif n[ActionKind.I] and not n[ActionKind.W]:
                    msg = f"{what} has {s}I{mb} but no weight gradient {s}W{mb}"
                elif n[ActionKind.W] and not n[ActionKind.I]:
                    msg = f"{what} has {s}W{mb} but no input gradient {s}I{mb}"
                else:
                    msg = f"{what} has no backward ({s}B{mb}, or {s}I{mb} and {s}W{mb})"
                issues.append(_Issue(msg, owner[s]))

    # Messages between two ranks are matched in order: the k-th send and k-th receive must agree.
    for key in sorted(set(index.sends) | set(index.recvs)):
        sends, recvs = index.sends.get(key, []), index.recvs.get(key, [])
        for k, (spos, rpos) in enumerate(zip(sends, recvs)):
            sent = schedule.actions[spos[0]][spos[1]]
            got = schedule.actions[rpos[0]][rpos[1]]
            if sent.counterpart() != got:
                issues.append(
                    _Issue(
                        f"messages from rank {key[0]} to rank {key[1]} are matched in order, and message "
                        f"#{k} is {format_action(sent)} (rank {spos[0]} step {spos[1]}): the data would go "
                        "to the wrong microbatch or stage",
                        rpos[0],
                        rpos[1],
                        got,
                    )
                )
    return issues


def deadlock_issues(schedule: Schedule, index: ScheduleIndex, run: Execution | None = None) -> list:
    """The stuck ranks of ``run`` (default: an execution with zero durations; any durations reach
    the same fixed point), each with what it waits for."""
    run = run or execute(schedule, lambda a: 0.0, index=index)
    issues = []
    for rank, step in run.stuck.items():
        wait = index.remote_wait(rank, step)
        if isinstance(wait, str):
            why = f"waits for {wait}"
        else:
            other, other_step = wait
            blocker = run.stuck[other]
            awaited = format_action(schedule.actions[other][other_step])
            why = f"waits for {awaited} on rank {other} (step {other_step})"
            if blocker == other_step:
                why += ", which is stuck itself"
            else:
                why += (
                    f", which rank {other} never reaches: it is stuck at step {blocker} "
                    f"({format_action(schedule.actions[other][blocker])})"
                )
        issues.append(_Issue(f"deadlock: {why}", rank, step, schedule.actions[rank][step]))
    return issues


def _issues(schedule: Schedule) -> list:
    index = ScheduleIndex(schedule)
    return static_issues(schedule, index) + deadlock_issues(schedule, index)


def check_schedule(schedule: Schedule) -> list:
    """Readable errors (``[]`` when the schedule is valid and cannot deadlock); see the module
    docstring for the rules and the algorithm."""
    return [str(issue) for issue in _issues(schedule)]


def assert_valid(schedule: Schedule) -> None:
    """Raise ``ValueError`` with the errors and the grid (offending actions marked ``!``)."""
    raise_for_issues(schedule, _issues(schedule))


def raise_for_issues(schedule: Schedule, issues: list) -> None:
    if issues:
        marks = [(i.rank, i.step) for i in issues if i.step is not None]
        raise ValueError(
            f"invalid pipeline schedule {schedule.name!r} ({len(issues)} errors):\n"
            + "\n".join(f"  - {i}" for i in issues)
            + "\n\n"
            + schedule.grid(highlight=marks)
        )


def checked_index(schedule: Schedule) -> ScheduleIndex:
    """The schedule's :class:`ScheduleIndex` once its static checks passed (else ``ValueError`` as
    :func:`assert_valid`), kept on the schedule: a schedule simulated again (the configuration
    search replays one schedule with many stage times) is indexed and checked once. The deadlock
    part of the check is the simulation's own execution (the same fixed point)."""
    index = schedule.__dict__.get("_checked_index")
    if index is None:
        index = ScheduleIndex(schedule)
        if not plainly_valid(schedule, index):  # then the full check, which names what is wrong
            raise_for_issues(schedule, static_issues(schedule, index))
        object.__setattr__(schedule, "_checked_index", index)
    return index


def plainly_valid(schedule: Schedule, index: ScheduleIndex | None = None) -> bool:
    """True only when a compute-only schedule passes every static check of :func:`static_issues`
    (each action in range, on its stage's rank, once; every (stage, microbatch) with ``F`` and
    either ``B`` or ``I`` and ``W``; the same-rank dependencies in order), checked on tables of
    positions; False means "run the full check" (it names the errors), not "invalid"."""
    index = index or ScheduleIndex(schedule)
    if index.lowered:
        return False
    S, M, owner = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    pos = index.positions
    if len(pos) != sum(len(acts) for acts in schedule.actions):  # some action repeated
        return False
    if any(s >= S or mb >= M or owner[s] != rank for (_, s, mb), (rank, _) in pos.items()):
        return False
    F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741
    for s in range(S):
        for mb in range(M):
            f, b, i, w = (pos.get((k, s, mb)) for k in (F, B, I, W))
            if f is None or (b is None) == (i is None) or (i is None) != (w is None):
                return False
            back = b or i
            assert back is not None
            if back[1] < f[1] or (w is not None and i is not None and w[1] < i[1]):
                return False
            if s > 0 and owner[s - 1] == owner[s] and pos[(F, s - 1, mb)][1] > f[1]:
                return False
            if s < S - 1 and owner[s + 1] == owner[s]:
                later = pos.get((B, s + 1, mb)) or pos.get((I, s + 1, mb))
                if later is None or later[1] > back[1]:
                    return False
    return True
