"""A pipeline schedule: one list of actions per rank, as a value, and its text form.

A whole schedule is a header and one line per rank (:func:`format_schedule`)::

    # name=1f1b ranks=2 stages=2 microbatches=2 stage_to_rank=0,1
    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1B0 1F1 1B1

Nothing here starts a process: the runtime's interpreter executes a schedule that
:func:`passes.schedules.checker.check_schedule` has already proved safe.
:meth:`Schedule.grid` replays the execution (:mod:`passes.schedules.execution`) with unit
durations to draw it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from passes.schedules.actions import Action, format_action, parse_action
from passes.schedules.execution import execute

logger = logging.getLogger(__name__)


def looped_stage_to_rank(num_ranks: int, stages_per_rank: int = 1) -> tuple:
    """Stage ``s`` on rank ``s % num_ranks`` (rank r holds stages r, r+p, r+2p, ...)."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_shape_stage_to_rank(num_ranks: int, stages_per_rank: int = 2) -> tuple:
    """Stages go down the ranks and back up: rank r holds r, 2p-1-r, 2p+r, ... (p=2: 0,1,1,0)."""
    return tuple(
        s % num_ranks if (s // num_ranks) % 2 == 0 else num_ranks - 1 - s % num_ranks
        for s in range(num_ranks * stages_per_rank)
    )


@dataclass(frozen=True, init=False)
class Schedule:
    """Per-rank action lists plus what is needed to read them. A value: compare, hash, print.

    ``actions[r]`` is rank r's program, in execution order. Construct with a mapping
    ``{rank: [Action, ...]}`` or a sequence indexed by rank; it is stored as a tuple of tuples.
    Only the shape is validated here; :func:`check_schedule` judges the content.
    """

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    """``stage_to_rank[s]`` is the rank that owns stage ``s``."""
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)

    def __init__(
        self,
        name: str,
        num_ranks: int,
        num_stages: int,
        num_microbatches: int,
        stage_to_rank: Sequence[int],
        actions: Mapping[int, Sequence[Action]] | Sequence[Sequence[Action]],
    ):
        # frozen: every field is set through object.__setattr__, after the checks
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "num_ranks", num_ranks)
        object.__setattr__(self, "num_stages", num_stages)
        object.__setattr__(self, "num_microbatches", num_microbatches)
        if not re.fullmatch(r"\S+", self.name):
            raise ValueError(f"schedule name must be one word without spaces, got {self.name!r}")
        if min(self.num_ranks, self.num_stages, self.num_microbatches) < 1:
            raise ValueError(
                f"a schedule needs at least one rank, stage and microbatch, got "
                f"ranks={self.num_ranks} stages={self.num_stages} "
                f"microbatches={self.num_microbatches}"
            )
        stage_to_rank = tuple(int(r) for r in stage_to_rank)
        if len(stage_to_rank) != self.num_stages or not all(0 <= r < self.num_ranks for r in stage_to_rank):
            raise ValueError(
                f"stage_to_rank must give a rank in [0, {self.num_ranks}) for each of the "
                f"{self.num_stages} stages, got {stage_to_rank}"
            )
        if isinstance(actions, Mapping):
            extra = sorted(set(actions) - set(range(self.num_ranks)))
            if extra:
                raise ValueError(f"actions given for ranks {extra}, but the schedule has {self.num_ranks} ranks")
            actions = [actions.get(r, ()) for r in range(self.num_ranks)]
        if len(actions) != self.num_ranks:
            raise ValueError(f"need one action list per rank ({self.num_ranks}), got {len(actions)}")
        object.__setattr__(self, "stage_to_rank", stage_to_rank)
        object.__setattr__(self, "actions", tuple(tuple(a) for a in actions))

    @property
    def has_communication(self) -> bool:
        return any(not a.is_compute for acts in self.actions for a in acts)

    def stages_of(self, rank: int) -> list:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def with_actions(self, rank: int, actions: Sequence[Action]) -> Schedule:
        """A copy with rank ``rank``'s program replaced (to edit schedules, e.g. in tests)."""
        new = list(self.actions)
        new[rank] = tuple(actions)
        return Schedule(
            self.name, self.num_ranks, self.num_stages, self.num_microbatches, self.stage_to_rank, tuple(new)
        )

    def grid(self, *, highlight=()) -> str:
        """A printable grid: one row per rank, one column per unit time step of compute actions.

        Every compute action takes one step and waits for its dependencies, so empty cells
        (``.``) are the bubble. Cells hold the action's text form (``2F0``), so each compute
        action appears exactly once. Actions at ``(rank, step)`` in ``highlight`` get a ``!``.
        Actions that can never run (deadlock) follow a ``|`` in program order.
        Sends and receives are not drawn; :func:`format_schedule` lists them.
        """
        run = execute(self, lambda a: 1.0 if a.is_compute else 0.0)
        highlight = set(highlight)

        def cell(rank, step):
            return format_action(self.actions[rank][step]) + ("!" if (rank, step) in highlight else "")

        width_t = int(max(run.end.values(), default=0))
        rows = []
        for rank, acts in enumerate(self.actions):
            row = ["."] * width_t
            stuck = []
            for step, action in enumerate(acts):
                if not action.is_compute:
                    continue
                if (rank, step) in run.start:
                    row[int(run.start[(rank, step)])] = cell(rank, step)
                else:
                    stuck.append(cell(rank, step))
            rows.append(row + (["|"] + stuck if stuck else []))
        width = max([len(c) for row in rows for c in row] + [len(str(width_t))])
        lines = [
            f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches (one column per time step, '.' = idle)"
        ]
        label = len(f"rank {self.num_ranks - 1}")
        lines.append(" " * label + " " + " ".join(str(t).rjust(width) for t in range(width_t)))
        for rank, row in enumerate(rows):
            lines.append(f"rank {rank}".ljust(label) + " " + " ".join(c.rjust(width) for c in row))
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return format_schedule(self)


