"""Planners on hand-checkable profiles, the registry, and property tests judged by the simulator.

Test hardware: copies move 1e10 bytes/s with no latency (1 MB takes 100 us each way); compute
times are given per op, so every expected action can be worked out by hand.
"""
import re

import pytest
from helpers import hand_hw, load_benchmark
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap_cli.errors import InputError
from slackswap_cli.layers import op_layer_indices
from slackswap_cli.planners import PLANNERS, make_plan, planner_names, run_planner
from slackswap_cli.profile_build import ProfileBuilder
from slackswap_cli.simulate import budget_floor_bytes, simulate
from slackswap_testkit.synthetic import chain_profile

MB = 1_000_000
HW = hand_hw()
FAST = ["slackswap", "recompute-only", "swap-all", "checkpoint-layers"]


def two_tensor_profile(a_us: float, a_bytes: int, mid_us: float, bwd_us: float = 100.0):
    """f_a: x -> a (a_us);  f_c: a -> c (mid_us, c is 1 byte). Backward: b_c reads c and makes
    a gradient gc as big as a; b_g reads gc; b_h reads nothing saved; b_a reads a. Keep-all peak: a + c + gc at b_c;
    floor: a + c (while f_c reads a) -- so a budget at the floor forces a out across b_c, b_g
    (and a prefetch of a fits only during b_h).
    """
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    a = b.add_tensor("a", "activation", (a_bytes,), "uint8", size_bytes=a_bytes)
    c = b.add_tensor("c", "activation", (1,), "uint8", size_bytes=1)
    b.add_op("f_a", "aten.mm.default", "forward", (x,), (a,), module="layers.0", time_us=a_us)
    b.add_op("f_c", "aten.mm.default", "forward", (a,), (c,), module="layers.1", time_us=mid_us)
    g = b.add_tensor("g", "input", (1,), "float32", size_bytes=4)
    gc = b.add_tensor("gc", "activation", (a_bytes,), "uint8", size_bytes=a_bytes)
    b.add_op("b_c", "aten.mm.default", "backward", (g, c), (gc,), module="layers.1",
             time_us=bwd_us)
    gw1 = b.add_tensor("gw1", "gradient", (1,), "float32", size_bytes=4)
    b.add_op("b_g", "aten.mm.default", "backward", (gc,), (gw1,), module="layers.1",
             time_us=bwd_us)
    gw2 = b.add_tensor("gw2", "gradient", (1,), "float32", size_bytes=4)
    b.add_op("b_h", "aten.mm.default", "backward", (g,), (gw2,), module="layers.1",
             time_us=bwd_us)
    gw0 = b.add_tensor("gw0", "gradient", (1,), "float32", size_bytes=4)
    b.add_op("b_a", "aten.mm.default", "backward", (g, a), (gw0,), module="layers.0",
             time_us=bwd_us)
    return b.build()


def actions(decisions):
    return {d.tensor: d.action for d in decisions}


# ---------------------------------------------------------------------------------------------
# hand-checked cases
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAST + ["optimal"])
def test_budget_one_keeps_everything_at_retention_one(name):
    p = chain_profile(4, act_bytes=MB)
    plan = make_plan(name, p, HW, p.summary["peak_activation_bytes"], 1.0)
    if name != "swap-all":
        assert set(actions(plan.decisions).values()) == {"keep"}
        assert plan.predicted.retention == 1.0
    assert plan.feasible
    assert plan.budget_fraction == 1.0
    assert plan.profile_fingerprint == p.fingerprint
    assert plan.hardware == HW.to_dict()
    assert len(plan.decisions) == len(p.saved_activations)


def test_big_tensor_cheap_to_recompute_is_recomputed():
    # a: 10 MB made in 1 us. Swapping it costs 1000 us of copy each way under 100-200 us of
    # compute; recomputing it costs 1 us.
    p = two_tensor_profile(a_us=1.0, a_bytes=10 * MB, mid_us=100.0)
    a = p.saved_activations[0].id
    floor = budget_floor_bytes(p)
    assert floor == 10 * MB + 1 and p.summary["peak_activation_bytes"] == 20 * MB + 1
    for name in ("slackswap", "optimal", "recompute-only"):
        plan = make_plan(name, p, HW, floor)
        assert actions(plan.decisions)[a] == "recompute"
        assert plan.feasible
        assert plan.predicted.recompute_us == 1.0
        assert plan.predicted.step_us == pytest.approx(1.0 + 100 + 4 * 100 + 1.0)


