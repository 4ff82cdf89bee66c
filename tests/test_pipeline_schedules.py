"""Pipeline schedules as data: text form, generators, lowering, the checker, the simulator."""
import pytest

from passes.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    Schedule,
    add_communication,
    assert_valid,
    check_schedule,
    format_action,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse_action,
    parse_schedule,
    peak_in_flight,
    schedule_kind,
    simulate,
    stage_in_flight,
    v_shape_stage_to_rank,
    zb_h1,
)

# every registered schedule (interleaved with 2 stages per rank), by its registry name
GENERATORS = {name: (lambda p, m, kind=kind: kind.make(p, m, 2)) for name, kind in SCHEDULES.items()}
SIZES = [(p, m) for p in (2, 4) for m in (4, 8)]


def acts(text):
    return [parse_action(tok) for tok in text.split()]


def replace_rank(schedule, rank, edit):
    """A copy of ``schedule`` whose rank's list is ``edit(list)``."""
    actions = list(schedule.actions[rank])
    return schedule.with_actions(rank, edit(actions) or actions)


def swap(actions, a, b):
    i, j = actions.index(parse_action(a)), actions.index(parse_action(b))
    actions[i], actions[j] = actions[j], actions[i]


# --- text form -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, action", [
    ("2F0", Action(ActionKind.F, 2, 0)),
    ("1B3", Action(ActionKind.B, 1, 3)),
    ("0I1", Action(ActionKind.I, 0, 1)),
    ("0W1", Action(ActionKind.W, 0, 1)),
    ("1SEND_F0->2", Action(ActionKind.SEND_F, 1, 0, peer=2)),
    ("2RECV_F0<-1", Action(ActionKind.RECV_F, 2, 0, peer=1)),
    ("12SEND_B10->11", Action(ActionKind.SEND_B, 12, 10, peer=11)),
    ("11RECV_B10<-12", Action(ActionKind.RECV_B, 11, 10, peer=12)),
])
def test_action_text_round_trip(text, action):
    assert parse_action(text) == action
    assert format_action(action) == str(action) == text


@pytest.mark.parametrize("text", ["", "F0", "1F", "01F0", "1X0", "1F0->2", "1SEND_F0", "1SEND_F0<-2",
                                  "1RECV_B0->2", "1 F 0", "-1F0"])
def test_bad_action_text_is_rejected(text):
    with pytest.raises(ValueError, match="cannot parse pipeline action"):
        parse_action(text)


def test_action_validates_peer():
    with pytest.raises(ValueError, match="needs the peer"):
        Action(ActionKind.SEND_F, 0, 0)
    with pytest.raises(ValueError, match="takes no peer"):
        Action(ActionKind.F, 0, 0, peer=1)


@pytest.mark.parametrize("name", GENERATORS)
def test_schedule_text_round_trip(name):
    for schedule in (GENERATORS[name](4, 8), add_communication(GENERATORS[name](4, 8))):
        text = format_schedule(schedule)
        assert parse_schedule(text) == schedule
        assert format_schedule(parse_schedule(text)) == text
        for rank_actions in schedule.actions:
            for action in rank_actions:
                assert parse_action(format_action(action)) == action


def test_schedule_text_shape():
    text = format_schedule(one_f_one_b(2, 2))
    assert text.splitlines() == [
        "# name=1f1b ranks=2 stages=2 microbatches=2 stage_to_rank=0,1",
        "rank 0: 0F0 0F1 0B0 0B1",
        "rank 1: 1F0 1B0 1F1 1B1",
    ]


# --- generators pass the checker -------------------------------------------------------------

@pytest.mark.parametrize("name", GENERATORS)
@pytest.mark.parametrize("p, m", SIZES)
def test_generated_schedules_are_valid(name, p, m):
    schedule = GENERATORS[name](p, m)
    assert not schedule.has_communication
    assert check_schedule(schedule) == []
    lowered = add_communication(schedule)
    assert lowered.has_communication
    assert check_schedule(lowered) == []
    assert_valid(lowered)
    # Lowering only adds sends and receives.
    for rank in range(p):
        assert [a for a in lowered.actions[rank] if a.is_compute] == list(schedule.actions[rank])


@pytest.mark.parametrize("name", GENERATORS)
def test_every_stage_and_microbatch_once(name):
    schedule = GENERATORS[name](4, 8)
    forwards = sorted((a.stage, a.microbatch) for r in schedule.actions for a in r if a.kind == ActionKind.F)
    assert forwards == [(s, mb) for s in range(schedule.num_stages) for mb in range(8)]
    for rank, rank_actions in enumerate(schedule.actions):
        assert {a.stage for a in rank_actions} == set(schedule.stages_of(rank))


