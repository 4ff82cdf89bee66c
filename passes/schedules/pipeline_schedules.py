"""Pipeline schedules as data (decision 8 in docs/ARCHITECTURE.md): generate, lower, check, simulate.

A schedule is one list of actions per rank. Nothing here starts a process: the runtime's
interpreter executes a schedule that :func:`check_schedule` has already proved safe.

Text form
---------
One action is ``<stage><KIND><microbatch>``, with ``->peer`` for a send and ``<-peer`` for a
receive (``peer`` is the stage at the other end)::

    2F0          stage 2, forward of microbatch 0
    1B3          stage 1, full backward (input and weight gradients) of microbatch 3
    0I1  0W1     stage 0, input-gradient-only backward / weight-gradient of microbatch 1
    1SEND_F0->2  stage 1 sends microbatch 0's activation to stage 2
    2RECV_F0<-1  stage 2 receives it from stage 1
    2SEND_B0->1  stage 2 sends microbatch 0's input gradient to stage 1
    1RECV_B0<-2  stage 1 receives it

Numbers have no leading zeros, so ``format_action(parse_action(s)) == s`` for every valid
``s``. A whole schedule is a header and one line per rank (:func:`format_schedule`)::

    # name=1f1b ranks=2 stages=2 microbatches=2 stage_to_rank=0,1
    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1B0 1F1 1B1

Generators
----------
:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b` (``v`` looped stages per rank,
``m`` a multiple of ``p``) and :func:`zb_h1` (zero bubble, backward split into ``I`` and ``W``)
return compute-only schedules; :func:`add_communication` lowers them. Combinations that cannot
be scheduled raise ``ValueError`` naming the numbers; everything returned passes the checker.
:data:`SCHEDULES` is the one registry of them by the names users give (``gpipe``, ``1f1b``,
``interleaved``, ``zb-h1``), each with its activations in flight per stage and its closed-form
bubble; configuration checks, the builder, the automatic choice and the benchmarks read it.

Dependency rules
----------------
For every microbatch ``m`` and stage ``s`` of ``S`` stages, where "backward" means ``B`` or ``I``:

* ``F(s, m)`` after ``F(s-1, m)``;
* backward ``(s, m)`` after ``F(s, m)`` and after backward ``(s+1, m)`` (the last stage's
  backward needs only its own forward: the loss is computed there);
* ``W(s, m)`` after ``I(s, m)``, on the same rank;
* every ``(s, m)`` has exactly one ``F`` and either one ``B`` or one ``I`` and one ``W``, on the
  rank that owns stage ``s``.

In a lowered schedule (one with sends and receives, see :func:`add_communication`) every
dependency between stages on different ranks travels as a message: the producer's rank runs
``SEND`` after the producing action, the consumer's rank runs the matching ``RECV`` before the
consuming action. Stages that share a rank exchange nothing.

The checker
-----------
:func:`check_schedule` runs in two parts and returns readable errors naming the rank, the step
(the action's index in that rank's list) and the action.

1. *Static*: every action is in range and on the rank that owns its stage; every compute
   action occurs exactly once; every dependency on the same rank comes earlier in that rank's
   list; every send has a matching receive and vice versa; messages between two ranks are
   matched in order (the k-th receive on rank b from rank a takes the k-th send from a to b,
   as NCCL and untagged gloo do), so the k-th send and the k-th receive must name the same
   message.
2. *Deadlock*: execute all lists symbolically. Each rank runs its list in order; a send is
   buffered (it never waits); a receive completes only once its matching send has been issued;
   in a compute-only schedule an action waits for its dependency on another rank instead. Each
   action waits for at most one action of another rank, and once that has run it stays run
   (readiness is monotone), so advancing every rank as far as it can until nothing moves reaches
   the same fixed point in any order. If some rank has not finished there, no execution can
   finish it: each stuck rank is reported with the action it waits for and where that one's
   rank is stuck. If every rank finishes, the completion order is a global order that respects
   every per-rank order and puts each send before its receive: the proof that the schedule runs.

:func:`simulate` replays the same execution with durations (seconds) to give timelines and the
bubble (idle) fraction; :meth:`Schedule.grid` replays it with unit durations to draw the grid.
"""

from __future__ import annotations

