"""The MILP planner on an instance whose optimum is known by hand."""
import pytest
from helpers import hand_hw

from slackswap_cli.planners import make_plan
from slackswap_cli.planners.common import build_cost_model
from slackswap_cli.planners.optimal import OptimalSettings, solve
from slackswap_testkit.synthetic import chain_profile

MB = 1_000_000
HW = hand_hw(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)   # 1 MB takes 1000 us: swaps never hide


def test_knapsack_picks_the_cheapest_pair_by_hand():
    # Five layers a0..a4 of 1 MB each (a_i = f_i(a_{i-1}), b_i reads a_i); budget 3 MB + loss.
    # A tensor can leave only after the next layer read it: while f3 runs (a0..a3 live, f3
    # reads a2) one of a0, a1 must be out; while f4 runs (a0..a4, f4 reads a3) two of a0, a1,
    # a2. Recompute costs the forward op (50, 10, 30, 20, 40 us); swaps cannot hide (1000 us
    # copies under ~100 us of compute). Best: a1 + a2 = 40 us (a0 + a1 = 60, a0 + a2 = 80).
    p = chain_profile(5, act_bytes=MB, fwd_us=[50.0, 10.0, 30.0, 20.0, 40.0])
    budget = 3 * MB + 4
    m = build_cost_model(p, HW)
    actions, notes, objective = solve(m, budget, OptimalSettings(time_limit_s=10))
    assert actions == ["keep", "recompute", "recompute", "keep", "keep"]
    assert any("proven lower bound 40.0 us (gap 0.00%)" in n for n in notes)
    assert objective == pytest.approx(40.0)
    plan = make_plan("optimal", p, HW, budget)
    assert plan.feasible
    # here the MILP's model is exact: its plan simulates at its objective
    assert any("simulates at 40.0 us of overhead, its objective says 40.0 us (+0.00%)" in n
               for n in plan.notes), plan.notes
    assert plan.predicted.recompute_us == 40.0
    assert plan.predicted.peak_bytes <= budget
    # slackswap's greedy finds the same plan here
    ss = make_plan("slackswap", p, HW, budget)
    assert ss.predicted.recompute_us == 40.0


def test_everything_fits_needs_no_solve():
    p = chain_profile(3, act_bytes=MB)
    actions, notes, objective = solve(build_cost_model(p, HW), p.summary["peak_activation_bytes"])
    assert objective == 0.0
    assert actions == ["keep"] * 3 and "nothing to solve" in notes[0]


def test_tied_blocks_share_variables_and_still_fit():
    # eight identical chain layers: tied into groups, the plan is still judged feasible
    p = chain_profile(8, act_bytes=MB, fwd_us=10.0)
    budget = 5 * MB + 4
    plan = make_plan("optimal", p, HW, budget, untie_limit=0, groups=2, time_limit_s=10)
    assert any("tied: 8 identical blocks in 4 groups" in n for n in plan.notes)
    assert plan.feasible and plan.predicted.peak_bytes <= budget


def test_queued_windows_by_hand():
    # Five 1 MB layers of 50 us: f0..f4 end at 50..250 us, loss (0 us), b4..b0 take 100 us
    # each (end at 350..750). D2H 100 us per tensor, H2D 200 us.
    from slackswap_cli.planners.optimal import _queued_windows, _windows
    hw = hand_hw(name="q", h2d_bytes_per_s=5e9)
    m = build_cost_model(chain_profile(5, act_bytes=MB, fwd_us=50.0), hw)
    assert list(m.t_end[:7]) == [50, 100, 150, 200, 250, 250, 350]
    tail, head = _windows(m, 0.0)[:2]
    # alone, a1's offload runs 100-200 us: its tail ends after f3 (op 3)
    assert tail[1] == 4
    qt, qh = _queued_windows(m, [0, 1], 0.0)
    # a0 offloads 50-150 us; a1 waits for it: 150-250 us, its tail ends after f4 (op 4)
    assert qt[0] == tail[0] == 3 and qt[1] == 5
    # a2, not swapped: were it, its copy would wait behind a1's, 250-350 us, ending in b4
    assert qt[2] == 7 and tail[2] == 5
    # prefetches, latest need first: a0 (needed by b0 at 650 us) 450-650; a1 (b1 at 550 us)
    # must end before a0's starts: 250-450, so its head starts at b4 (op 6), not at op 7
    assert head[1] == 7 and qh[1] == 6 and qh[0] == head[0] == 8
    # a window never ends before it starts; windows only widen
    assert (qh >= qt).all() and (qt >= tail).all()


def _model_error(notes) -> tuple[float, float]:
    """(simulated, objective) from the note comparing the MILP's plan with its objective."""
    import re
    note = next(n for n in notes if "its objective says" in n)
    sim, obj = re.search(r"simulates at ([\d.]+) us.*objective says ([\d.]+) us", note).groups()
    return float(sim), float(obj)


def test_a_spill_the_simulator_hides_is_not_charged_in_the_next_round():
    # random profile 5 at 0.8 of its peak: the first round's plan has offloads running 26.9 us
    # past the end of forward, charged as exposed copy time (eF), while its simulation waits
    # for none of them (0 us of overhead). The next round does not charge that spill and
    # starts from that plan: its objective is what the simulator says.
    import random

    from helpers import random_hw

    from slackswap_testkit.synthetic import random_profile
    prof = random_profile(5)
    hw = random_hw(random.Random(5))
    budget = int(0.8 * prof.keep_all_peak_bytes)
    one = make_plan("optimal", prof, hw, budget, time_limit_s=10, max_rounds=1)
    sim, obj = _model_error(one.notes)
    assert sim == 0.0 and obj == pytest.approx(26.9, abs=0.05)
    assert not any("does not charge that spill" in n for n in one.notes)
    out = make_plan("optimal", prof, hw, budget, time_limit_s=10)
    assert any("run 26.9 us past the end of forward" in n for n in out.notes)
    assert _model_error(out.notes) == (0.0, 0.0)
    assert out.feasible and out.predicted.retention == 1.0
