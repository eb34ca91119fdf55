"""Stage plans made for what a microbatch holds in flight (slackswap_cli/pipeline/inflight.py):
a stage whose peak is in backward and whose end of forward holds a tensor the peak never
sees, planned by hand. The runs on ranks: tests/test_pipeline_ranks.py."""
import pytest
from workloads import HW

from slackswap_cli.pipeline.inflight import held_floor, held_limit, plan_held, with_hold
from slackswap_cli.pipeline.stages import plan_stages, plans_at, rank_peak, stage_cost
from slackswap_cli.planners import make_plan
from slackswap_cli.profile_build import ProfileBuilder
from slackswap_cli.run.parallel.pipeline import schedule_order

A, C, T = 100_000, 300_000, 500_000     # saved a and c, the backward temporary t
END = 4 + 4                             # d and the loss, live at the last forward op


def _stage():
    """f0: x -> a; f1: a -> c; f2: c -> d; f3: d -> loss (the last forward op). Backward:
    bc reads c, w makes t, w2 reads t, ba reads a. Keep-all: at f3 a + c + d + loss =
    400,008 live, the peak a + t = 600,000 at w and w2; a's gap (f2 to w2) covers the peak,
    c's (f3 only) the end of forward alone."""
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    w = b.add_tensor("w", "parameter", (1,), "float32", size_bytes=4)
    a = b.add_tensor("a", "activation", (A,), "uint8", size_bytes=A)
    c = b.add_tensor("c", "activation", (C,), "uint8", size_bytes=C)
    d = b.add_tensor("d", "activation", (4,), "uint8", size_bytes=4)
    loss = b.add_tensor("loss", "activation", (), "float32", size_bytes=4)
    b.add_op("f0", "aten.mm.default", "forward", (x, w), (a,), time_us=100.0)
    b.add_op("f1", "aten.mm.default", "forward", (a, w), (c,), time_us=100.0)
    b.add_op("f2", "aten.mm.default", "forward", (c, w), (d,), time_us=100.0)
    b.add_op("f3", "aten.sum.default", "forward", (d,), (loss,), time_us=0.0)
    g = b.add_tensor("tangent", "input", (), "float32", size_bytes=4)
    t = b.add_tensor("t", "activation", (T,), "uint8", size_bytes=T)
    grads = [b.add_tensor(f"g{i}", "gradient", (1,), "float32", size_bytes=4) for i in range(3)]
    b.add_op("bc", "aten.mm.default", "backward", (g, c), (grads[0],), time_us=200.0)
    b.add_op("w", "aten.mm.default", "backward", (g,), (t,), time_us=200.0)
    b.add_op("w2", "aten.mm.default", "backward", (t,), (grads[1],), time_us=200.0)
    b.add_op("ba", "aten.mm.default", "backward", (g, a), (grads[2],), time_us=200.0)
    return b.build(workload={"name": "inflight"}, env={"device": "synthetic"})


def _planner(prof, budget):
    return make_plan("slackswap", prof, HW, budget)


def test_the_hold_by_hand():
    prof = _stage()
    assert prof.live_bytes_per_op[prof.n_forward - 1] == A + C + END
    assert prof.keep_all_peak_bytes == A + T
    # a and c can be gone at the end of forward; d and the loss cannot
    assert held_floor(prof) == END
    assert held_limit(prof, 1.0) is None
    assert held_limit(prof, 0.0) == END and held_limit(prof, 0.5) == END + (A + C) // 2
    held = with_hold(prof, 123)
    assert held.live_bytes_per_op[prof.n_forward - 1] == A + C + END + 123
    assert held.live_bytes_per_op[prof.n_forward:] == prof.live_bytes_per_op[prof.n_forward:]
    assert held.saved_activations == prof.saved_activations
    # at its own peak unconstrained, a hold of 150,000 bytes: c must go, a may stay
    plan = plan_held(_planner, prof, A + T, END + 150_000)
    assert plan.feasible and plan.profile_fingerprint == prof.fingerprint
    assert plan.predicted.peak_bytes == A + T
    evicted = {d.tensor for d in plan.decisions if d.action != "keep"}
    assert evicted == {prof.tensors[3].id}       # c
    assert stage_cost(prof, plan).held_bytes == A + END
    # a hold under the floor: no plan
    assert not plan_held(_planner, prof, A + T, END - 1).feasible


