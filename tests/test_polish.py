"""The polish pass of `slackswap` and the simulator helpers it stands on: `static_costs`
(recompute time and least peak of a plan, no timing) and `simulate(give_up_stall_us=...)`."""
import random

from helpers import random_decisions, random_hw

from slackswap_cli.errors import InputError
from slackswap_cli.planners import run_planner
from slackswap_cli.planners.polish import STATIC_SHARE, polish
from slackswap_cli.schema import Decision
from slackswap_cli.simulate import simulate, static_costs
from slackswap_testkit.synthetic import random_profile


def _instances(n: int):
    for seed in range(n):
        rng = random.Random(seed)
        prof = random_profile(seed)
        hw = random_hw(rng)
        peak = prof.summary["peak_activation_bytes"]
        yield seed, rng, prof, hw, int(peak * rng.uniform(0.4, 0.9))


def test_static_costs_agree_with_the_simulator_on_random_plans():
    checked = stall_free = 0
    for seed, rng, prof, hw, budget in _instances(60):
        for _ in range(5):
            dec = random_decisions(prof, rng)
            try:
                sc = static_costs(prof, dec)
            except InputError:
                continue
            res = simulate(prof, dec, hw, None, record=False)
            checked += 1
            assert abs(sc.recompute_us - res.predicted.recompute_us) <= 1e-6 * res.predicted.ideal_us
            # the least peak: the plan fits a budget of exactly that, and not one byte less
            assert simulate(prof, dec, hw, sc.peak_bytes, record=False).feasible
            if sc.peak_bytes > 0:
                assert not simulate(prof, dec, hw, sc.peak_bytes - 1, record=False).feasible
            assert max(sc.forward_req, default=0) <= sc.peak_bytes
            assert len(sc.forward_req) == prof.n_forward
            if res.predicted.stall_us == 0:
                stall_free += 1
                assert abs(res.predicted.step_us - res.predicted.ideal_us - sc.recompute_us) \
                    <= 1e-6 * res.predicted.ideal_us
    assert checked > 200 and stall_free > 50


def test_give_up_stall_returns_none_exactly_when_the_plan_stalls_longer_or_does_not_fit():
    gave_up = kept = 0
    for seed, rng, prof, hw, budget in _instances(60):
        dec = random_decisions(prof, rng)
        try:
            full = simulate(prof, dec, hw, budget, record=False)
        except InputError:
            continue
        limit = rng.choice([0.0, 10.0, 100.0, 1000.0])
        res = simulate(prof, dec, hw, budget, record=False, give_up_stall_us=limit)
        if not full.feasible or full.predicted.stall_us > limit:
            assert res is None
            gave_up += 1
        else:
            assert res is not None and res.predicted == full.predicted
            kept += 1
    assert gave_up > 5 and kept > 5


def test_polish_never_loses_and_reports_what_the_simulator_says():
    gained = 0
    for seed, rng, prof, hw, budget in _instances(80):
        try:
            dec = run_planner("recompute-only", prof, hw, budget)[0]
            start = simulate(prof, dec, hw, budget, record=False)
        except InputError:
            continue
        out = polish(prof, hw, budget, dec, start)
        again = simulate(prof, list(out.decisions), hw, budget, record=False)
        assert again.predicted == out.result.predicted          # what it reports is true
        if not start.feasible:
            assert out.moves == 0 and out.result is start
            continue
        assert again.feasible
        assert again.predicted.retention >= start.predicted.retention
        assert (out.moves > 0) == (again.predicted.retention > start.predicted.retention)
        gained += out.moves > 0
        assert polish(prof, hw, budget, dec, start).decisions == out.decisions  # deterministic
    assert gained > 10       # recompute-only plans leave slack that swaps can use


def test_polish_respects_its_work_allowance():
    seed, rng, prof, hw, budget = next(i for i in _instances(40) if i[0] == 19)
    dec = [Decision(t.id, "recompute" if t.recomputable else "swap")
           for t in prof.saved_activations]
    start = simulate(prof, dec, hw, budget, record=False)
    assert start.feasible
    full = polish(prof, hw, budget, dec, start)
    assert full.simulated > 10 and full.moves > 0
    assert polish(prof, hw, budget, dec, start, work_ops=0).moves == 0
    small = polish(prof, hw, budget, dec, start, work_ops=5 * len(prof.ops))
    # a simulation costs the op count, a static pass STATIC_SHARE of it; the last may overshoot
    assert small.simulated <= 5 and small.simulated + STATIC_SHARE * small.laid_out <= 6


