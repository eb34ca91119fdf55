"""chains: one owner of what backward re-runs, and what the patched module runs is what it says.

Hand-checked layouts on the synthetic chain (forward f_i writes a_i from a_{i-1}; backward b_i
reads a_i, in reverse order), then the generated code of real models held against the
simulator: for tiny GPT, HF GPT-2/BERT/Llama and a BatchNorm CNN at budgets 0.3/0.5/0.7, the
ops each backward step re-runs in the patched module are exactly the simulator's recompute
chains, and every swapped root is offloaded and fetched exactly once.
"""
import ast
import re

import pytest

from slackswap_cli import chains
from slackswap_cli.chains import RECOMPUTE_CODE, SWAP_CODE, lay_out, tables
from slackswap_cli.errors import InputError
from slackswap_cli.simulate import recompute_chains
from slackswap_testkit.synthetic import chain_profile


def _ids(prof):
    return {t.name: t.id for t in prof.tensors}, {o.name: o.id for o in prof.ops}


def _layout(prof, actions):
    tab = tables(prof)
    action = list(tab.default_action)
    t, _ = _ids(prof)
    for name, a in actions.items():
        action[t[name]] = a
    return lay_out(prof, tab, action)


def test_recompute_one_tensor_reruns_its_producer_before_its_reader():
    prof = chain_profile(4)
    t, o = _ids(prof)
    lay = _layout(prof, {"a2": RECOMPUTE_CODE})
    assert lay.chains(prof.n_forward) == {o["b2"]: (o["f2"],)}
    chain_task = lay.task_op.index(o["f2"], prof.n_forward)
    assert lay.task_owner[chain_task] == o["b2"]
    assert lay.made == [(t["a2"], chain_task)]       # a recompute root stays until its reader
    assert lay.chain_alloc[chain_task] == 1 << 20
    assert lay.temps == [] and lay.need_task == {} and lay.ext == {}


def test_a_run_of_recomputed_tensors_is_rerun_once_in_forward_order():
    prof = chain_profile(4)
    t, o = _ids(prof)
    lay = _layout(prof, {"a1": RECOMPUTE_CODE, "a2": RECOMPUTE_CODE})
    # b3 runs first (a3 kept); b2 needs a2, whose producer reads a1: both re-run before b2,
    # and a1 stays resident for b1 (not re-run a second time)
    assert lay.chains(prof.n_forward) == {o["b2"]: (o["f1"], o["f2"])}
    assert sorted(r for r, _ in lay.made) == [t["a1"], t["a2"]]


def test_a_swapped_input_of_a_chain_is_fetched_early_never_recomputed():
    prof = chain_profile(4)
    t, o = _ids(prof)
    # b2 needs a2 recomputed; f2 reads a1, which is swapped and not back yet (its own reader
    # b1 comes later): the chain fetches it, at the chain's task
    lay = _layout(prof, {"a1": SWAP_CODE, "a2": RECOMPUTE_CODE})
    assert lay.chains(prof.n_forward) == {o["b2"]: (o["f2"],)}
    chain_task = lay.task_op.index(o["f2"], prof.n_forward)
    assert lay.need_task == {t["a1"]: chain_task}
    # the planners' static view says the same: a2's chain reads candidate a1
    ch = chains.candidate_chain(tables(prof), t["a2"])
    assert ch.ops == (o["f2"],) and ch.inputs == (t["a1"],) and ch.temps == ()


def test_a_chain_reads_a_saved_random_output_as_it_is():
    prof = chain_profile(3, random_layers=[1])
    # a1 is a random op's output (not recomputable); recomputing a2 needs a1, which is saved
    # (b1 reads it) and kept: the chain reads it and re-runs only f2
    t, o = _ids(prof)
    lay = _layout(prof, {"a2": RECOMPUTE_CODE})
    assert lay.chains(prof.n_forward) == {o["b2"]: (o["f2"],)}
    assert chains.candidate_chain(tables(prof), t["a1"]) is None


def test_the_simulator_reports_the_layouts_chains():
    prof = chain_profile(4)
    t, o = _ids(prof)
    decisions = {t["a1"]: "recompute", t["a2"]: "recompute", t["a0"]: "swap"}
    assert recompute_chains(prof, decisions) == {o["b2"]: (o["f1"], o["f2"])}


def test_impossible_chain_is_an_input_error():
    from slackswap_cli.profile_build import ProfileBuilder
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    m = b.add_tensor("mask", "activation", (8,), "uint8", size_bytes=8, recomputable=False)
    y = b.add_tensor("y", "activation", (8,), "uint8", size_bytes=8)
    loss = b.add_tensor("loss", "activation", (), "float32", size_bytes=4)
    b.add_op("drop", "aten.native_dropout.default", "forward", (x,), (m,), time_us=1.0)
    b.add_op("f", "aten.mul.Tensor", "forward", (m,), (y,), time_us=1.0)
    b.add_op("l", "aten.sum.default", "forward", (y,), (loss,), time_us=1.0)
    g = b.add_tensor("g", "activation", (8,), "uint8", size_bytes=8)
    b.add_op("bw", "aten.mul.Tensor", "backward", (y,), (g,), time_us=1.0)
    prof = b.build(workload={"name": "t"}, env={})
    with pytest.raises(InputError, match="random op"):
        recompute_chains(prof, {prof.tensors[2].id: "recompute"})