import functools
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "SimulationResult",
    "TimedAction",
    "format_action",
    "parse_action",
    "format_schedule",
    "parse_schedule",
    "looped_stage_to_rank",
    "v_shape_stage_to_rank",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "add_communication",
    "check_schedule",
    "assert_valid",
    "simulate",
    "peak_in_flight",
    "stage_in_flight",
    "stage_durations",
    "stage_syncs",
    "choose_schedule",
    "auto_stage_in_flight",
    "ScheduleKind",
    "SCHEDULES",
    "AUTO_SCHEDULES",
    "schedule_kind",
]


class ActionKind(str, Enum):
    F = "F"
    """Forward."""
    B = "B"
    """Full backward: input and weight gradients."""
    I = "I"  # noqa: E741
    """Backward for the input gradient only (zero-bubble split)."""
    W = "W"
    """Weight gradient only; needs the stage's ``I`` first."""
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


_KIND_OF = {k.value: k for k in ActionKind}
_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
_SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
_RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
# Where the peer of a communication action sits relative to its own stage.
_PEER_OFFSET = {ActionKind.SEND_F: 1, ActionKind.RECV_F: -1, ActionKind.SEND_B: -1, ActionKind.RECV_B: 1}
_COUNTERPART = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.RECV_B: ActionKind.SEND_B,
}


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    stage: int
    """The (virtual) stage that runs the action."""
    microbatch: int
    peer: int | None = None
    """For sends and receives: the stage at the other end. ``None`` for compute actions."""

    def __post_init__(self):
        if self.kind.__class__ is not ActionKind:  # a plain string such as "F"
            object.__setattr__(self, "kind", _KIND_OF.get(self.kind) or ActionKind(self.kind))
        if self.stage < 0 or self.microbatch < 0 or (self.peer is not None and self.peer < 0):
            raise ValueError(
                f"stage, microbatch and peer must be >= 0, got {self.stage}, {self.microbatch} and {self.peer}"
            )
        if self.is_compute != (self.peer is None):
            need = "takes no peer" if self.is_compute else "needs the peer stage"
            raise ValueError(f"action kind {self.kind.value} {need} (got peer={self.peer})")

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self.kind in _SENDS

    @property
    def is_recv(self) -> bool:
        return self.kind in _RECVS

    @property
    def is_backward(self) -> bool:
        """``B`` or ``I``: the action that produces the stage's input gradient."""
        return self.kind in (ActionKind.B, ActionKind.I)

    @property
    def makes_weight_grads(self) -> bool:
        """``B`` or ``W``: the action that produces the stage's parameter gradients."""
        return self.kind in (ActionKind.B, ActionKind.W)

    def counterpart(self) -> Action:
        """The receive matching this send, or the send matching this receive."""
        assert self.peer is not None, "a compute action has no counterpart"  # sends and receives have a peer
        return Action(_COUNTERPART[self.kind], self.peer, self.microbatch, self.stage)

    def __str__(self) -> str:
        return format_action(self)


def format_action(action: Action) -> str:
    """``Action(F, 2, 0)`` -> ``"2F0"``; ``Action(SEND_F, 1, 0, peer=2)`` -> ``"1SEND_F0->2"``."""
    text = f"{action.stage}{action.kind.value}{action.microbatch}"
    if action.is_send:
        text += f"->{action.peer}"
    elif action.is_recv:
        text += f"<-{action.peer}"
    return text


_NUM = r"(0|[1-9][0-9]*)"
_ACTION_RE = re.compile(rf"^{_NUM}(SEND_F|SEND_B|RECV_F|RECV_B|F|B|I|W){_NUM}(?:(->|<-){_NUM})?$")


def parse_action(text: str) -> Action:
    """Inverse of :func:`format_action`; raises ``ValueError`` naming the text it cannot read."""
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ValueError(
            f"cannot parse pipeline action {text!r}: expected <stage><KIND><microbatch> "
            "like '2F0', '1B3', '0W1', '1SEND_F0->2' or '2RECV_F0<-1'"
        )
    stage, kind, mb, arrow, peer = match.groups()
    kind = ActionKind(kind)
    expected_arrow = "->" if kind in _SENDS else "<-" if kind in _RECVS else None
    if arrow != expected_arrow:
        need = f"'{expected_arrow}<peer stage>'" if expected_arrow else "no peer"
        raise ValueError(f"cannot parse pipeline action {text!r}: {kind.value} takes {need}")
    return Action(kind, int(stage), int(mb), None if peer is None else int(peer))


# ---------------------------------------------------------------------------------------------
# Schedule


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
        run = _execute(self, lambda a: 1.0 if a.is_compute else 0.0)
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


# ---------------------------------------------------------------------------------------------
# Generators (compute actions only; add_communication lowers them)