def test_interleaved_is_looped():
    schedule = interleaved_1f1b(4, 8, 2)
    assert schedule.num_stages == 8
    assert schedule.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert check_schedule(add_communication(interleaved_1f1b(2, 6, 3))) == []


def test_zb_h1_splits_backward():
    schedule = zb_h1(4, 8)
    kinds = {a.kind for r in schedule.actions for a in r}
    assert kinds == {ActionKind.F, ActionKind.I, ActionKind.W}


def test_peak_activation_memory():
    # 1F1B: rank r holds p - r microbatches; ZB-H1 holds p on every rank, never more than 1F1B's peak.
    assert peak_in_flight(one_f_one_b(4, 8)) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert max(peak_in_flight(zb_h1(4, 8)).values()) == max(peak_in_flight(one_f_one_b(4, 8)).values())
    assert peak_in_flight(gpipe(4, 8)) == {r: 8 for r in range(4)}


@pytest.mark.parametrize("p, m", [(4, 1), (4, 2), (4, 3), (8, 5)])
@pytest.mark.parametrize("name", GENERATORS)
def test_fewer_microbatches_than_stages(name, p, m):
    """Either a valid schedule or a ValueError naming both numbers: never one that hangs."""
    try:
        schedule = GENERATORS[name](p, m)
    except ValueError as err:
        assert f"m={m}" in str(err) and f"p={p}" in str(err)
        return
    assert check_schedule(schedule) == []
    assert check_schedule(add_communication(schedule)) == []


def test_gpipe_and_1f1b_run_with_fewer_microbatches():
    for schedule in (gpipe(4, 2), one_f_one_b(4, 2), zb_h1(4, 2)):
        assert check_schedule(add_communication(schedule)) == []


@pytest.mark.parametrize("call, match", [
    (lambda: interleaved_1f1b(4, 6, 2), r"m=6 .*p=4.*use m=4 or m=8"),
    (lambda: interleaved_1f1b(4, 2, 2), r"m=2 .*p=4.*use m=4"),
    (lambda: interleaved_1f1b(4, 8, 1), "v >= 2"),
    (lambda: one_f_one_b(0, 4), "p=0"),
    (lambda: gpipe(2, 0), "m=0"),
    (lambda: zb_h1(2, -1), "m=-1"),
    (lambda: gpipe(2, 4, layout="zigzag"), "layout"),
])
def test_unsupported_combinations_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- lowering --------------------------------------------------------------------------------

def test_sends_follow_producers_and_recvs_precede_consumers():
    lowered = add_communication(one_f_one_b(4, 8))
    n_messages = 0
    for rank_actions in lowered.actions:
        for i, a in enumerate(rank_actions):
            if a.is_send:
                n_messages += 1
                producer = rank_actions[i - 1]
                assert producer.is_compute and producer.stage == a.stage and producer.microbatch == a.microbatch
                assert (producer.kind == ActionKind.F) == (a.kind == ActionKind.SEND_F)
            if a.is_recv:
                consumer = rank_actions[i + 1]
                assert consumer.is_compute and consumer.stage == a.stage and consumer.microbatch == a.microbatch
    assert n_messages == 2 * 8 * 3  # activation and gradient across each of the 3 cuts, per microbatch


def test_interleaved_lowering_keeps_messages_in_order():
    """Interleaved ranks consume messages in another order than their peer sends them on one
    channel; lowering receives earlier ones first, so every receive still precedes its consumer."""
    lowered = add_communication(interleaved_1f1b(2, 4, 2))
    assert check_schedule(lowered) == []
    for rank_actions in lowered.actions:
        for i, a in enumerate(rank_actions):
            if a.is_recv:
                consumer = Action(ActionKind.F if a.kind == ActionKind.RECV_F else ActionKind.B,
                                  a.stage, a.microbatch)
                assert rank_actions.index(consumer) > i


def test_no_communication_between_stages_on_one_rank():
    schedule = gpipe(2, 4, v=2, layout="v")
    assert schedule.stage_to_rank == v_shape_stage_to_rank(2, 2) == (0, 1, 1, 0)
    lowered = add_communication(schedule)
    assert check_schedule(lowered) == []
    pairs = {(a.stage, a.peer) for r in lowered.actions for a in r if not a.is_compute}
    assert (1, 2) not in pairs and (2, 1) not in pairs
    assert pairs == {(0, 1), (1, 0), (2, 3), (3, 2)}


