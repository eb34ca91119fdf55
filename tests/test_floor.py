"""The budget floor is exact, on random small profiles.

- no plan has a least peak below the floor (`min_peak_bytes` of random decisions);
- the swap-everything plan fits every budget from the floor up;
- every planner of record, at any budget from the floor up, returns a plan that fits or says
  why (its notes carry the simulator's reason, or the simulator refuses a recompute chain
  through a random op's unsaved output by name), and `repair_to_fit` makes that plan fit;
- `first_feasible_budget` returns a budget at which the planner's own plan fits.
"""
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from slackswap_cli.budget import first_feasible_budget
from slackswap_cli.errors import InputError
from slackswap_cli.hardware import PRESETS
from slackswap_cli.planners import make_plan, planner_names, run_planner
from slackswap_cli.profile_build import ProfileBuilder
from slackswap_cli.schema import Decision
from slackswap_cli.simulate import budget_floor_bytes, min_peak_bytes, recompute_chains, simulate
from slackswap_testkit.repair import repair_to_fit

HW = PRESETS["a100-pcie4"]
KB = 1 << 10


@st.composite
def random_profiles(draw):
    """Forward ops reading one or two earlier values (some views, some random ops, some
    layer-sized), a loss, and backward ops reading forward values and the incoming gradient,
    writing gradient-sized activations and parameter gradients."""
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    w = b.add_tensor("w", "parameter", (1,), "float32", size_bytes=4)
    acts: list[int] = []
    n = draw(st.integers(2, 9))
    for i in range(n):
        pool = [x] + acts
        if acts and draw(st.integers(0, 5)) == 0:
            src = draw(st.sampled_from(acts))
            t = b.add_tensor(f"v{i}", "activation", (1,), "uint8",
                             size_bytes=b.tensors[src].size_bytes, alias_of=src)
            b.add_op(f"view{i}", "aten.view.default", "forward", (src,), (t,), time_us=0.0,
                     module=f"layers.{i}")
        else:
            ins = [pool[-1]]
            if len(pool) > 2 and draw(st.booleans()):
                ins.append(draw(st.sampled_from(pool[:-1])))
            rnd = draw(st.integers(0, 4)) == 0
            t = b.add_tensor(f"a{i}", "activation", (1,), "uint8",
                             size_bytes=draw(st.integers(1, 16)) * 64 * KB, recomputable=not rnd)
            b.add_op(f"f{i}", "aten.native_dropout.default" if rnd else "aten.mm.default",
                     "forward", (*dict.fromkeys(ins), w), (t,), module=f"layers.{i}",
                     time_us=float(draw(st.sampled_from([1, 10, 50, 200, 800]))))
        acts.append(t)
    loss = b.add_tensor("loss", "activation", (), "float32", size_bytes=4)
    b.add_op("loss", "aten.sum.default", "forward", (acts[-1],), (loss,), time_us=1.0)
    g = b.add_tensor("tangent", "input", (), "float32", size_bytes=4)
    for i in range(draw(st.integers(1, 6))):
        reads = draw(st.lists(st.sampled_from(acts), min_size=1, max_size=3, unique=True))
        out = b.add_tensor(f"g{i}", "activation", (1,), "uint8",
                           size_bytes=draw(st.sampled_from([0, 64 * KB, 256 * KB])))
        gw = b.add_tensor(f"gw{i}", "gradient", (1,), "float32", size_bytes=4)
        b.add_op(f"b{i}", "aten.mm.default", "backward", (g, *reads), (out, gw),
                 time_us=float(draw(st.sampled_from([1, 20, 100, 400]))))
        g = out
    return b.build()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=random_profiles(), data=st.data())
def test_no_plan_goes_below_the_floor_and_swap_all_reaches_it(p, data):
    floor = budget_floor_bytes(p)
    peak = p.summary["peak_activation_bytes"]
    assert floor <= peak
    acts = {t.id: data.draw(st.sampled_from(["keep", "swap", "recompute"] if t.recomputable
                                            else ["keep", "swap"])) for t in p.saved_activations}
    try:
        least = min_peak_bytes(p, acts)
    except InputError as exc:       # a recompute chain through an unsaved random op's output
        assert "random op" in exc.message
        assume(False)
    assert least >= floor
    swap_all = {t.id: "swap" for t in p.saved_activations}
    assert min_peak_bytes(p, swap_all) == floor
    budget = data.draw(st.integers(floor, peak + 1))
    assert simulate(p, swap_all, HW, budget, record=False).feasible


# 40 random profiles by default (11 s), 80 in the slow tier (SLACKSWAP_SLOW=1)
SLOW = os.environ.get("SLACKSWAP_SLOW") == "1"


