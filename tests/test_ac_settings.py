"""The activation-checkpointing settings users run (`torchtitan-sac`, `full-ac`,
`megatron-selective`), on hand-checkable profiles: exactly which saved tensors each keeps and
which it recomputes, and what torch's checkpoint holds beyond the simulator's picture."""
from helpers import hand_hw

from slackswap_cli.planners import make_plan, run_planner
from slackswap_cli.planners.ac_settings import checkpoint_gap, sac_cached_ops
from slackswap_cli.planners.common import State, build_cost_model
from slackswap_cli.profile_build import ProfileBuilder
from slackswap_testkit.synthetic import transformer_profile

HW = hand_hw()
BIG = 1 << 40


def acts(name, prof):
    decisions, notes, _ = run_planner(name, prof, HW, BIG)
    by_name = {prof.tensors[d.tensor].name: d.action for d in decisions}
    return {n for n, a in by_name.items() if a == "keep"}, \
        {n for n, a in by_name.items() if a == "recompute"}, notes


def llama(layers=2):
    return transformer_profile("llama", layers=layers, hidden=64, heads=2, batch=1, seq=16)


# the synthetic llama block saves: its input x (the previous block's res2, or embed), ln1's
# h1 mu1 rs1, qkv (addmm), the roped qk, attention's o and lse, res1 x2, ln2's h2 mu2 rs2, the
# gate/up projection u (mm) and the SwiGLU output g
def per_block(names, li):
    return {f"{n}_{li}" for n in names}


def test_torchtitan_sac_keeps_save_list_outputs_and_recomputes_the_rest():
    keep, rec, notes = acts("torchtitan-sac", llama())
    # addmm and fused attention are in the save list; the block's only mm is its 1st: kept
    saved = ["qkv", "attn", "lse", "gateup"]
    recomputed = ["ln1", "mu1", "rs1", "rope", "res1", "ln2", "mu2", "rs2", "swiglu"]
    assert keep == {"embed", "res2_0", "res2_1"} | per_block(saved, 0) | per_block(saved, 1)
    assert rec == per_block(recomputed, 0) | per_block(recomputed, 1)
    assert "torchtitan selective op AC: recomputed 18 of" in notes[0]


def test_full_ac_keeps_only_what_the_next_block_reads():
    keep, rec, notes = acts("full-ac", llama())
    assert keep == {"embed", "res2_0", "res2_1"}
    everything = ["ln1", "mu1", "rs1", "qkv", "rope", "attn", "lse", "res1", "ln2", "mu2",
                  "rs2", "gateup", "swiglu"]
    assert rec == per_block(everything, 0) | per_block(everything, 1)
    assert any("checkpoint around every block" in n for n in notes)


def test_megatron_selective_recomputes_the_core_attention_only():
    keep, rec, _ = acts("megatron-selective", llama())
    assert rec == per_block(["attn", "lse"], 0) | per_block(["attn", "lse"], 1)
    assert "qkv_0" in keep and "rope_1" in keep and "gateup_0" in keep


def test_plans_are_judged_by_the_simulator_and_order_by_memory():
    prof = llama(4)
    peaks = {n: make_plan(n, prof, HW, BIG).predicted for n in
             ("full-ac", "torchtitan-sac", "megatron-selective")}
    assert peaks["full-ac"].peak_bytes < peaks["torchtitan-sac"].peak_bytes \
        < peaks["megatron-selective"].peak_bytes
    assert peaks["full-ac"].recompute_us > peaks["torchtitan-sac"].recompute_us \
        > peaks["megatron-selective"].recompute_us > 0


def mm_block_profile():
    """One block of four matmuls in a row (each output saved by its own backward op) plus
    an outside head: torchtitan keeps the 1st and 3rd, recomputes the 2nd and 4th."""
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (4,), "float32")
    w = b.add_tensor("w", "parameter", (4,), "float32")
    prev, outs = x, []
    for k in range(4):
        t = b.add_tensor(f"m{k}", "activation", (4,), "float32")
        b.add_op(f"mm{k}", "aten.mm.default", "forward", (prev, w), (t,),
                 module=f"layers.{k // 4}.f{k}", time_us=10.0)
        prev = t
        outs.append(t)
    head = b.add_tensor("head", "activation", (4,), "float32")
    b.add_op("head", "aten.mm.default", "forward", (prev, w), (head,), module="layers.1",
             time_us=10.0)
    g = b.add_tensor("g", "input", (4,), "float32")
    for k, t in enumerate([head, *reversed(outs)]):
        gt = b.add_tensor(f"g{k}", "activation", (4,), "float32")
        b.add_op(f"b{k}", "aten.mm.default", "backward", (g, t), (gt,), module="layers.0",
                 time_us=10.0)
    return b.build()


