"""apply: plans carried out on real models (tiny GPT, HF GPT-2/BERT/Llama, a CNN with BatchNorm).

Every model is profiled (fake tensors, roofline costs), planned at budgets 1.0, 0.5 and the
smallest budget the planner can meet, applied and verified against eager PyTorch: equal losses
and gradients, and fewer bytes held for backward as the budget falls. Two small hand-made plans
prove that recompute really re-runs forward ops in backward (counted FLOPs) and that swap really
moves the tensor (device tensor gone, data in the host buffer).
"""
import ast
import dataclasses
import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from workloads import (  # noqa: F401
    HW,
    MLP,
    ROOT,
    SOURCES,
    hand_plan,
    plan_at,
    profiled,
    smallest_feasible,
    write_patched,
)

from slackswap_cli.errors import FingerprintMismatch, InputError
from slackswap_cli.run.emit import apply_plan, load_patched
from slackswap_cli.run.verify.verify import verify
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.workload import load_workload

# --------------------------------------------------------------------------------------------
_CPU_TARGET: dict = {}


@pytest.mark.parametrize("name", ["tiny_gpt", "gpt2", "bert", "llama", "cnn"])
def test_budgets_apply_and_verify(name, files, tmp_path):
    # verify runs on this CPU and checks the model patched in place against the budget too:
    # the profile is for a CPU (`fake:cpu`: dropout as a CPU draws it, float masks)
    if name not in _CPU_TARGET:
        _CPU_TARGET[name] = profile_workload(str(files[name]), device="fake:cpu", hardware=HW)
    prof = _CPU_TARGET[name]
    peak = prof.summary["peak_activation_bytes"]
    half = plan_at(prof, peak // 2)
    if not half.feasible:
        # the CNN's floor is exactly half its peak (the input of the first conv and the pooled
        # features must stay), and the planner may miss a budget right at the floor of a
        # small model: then take three quarters (apply is under test here, not the planner)
        half = plan_at(prof, peak * 3 // 4)
    plans = [plan_at(prof, peak), half, smallest_feasible(prof, half.budget_bytes)]
    held = []
    for i, plan in enumerate(plans):
        assert plan.feasible
        path = write_patched(tmp_path, plan, prof, name=f"p{i}.py")
        r = verify(str(path), steps=1, check_trace=False)
        assert r.passed, r.reasons
        assert r.max_loss_rel_diff <= 1e-5 and r.max_grad_rel_diff <= 1e-4
        assert r.max_buffer_rel_diff <= 1e-4
        assert r.patched_peak_bytes <= plan.budget_bytes * 1.05
        held.append(r.patched_peak_bytes)
        if i == 0:
            # keep-all holds exactly the saved bytes the profile counts, and no more than eager
            # autograd saves, give or take other views of the decomposed graph (5%)
            assert r.patched_peak_bytes == prof.summary["saved_bytes"]
            assert r.patched_peak_bytes <= 1.05 * r.original_peak_bytes
    assert held[0] > held[1] >= held[2]


def test_keep_all_holds_exactly_what_eager_saves(files, tmp_path):
    # without dropout the traced graph saves what eager autograd saves, byte for byte
    prof = profile_workload(str(files["tiny_gpt"]), device="fake", hardware=HW,
                            args={"dropout": 0.0})
    path = write_patched(tmp_path, plan_at(prof, prof.summary["peak_activation_bytes"]), prof)
    r = verify(str(path), steps=2, check_trace=False)
    assert r.passed and r.original_peak_bytes == r.patched_peak_bytes
    assert r.losses_original == r.losses_patched      # bitwise: same ops, same order, same masks


def test_recompute_reruns_forward_flops_in_backward(files, tmp_path):
    from torch.utils.flop_counter import FlopCounterMode
    prof = profiled(files, "mlp")
    flops = {}
    for label, actions in (("keep", {}), ("recompute", {"addmm": "recompute"})):
        mod = load_patched(write_patched(tmp_path, hand_plan(prof, actions), prof, f"{label}.py"))
        work = load_workload(str(files["mlp"]))
        step = mod.step_module(work.model, check_trace=False)
        with FlopCounterMode(display=False) as fwd:
            loss = step(*work.inputs)
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
        flops[label] = (fwd.get_total_flops(), bwd.get_total_flops())
    assert flops["recompute"][0] == flops["keep"][0]
    # re-running fc1 (4x16 @ 16x32) in backward adds exactly its 2*4*16*32 FLOPs
    assert flops["recompute"][1] - flops["keep"][1] == 2 * 4 * 16 * 32


def test_swap_moves_the_tensor_to_host(files, tmp_path):
    prof = profiled(files, "mlp")
    mod = load_patched(write_patched(tmp_path, hand_plan(prof, {"gelu": "swap"}), prof))
    keep = load_patched(write_patched(tmp_path, hand_plan(prof, {}), prof, "keep.py"))
    work = load_workload(str(files["mlp"]))
    step = mod.step_module(work.model, check_trace=False)
    loss = step(*work.inputs)
    gc.collect()
    store = step.last_store()
    handle = store.swapped["gelu"]
    assert "gelu" not in store.kept
    assert not handle.device_storage_alive()           # forward's device tensor released
    x, = work.inputs
    expected = F.gelu(F.linear(x, work.model.fc1.weight, work.model.fc1.bias))
    assert torch.equal(handle.host, expected)          # its data lives in the host buffer
    held_swap = step.held_bytes_after_forward
    keep_step = keep.step_module(work.model, check_trace=False)
    keep_step(*work.inputs).backward()
    assert keep_step.held_bytes_after_forward - held_swap == 4 * 32 * 4
    grads_keep = [p.grad.clone() for p in work.model.parameters()]
    work.model.zero_grad()
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads_keep, work.model.parameters()))
    assert "gelu" not in store.swapped                 # waited for and handed to backward