def _check_counts(name: str, p: int, m: int):
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ValueError(f"{name} needs at least one rank and one microbatch, got p={p!r}, m={m!r}")


def _from_orders(name, p, m, stage_to_rank, orders) -> Schedule:
    return Schedule(
        name,
        p,
        len(stage_to_rank),
        m,
        stage_to_rank,
        {r: [Action(k, s, mb) for k, s, mb in order] for r, order in orders.items()},
    )


def gpipe(p: int, m: int, *, v: int = 1, layout: str = "loop") -> Schedule:
    """All forwards, then all backwards (GPipe). Any ``m >= 1``, also ``m < p``.

    With ``v > 1`` each rank holds ``v`` stages (``layout="loop"`` or ``"v"``): a rank runs its
    stages' forwards in stage order, then their backwards in reverse stage order.
    """
    _check_counts("gpipe", p, m)
    if v < 1 or layout not in ("loop", "v"):
        raise ValueError(f"gpipe needs v >= 1 and layout 'loop' or 'v', got v={v}, layout={layout!r}")
    stage_to_rank = (looped_stage_to_rank if layout == "loop" else v_shape_stage_to_rank)(p, v)
    orders = {r: [] for r in range(p)}
    for r in range(p):
        stages = [s for s, owner in enumerate(stage_to_rank) if owner == r]
        orders[r] += [("F", s, mb) for s in stages for mb in range(m)]
        orders[r] += [("B", s, mb) for s in reversed(stages) for mb in range(m)]
    return _from_orders("gpipe" if v == 1 else f"gpipe_{layout}{v}", p, m, stage_to_rank, orders)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: rank r runs ``p-1-r`` warm-up forwards, then alternates one forward and one backward,
    then drains the backwards. At most ``p-r`` microbatches are in flight on rank r.
    ``m < p`` is allowed (the warm-up is cut to ``m``; the schedule degrades towards GPipe)."""
    _check_counts("one_f_one_b", p, m)
    orders = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [("F", r, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            order += [("F", r, warmup + i), ("B", r, i)]
        order += [("B", r, mb) for mb in range(m - warmup, m)]
        orders[r] = order
    return _from_orders("1f1b", p, m, looped_stage_to_rank(p), orders)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): ``v >= 2`` stages per rank, looped (stage s on rank s % p).

    Rank r walks "virtual microbatches" k = 0 .. m*v-1: forward k runs microbatch
    ``(k // (p*v)) * p + k % p`` on its chunk ``(k // p) % v``; backwards walk the chunks in
    reverse. Microbatches move through the chunks in groups of p, so ``m`` must be a multiple
    of ``p`` (which also rules out ``m < p``). Warm-up is ``2(p-1-r) + (v-1)p`` forwards.
    """
    _check_counts("interleaved_1f1b", p, m)
    if not isinstance(v, int) or v < 2:
        raise ValueError(
            f"interleaved_1f1b needs v >= 2 stages per rank, got v={v!r} (for one stage per rank use one_f_one_b)"
        )
    if m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        hint = f"m={lower} or m={upper}" if lower else f"m={upper}"
        raise ValueError(
            f"interleaved_1f1b needs the number of microbatches to be a multiple of the "
            f"number of ranks: m={m} microbatches on p={p} ranks (fewer microbatches "
            f"than ranks is not supported either); use {hint}"
        )
    total = m * v

    def virtual(k, backward):
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    orders = {}
    for r in range(p):
        warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)
        order = []
        for k in range(warmup):
            chunk, mb = virtual(k, False)
            order.append(("F", chunk * p + r, mb))
        for i in range(total - warmup):
            chunk, mb = virtual(warmup + i, False)
            order.append(("F", chunk * p + r, mb))
            chunk, mb = virtual(i, True)
            order.append(("B", chunk * p + r, mb))
        for k in range(total - warmup, total):
            chunk, mb = virtual(k, True)
            order.append(("B", chunk * p + r, mb))
        orders[r] = order
    return _from_orders("interleaved_1f1b", p, m, looped_stage_to_rank(p, v), orders)