# --------------------------------------------------------------------------------------------
# The generated code runs the simulator's chains
# --------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")

from helpers import two_us_kernels  # noqa: E402
from workloads import hand_plan, plan_at, profiled  # noqa: E402


@pytest.fixture(autouse=True)
def _costs(monkeypatch):
    two_us_kernels(monkeypatch)   # plans that recompute as well as swap (see helpers)


def _backward_body(source: str) -> list[str]:
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "backward_step")
    lines = source.splitlines()[fn.body[0].lineno - 1:fn.end_lineno]
    return [ln.strip() for ln in lines]


def code_chains(prof, source: str) -> dict[int, tuple[int, ...]]:
    """Backward op -> the forward ops the patched module re-runs right before it (views and
    in-place aliases, which cost no memory and which the simulator does not run, left out)."""
    tab = tables(prof)
    op_of = {o.name: o for o in prof.ops}
    out: dict[int, tuple[int, ...]] = {}
    pending: list[int] = []
    for ln in _backward_body(source):
        m = re.match(r"(\w+) = (aten|torch\.ops)\.", ln)
        if not m or m.group(1) not in op_of:
            continue
        op = op_of[m.group(1)]
        if op.phase == "forward":
            if tab.out_roots[op.id]:
                pending.append(op.id)
        else:
            if pending:
                out[op.id] = tuple(pending)
            pending = []
    assert not pending, "re-run ops after the last backward op"
    return out


# GPT-2 and BERT in the slow tier: tiny GPT, HF Llama and the CNN hold the check by default
@pytest.mark.parametrize("name", ["tiny_gpt", pytest.param("gpt2", marks=pytest.mark.slow_tier),
                                  pytest.param("bert", marks=pytest.mark.slow_tier), "llama",
                                  "cnn"])
def test_generated_backward_reruns_exactly_the_simulated_chains(name, files):
    from slackswap_cli.run.emit import emit_module
    from slackswap_cli.trace.retrace import trace_fake
    prof = profiled(files, name)
    peak = prof.summary["peak_activation_bytes"]
    joint, work = trace_fake(str(files[name]), "workload", {}, None)
    ref = {"path": str(files[name]), "entry": "workload", "args": {}, "name": name}
    n_chains = 0
    for frac in (0.3, 0.5, 0.7):
        plan = plan_at(prof, int(peak * frac))
        src = emit_module(joint, work, prof, plan, workload_ref=ref)
        want = recompute_chains(prof, plan.decisions)
        assert code_chains(prof, src) == want, frac
        n_chains += len(want)
        swapped = [prof.tensors[d.tensor].name for d in plan.decisions if d.action == "swap"]
        for r in swapped:
            assert src.count(f"_s.offload({r!r}, ") == 1, r
            assert src.count(f"_s.wait({r!r})") == 1, r
        assert src.count("_s.offload(") == src.count("_s.wait(") == len(swapped)
    assert n_chains > 0     # the budgets do make it recompute


def test_a_chain_that_needs_a_swapped_value_early_fetches_it(files, tmp_path):
    """The case the three old copies disagreed on: a swapped tensor that another tensor's
    chain reads before its own first use is fetched for that chain, in code as simulated,
    and gradients stay exact."""
    from slackswap_cli.run.emit import emit_module
    from slackswap_cli.trace.retrace import trace_fake
    prof = profiled(files, "mlp")
    # forward: addmm (fc1) -> gelu -> addmm_1 (fc2) -> pow -> mean. Recompute gelu: its chain
    # reads addmm, which is swapped and whose own first backward use (gelu_backward) comes later
    plan = hand_plan(prof, {"addmm": "swap", "gelu": "recompute"})
    joint, work = trace_fake(str(files["mlp"]), "workload", {}, None)
    ref = {"path": str(files["mlp"]), "entry": "workload", "args": {}, "name": "mlp"}
    src = emit_module(joint, work, prof, plan, workload_ref=ref)
    body = _backward_body(src)
    wait = next(i for i, ln in enumerate(body) if ln.startswith("addmm = _s.wait('addmm')"))
    rerun = next(i for i, ln in enumerate(body) if ln.startswith("gelu = aten.gelu"))
    assert wait < rerun
    assert code_chains(prof, src) == recompute_chains(prof, plan.decisions)
    path = tmp_path / "p.py"
    path.write_text(src)
    from slackswap_cli.run.verify.verify import verify
    r = verify(str(path), steps=1, check_trace=False)
    assert r.passed, r.reasons
    assert r.max_grad_rel_diff == 0.0


def test_the_in_place_test_chains_is_handed_is_atens():
    # chains is torch-free: runtime_table's `last_write` asks aten's rule (schema `a!` on the
    # first argument, returned) by the profile's target name, never a naming convention
    from slackswap_cli.trace.aten import is_inplace_target
    assert is_inplace_target("aten.add_.Tensor") and is_inplace_target("aten.relu_.default")
    assert is_inplace_target("aten.__iand__.Tensor")          # in place, no trailing _
    assert not is_inplace_target("aten.add.Tensor")
    assert not is_inplace_target("aten.add.out")               # writes `out=`, not its input
    assert not is_inplace_target("aten.view.default")          # an alias, not a write
    assert not is_inplace_target("aten.no_such_op_.default")
    assert not is_inplace_target("onnx.Relu") and not is_inplace_target("getitem")