def test_patched_module_shares_parameters_and_trains(files, tmp_path):
    prof = profiled(files, "tiny_gpt")
    plan = plan_at(prof, prof.summary["peak_activation_bytes"] // 2)
    mod = load_patched(write_patched(tmp_path, plan, prof))
    work = load_workload(str(files["tiny_gpt"]))
    step = mod.step_module(work.model, check_trace=False)
    assert [id(p) for p in step.parameters()] == [id(p) for p in work.model.parameters()]
    opt = torch.optim.SGD(work.model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = step(*work.inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[0]


def test_emitted_file_imports_only_torch_and_the_runtimes(files, tmp_path):
    prof = profiled(files, "mlp")
    src = apply_plan(hand_plan(prof, {"gelu": "swap", "addmm": "recompute"}), prof)
    imported = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{a.name}" for a in node.names}
    assert imported == {"torch", "slackswap_cli.run.door", "slackswap_cli.run.door.OpRow",
                        "slackswap_cli.run.door.GraphRow"}     # (one runtime module)
    assert prof.fingerprint in src
    assert "_s.offload('gelu', gelu)" in src and "_s.wait('gelu')" in src
    assert "recompute" in src


def test_random_results_are_never_recomputed(files):
    prof = profiled(files, "tiny_gpt")
    mask = next(t for t in prof.saved_activations if not t.recomputable)
    with pytest.raises(InputError, match="not recomputable"):
        apply_plan(hand_plan(prof, {mask.name: "recompute"}), prof)


def test_onnx_profile_cannot_be_applied(files):
    prof = profiled(files, "mlp")
    onnx = dataclasses.replace(prof, workload={**prof.workload, "source": "onnx"})
    with pytest.raises(InputError, match="ONNX"):
        apply_plan(hand_plan(onnx, {}), onnx)


def test_plan_of_another_profile_is_refused(files):
    prof = profiled(files, "mlp")
    other = dataclasses.replace(hand_plan(prof, {}), profile_fingerprint="0" * 16)
    with pytest.raises(InputError, match="re-run `slackswap plan`"):
        apply_plan(other, prof)


def test_model_that_traces_differently_is_refused_at_apply(files):
    prof = profiled(files, "tiny_gpt")
    with pytest.raises(FingerprintMismatch) as exc:
        apply_plan(hand_plan(prof, {}), prof, args={"n_layer": 1})
    assert "slackswap profile" in exc.value.hint


def test_wrong_inputs_model_or_mode_raise_clear_errors(files, tmp_path):
    prof = profiled(files, "tiny_gpt")
    mod = load_patched(write_patched(tmp_path, hand_plan(prof, {}), prof))
    work = load_workload(str(files["tiny_gpt"]))
    step = mod.step_module(work.model, check_trace=False)
    idx, targets = work.inputs
    with pytest.raises(FingerprintMismatch, match="input 0 is") as exc:
        step(idx[:, :16], targets[:, :16])
    assert "re-profile" in exc.value.hint
    with pytest.raises(FingerprintMismatch, match="structure"):
        step(idx=idx, targets=targets)
    other = load_workload(str(files["tiny_gpt"]), args={"d_model": 32})
    with pytest.raises(FingerprintMismatch, match="parameters differ"):
        mod.step_module(other.model, check_trace=False)
    work.model.eval()
    with pytest.raises(InputError, match="eval mode"):
        step(idx, targets)


def test_check_trace_refuses_a_changed_model(files, tmp_path):
    path = tmp_path / "mlp_changing.py"
    path.write_text(SOURCES["mlp"])
    prof = profile_workload(str(path), device="fake", hardware=HW)
    mod = load_patched(write_patched(tmp_path, hand_plan(prof, {}), prof))
    work = load_workload(str(path))
    mod.step_module(work.model)                              # same model: accepted
    path.write_text(MLP.replace("ACT", "relu"))        # same parameters, another graph
    work = load_workload(str(path))
    with pytest.raises(FingerprintMismatch, match="traces to graph"):
        mod.step_module(work.model)
    mod.step_module(work.model, check_trace=False)           # the cheap checks alone pass


def test_prefetches_are_issued_where_the_plan_schedules_them(files):
    prof = profiled(files, "tiny_gpt")
    plan = plan_at(prof, prof.summary["peak_activation_bytes"] // 2)
    events = [e for e in plan.schedule if e.kind == "prefetch"]
    assert events
    lines = apply_plan(plan, prof).splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("def backward_step"))
    body = lines[start:]

    def defined_at(name):
        return next(i for i, l in enumerate(body) if l.strip().startswith(f"{name} = "))

    for e in events:
        name = prof.tensors[e.tensor].name
        at = next(i for i, l in enumerate(body) if l.strip().startswith(f"_s.prefetch({name!r})"))
        issue = prof.ops[e.issue_op]
        previous = prof.ops[e.issue_op - 1]
        # right before the op the simulator issued it at, after the op before that
        assert at < defined_at(issue.name)
        if previous.phase == "backward":
            assert defined_at(previous.name) < at
        assert at < defined_at(name)                   # and before the wait


def test_backward_twice_and_autocast_are_refused(files, tmp_path):
    prof = profiled(files, "mlp")
    mod = load_patched(write_patched(tmp_path, hand_plan(prof, {"gelu": "swap"}), prof))
    work = load_workload(str(files["mlp"]))
    step = mod.step_module(work.model, check_trace=False)
    loss = step(*work.inputs)
    loss.backward(retain_graph=True)
    with pytest.raises(InputError, match="retain_graph"):
        loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(InputError, match="autocast"):
            step(*work.inputs)


DROPOUT_MLP = '''
import torch, torch.nn as nn, torch.nn.functional as F
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(16, 32), nn.Linear(32, 8), nn.Dropout(0.5)
    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x)))).pow(2).mean()
def workload():
    torch.manual_seed(0)
    return MLP(), (torch.randn(4, 16),)
'''


def test_dropout_masks_equal_eager_when_everything_else_is_recomputed(tmp_path):
    path = tmp_path / "dropout_mlp.py"
    path.write_text(DROPOUT_MLP)
    prof = profile_workload(str(path), device="fake", hardware=HW)
    actions = {t.name: "recompute" if t.recomputable else "swap" for t in prof.saved_activations}
    # fc1's and fc2's outputs are recomputed; native_dropout's output and mask (random) swapped
    assert sorted(actions.values()) == ["recompute", "recompute", "swap", "swap"]
    patched = write_patched(tmp_path, hand_plan(prof, actions), prof)
    r = verify(str(patched), steps=2, seed=3, check_trace=False)
    assert r.passed and r.losses_original == r.losses_patched     # bitwise: the same masks
    assert r.patched_peak_bytes == 0                               # nothing kept on the device
    # dropout is live: another seed draws another mask and another loss
    other = verify(str(patched), steps=1, seed=4, check_trace=False)
    assert other.losses_original[0] != r.losses_original[0]


def test_inputs_that_require_grad_are_refused(files, tmp_path):
    prof = profiled(files, "mlp")
    mod = load_patched(write_patched(tmp_path, hand_plan(prof, {}), prof))
    work = load_workload(str(files["mlp"]))
    step = mod.step_module(work.model, check_trace=False)
    x, = work.inputs
    with pytest.raises(InputError, match="requires grad"):
        step(x.clone().requires_grad_())


def test_patch_leaves_the_callers_rng_alone(files, tmp_path):
    prof = profiled(files, "tiny_gpt")                 # its workload() seeds the RNG
    mod = load_patched(write_patched(tmp_path, hand_plan(prof, {}), prof))
    work = load_workload(str(files["tiny_gpt"]))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    mod.step_module(work.model, check_trace=True)
    assert torch.equal(torch.rand(3), expected)


CLOSURE_LABELS = '''
import torch, torch.nn as nn, torch.nn.functional as F
def workload():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    return model, (x,), (lambda out, inputs: F.cross_entropy(out, y))
'''


def test_tensors_a_loss_fn_closes_over_are_embedded_with_a_note(tmp_path):
    path = tmp_path / "closure.py"
    path.write_text(CLOSURE_LABELS)
    prof = profile_workload(str(path), device="fake", hardware=HW)
    patched = write_patched(tmp_path, hand_plan(prof, {}), prof)
    src = patched.read_text()
    assert "NOTE: the step reads tensors the workload made outside its inputs" in src
    labels = load_workload(str(path)).loss_fn.__closure__[0].cell_contents.tolist()
    assert f"torch.tensor({labels!r}, dtype=torch.int64" in src
    assert verify(str(patched), check_trace=False).passed


def test_a_module_written_with_another_layout_is_refused(files, tmp_path):
    """A file whose META records another layout version is refused by every entry point that
    reads its tables, naming the fix, instead of running with columns read wrongly."""
    prof = profiled(files, "tiny_gpt")
    plan = plan_at(prof, prof.summary["peak_activation_bytes"] // 2)
    path = Path(write_patched(tmp_path, plan, prof))
    mod = load_patched(str(path))
    work = load_workload(str(files["tiny_gpt"]))
    old = dict(mod.META, generator_version=0)
    from slackswap_cli.run.eager import inplace
    from slackswap_cli.run.written import step
    for call in (lambda: inplace.patch(work.model, old, mod.TABLE),
                 lambda: step.PatchedStep(work.model, old, mod.forward_step, mod.backward_step)):
        with pytest.raises(InputError, match="layout version 0") as exc:
            call()
        assert "slackswap apply" in exc.value.hint
        assert f"by slackswap {mod.META['slackswap_version']}" in str(exc.value)
    assert "forward" not in work.model.__dict__           # nothing was patched
    from slackswap_cli.run.generated import GENERATOR_VERSION
    text = path.read_text().replace(f"'generator_version': {GENERATOR_VERSION},",
                                    "'generator_version': 0,")
    assert text != path.read_text()
    edited = tmp_path / "edited.py"
    edited.write_text(text)
    with pytest.raises(InputError, match="layout version 0"):
        load_patched(str(edited))


def test_the_emitted_tables_are_typed_rows_read_by_name(files, tmp_path):
    """TABLE's and GRAPH_TABLE's op rows are written as OpRow(...) / GraphRow(...) calls (the
    file says what each column is) and load as those types; both tables name the same op's
    module by the same field."""
    from slackswap_cli.table_rows import GraphRow, OpRow
    prof = profiled(files, "tiny_gpt")
    path = Path(write_patched(tmp_path, plan_at(prof, prof.summary["peak_activation_bytes"] // 2),
                              prof))
    text = path.read_text()
    assert "OpRow(name=" in text and "GraphRow(name=" in text
    mod = load_patched(str(path))
    ops, graph_ops = mod.TABLE["ops"], mod.GRAPH_TABLE["ops"]
    assert ops and all(type(o) is OpRow for o in ops)
    assert len(graph_ops) == len(ops) and all(type(o) is GraphRow for o in graph_ops)
    fwd = [o for o in prof.ops if o.phase == "forward"]
    for o, g, p in zip(ops, graph_ops, fwd):
        assert (o.name, o.target, o.module) == (g.name, g.target, g.module) \
            == (p.name, p.target, p.module)
        assert o.outputs == list(p.outputs)
        assert o.shapes == [r[0] for r in g.results]