def test_torchtitan_sac_recomputes_every_second_matmul_of_a_block():
    prof = mm_block_profile()
    keep, rec, _ = acts("torchtitan-sac", prof)
    # m3 is read by the head (block 1): the next block's input stays
    assert rec == {"m1"} and keep == {"m0", "m2", "m3", "head"}
    assert sac_cached_ops(prof) == {0, 2, 4}   # block 1's matmul is its own 1st


def test_checkpoint_gap_counts_cached_outputs_backward_does_not_read():
    prof = llama()
    m = build_cost_model(prof, HW)
    plan = make_plan("torchtitan-sac", prof, HW, BIG)
    state = State(m, [plan.actions()[t] for t in m.cands])
    gap = checkpoint_gap(prof, state, sac_cached_ops(prof))
    # the output projection and the down projection (addmm, saved-list) are cached and unread:
    # 16 tokens x 64 bf16 each, two per block
    assert gap.cached_unread_bytes == 2 * 2 * 16 * 64 * 2
    # the block input is saved by the profile itself: nothing to add or take away
    assert gap.input_bytes == 0 and gap.derived_kept_bytes == 0
    assert "not simulated" in plan.notes[-1]


# ---------------------------------------------------------------------------------------------
# through the CLI and the Python API
# ---------------------------------------------------------------------------------------------
AC = ("torchtitan-sac", "full-ac", "megatron-selective")


def test_compare_fit_and_plan_model_take_them(tmp_path):
    import orjson
    from typer.testing import CliRunner
    from workloads import ROOT

    import slackswap_cli as slackswap
    from slackswap_cli.cli import app
    from slackswap_cli.schema import save
    from slackswap_cli.trace.workload import load_workload

    prof_path = tmp_path / "llama.profile.json"
    save(llama(4), prof_path)
    runner = CliRunner()
    r = runner.invoke(app, ["compare", str(prof_path), "--budget", "1.0", "--planners",
                            ",".join(("slackswap", *AC)), "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["planner"]: row for row in orjson.loads(r.stdout)["results"]}
    assert set(rows) == {"slackswap", *AC} and all(row["feasible"] for row in rows.values())
    tiny = ROOT / "examples" / "tiny_gpt.py"
    args = ["--arg", "n_layer=2", "--arg", "seq=32"]
    r = runner.invoke(app, ["fit", str(tiny), *args, "--batch", "1,2", "--planner", "full-ac",
                            "--memory", "8GiB", "--json", "-o", str(tmp_path / "fit.plan.json")])
    assert r.exit_code == 0, r.output
    assert orjson.loads(r.stdout)["best"]["planner"] == "full-ac"
    work = load_workload(str(tiny), args={"n_layer": 2, "seq": 32})
    plan = slackswap.plan_model(work.model, work.inputs, budget=1.0, planner="torchtitan-sac",
                                device="fake")
    assert plan.planner == "torchtitan-sac" and plan.feasible


def test_core_attention_is_the_fused_kernel_or_square_matrices_inside_attention():
    from slackswap_cli.planners.ac_settings import is_core_attention
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1, 2, 8, 4), "float32")
    outs = {}
    for name, target, mod, shape in (
            ("scores", "aten.bmm.default", "layers.0.self_attn", (1, 2, 8, 8)),
            ("probs", "aten._softmax.default", "layers.0.self_attn", (1, 2, 8, 8)),
            ("proj", "aten.mm.default", "layers.0.self_attn.o_proj", (1, 2, 8, 4)),
            ("feature", "aten.convolution.default", "layers.0.conv", (1, 2, 8, 8)),
            ("flash", "aten._scaled_dot_product_flash_attention.default", "layers.0.mix",
             (1, 2, 8, 4))):
        t = b.add_tensor(name, "activation", shape, "float32")
        outs[name] = b.add_op(name, target, "forward", (x,), (t,), module=mod)
    prof = b.build()
    assert {n for n, op in outs.items() if is_core_attention(prof, op)} == \
        {"scores", "probs", "flash"}