def test_a_1f1b_rank_fits_only_with_the_hold():
    """1F1B on 2 ranks, 4 microbatches: rank 0 holds 2, so its peak is one microbatch's held
    bytes plus the other's peak. Planned for the peak alone the stage at best evicts a
    (the peak falls to t's 500,000, held 300,008): 800,008. With the hold, c goes instead
    (held 100,008, peak 600,000): 700,008, under a budget of 720,000."""
    prof = _stage()
    order = schedule_order("1F1B", 2, 4)
    profiles = {0: prof, 1: prof}
    _, alone = plans_at(0.0, [0], profiles, _planner, {}, {})
    assert (alone[0].held_bytes, alone[0].peak_bytes) == (C + END, T)
    assert rank_peak(order[0], alone) == C + END + T > 720_000
    planned = plan_stages(order, profiles, 720_000, _planner)
    row = {r.rank: r for r in planned.rows}
    assert row[0].held == 2 and row[0].held_fraction < 1.0
    cost = stage_cost(prof, planned.plans[0])
    assert (cost.held_bytes, cost.peak_bytes) == (A + END, A + T)
    assert row[0].planned_peak_bytes == A + END + A + T <= 720_000
    # rank 1 holds one microbatch: keeping everything fits, no hold is tried
    assert planned.plans[1] is None and row[1].held_fraction == 1.0


def test_the_quicker_of_the_two_wins_where_both_fit():
    """At 850,000 both fit: a evicted for the peak alone (800,008) and c for the hold
    (700,008). Each is one swap hidden under compute but for its tail, and c's copy is three
    times a's, so the search keeps the plan for the peak alone: the one the rank runs in the
    least time (`step_us`), not the one that holds least."""
    from slackswap_cli.pipeline.stages import step_us
    prof = _stage()
    order = schedule_order("1F1B", 2, 4)
    planned = plan_stages(order, {0: prof, 1: prof}, 850_000, _planner)
    row = planned.rows[0]
    assert row.held_fraction == 1.0 and row.planned_peak_bytes == C + END + T
    assert {d.tensor for d in planned.plans[0].decisions if d.action != "keep"} == {2}   # a
    held = plan_stages(order, {0: prof, 1: prof}, 720_000, _planner)
    assert step_us(order[0], {0: prof}, planned.plans) < step_us(order[0], {0: prof},
                                                                  held.plans)


@pytest.mark.parametrize("budget", [500_000])
def test_below_the_hold_floor_names_the_least(budget):
    """Both evicted, the rank holds 8 + 4 of one microbatch and 500,000 of the other's peak:
    the least any plan reaches, named in the error."""
    from slackswap_cli.errors import InfeasibleError
    prof = _stage()
    with pytest.raises(InfeasibleError, match=f"at least {END + T}"):
        plan_stages(schedule_order("1F1B", 2, 4), {0: prof, 1: prof}, budget, _planner)


def test_a_slower_link_factor_is_recorded_and_said():
    """The windows' search at a link factor below 1 (pipeline/windows.py): the rank fits under
    the judge, and the plan records the slower link and says why it was planned so."""
    from slackswap_cli.pipeline.windows import Windows
    prof = _stage()

    def planner(p, b, hw=HW):
        return make_plan("slackswap", p, hw, b)
    win = plan_stages(schedule_order("1F1B", 2, 4), {0: prof, 1: prof}, 720_000, None,
                      windows=Windows(planner, HW, (0.5,)))
    row, plan = win.rows[0], win.plans[0]
    assert row.link_factor == 0.5 and row.planned_peak_bytes <= 720_000
    assert row.held_fraction < 1.0
    assert plan.hardware["d2h_bytes_per_s"] == 0.5 * HW.d2h_bytes_per_s
    assert any("share the rank's copy engines" in n for n in plan.notes)