def test_polish_trades_a_swap_for_a_dearer_recompute_on_resnet50():
    # ResNet-50 at 0.6 (the sample as priced by the fitted op costs, op_costs.json, and the
    # a100-pcie4 preset's published bf16 GEMM fraction): the static passes swap relu_41 (6.1
    # MiB, recompute chain 12.2 us) and recompute relu_23 (12.3 MiB, chain 20.3 us), since the
    # slack ledger ranks by recompute time per byte (2.0 vs 1.7 us/MiB) and relu_23's copies
    # no longer fit the slack left. The polish's exchange with a swap (move 2) trades them
    # within its default allowance: relu_23's copies hide in its longer gap (ops 160 to 462),
    # relu_41 is recomputed, and the step drops by the difference of the two chains (8.2 us),
    # with no stall before or after. (At 0.7, where this test stood before the preset's GEMM
    # fraction was sourced, the polish now trades keeps for recomputes instead.)
    from pathlib import Path

    from slackswap_cli.chains import tables
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.planners import make_plan
    from slackswap_cli.planners.polish import _chain_time
    from slackswap_cli.schema import load_profile
    p = load_profile(Path(__file__).resolve().parents[1] / "sample_profiles" / "resnet50.json")
    hw = PRESETS["a100-pcie4"]
    budget = int(0.6 * p.keep_all_peak_bytes)
    start = make_plan("slackswap", p, hw, budget, polish_work_ops=0)
    res = simulate(p, start.decisions, hw, budget, record=False)
    out = polish(p, hw, budget, start.decisions, res)
    before = {d.tensor: d.action for d in start.decisions}
    changed = {d.tensor: d.action for d in out.decisions if before[d.tensor] != d.action}
    name = {t.id: t.name for t in p.tensors}
    assert {name[t]: str(a) for t, a in changed.items()} == {"relu_23": "swap",
                                                                "relu_41": "recompute"}
    assert out.moves == 1
    a, b = res.predicted, out.result.predicted
    assert a.stall_us == b.stall_us == 0.0
    by_name = {v: k for k, v in name.items()}
    tab = tables(p)
    saved = _chain_time(tab, by_name["relu_23"]) - _chain_time(tab, by_name["relu_41"])
    assert abs((a.recompute_us - b.recompute_us) - saved) < 1e-6 * a.recompute_us
    assert b.retention > a.retention + 1e-4


def test_polish_leaves_a_plan_at_the_ideal_step_alone():
    seed, rng, prof, hw, budget = next(_instances(1))
    keep = [Decision(t.id, "keep") for t in prof.saved_activations]
    peak = prof.summary["peak_activation_bytes"]
    res = simulate(prof, keep, hw, peak, record=False)
    assert res.feasible and res.predicted.retention == 1.0
    out = polish(prof, hw, peak, keep, res)
    assert out.moves == out.simulated == out.laid_out == 0 and out.decisions == tuple(keep)


def test_polish_recomputes_one_kept_tensor_instead_of_two_dearer_recomputes():
    # a0 (2 MiB, chain 100 us) is kept; a1 and a2 (1 MiB each, chains 60 us) are recomputed.
    # Their gaps lie inside a0's, so recomputing a0 and keeping both frees the same bytes
    # where memory is full and saves 20 us. No one-for-one exchange helps (each 60 us chain is
    # cheaper than a0's 100 us) and copies are too slow to hide, so only the one-for-many
    # move finds it.
    from slackswap_cli.hardware import HardwareSpec
    from slackswap_testkit.synthetic import chain_profile
    mib = 1 << 20
    prof = chain_profile(n=6, act_bytes=[2 * mib] + [mib] * 5, fwd_us=[100] + [60] * 5)
    hw = HardwareSpec(name="slow-copies", peak_flops_per_s=1e12, matmul_efficiency=1.0,
                      hbm_bytes_per_s=1e12, hbm_efficiency=1.0, memory_bytes=1 << 40,
                      h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6, copy_latency_us=0.0,
                      duplex=True, duplex_derate=1.0)
    budget = prof.keep_all_peak_bytes - 2 * mib
    ids = {t.name: t.id for t in prof.saved_activations}
    acts = {"a0": "keep", "a1": "recompute", "a2": "recompute", "a3": "keep", "a4": "keep",
            "a5": "keep"}
    dec = [Decision(ids[n], a) for n, a in acts.items()]
    start = simulate(prof, dec, hw, budget, record=False)
    assert start.feasible and start.predicted.recompute_us == 120.0
    out = polish(prof, hw, budget, dec, start)
    got = {n: str(a) for n, a in zip(acts, (next(d.action for d in out.decisions
                                                  if d.tensor == ids[n]) for n in acts))}
    assert got == {**{n: "keep" for n in acts}, "a0": "recompute"}
    assert out.result.feasible and out.result.predicted.recompute_us == 100.0