def test_expensive_tensor_with_enough_slack_is_swapped():
    # a: 1 MB (100 us to copy) made by a 500 us op; 1000 us of forward after it and 1000 us of
    # backward (b_h) before its use hide both copies, so the swap is free and recompute is not.
    p = two_tensor_profile(a_us=500.0, a_bytes=MB, mid_us=1000.0, bwd_us=1000.0)
    a = p.saved_activations[0].id
    for name in ("slackswap", "optimal"):
        plan = make_plan(name, p, HW, budget_floor_bytes(p))
        assert actions(plan.decisions)[a] == "swap"
        assert plan.feasible
        assert plan.predicted.retention == 1.0
        assert plan.predicted.stall_us == 0.0


@pytest.mark.parametrize("name", FAST + ["optimal"])
def test_dropout_outputs_are_never_recomputed(name):
    p = chain_profile(6, act_bytes=MB, random_layers=(1, 3, 4))
    random_ids = {t.id for t in p.saved_activations if not t.recomputable}
    assert len(random_ids) == 3
    floor = budget_floor_bytes(p)
    for budget in (floor, (floor + p.summary["peak_activation_bytes"]) // 2):
        decisions, _, _ = run_planner(name, p, HW, budget)
        for d in decisions:
            if d.tensor in random_ids:
                assert d.action != "recompute"


def test_only_tensors_live_at_over_budget_moments_are_evicted():
    # chain of 4 x 1 MB, keep-all peak 4 MB at the loss; budget 3 MB + loss: one eviction
    # suffices. Layer 3 is read by backward at once (gap empty): never worth evicting.
    p = chain_profile(4, act_bytes=MB, fwd_us=100.0)
    budget = 3 * MB + 4
    plan = make_plan("slackswap", p, HW, budget)
    acts = actions(plan.decisions)
    evicted = [t for t, a in acts.items() if a != "keep"]
    assert len(evicted) == 1
    assert acts[p.saved_activations[-1].id] == "keep"
    assert plan.feasible and plan.predicted.peak_bytes <= budget


def test_checkpoint_layers_finds_blocks_from_module_paths():
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    mods = ["transformer.h.3.mlp", "transformer.h.12.attn", "transformer.h.0", "lm_head", "",
            "transformer.h.3.mlp.experts.1"]
    for i, mod in enumerate(mods):
        t = b.add_tensor(f"t{i}", "activation", (1,), "uint8", size_bytes=1)
        b.add_op(f"op{i}", "aten.relu.default", "forward", (x,), (t,), module=mod)
    assert op_layer_indices(b.build()) == [3, 12, 0, None, None, 3]


def test_checkpoint_layers_recomputes_inside_blocks_only():
    p = chain_profile(6, act_bytes=MB)
    floor = budget_floor_bytes(p)
    decisions, notes, _ = run_planner("checkpoint-layers", p, HW, floor)
    acts = actions(decisions)
    # in a chain every layer's output is the next layer's input: nothing is block-internal
    assert set(acts.values()) == {"keep"}
    assert any("checkpoint" in n for n in notes)


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------
def test_registry_names_and_unknown_planner():
    assert planner_names() == list(PLANNERS)
    assert set(planner_names()) == {"slackswap", "optimal", "recompute-only", "swap-all",
                                    "checkpoint-layers", "torchtitan-sac", "full-ac",
                                    "megatron-selective"}
    p = chain_profile(2)
    with pytest.raises(InputError, match="unknown planner 'nope'") as exc:
        make_plan("nope", p, HW, 10)
    assert "slackswap" in exc.value.hint and "checkpoint-layers" in exc.value.hint


def test_make_plan_reports_infeasible_with_reason():
    p = chain_profile(4, act_bytes=MB)
    plan = make_plan("recompute-only", p, HW, 1000)   # far below the floor
    assert not plan.feasible
    assert any("simulator" in n for n in plan.notes)


# ---------------------------------------------------------------------------------------------
# properties on random small profiles
# ---------------------------------------------------------------------------------------------
@st.composite
def random_profiles(draw):
    """Random forward DAGs: op i reads one or two earlier activations, writes a_i (maybe a
    random op's output); the loss reads the last; backward op j reads a_j and maybe a_{j-1}."""
    n = draw(st.integers(2, 7))
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    acts = []
    for i in range(n):
        size = draw(st.integers(1, 8)) * MB // 4
        rand = draw(st.booleans()) and i > 0 and draw(st.booleans())
        t = b.add_tensor(f"a{i}", "activation", (size,), "uint8", size_bytes=size,
                         recomputable=not rand)
        ins = [acts[-1] if acts else x]
        if len(acts) > 1 and draw(st.booleans()):
            ins.append(acts[draw(st.integers(0, len(acts) - 2))])
        b.add_op(f"f{i}", "aten.native_dropout.default" if rand else "aten.mm.default",
                 "forward", ins, (t,), module=f"layers.{i}",
                 time_us=float(draw(st.integers(1, 400))))
        acts.append(t)
    loss = b.add_tensor("loss", "activation", (), "float32", size_bytes=4)
    b.add_op("loss", "aten.sum.default", "forward", (acts[-1],), (loss,), time_us=1.0)
    g = b.add_tensor("g", "input", (), "float32", size_bytes=4)
    for i in reversed(range(n)):
        gw = b.add_tensor(f"gw{i}", "gradient", (1,), "float32", size_bytes=4)
        ins = [g, acts[i]]
        if i > 0 and draw(st.booleans()):
            ins.append(acts[i - 1])
        b.add_op(f"b{i}", "aten.mm.default", "backward", ins, (gw,), module=f"layers.{i}",
                 time_us=float(draw(st.integers(1, 800))))
    return b.build()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=random_profiles(), frac=st.floats(0.0, 1.0))
