"""Pipeline schedules as data (decision 8 in docs/ARCHITECTURE.md): generate, lower, check, simulate.

A schedule is one list of actions per rank. Nothing here starts a process: the runtime's
interpreter executes a schedule that :func:`check_schedule` has already proved safe. One module
per idea:

* :mod:`~passes.schedules.actions`: one action and its text form (``2F0``, ``1SEND_F0->2``);
* :mod:`~passes.schedules.schedule`: :class:`Schedule`, per-rank action lists, its text form and grid;
* :mod:`~passes.schedules.generators`: GPipe, 1F1B, interleaved 1F1B, ZB-H1 (compute actions only);
* :mod:`~passes.schedules.registry`: :data:`SCHEDULES`, every schedule by the name users give it;
* :mod:`~passes.schedules.lowering`: :func:`add_communication` inserts sends and receives;
* :mod:`~passes.schedules.execution`: the symbolic execution the checker and simulator share;
* :mod:`~passes.schedules.checker`: :func:`check_schedule`, static rules and deadlocks;
* :mod:`~passes.schedules.simulator`: :func:`simulate`, timelines and the bubble;
* :mod:`~passes.schedules.shared_cores`: ranks sharing a CPU host's cores (:class:`SharedCores`);
* :mod:`~passes.schedules.in_flight`: activations alive per rank and per stage;
* :mod:`~passes.schedules.schedule_choice`: stage durations from the cost model, and the
  schedule they favour.

The names below are the public surface; import them from ``passes.schedules``.
"""

from passes.schedules.actions import Action, ActionKind, format_action, parse_action
from passes.schedules.checker import assert_valid, check_schedule
from passes.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from passes.schedules.in_flight import peak_in_flight, stage_in_flight
from passes.schedules.lowering import add_communication
from passes.schedules.registry import AUTO_SCHEDULES, SCHEDULES, ScheduleKind, auto_stage_in_flight, schedule_kind
from passes.schedules.schedule import (
    Schedule,
    format_schedule,
    looped_stage_to_rank,
    parse_schedule,
    v_shape_stage_to_rank,
)
from passes.schedules.schedule_choice import choose_schedule, stage_durations, stage_syncs
from passes.schedules.shared_cores import SharedCores
from passes.schedules.simulator import SimulationResult, TimedAction, simulate

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
    "SharedCores",
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
