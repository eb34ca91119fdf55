"""Render into a recording console and check the numbers a user would read."""
import re

from rich.console import Console

from slackswap_cli import schema
from slackswap_cli.cli import render
from slackswap_cli.cli.render import fmt_bytes, fmt_us
from slackswap_cli.cli.render.plan import _idle, _why
from slackswap_cli.hardware import HardwareSpec
from slackswap_cli.layers import UNATTRIBUTED, layer_container, layer_of
from slackswap_cli.simulate import simulate
from slackswap_testkit.synthetic import chain_profile

MiB = 1 << 20
# 1 MiB copies in 100 us: 1 MiB / (MiB / 100 us)
HW = HardwareSpec(name="testhw", peak_flops_per_s=1e12, matmul_efficiency=1.0,
                  hbm_bytes_per_s=1e12, hbm_efficiency=1.0, memory_bytes=1 << 40,
                  h2d_bytes_per_s=MiB * 1e4, d2h_bytes_per_s=MiB * 1e4, copy_latency_us=0.0,
                  duplex=True, duplex_derate=0.5)


def text_of(renderables) -> str:
    c = Console(record=True, width=120)
    for r in renderables if isinstance(renderables, list) else [renderables]:
        c.print(r)
    return c.export_text()


def test_formatting_helpers():
    assert fmt_bytes(1.5 * 2**30) == "1.50 GiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(3 * MiB) == "3.00 MiB"
    assert fmt_us(12.34) == "12.3 us"
    assert fmt_us(1234.0) == "1.23 ms"
    assert fmt_us(4.56e6) == "4.56 s"


def test_layer_detection():
    mods = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.0.mlp",
            "transformer.h.1.mlp.c_fc", "transformer.h.2.ln_1", "transformer.ln_f", "lm_head"]
    c = layer_container(mods)
    assert c == "transformer.h"
    assert layer_of("transformer.h.1.mlp.c_fc", c) == "transformer.h.1"
    assert layer_of("transformer.wte", c) == "transformer.wte"
    assert layer_of("lm_head", c) == "lm_head"
    assert layer_of("", c) == UNATTRIBUTED
    # the container with the most indices wins over a numbered submodule inside a block
    mods = [f"model.layers.{i}.mlp.experts.{e}" for i in range(4) for e in range(2)]
    assert layer_container(mods) == "model.layers"
    assert layer_container(["bert.encoder.layer.11.output", "bert.encoder.layer.3.attention",
                            "bert.embeddings"]) == "bert.encoder.layer"
    assert layer_container(["encoder", "decoder"]) is None


def test_profile_views_numbers_and_collapsed_layers():
    p = chain_profile(48, act_bytes=MiB, fwd_us=100.0)
    out = text_of(render.profile_views(p))
    assert "97 (49 forward, 48 backward)" in out
    assert "4.80 ms" in out and "9.60 ms" in out            # forward / backward time
    assert "48.00 MiB in 48 tensors" in out                 # saved activations
    assert "roofline (97 ops)" in out
    # 48 identical layers collapse into one row with per-layer numbers
    assert "layers.0-47 (x48)" in out
    row = next(line for line in out.splitlines() if "layers.0-47" in line)
    assert "100.0 us" in row and "200.0 us" in row and "1.00 MiB" in row
    per_layer = out.split("Per layer")[1].split("Largest")[0]
    assert "layers.5 " not in per_layer
    # largest tensors: recompute cost is the producer's time, 100 us per MiB here
    assert "Largest saved activations (top 10 of 48)" in out


def test_profile_views_collapse_jittery_times_but_not_other_structure():
    # measured times jitter: blocks within 25% of each other collapse, with their mean time
    p = chain_profile(4, act_bytes=MiB, fwd_us=[100.0, 110.0, 90.0, 100.0])
    out = text_of(render.profile_views(p))
    row = next(line for line in out.splitlines() if "layers.0-3 (x4)" in line)
    assert "100.0 us" in row and "200.0 us" in row


def test_profile_views_does_not_collapse_different_layers():
    p = chain_profile(3, act_bytes=[MiB, 2 * MiB, MiB], fwd_us=100.0)
    out = text_of(render.profile_views(p))
    for name in ("layers.0", "layers.1", "layers.2"):
        assert name in out
    assert "(x" not in out


def make_plan(p, dec, budget):
    r = simulate(p, dec, HW, budget)
    plan = schema.Plan(profile_fingerprint=p.fingerprint, planner="handmade",
                       hardware=HW.to_dict(), budget_bytes=budget, budget_fraction=None,
                       feasible=r.feasible, decisions=tuple(schema.Decision(t, a)
                                                            for t, a in dec.items()),
                       schedule=r.schedule, predicted=r.predicted, solve_ms=12.5)
    return plan, r