def test_with_allowance_to_spare_the_polish_ends_at_a_local_optimum():
    # a small transformer at 0.3 of its peak: the targeted moves leave slackswap's plan at
    # 72.4%, where a 1-/2-move local search still found 79.4%. With allowance left, the
    # polish sweeps that neighbourhood itself: a local search from its plan finds nothing
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.planners import make_plan
    from slackswap_testkit.local_search import improve
    from slackswap_testkit.synthetic import transformer_profile
    hw = PRESETS["a100-pcie4"]
    prof = transformer_profile("gpt2", layers=3, hidden=128, heads=4, batch=2, seq=32)
    budget = int(0.3 * prof.keep_all_peak_bytes)
    plan = make_plan("slackswap", prof, hw, budget)
    assert plan.feasible and plan.predicted.retention > 0.80
    res = improve(prof, hw, budget, list(plan.decisions), max_passes=1, time_limit_s=60)
    assert res.moves == 0 and res.evaluated > 100
    assert res.start_retention == plan.predicted.retention


def test_where_compute_waits_for_memory_the_polish_tries_swapping_the_biggest_kept_tensors():
    # four 100 us layers, 1 MiB each, copies at 1 MiB per 250 us, budget one tensor under the
    # peak. a1 (a dropout output: it cannot be recomputed) is swapped: its offload runs
    # 200-450 us, so f3 waits for memory from 300 to 450 us (150 us). Kept tensors live across
    # f3 are a0 and a2; swapping a0 as well frees 1 MiB when its offload ends at
    # 100 + 250 = 350 us: the wait drops to 50 us and the step from 2150 to 2050 us. a1's gap
    # lies inside a0's and it is no bigger, so a0 swapped with a1 kept is tried as well.
    from slackswap_cli.hardware import HardwareSpec
    from slackswap_cli.planners.polish import KEEP, SWAP, _Polisher
    from slackswap_testkit.synthetic import chain_profile
    mib = 1 << 20
    prof = chain_profile(n=4, act_bytes=mib, fwd_us=100, bwd_us=400, random_layers=[1])
    bw = mib / 250e-6
    hw = HardwareSpec(name="slow-copies", peak_flops_per_s=1e12, matmul_efficiency=1.0,
                      hbm_bytes_per_s=1e12, hbm_efficiency=1.0, memory_bytes=1 << 40,
                      h2d_bytes_per_s=bw, d2h_bytes_per_s=bw, copy_latency_us=0.0,
                      duplex=True, duplex_derate=1.0)
    budget = prof.keep_all_peak_bytes - mib
    ids = {t.name: t.id for t in prof.saved_activations}
    dec = [Decision(ids[n], "swap" if n == "a1" else "keep") for n in ("a0", "a1", "a2", "a3")]
    start = simulate(prof, dec, hw, budget)
    assert start.feasible and start.predicted.step_us == 2150.0
    assert start.predicted.stall_by_cause == {"memory_full": 150.0}
    p = _Polisher(prof, hw, budget, dec, start, None, 3, 1e-9)
    assert p.swap_where_memory_waits() == [(150.0, {ids["a0"]: SWAP}),
                                           (150.0, {ids["a0"]: SWAP, ids["a1"]: KEEP}),
                                           (150.0, {ids["a2"]: SWAP})]
    out = polish(prof, hw, budget, dec, start)
    assert out.result.feasible and out.result.predicted.step_us <= 2050.0
    assert next(d.action for d in out.decisions if d.tensor == ids["a0"]) == "swap"