def test_lowering_twice_is_refused():
    with pytest.raises(ValueError, match="already has sends"):
        add_communication(add_communication(gpipe(2, 2)))


# --- the checker catches broken schedules ----------------------------------------------------

def test_swapped_actions_violate_a_dependency():
    broken = replace_rank(one_f_one_b(2, 4), 0, lambda a: swap(a, "0F1", "0B1"))
    errors = check_schedule(broken)
    assert any(e.startswith("rank 0 step 1 (0B1): needs 0F1, which rank 0 runs later") for e in errors), errors


def test_weight_gradient_before_input_gradient():
    broken = replace_rank(zb_h1(2, 4), 1, lambda a: swap(a, "1I0", "1W0"))
    errors = check_schedule(broken)
    assert any("rank 1" in e and "(1W0): needs 1I0" in e for e in errors), errors


def test_removed_send_deadlocks():
    lowered = add_communication(one_f_one_b(2, 4))
    broken = replace_rank(lowered, 0, lambda a: a.remove(parse_action("0SEND_F2->1")))
    errors = check_schedule(broken)
    assert any(e.startswith("rank 1") and "(1RECV_F2<-0): no matching 0SEND_F2->1" in e for e in errors), errors
    deadlocks = [e for e in errors if "deadlock" in e]
    assert deadlocks
    assert any(e.startswith("rank 1 ") and "RECV_F" in e and "never sends" in e for e in deadlocks), deadlocks
    with pytest.raises(ValueError, match="deadlock"):
        assert_valid(broken)


def test_cross_rank_cycle_deadlocks():
    # Rank 0 waits in 0B0 for 1B0; rank 1 first runs 1F1, which waits for 0F1, after 0B0 on rank 0.
    broken = one_f_one_b(2, 2).with_actions(0, acts("0F0 0B0 0F1 0B1")).with_actions(1, acts("1F1 1B1 1F0 1B0"))
    errors = check_schedule(broken)
    assert "rank 0 step 1 (0B0): deadlock: waits for 1B0 on rank 1 (step 3), which rank 1 never reaches: " \
           "it is stuck at step 0 (1F1)" in errors
    assert "rank 1 step 0 (1F1): deadlock: waits for 0F1 on rank 0 (step 2), which rank 0 never reaches: " \
           "it is stuck at step 1 (0B0)" in errors
    assert check_schedule(add_communication(broken)) != []  # still deadlocks once lowered


def test_receives_out_of_channel_order():
    lowered = add_communication(one_f_one_b(2, 4))
    broken = replace_rank(lowered, 1, lambda a: swap(a, "1RECV_F0<-0", "1RECV_F1<-0"))
    errors = check_schedule(broken)
    assert any(e.startswith("rank 1 step 0 (1RECV_F1<-0): messages from rank 0 to rank 1 are matched in order")
               for e in errors), errors


def test_missing_duplicate_and_misplaced_actions():
    schedule = one_f_one_b(2, 2)
    missing = schedule.with_actions(1, acts("1F0 1B0 1F1"))
    assert any("stage 1 microbatch 1 has no backward" in e for e in check_schedule(missing))
    dup = schedule.with_actions(1, acts("1F0 1B0 1F1 1B1 1F1"))
    assert any(e.startswith("rank 1 step 4 (1F1): duplicate of rank 1 step 2") for e in check_schedule(dup))
    misplaced = schedule.with_actions(0, acts("0F0 0F1 0B0 0B1 1F0"))
    assert any(e.startswith("rank 0 step 4 (1F0): stage 1 belongs to rank 1") for e in check_schedule(misplaced))
    split_and_full = schedule.with_actions(1, acts("1F0 1B0 1F1 1B1 1W1"))
    assert any("has 1W1 but no input gradient" in e or "both a full backward" in e
               for e in check_schedule(split_and_full))


def test_unneeded_communication_is_flagged():
    lowered = add_communication(gpipe(2, 1, v=2, layout="v"))
    extra = Action(ActionKind.SEND_F, 1, 0, peer=2)
    broken = replace_rank(lowered, 1, lambda a: a.append(extra))
    assert any("(1SEND_F0->2): stages 1 and 2 are both on rank 1" in e for e in check_schedule(broken))