def format_schedule(schedule: Schedule) -> str:
    """The whole schedule as text: a header line, then ``rank r: <actions>`` per rank."""
    lines = [
        f"# name={schedule.name} ranks={schedule.num_ranks} stages={schedule.num_stages} "
        f"microbatches={schedule.num_microbatches} "
        f"stage_to_rank={','.join(str(r) for r in schedule.stage_to_rank)}"
    ]
    for rank, acts in enumerate(schedule.actions):
        lines.append(" ".join([f"rank {rank}:"] + [format_action(a) for a in acts]))
    return "\n".join(lines)


def parse_schedule(text: str) -> Schedule:
    """Inverse of :func:`format_schedule`."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines or not lines[0].startswith("#"):
        raise ValueError(
            "a schedule's text starts with a header line "
            "'# name=... ranks=... stages=... microbatches=... stage_to_rank=...'"
        )
    header = dict(tok.split("=", 1) for tok in lines[0][1:].split() if "=" in tok)
    missing = {"name", "ranks", "stages", "microbatches", "stage_to_rank"} - set(header)
    if missing:
        raise ValueError(f"schedule header {lines[0]!r} lacks {sorted(missing)}")
    actions = {}
    for line in lines[1:]:
        match = re.match(r"^rank\s+(\d+):(.*)$", line)
        if not match:
            raise ValueError(f"cannot parse schedule line {line!r}: expected 'rank <r>: <actions>'")
        rank = int(match.group(1))
        if rank in actions:
            raise ValueError(f"rank {rank} appears twice in the schedule text")
        actions[rank] = [parse_action(tok) for tok in match.group(2).split()]
    return Schedule(
        header["name"],
        int(header["ranks"]),
        int(header["stages"]),
        int(header["microbatches"]),
        tuple(int(r) for r in header["stage_to_rank"].split(",")),
        actions,
    )