def test_feasible_plans_respect_the_budget(p, frac):
    floor = budget_floor_bytes(p)
    peak = p.summary["peak_activation_bytes"]
    budget = int(floor + frac * (peak - floor))
    saved = {t.id for t in p.saved_activations}
    non_rec = {t.id for t in p.saved_activations if not t.recomputable}
    for name in FAST:
        plan = make_plan(name, p, HW, budget)
        assert {d.tensor for d in plan.decisions} == saved
        assert len(plan.decisions) == len(saved)
        assert all(d.action != "recompute" for d in plan.decisions if d.tensor in non_rec)
        assert plan.predicted.retention <= 1.0
        if plan.feasible:
            assert plan.predicted.peak_bytes <= budget
            # and the simulator agrees when re-run on the decisions alone
            again = simulate(p, plan.decisions, HW, budget, record=False)
            assert again.feasible and again.predicted.peak_bytes <= budget


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=random_profiles(), frac=st.floats(0.0, 1.0))
def test_slackswap_never_worse_than_recompute_only_when_both_fit(p, frac):
    floor = budget_floor_bytes(p)
    peak = p.summary["peak_activation_bytes"]
    budget = int(floor + frac * (peak - floor))
    ss = make_plan("slackswap", p, HW, budget)
    ro = make_plan("recompute-only", p, HW, budget)
    if ro.feasible:
        assert ss.feasible
        assert ss.predicted.retention >= ro.predicted.retention - 1e-9


def test_planner_options_are_checked():
    p = chain_profile(3, act_bytes=MB)
    budget = p.summary["peak_activation_bytes"]
    plan = make_plan("optimal", p, HW, budget, time_limit_s=5.0)
    assert plan.feasible
    with pytest.raises(InputError, match="takes no option time_limit_s") as exc:
        make_plan("slackswap", p, HW, budget, time_limit_s=5.0)
    assert "exchange_tries" in exc.value.hint and "max_tries" in exc.value.hint
    with pytest.raises(InputError, match="takes no option max_tries") as exc:
        make_plan("recompute-only", p, HW, budget, max_tries=3)
    assert exc.value.hint == "its options: none"


@pytest.mark.parametrize("planner, option, message", [
    ("optimal", {"time_limit_s": "5"}, "time_limit_s='5' is not a number"),
    ("optimal", {"node_limit": 2.5}, "node_limit=2.5 is not an integer or None"),
    ("optimal", {"groups": True}, "groups=True is not an integer"),
    ("optimal", {"time_limit_s": 0}, "time_limit_s=0 is out of range: it must be above 0"),
    ("optimal", {"soft_share": 1.5}, "soft_share=1.5 is out of range"),
    ("slackswap", {"repairs": ((1.0, "no"),)}, "is not a tuple of"),
    ("slackswap", {"repairs": ()}, "repairs=() is out of range"),
    ("slackswap", {"max_tries": 0}, "max_tries=0 is out of range: it must be at least 1"),
    ("slackswap", {"price_quantiles": (1.0, 1.5)}, "price_quantiles=(1.0, 1.5) is out of range"),
    ("slackswap", {"price_quantiles": ()}, "price_quantiles=() is out of range"),
])
def test_planner_option_values_are_checked(planner, option, message):
    p = chain_profile(3, act_bytes=MB)
    with pytest.raises(InputError, match=re.escape(message)):
        run_planner(planner, p, HW, p.summary["peak_activation_bytes"], **option)