def test_assert_valid_shows_errors_and_grid():
    broken = replace_rank(one_f_one_b(2, 4), 0, lambda a: swap(a, "0F1", "0B1"))
    with pytest.raises(ValueError) as info:
        assert_valid(broken)
    message = str(info.value)
    assert "rank 0 step 1 (0B1)" in message
    assert "0B1!" in message  # the grid marks the offending action
    assert "rank 1" in message.split("\n\n", 1)[1]


# --- grid ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", GENERATORS)
def test_grid_contains_each_action_once(name):
    for schedule in (GENERATORS[name](4, 8), add_communication(GENERATORS[name](4, 8))):
        tokens = schedule.grid().split()
        for rank_actions in schedule.actions:
            for a in rank_actions:
                assert tokens.count(format_action(a)) == (1 if a.is_compute else 0)


def test_grid_shows_the_bubble():
    lines = gpipe(2, 2).grid().splitlines()
    assert lines[2].split() == ["rank", "0", "0F0", "0F1", ".", ".", "0B0", "0B1"]
    assert lines[3].split() == ["rank", "1", ".", "1F0", "1F1", "1B0", "1B1", "."]


# --- simulation ------------------------------------------------------------------------------

def one_f_one_b_bubble(p, m):
    return (p - 1) / (m + p - 1)


@pytest.mark.parametrize("p, m", SIZES + [(8, 32)])
def test_bubble_gpipe_and_1f1b(p, m):
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        result = simulate(schedule, forward_time=1.0, backward_time=2.0)
        assert result.bubble_fraction == pytest.approx(one_f_one_b_bubble(p, m), rel=0.10)
        assert result.makespan == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("p, m", SIZES + [(4, 16)])
@pytest.mark.parametrize("v", [2, 4])
def test_bubble_interleaved_divided_by_v(p, m, v):
    # Each of the v stages of a rank holds 1/v of its layers.
    result = simulate(interleaved_1f1b(p, m, v), forward_time=1.0 / v, backward_time=2.0 / v)
    assert result.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=0.10)  # 1F1B's (p-1)/m over v
    bubble = (p - 1) / v
    assert result.bubble_fraction == pytest.approx(bubble / (m + bubble), rel=0.10)
    plain = simulate(one_f_one_b(p, m), forward_time=1.0, backward_time=2.0)
    assert result.bubble_fraction < plain.bubble_fraction


@pytest.mark.parametrize("p, m", SIZES + [(8, 16)])
def test_bubble_zb_h1_about_a_third_of_1f1b(p, m):
    # F = 1, B = 2 = I + W with I = W = 1.
    zb = simulate(zb_h1(p, m), forward_time=1.0, backward_time=2.0)
    base = simulate(one_f_one_b(p, m), forward_time=1.0, backward_time=2.0)
    assert zb.bubble_fraction < base.bubble_fraction
    idle_zb, idle_base = zb.makespan - 3 * m, base.makespan - 3 * m  # idle seconds per rank
    assert idle_zb / idle_base == pytest.approx(1 / 3, rel=0.10)
    assert idle_zb == pytest.approx(p - 1)  # (p-1)(F + I - W)


@pytest.mark.parametrize("name", GENERATORS)
def test_lowered_schedule_simulates_like_the_compute_schedule(name):
    schedule = GENERATORS[name](4, 8)
    for comm in (0.0, 0.25):
        a = simulate(schedule, 1.0, 2.0, comm_time=comm)
        b = simulate(add_communication(schedule), 1.0, 2.0, comm_time=comm)
        assert a.makespan == pytest.approx(b.makespan)
    assert simulate(schedule, 1.0, 2.0, comm_time=0.25).makespan > simulate(schedule, 1.0, 2.0).makespan


def test_timelines_respect_dependencies_and_per_stage_times():
    schedule = one_f_one_b(3, 4)
    fwd = {0: 1.0, 1: 3.0, 2: 1.0}
    result = simulate(schedule, fwd, lambda s: 2 * fwd[s], comm_time=0.5)
    at = {t.action: t for tl in result.timelines.values() for t in tl}
    for mb in range(4):
        assert at[Action(ActionKind.F, 1, mb)].start >= at[Action(ActionKind.F, 0, mb)].end + 0.5
        assert at[Action(ActionKind.B, 0, mb)].start >= at[Action(ActionKind.B, 1, mb)].end + 0.5
        assert at[Action(ActionKind.B, 1, mb)].end - at[Action(ActionKind.B, 1, mb)].start == 6.0
    for tl in result.timelines.values():  # a rank runs one action at a time, in its order
        assert all(x.end <= y.start for x, y in zip(tl, tl[1:]))
    # The slowest stage sets the pace: at least m of its (F + B).
    assert result.makespan >= 4 * 9.0
    assert result.busy[1] == pytest.approx(4 * 9.0)