@settings(max_examples=80 if SLOW else 40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(p=random_profiles(), frac=st.sampled_from([0.0, 0.05, 0.2, 0.5, 1.0]))
def test_every_planner_fits_above_the_floor_or_says_why_and_is_repaired(p, frac):
    floor = budget_floor_bytes(p)
    peak = p.summary["peak_activation_bytes"]
    budget = int(floor + frac * (peak - floor))
    for name in planner_names():
        options = {"time_limit_s": 5.0} if name == "optimal" else {}
        try:
            plan = make_plan(name, p, HW, budget, **options)
            decisions, feasible = list(plan.decisions), plan.feasible
            if not feasible:
                assert any(n.startswith("simulator:") for n in plan.notes), (name, plan.notes)
        except InputError as exc:
            # planners may still recompute through a random op's unsaved output, which the
            # simulator refuses with this message (reported; the chain model is being unified)
            assert "random op" in exc.message and "cannot be recomputed" in exc.message
            try:
                decisions = run_planner(name, p, HW, budget, **options)[0]
            except InputError:      # the planner itself stopped on the simulator's refusal
                decisions = []
            feasible = False
        fixed = repair_to_fit(p, decisions, budget)
        assert simulate(p, fixed, HW, budget, record=False).feasible, name
        if feasible:
            assert fixed == decisions                  # a plan that fits is left alone
        # a repair only turns kept or recomputed tensors into swaps
        before = {d.tensor: d.action for d in decisions}
        for d in fixed:
            assert d.action == before.get(d.tensor, "keep") or d.action == "swap"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=random_profiles())
def test_first_feasible_budget_is_one_where_the_planner_fits(p):
    floor = budget_floor_bytes(p)
    reach = first_feasible_budget(p, HW, "slackswap")
    assert reach is not None and floor <= reach <= p.summary["peak_activation_bytes"]
    assert make_plan("slackswap", p, HW, reach).feasible
    assert first_feasible_budget(p, HW, "swap-all") == floor


def test_repair_refuses_a_budget_below_the_floor():
    from slackswap_cli.errors import InfeasibleError
    from slackswap_testkit.synthetic import chain_profile
    p = chain_profile(3, act_bytes=1 << 20)
    with pytest.raises(InfeasibleError, match="below the floor"):
        repair_to_fit(p, [], budget_floor_bytes(p) - 1)


def _chain_through_random_profile():
    """Found by the property above: recomputing a8 re-runs f7..f3, and f3 reads a2, the output
    of the random op f2, which no backward op reads (so it is not saved and cannot be re-run)."""
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    w = b.add_tensor("w", "parameter", (1,), "float32", size_bytes=4)
    sizes = [6, 5, 9, 1, 3, 16, 1, 14, 1]            # x 64 KiB
    rand = {0, 2}
    reads = {2: [1, 0], 5: [4, 3], 6: [5, -1], 8: [7, -1]}   # -1: the input x
    times = [50, 800, 50, 1, 50, 10, 1, 200, 10]
    a: list[int] = []
    for i, (size, us) in enumerate(zip(sizes, times)):
        t = b.add_tensor(f"a{i}", "activation", (1,), "uint8", size_bytes=size * 64 * KB,
                         recomputable=i not in rand)
        ins = [a[j] if j >= 0 else x for j in reads.get(i, [i - 1])] if i else [x]
        b.add_op(f"f{i}", "aten.native_dropout.default" if i in rand else "aten.mm.default",
                 "forward", (*ins, w), (t,), time_us=float(us))
        a.append(t)
    loss = b.add_tensor("loss", "activation", (), "float32", size_bytes=4)
    b.add_op("loss", "aten.sum.default", "forward", (a[-1],), (loss,), time_us=1.0)
    g = b.add_tensor("tangent", "input", (), "float32", size_bytes=4)
    g0 = b.add_tensor("g0", "activation", (1,), "uint8", size_bytes=4 * 64 * KB)
    gw0 = b.add_tensor("gw0", "gradient", (1,), "float32", size_bytes=4)
    b.add_op("b0", "aten.mm.default", "backward", (g, a[7], a[6], a[3]), (g0, gw0), time_us=1.0)
    g1 = b.add_tensor("g1", "activation", (1,), "uint8", size_bytes=0)
    gw1 = b.add_tensor("gw1", "gradient", (1,), "float32", size_bytes=4)
    b.add_op("b1", "aten.mm.default", "backward", (g0, a[8]), (g1, gw1), time_us=20.0)
    return b.build()


@pytest.mark.parametrize("name", ["slackswap", "recompute-only"])
def test_planners_never_recompute_through_an_unsaved_random_output(name):
    # a8's chain reads a3, kept but past its last reader: the chain holds it on (as the
    # planners' static view assumes) instead of re-running f3, which reads the random a2
    p = _chain_through_random_profile()
    budget = (budget_floor_bytes(p) + p.summary["peak_activation_bytes"]) // 2
    plan = make_plan(name, p, HW, budget)
    assert all(prof_op != 3 for ops in recompute_chains(p, plan.decisions).values()
               for prof_op in ops)


def test_repair_keeps_a_plan_that_fits_and_fixes_one_that_does_not():
    p = _chain_through_random_profile()
    budget = (budget_floor_bytes(p) + p.summary["peak_activation_bytes"]) // 2
    decisions = run_planner("recompute-only", p, HW, budget)[0]
    fixed = repair_to_fit(p, decisions, budget)
    assert simulate(p, fixed, HW, budget, record=False).feasible
    floor = budget_floor_bytes(p)
    keep_all = [Decision(t.id, "keep") for t in p.saved_activations]
    assert simulate(p, repair_to_fit(p, keep_all, floor), HW, floor, record=False).feasible
