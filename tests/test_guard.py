"""The memory guard's rule (`slackswap_cli/guard.py`), on cases computed by hand: what a run
keeps and swaps of what its plan cannot place, and the same rule as decisions the simulator
judges."""
from helpers import hand_hw

from slackswap_cli.guard import Guard, guarded_decisions
from slackswap_cli.schema import Decision
from slackswap_cli.simulate import simulate
from slackswap_testkit.synthetic import chain_profile

MB = 1_000_000


def test_guard_keeps_within_the_limit_and_swaps_beyond_it():
    g = Guard(3 * MB)
    g.hold("a", MB)                     # the plan keeps 1 MB
    assert g.admit("b", MB)             # 2 MB: kept
    assert g.admit("b", MB)             # another view of b: already held, free
    assert g.admit("c", MB)             # exactly 3 MB: kept (at the limit is within it)
    assert not g.admit("d", 1)          # one byte more: swapped
    assert (g.held, g.swaps, g.swapped_bytes, g.kept_over) == (3 * MB, 1, 1, 0)
    g.drop("a", MB)                     # a root the plan held for a chain went to the host
    assert g.admit("e", MB) and g.held == 3 * MB


def test_planned_keeps_are_never_changed_only_counted():
    g = Guard(MB)
    g.hold("a", MB)
    g.hold("b", MB)                     # the plan itself keeps 2 MB against a 1 MB limit
    assert (g.held, g.kept_over) == (2 * MB, MB)
    assert not g.admit("c", 1)
    assert Guard(None).admit("x", 10 ** 12)      # no budget: everything kept


def test_guarded_decisions_swap_the_unplaced_roots_beyond_the_limit_in_forward_order():
    prof = chain_profile(5, act_bytes=MB)
    a = [t.id for t in prof.saved_activations]
    assert len(a) == 5
    plan = [Decision(a[0], "keep"), Decision(a[1], "keep"), Decision(a[2], "recompute"),
            Decision(a[3], "recompute"), Decision(a[4], "recompute")]
    # a2..a4's chains did not line up: held a0 + a1 = 2 MB, a2 fits (3 MB), a3 and a4 do not
    got = guarded_decisions(prof, plan, 3 * MB, unplaced={a[2], a[3], a[4]})
    assert [d.action for d in got] == ["keep", "keep", "keep", "swap", "swap"]
    # the plan's own decisions stand: only unplaced roots change
    assert guarded_decisions(prof, plan, 3 * MB, unplaced=set()) == tuple(plan)
    # the simulator judges the result like any plan: swapping beats keeping everything
    hw = hand_hw()
    kept = simulate(prof, [Decision(d.tensor, "keep") for d in plan], hw, None)
    guarded = simulate(prof, got, hw, None)
    assert guarded.predicted.peak_bytes < kept.predicted.peak_bytes
    assert guarded.predicted.swapped_bytes == 2 * MB


def test_the_guard_leaves_room_for_what_the_plan_keeps_later_in_forward():
    prof = chain_profile(5, act_bytes=MB)
    a = [t.id for t in prof.saved_activations]
    plan = [Decision(a[0], "keep"), Decision(a[1], "recompute"), Decision(a[2], "recompute"),
            Decision(a[3], "keep"), Decision(a[4], "keep")]
    # a1, a2 unplaced: a0 (1 MB) + a1 (1 MB) + a3, a4 still to come (2 MB) = 4 MB > 3 MB
    got = guarded_decisions(prof, plan, 3 * MB, unplaced={a[1], a[2]})
    assert [d.action for d in got] == ["keep", "swap", "swap", "keep", "keep"]
    # with 4 MB, a1 fits beside the reserve, a2 no longer does
    got = guarded_decisions(prof, plan, 4 * MB, unplaced={a[1], a[2]})
    assert [d.action for d in got] == ["keep", "keep", "swap", "keep", "keep"]
    g = Guard(3 * MB)
    assert not g.admit("x", MB, reserve=2 * MB + 1) and g.admit("x", MB, reserve=2 * MB)


def test_scale_maps_the_changed_input_sizes_and_learns_what_it_did_not_foresee():
    from slackswap_cli.guard import Scale
    # inputs [2, 32] (ids) and [2, 32] (labels) become [2, 20]: 32 -> 20, 2 unchanged
    s = Scale([(2, 32), (2, 32)], [(2, 20), (2, 20)])
    assert s.shape((2, 32, 64)) == (2, 20, 64)
    assert s.shape((2, 4, 32, 32)) == (2, 4, 20, 20)
    assert s.ratio((2, 4, 32, 32)) == 400 / 1024
    # a flattened batch x sequence (64 = 2 x 32) is not foreseen: 1.0 until one is seen
    assert s.ratio((64, 64)) == 1.0
    assert s.observe((64, 64), (40, 64)) is True
    assert s.shape((64, 64)) == (40, 64) and s.ratio((64, 64)) == 40 / 64
    assert s.observe((64, 64), (40, 64)) is False          # (known already)
    assert s.observe((2, 32, 64), (2, 20, 64)) is False    # as predicted
    assert s.ratio((0, 32)) == 1.0                         # no elements