def test_weight_time_splits_the_backward():
    result = simulate(zb_h1(2, 2), 1.0, 2.0, weight_time=0.5)
    durations = {t.action.kind: t.end - t.start for tl in result.timelines.values() for t in tl}
    assert durations == {ActionKind.F: 1.0, ActionKind.I: 1.5, ActionKind.W: 0.5}


def test_simulate_rejects_bad_input():
    broken = replace_rank(one_f_one_b(2, 4), 0, lambda a: swap(a, "0F1", "0B1"))
    with pytest.raises(ValueError, match="invalid pipeline schedule"):
        simulate(broken, 1.0, 2.0)
    with pytest.raises(ValueError, match=r"no time for stages \[1\]"):
        simulate(one_f_one_b(2, 4), {0: 1.0}, 2.0)
    with pytest.raises(ValueError, match="weight_time exceeds backward_time"):
        simulate(zb_h1(2, 4), 1.0, 2.0, weight_time=3.0)


def test_schedule_shape_is_validated():
    with pytest.raises(ValueError, match="stage_to_rank"):
        Schedule("x", 2, 2, 1, (0, 2), {})
    with pytest.raises(ValueError, match="ranks \\[5\\]"):
        Schedule("x", 2, 2, 1, (0, 1), {5: []})


# ------------------------------------------------------------------ durations and the automatic choice


def test_stage_durations_split_the_estimate():
    from types import SimpleNamespace as Est

    from passes.schedules import stage_durations, stage_syncs
    estimates = [Est(step_time_s=3.0, weight_grad_s=0.9, grad_sync_s=0.0),
                 Est(step_time_s=6.5, weight_grad_s=1.5, grad_sync_s=0.5),
                 Est(step_time_s=6.0, weight_grad_s=9.0, grad_sync_s=0.0)]
    forward, backward, weight = stage_durations(estimates, [False, True, True])
    # the gradient reduction is not part of a microbatch: it runs once per step
    assert forward == {0: 1.0, 1: 2.0, 2: 2.0} and backward == {0: 2.0, 1: 4.0, 2: 4.0}
    assert stage_syncs(estimates) == {0: 0.0, 1: 0.5, 2: 0.0}
    # no activations in: the whole backward is W; otherwise the weight products, at most B
    assert weight == {0: 2.0, 1: 1.5, 2: 4.0}


@pytest.mark.parametrize("make", [lambda: one_f_one_b(2, 4), lambda: zb_h1(2, 4), lambda: gpipe(2, 4)])
def test_a_stage_gradient_sync_runs_once_after_its_ranks_last_action(make):
    schedule = make()
    base = simulate(schedule, 1.0, 2.0)
    # stage 0 finishes the step in these schedules: its sync adds to the step once, not per microbatch
    synced = simulate(schedule, 1.0, 2.0, sync_time={0: 0.75, 1: 0.0})
    assert synced.makespan == pytest.approx(base.makespan + 0.75)
    assert synced.busy[0] == pytest.approx(base.busy[0] + 0.75) and synced.busy[1] == pytest.approx(base.busy[1])
    # the last stage's sync runs after its rank's last action, beside the stage before's last
    # backward, not before the input gradient it sends there: the step ends when the later finishes
    last = simulate(schedule, 1.0, 2.0, sync_time={0: 0.0, 1: 0.75})
    rank1_done = max(t.end for t in base.timelines[1])
    assert last.makespan == pytest.approx(max(base.makespan, rank1_done + 0.75))
    assert last.timelines[0] == base.timelines[0]  # rank 0 never waits for it
    long = simulate(schedule, 1.0, 2.0, sync_time={0: 0.0, 1: 50.0})
    assert long.makespan == pytest.approx(rank1_done + 50.0)


def test_choose_schedule_known_answers():
    from passes.schedules import choose_schedule
    # uniform stages, W half of B: zero-bubble fills the bubble with W, and wins
    name, steps = choose_schedule(4, 8, 1.0, 2.0, 1.0)
    assert name == "zb-h1" and steps["zb-h1"] < steps["1f1b"], steps
    assert steps["1f1b"] == pytest.approx(11 * 3.0)            # (m + p - 1) (F + B)
    # nothing to defer (W = 0): both take as long; 1F1B holds fewer microbatches and comes first
    name, steps = choose_schedule(4, 8, 1.0, 2.0, 0.0)
    assert name == "1f1b" and steps["1f1b"] == steps["zb-h1"], steps