def zb_h1(p: int, m: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., 2023): the backward split into ``I`` (input gradient, on the
    critical path up the pipeline) and ``W`` (weight gradient, which nothing waits for).

    Rank r runs 1F1B's ``p-1-r`` warm-up forwards, then ``F, I`` pairs, but defers each ``W`` by
    r microbatches (``W(i-r)`` follows ``I(i)``); the ``r`` deferred ``W`` fill the cool-down,
    where 1F1B idles. Every rank then holds at most ``p`` microbatches' activations (counted from
    ``F`` to ``W``): the peak of 1F1B (its rank 0), on every rank. With ``F = I = W`` the idle
    time per rank is ``(p-1) F`` against 1F1B's ``3 (p-1) F``. Any ``m >= 1``.
    """
    _check_counts("zb_h1", p, m)
    orders = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [("F", r, mb) for mb in range(warmup)]
        backwards = []
        for i in range(m):
            backwards.append([("I", r, i)] + ([("W", r, i - r)] if i >= r else []))
        for i in range(m - warmup):
            order += [("F", r, warmup + i)] + backwards[i]
        for i in range(m - warmup, m):
            order += backwards[i]
        order += [("W", r, mb) for mb in range(max(m - r, 0), m)]
        orders[r] = order
    return _from_orders("zb_h1", p, m, looped_stage_to_rank(p), orders)


# ---------------------------------------------------------------------------------------------
# The registry: every schedule by the name users give it


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


# ---------------------------------------------------------------------------------------------
# Lowering: insert sends and receives


def add_communication(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule: add ``SEND``/``RECV`` for every dependency across ranks.

    A send goes right after the action that produces the value (``F`` -> ``SEND_F`` to stage
    s+1; ``B``/``I`` -> ``SEND_B`` to stage s-1), a receive right before the action that consumes
    it. Messages between two ranks are matched in order, so when a rank must receive a message
    that its peer sent after others it has not received yet, those earlier ones are received
    first (just before, and buffered): this never waits longer than the needed message would.
    Adjacent stages on the same rank exchange nothing.
    """
    if schedule.has_communication:
        raise ValueError(f"schedule {schedule.name!r} already has sends and receives")
    owner = schedule.stage_to_rank
    last = schedule.num_stages - 1

    def outgoing(a: Action):
        if a.kind == ActionKind.F and a.stage < last and owner[a.stage + 1] != owner[a.stage]:
            return Action(ActionKind.SEND_F, a.stage, a.microbatch, a.stage + 1)
        if a.is_backward and a.stage > 0 and owner[a.stage - 1] != owner[a.stage]:
            return Action(ActionKind.SEND_B, a.stage, a.microbatch, a.stage - 1)
        return None

    def incoming(a: Action):
        if a.kind == ActionKind.F and a.stage > 0 and owner[a.stage - 1] != owner[a.stage]:
            return Action(ActionKind.RECV_F, a.stage, a.microbatch, a.stage - 1)
        if a.is_backward and a.stage < last and owner[a.stage + 1] != owner[a.stage]:
            return Action(ActionKind.RECV_B, a.stage, a.microbatch, a.stage + 1)
        return None

    # Messages on each channel (src rank, dst rank), in the order the source sends them.
    channel = defaultdict(list)
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            send = outgoing(a)
            if send is not None:
                channel[(rank, owner[send.peer])].append(send.counterpart())
    position = {(key, recv): k for key, msgs in channel.items() for k, recv in enumerate(msgs)}

    lowered = []
    for rank, acts in enumerate(schedule.actions):
        received = Counter()  # channel -> how many messages this rank has received on it
        out = []
        for a in acts:
            recv = incoming(a)
            if recv is not None:
                key = (owner[recv.peer], rank)
                k = position.get((key, recv))
                if k is None:  # nobody sends it: leave the receive, the checker will say why
                    out.append(recv)
                else:
                    while received[key] <= k:
                        out.append(channel[key][received[key]])
                        received[key] += 1
            out.append(a)
            send = outgoing(a)
            if send is not None:
                out.append(send)
        lowered.append(out)
    return Schedule(
        schedule.name,
        schedule.num_ranks,
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.stage_to_rank,
        tuple(lowered),
    )


# ---------------------------------------------------------------------------------------------
# Checking


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