def test_planner_settings_reach_the_planner():
    # the options are the planner's settings: a repair list whose only try pins prefetches
    # just in time gives pinned swaps (the default's first try pins none), said in the notes
    from slackswap_cli.hardware import PRESETS
    from slackswap_testkit.synthetic import transformer_profile
    p, hw = transformer_profile(), PRESETS["a100-pcie4"]
    budget = int(0.5 * p.keep_all_peak_bytes)
    pinned = make_plan("slackswap", p, hw, budget, repairs=((0.97, True),), polish_work_ops=0)
    swaps = [d for d in pinned.decisions if d.action == "swap"]
    assert swaps and all(d.prefetch_at is not None for d in swaps)
    assert any("prefetches pinned just in time" in n for n in pinned.notes)
    default = make_plan("slackswap", p, hw, budget)
    assert all(d.prefetch_at is None for d in default.decisions)
    same = make_plan("slackswap", p, hw, budget, max_tries=8, prefetch_margin=0.10)
    assert same.decisions == default.decisions
    # the polish allowance: off, the plan is the repairs' best; on, never worse
    unpolished = make_plan("slackswap", p, hw, budget, polish_work_ops=0)
    assert not any("polished" in n for n in unpolished.notes)
    assert default.predicted.retention >= unpolished.predicted.retention


def test_price_ladder_finds_what_the_dearest_price_misses():
    # GPT-2 XL at 0.4: pricing every swap at the dearest recompute of the plan without swaps
    # makes 295 swaps; a lower price on the ladder makes 83, and the simulator prefers that plan
    # (retention 0.90149 against 0.90075 on the sample as priced now; at 0.5, where this test
    # stood before a100-pcie4's bf16 GEMM fraction was sourced, both prices give one plan)
    from pathlib import Path

    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.schema import load_profile
    p = load_profile(Path(__file__).resolve().parents[1] / "sample_profiles" / "gpt2-xl.json")
    hw = PRESETS["a100-pcie4"]
    budget = int(0.4 * p.keep_all_peak_bytes)
    one = make_plan("slackswap", p, hw, budget, price_quantiles=(1.0,), polish_work_ops=0)
    ladder = make_plan("slackswap", p, hw, budget, polish_work_ops=0)
    assert one.feasible and ladder.feasible
    assert ladder.predicted.retention > one.predicted.retention + 3e-4
    swapped = {d.tensor for d in ladder.decisions if d.action == "swap"}
    assert swapped != {d.tensor for d in one.decisions if d.action == "swap"}


# ---------------------------------------------------------------------------------------------
# a small transformer-shaped profile (synthetic.transformer_profile) and the paper benchmark
# ---------------------------------------------------------------------------------------------
def _paper_table():
    return load_benchmark("paper_table")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_transformer_profile_every_planner_judged_by_the_simulator(arch):
    from slackswap_cli.hardware import PRESETS
    hw = PRESETS["a100-pcie4"]
    from slackswap_testkit.synthetic import transformer_profile
    p = transformer_profile(arch, layers=3, hidden=128, heads=4, batch=2,
                            seq=64, hw=hw)
    budget = p.summary["peak_activation_bytes"] // 2
    assert budget >= budget_floor_bytes(p)
    plans = {name: make_plan(name, p, hw, budget, time_limit_s=10) if name == "optimal"
             else make_plan(name, p, hw, budget) for name in planner_names()}
    ss = plans["slackswap"]
    assert ss.feasible and ss.predicted.peak_bytes <= budget
    random_ids = {t.id for t in p.saved_activations if not t.recomputable}
    assert random_ids if arch == "gpt2" else not random_ids   # dropout outputs and masks
    assert all(d.action != "recompute" for d in ss.decisions if d.tensor in random_ids)
    for name, plan in plans.items():
        if plan.feasible and name != "optimal":
            assert ss.predicted.retention >= plan.predicted.retention - 1e-9, name


def test_paper_table_runs_on_given_profiles(tmp_path):
    import orjson

    from slackswap_cli import schema
    from slackswap_cli.hardware import PRESETS
    from slackswap_testkit.synthetic import transformer_profile
    pt = _paper_table()
    prof = transformer_profile("gpt2", layers=2, hidden=64, heads=2, batch=1, seq=32,
                               hw=PRESETS["a100-pcie4"], name="tiny")
    schema.save(prof, tmp_path / "tiny.json")
    out = tmp_path / "out"
    assert pt.main(["--profiles", str(tmp_path / "tiny.json"), "--out", str(out),
                    "--sweep", "0.5,1.0", "--planners", "slackswap,recompute-only"]) == 0
    res = orjson.loads((out / "paper_table.json").read_bytes())
    (entry,) = res["profiles"]
    assert entry["name"] == "tiny"
    assert {r["planner"] for r in entry["main"]} == {"slackswap", "recompute-only"}
    full = [r for r in entry["sweep"] if r["budget_fraction"] == 1.0]
    assert all(r["retention"] == 1.0 for r in full)
    assert "| tiny |" in (out / "paper_table.md").read_text()