def test_plan_views_summary_actions_and_chart():
    # chain of 4 x 1 MiB, 100 us forward / 200 us backward each. a0 swapped (copy 100 us,
    # hidden), a1 recomputed (100 us), a2, a3 kept.
    p = chain_profile(4, act_bytes=MiB, fwd_us=100.0)
    a0, a1, a2, a3 = (t.id for t in p.saved_activations)
    plan, r = make_plan(p, {a0: "swap", a1: "recompute"}, 3 * MiB)
    assert r.feasible
    assert r.predicted.recompute_us == 100.0 and r.predicted.stall_us == 0.0
    out = text_of(render.plan_views(plan, p, r))
    assert "handmade" in out and "testhw" in out
    assert re.search(r"retention +92\.3%", out)                          # 1200 / 1300
    assert "1.30 ms vs ideal 1.20 ms" in out
    assert "100.0 us (1.00 MiB re-produced)" in out
    assert "1.00 MiB to host, 1.00 MiB back" in out
    assert "1 ops re-run before 1 backward ops; longest 1 ops before op" in out
    assert "12.5 ms" in out                                              # solve time
    rows = {line.split()[1]: line for line in out.splitlines()
            if line.startswith("│ ") and line.split()[1] in ("keep", "swap", "recompute")}
    assert "2" in rows["keep"].split("│")[2] and "2.00 MiB" in rows["keep"]
    assert "50.0%" in rows["keep"] and "25.0%" in rows["swap"] and "25.0%" in rows["recompute"]
    assert "swap: 100.0 us to recompute, copy hidden" in out
    assert "recompute: 100.0 us (100.0 us per MiB) vs 100.0 us copy" in out
    assert "budget 3.00 MiB" in out
    assert "1.30 ms" in out.split("Activation memory over the step")[1]


def test_plan_views_infeasible_and_without_result():
    p = chain_profile(3, act_bytes=MiB, fwd_us=100.0)
    plan, r = make_plan(p, {}, 2 * MiB)
    out = text_of(render.plan_views(plan, p, r))
    assert "NO: op 2 (f2)" in out
    out = text_of(render.plan_views(plan, p, None))
    assert "no memory timeline" in out


def test_memory_chart_draws_budget_and_overshoot():
    chart = render.memory_chart([(0.0, 0), (0.0, 4 * MiB), (50.0, MiB), (100.0, 0)],
                                budget_bytes=2 * MiB, step_us=100.0, width=10, height=4)
    lines = chart.plain.splitlines()
    assert len(lines) == 6
    assert "budget 2.00 MiB" in lines[2]
    # the first half is at 4 MiB (full height), the second at 1 MiB (one row of four)
    assert lines[0].endswith("█████     ")
    assert lines[3].endswith("██████████")
    assert "─" in lines[2]
    over = [s for s in chart.spans if s.style == "red"]
    assert over      # bars above the budget are red


def test_compare_table_marks_the_best_feasible():
    p = chain_profile(3, act_bytes=MiB, fwd_us=100.0)
    a0 = p.saved_activations[0].id
    good = simulate(p, {a0: "recompute"}, HW).predicted
    keep = simulate(p, {}, HW).predicted
    out = text_of(render.compare_table([
        {"planner": "recompute-only", "feasible": True, "predicted": good, "solve_ms": 1.0},
        {"planner": "keep", "feasible": False, "predicted": keep, "solve_ms": 0.5}],
        budget_bytes=2 * MiB))
    assert "at a 2.00 MiB budget" in out
    line = next(l for l in out.splitlines() if "recompute-only" in l)
    assert f"{100 * 900 / 1000:.1f}%" in line and "yes" in line and "100.0 us" in line
    line = next(l for l in out.splitlines() if "│ keep" in l)
    assert "no" in line and "100.0%" in line


def test_memory_chart_labels_the_y_axis_and_marks_backward():
    chart = render.memory_chart([(0.0, 0), (0.0, 8 * MiB), (60.0, 2 * MiB), (100.0, 0)],
                                budget_bytes=None, step_us=100.0, width=40, height=8,
                                backward_us=50.0)
    lines = chart.plain.splitlines()
    labelled = [ln.split("│")[0].strip() for ln in lines[:8]]
    assert labelled == ["8.00 MiB", "", "6.00 MiB", "", "4.00 MiB", "", "2.00 MiB", "0"]
    axis = lines[8].split("└")[1]
    assert axis.index("┴") == 20                      # 50 us of 100 us over 40 columns
    assert "^ backward" in lines[9]


def test_memory_chart_is_as_wide_as_the_console():
    p = chain_profile(4, act_bytes=MiB, fwd_us=100.0)
    r = simulate(p, {}, HW, 4 * MiB)
    for width in (80, 160):
        c = Console(record=True, width=width)
        c.print(render.MemoryChart(r.memory, 4 * MiB, r.predicted.step_us))
        bars = [ln for ln in c.export_text().splitlines() if "└" in ln][0]
        assert len(bars.rstrip()) == width                 # fills the line, no wrap


def test_why_a_tensor_is_kept_is_its_own_reason():
    p = chain_profile(4, act_bytes=MiB, fwd_us=100.0)
    t_last = p.saved_activations[-1]       # a3: read by the loss, then at once by backward
    t_first = p.saved_activations[0]       # a0: idle through the whole rest of the step
    gap = _idle(p, t_first.id)
    assert gap["gap_ops"] > 3 and gap["gap_us"] > 0
    # plenty of idle time, plan fits: the reason is that it fits, not a recompute cost
    assert _why("keep", t_first, 100.0, 1.0, None, feasible=True, **gap).startswith(
        "keep: the budget holds with it resident")
    last = _idle(p, t_last.id)
    why = _why("keep", t_last, 100.0, 1e6, None, feasible=True, **last)
    assert "idle only" in why or "no idle time" in why