def test_stage_in_flight_counts_activations_alive_per_stage():
    from passes.schedules import auto_stage_in_flight, stage_in_flight
    assert stage_in_flight(one_f_one_b(4, 8)) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert stage_in_flight(gpipe(4, 8)) == {s: 8 for s in range(4)}
    # zero-bubble keeps the graph from F until W: every stage holds p microbatches
    assert stage_in_flight(zb_h1(4, 8)) == {s: 4 for s in range(4)}
    # interleaved: per virtual stage, not per rank (ranks hold two stages' worth)
    assert stage_in_flight(interleaved_1f1b(2, 4, 2)) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert peak_in_flight(interleaved_1f1b(2, 4, 2)) == {0: 5, 1: 3}    # stages 0 and 2 overlap
    # fewer microbatches than stages: never more than m
    assert max(stage_in_flight(one_f_one_b(4, 2)).values()) == 2
    # an open schedule is planned for the most either automatic choice keeps
    assert auto_stage_in_flight(4, 8) == {s: 4 for s in range(4)}


# ------------------------------------------------------------------ the registry


@pytest.mark.parametrize("name", SCHEDULES)
def test_registry_closed_forms_match_the_generated_schedules(name):
    """Each entry's activations in flight per stage are what the generated schedule keeps alive,
    and its closed-form bubble is what the simulator measures with uniform stages (B = 2F,
    I = W = F), for small and large microbatch counts (m < p included where allowed)."""
    kind = SCHEDULES[name]
    for p in (1, 2, 3, 4):
        for m in ((p, 2 * p, 3 * p) if kind.virtual else (1, 2, p, 2 * p + 1, 4 * p)):
            schedule = kind.make(p, m, 2)
            assert kind.in_flight(p, m, 2) == stage_in_flight(schedule), (p, m)
            simulated = simulate(schedule, 1.0, 2.0, 1.0).bubble_fraction
            assert kind.bubble(p, m, 2) == pytest.approx(simulated, abs=1e-12), (p, m)


def test_registry_names_and_lookup():
    assert tuple(SCHEDULES) == ("gpipe", "1f1b", "interleaved", "zb-h1")
    assert [name for name, kind in SCHEDULES.items() if kind.automatic] == ["1f1b", "zb-h1"]
    assert schedule_kind("ZB_H1") is SCHEDULES["zb-h1"]
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'.*gpipe.*1f1b.*interleaved.*zb-h1"):
        schedule_kind("pipedream")


def test_the_quick_validity_check_never_passes_what_the_full_check_refuses():
    """``simulate`` checks a compute-only schedule on tables of positions first and runs the full
    checker only when that fails; the quick check must never pass a schedule the checker refuses,
    and it passes the generators' own schedules. Broken variants: actions swapped, dropped,
    repeated or moved to another rank."""
    import random

    from passes.schedules.checker import plainly_valid, static_issues
    from passes.schedules.execution import ScheduleIndex
    rng = random.Random(0)
    seen = {True: 0, False: 0}
    for name in ("gpipe", "1f1b", "zb-h1", "interleaved"):
        for p, m in [(1, 2), (2, 3), (3, 4), (4, 8)]:
            try:
                schedule = SCHEDULES[name].make(p, m, 2 if name == "interleaved" else 1)
            except ValueError:
                continue
            assert plainly_valid(schedule) and not static_issues(schedule, ScheduleIndex(schedule))
            for _ in range(15):
                r, r2 = rng.randrange(p), rng.randrange(p)
                acts, other = list(schedule.actions[r]), list(schedule.actions[r2])
                i, j = rng.randrange(len(acts)), rng.randrange(len(acts))
                how = rng.randrange(4)
                if how == 0:
                    acts[i], acts[j] = acts[j], acts[i]
                elif how == 1:
                    del acts[i]
                elif how == 2:
                    acts.insert(j, acts[i])
                broken = schedule.with_actions(r, acts)
                if how == 3 and r2 != r:
                    other.append(acts.pop(i))
                    broken = schedule.with_actions(r, acts).with_actions(r2, other)
                valid = not static_issues(broken, ScheduleIndex(broken))
                assert valid or not plainly_valid(broken), (name, p, m, format_schedule(broken))
                seen[valid] += 1
    assert seen[False] > 100  # the broken variants were mostly refused