class _Index:
    """Where each action sits, and what each action waits for on another rank."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.lowered = schedule.has_communication

    @functools.cached_property
    def where(self) -> dict:
        """Action -> [(rank, step), ...] (built on first use: a plainly valid compute-only
        schedule, :func:`_plainly_valid`, is simulated without it)."""
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


def _local_needs(schedule: Schedule, index: _Index, a: Action) -> list:
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


def _static_issues(schedule: Schedule, index: _Index) -> list:
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
                if a.peer != a.stage + _PEER_OFFSET[a.kind]:
                    issue(
                        f"{a.kind.value} of stage {a.stage} must have peer stage "
                        f"{a.stage + _PEER_OFFSET[a.kind]}, not {a.peer}"
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


@dataclass
class _Run:
    start: dict
    """(rank, step) -> start time, for every action that ran."""
    end: dict
    stuck: dict
    """rank -> the step it cannot get past (ranks that finished are absent)."""


def _execute(
    schedule: Schedule, duration: Callable[[Action], float], comm_time: float = 0.0, index: _Index | None = None
) -> _Run:
    """Run every rank's list in order; an action starts when its rank is free and its remote
    dependency (if any) has finished plus ``comm_time``. Stops at the fixed point."""
    index = index or _Index(schedule)
    offsets = index.flat[0]
    durations = [duration(a) for acts in schedule.actions for a in acts]
    start, end, ptr = _execute_flat(schedule, index, durations, comm_time)
    started, ended = {}, {}
    for rank in range(schedule.num_ranks):
        for i in range(ptr[rank]):
            started[(rank, i)], ended[(rank, i)] = start[offsets[rank] + i], end[offsets[rank] + i]
    stuck = {r: ptr[r] for r in range(schedule.num_ranks) if ptr[r] < len(schedule.actions[r])}
    return _Run(started, ended, stuck)


def _execute_flat(schedule: Schedule, index: _Index, durations: list, comm_time: float) -> tuple:
    """:func:`_execute` on the flat positions of :attr:`_Index.flat` (``durations`` >= 0, one per
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


def _deadlock_issues(schedule: Schedule, index: _Index, run: _Run | None = None) -> list:
    """The stuck ranks of ``run`` (default: an execution with zero durations; any durations reach
    the same fixed point), each with what it waits for."""
    run = run or _execute(schedule, lambda a: 0.0, index=index)
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
    index = _Index(schedule)
    return _static_issues(schedule, index) + _deadlock_issues(schedule, index)


def check_schedule(schedule: Schedule) -> list:
    """Readable errors (``[]`` when the schedule is valid and cannot deadlock); see the module
    docstring for the rules and the algorithm."""
    return [str(issue) for issue in _issues(schedule)]


def assert_valid(schedule: Schedule) -> None:
    """Raise ``ValueError`` with the errors and the grid (offending actions marked ``!``)."""
    _raise_for(schedule, _issues(schedule))


def _raise_for(schedule: Schedule, issues: list) -> None:
    if issues:
        marks = [(i.rank, i.step) for i in issues if i.step is not None]
        raise ValueError(
            f"invalid pipeline schedule {schedule.name!r} ({len(issues)} errors):\n"
            + "\n".join(f"  - {i}" for i in issues)
            + "\n\n"
            + schedule.grid(highlight=marks)
        )


# ---------------------------------------------------------------------------------------------
# Simulation

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
    """A simulation's start and end of every action, at the flat positions of :attr:`_Index.flat`."""

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


def simulate(
    schedule: Schedule,
    forward_time: StageTime,
    backward_time: StageTime,
    weight_time: StageTime | None = None,
    comm_time: float = 0.0,
    sync_time: StageTime | None = None,
) -> SimulationResult:
    """Replay a valid schedule with durations in seconds.

    Times are per stage: a number (every stage), a dict ``{stage: seconds}`` or a callable
    ``stage -> seconds``. ``backward_time`` is the full backward ``B``; a split backward takes
    ``I = B - W`` and ``W = weight_time`` (default ``B / 2``). ``comm_time`` is added to every
    dependency that crosses ranks. ``sync_time``: the stage's parameter-gradient reduction, once
    per step, after its rank's last action (:class:`runtime.pipeline.PipelineRunner` moves the
    held sums once the rank has issued everything: no other stage waits for them); it counts as
    busy time of the rank. Sends and receives
    take no compute time, but a receive blocks its rank until the message arrives. Raises
    ``ValueError`` (as :func:`assert_valid`) for an invalid schedule.
    """
    index = _checked_index(schedule)
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
    durations = [table[a.kind][a.stage] if a.is_compute else 0.0 for acts in schedule.actions for a in acts]
    start, end, ptr = _execute_flat(schedule, index, durations, comm_time)
    if any(ptr[r] < len(acts) for r, acts in enumerate(schedule.actions)):
        _raise_for(schedule, _deadlock_issues(schedule, index))
    stops = offsets[1:] + [len(end)]
    synced = [sum(syncs[s] for s in schedule.stages_of(r)) for r in range(schedule.num_ranks)]
    finish = [max(end[offsets[r] : stops[r]], default=0.0) + synced[r] for r in range(schedule.num_ranks)]
    makespan = max([e for e, c in zip(end, compute) if c] + finish, default=0.0)
    busy = {r: sum(durations[offsets[r] : stops[r]]) + synced[r] for r in range(schedule.num_ranks)}
    return SimulationResult(makespan, busy, _Timed(schedule, tuple(start), tuple(end)))


def _checked_index(schedule: Schedule) -> _Index:
    """The schedule's :class:`_Index` once its static checks passed (else ``ValueError`` as
    :func:`assert_valid`), kept on the schedule: a schedule simulated again (the configuration
    search replays one schedule with many stage times) is indexed and checked once. The deadlock
    part of the check is the simulation's own execution (the same fixed point)."""
    index = schedule.__dict__.get("_checked_index")
    if index is None:
        index = _Index(schedule)
        if not _plainly_valid(schedule, index):  # then the full check, which names what is wrong
            _raise_for(schedule, _static_issues(schedule, index))
        object.__setattr__(schedule, "_checked_index", index)
    return index


def _plainly_valid(schedule: Schedule, index: _Index | None = None) -> bool:
    """True only when a compute-only schedule passes every static check of :func:`_static_issues`
    (each action in range, on its stage's rank, once; every (stage, microbatch) with ``F`` and
    either ``B`` or ``I`` and ``W``; the same-rank dependencies in order), checked on tables of
    positions; False means "run the full check" (it names the errors), not "invalid"."""
    index = index or _Index(schedule)
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


# ---------------------------------------------------------------------------------------------
# Stage durations from the cost model, and the schedule they favour


def stage_durations(estimates: Sequence, takes_activations: Sequence[bool]) -> tuple:
    """(forward, backward, weight) seconds per microbatch for each stage, as dicts by stage.

    ``estimates[s]`` is stage ``s``'s cost estimate for one microbatch (``step_time_s``:
    forward + backward; ``weight_grad_s``: its parameter-gradient products; ``grad_sync_s``: the
    parameter-gradient reductions it holds back and ``optimizer_s`` its optimizer step, which a
    pipeline runs once per step, :func:`stage_syncs`). A
    third of the rest is forward, two thirds backward. ``weight`` is what a zero-bubble W pass
    runs: the parameter products, or the whole backward on a stage that takes no floating-point
    activations (the first: its input-gradient pass has nothing to compute, so all of its
    backward waits for W).
    """
    forward, backward, weight = {}, {}, {}
    for s, (est, takes) in enumerate(zip(estimates, takes_activations)):
        per_microbatch = est.step_time_s - est.grad_sync_s - getattr(est, "optimizer_s", 0.0)
        forward[s] = per_microbatch / 3.0
        backward[s] = 2.0 * per_microbatch / 3.0
        weight[s] = min(est.weight_grad_s, backward[s]) if takes else backward[s]
    return forward, backward, weight


def stage_syncs(estimates: Sequence) -> dict:
    """stage -> seconds of its parameter-gradient reduction and its optimizer step, once per step
    (``sync_time`` of :func:`simulate`)."""
    return {s: est.grad_sync_s + getattr(est, "optimizer_s", 0.0) for s, est in enumerate(estimates)}


def auto_stage_in_flight(p: int, m: int) -> dict:
    """stage -> the activation copies to plan each stage for when the schedule is chosen after
    planning: the most any of :data:`AUTO_SCHEDULES` keeps alive, so whichever wins fits."""
    per = [SCHEDULES[name].in_flight(p, m, 1) for name in AUTO_SCHEDULES]
    return {s: max(d[s] for d in per) for s in range(p)}


def choose_schedule(
    p: int, m: int, forward: StageTime, backward: StageTime, weight: StageTime, sync: StageTime | None = None
) -> tuple:
    """The fastest one-stage-per-rank schedule for these stage durations: each of
    :data:`AUTO_SCHEDULES` is simulated; the shortest step wins, then the fewest microbatches in
    flight on any rank (activation memory), then the order of :data:`AUTO_SCHEDULES`.
    Returns (name, {name: simulated step seconds})."""
    steps, keys = {}, {}
    for order, name in enumerate(AUTO_SCHEDULES):
        sched = SCHEDULES[name].make(p, m, 1)
        result = simulate(sched, forward, backward, weight, sync_time=sync)
        steps[name] = result.makespan
        keys[name] = (round(result.makespan, 12), max(peak_in_flight(sched).values()), order)
    return min(AUTO_SCHEDULES, key=keys.__getitem__), steps
