"""New input shapes without a trace (`slackswap_cli/run/eager/new_shape.py`): after a recorded call,
the first call at another sequence length or batch size follows that call's template, held
by the guard to the plan's fraction of what a keep-all run holds at the new shapes; the next
call records on the borrowed plan and the calls after it run the steady state. Every call is
bitwise eager's."""
import pytest
import torch
from helpers import two_us_kernels

from benchmarks.robust_models import MODELS
from slackswap_cli.hardware import PRESETS
from slackswap_cli.planners import make_plan
from slackswap_cli.run.emit import apply_plan, load_patched
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.joint import loss_from_output, split_inputs
from slackswap_cli.trace.workload import load_workload

HW = PRESETS["a100-pcie4"]
FRACTION = 0.45    # (at the fitted op costs HF GPT-2 "branchy" recomputes below 0.5)


@pytest.fixture(autouse=True)
def _costs(monkeypatch):
    two_us_kernels(monkeypatch)   # plans that recompute as well as swap (see helpers)

# GPT-2 whose forward leaves the final norm out below 20 tokens: other ops at short lengths
BRANCHY = MODELS["gpt2"].replace("seq=16", "seq=24").replace(
    "    return GPT2LMHeadModel(cfg)",
    "    m = GPT2LMHeadModel(cfg)\n"
    "    norm = m.transformer.ln_f\n"
    "    m.transformer.ln_f = _Skip(norm)\n"
    "    return m") + '''
class _Skip(torch.nn.Module):
    def __init__(s, norm):
        super().__init__()
        s.norm = norm
    def forward(s, h):
        return h if h.shape[1] < 20 else s.norm(h)
'''

# a model of our own that leaves its norm out below 20 tokens and reads no tensor's value
SKIPPY = '''
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(64, 32)
        s.fc = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        s.norm = nn.LayerNorm(32)
    def forward(s, ids, labels):
        h = s.emb(ids)
        for fc in s.fc:
            h = torch.tanh(fc(h)) * torch.sigmoid(h)
        if ids.shape[1] >= 20:
            h = s.norm(h)
        return nn.functional.cross_entropy(h.flatten(0, 1), labels.flatten())
def workload(batch=2, seq=24):
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (batch, seq))
    return Net(), {"ids": ids, "labels": ids}
'''


def _patched(tmp_path, name: str, source: str):
    src = tmp_path / f"{name}.py"
    src.write_text(source)
    prof = profile_workload(str(src), device="fake:cpu", hardware=HW)
    peak = prof.summary["peak_activation_bytes"]
    plan = make_plan("slackswap", prof, HW, int(peak * FRACTION), FRACTION)
    assert any(d.action == "recompute" for d in plan.decisions)
    out = tmp_path / f"{name}_patched.py"
    out.write_text(apply_plan(plan, prof))
    return load_patched(str(out)), src


def _keep_all(model, batch) -> int:
    """What eager autograd holds for backward after forward (each storage saved once, not
    parameters, buffers or inputs), measured with saved-tensor hooks on the unpatched model."""
    outside = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    outside |= {t.untyped_storage().data_ptr() for t in batch.values()}
    seen = {}

    def pack(x):
        p = x.untyped_storage().data_ptr()
        if p not in outside:
            seen[p] = x.untyped_storage().nbytes()
        return x
    fwd = model.__dict__.pop("forward")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            a, kw = split_inputs(batch)
            loss = loss_from_output(model(*a, **kw), batch, None)
    finally:
        model.forward = fwd
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _run(tmp_path, name, source, shapes):
    """One training call per (batch, seq) of `shapes`, eager and patched from the same seed:
    gradients bitwise equal; per patched call, its kind, report and held bytes, and the keep-all
    bytes at its shapes."""
    mod, src = _patched(tmp_path, name, source)
    eager, work = load_workload(str(src)), load_workload(str(src))
    mod.patch(work.model)
    state = work.model.forward.__slackswap__
    state.measure_held = True
    calls = []
    for batch_size, seq in shapes:
        batch = load_workload(str(src), args={"batch": batch_size, "seq": seq}).inputs
        keep_all = _keep_all(work.model, batch)
        grads = []
        for m in (eager.model, work.model):
            torch.manual_seed(0)
            a, kw = split_inputs(batch)
            loss = loss_from_output(m(*a, **kw), batch, None)
            if m is work.model:
                calls.append((state.last_run.kind, state.last_report,
                              state.last_run.held_device_bytes(), keep_all))
            loss.backward()
            grads.append([loss.detach(), *(p.grad for p in m.parameters())])
            m.zero_grad(set_to_none=True)
        assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(*grads)), seq
    return mod, calls


def _budget(mod, calls) -> float:
    """The plan's budget as a fraction of what eager holds at the profiled shapes (the first
    call's)."""
    return calls[0][1]["budget_bytes"] / calls[0][3]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_new_lengths_follow_a_recorded_call_without_a_trace_within_the_budget(
        tmp_path, name, capfd):
    shapes = [(2, 16), (2, 16), (2, 16), (2, 24), (2, 24), (2, 24), (2, 10), (2, 10), (3, 16)]
    mod, calls = _run(tmp_path, name, MODELS[name], shapes)
    kinds = [c[0] for c in calls]
    # (the second call at 16 runs a plan made along the branches the first one took)
    assert kinds == ["first", "first", "steady", "new_shape", "first", "steady",
                     "new_shape", "first", "new_shape"], kinds
    err = capfd.readouterr().err
    assert "new inputs" not in err                    # no fake trace for a new shape
    fraction = _budget(mod, calls)
    for kind, rep, held, keep_all in calls[3:]:
        # the budget at these shapes: the plan's fraction of what eager holds at them
        assert held <= 1.05 * fraction * keep_all, (kind, rep, held, keep_all)
        assert rep["held_bytes"] <= 1.05 * fraction * keep_all, (kind, rep)
        assert rep["borrowed"], rep
    for kind, rep, _, _ in calls[4:6]:
        assert rep["fraction"] >= 0.99, rep           # the borrowed plan lines up by rank
    assert not calls[3][1]["recorded"] and calls[4][1]["recorded"]


def test_a_shape_run_holds_its_budget_where_the_plan_keeps_more_than_it(tmp_path):
    """At 8 tokens of a model profiled at 16, a plan's kept tensors (linear in the length)
    weigh more against the keep-all bytes than at 16 (attention scores shrink
    quadratically): the guard swaps kept tensors to stay in the budget, exactly."""
    shapes = [(2, 16), (2, 16), (2, 16), (2, 6), (2, 6), (2, 6)]
    mod, calls = _run(tmp_path, "gpt2", MODELS["gpt2"], shapes)
    fraction = _budget(mod, calls)
    assert calls[3][0] == "new_shape" and calls[3][1]["guard_swaps"] > 0, calls[3]
    for kind, rep, held, keep_all in calls[3:]:
        assert held <= 1.05 * fraction * keep_all, (kind, rep, held, keep_all)


@pytest.mark.parametrize("name, said", [
    ("skippy", "at these shapes, where the plan of other shapes did not line up"),
    ("branchy", "along the branches this call took")])   # (HF's GPT-2 reads values)
def test_a_step_that_leaves_ops_out_at_a_new_length_is_planned_for_it(tmp_path, capfd,
                                                                       name, said):
    """Below 20 tokens the model runs other ops: the first call leaves the template (the guard
    holds the rest), the next lines up less than 99% on the borrowed plan, so these shapes
    get a plan of their own from a trace; the call after it lines up."""
    shapes = [(2, 24), (2, 24), (2, 24), (2, 12), (2, 12), (2, 12), (2, 12)]
    mod, calls = _run(tmp_path, name, {"skippy": SKIPPY, "branchy": BRANCHY}[name], shapes)
    kinds = [c[0] for c in calls[3:]]
    assert kinds == ["new_shape", "first", "first", "steady"], kinds
    assert calls[3][1]["left_template"]
    assert calls[4][1]["fraction"] < 0.99 and calls[5][1]["fraction"] >= 0.99
    assert not calls[5][1]["borrowed"] and calls[5][1]["recorded"]
    err = capfd.readouterr().err
    assert f"planned again {said}" in err and err.count("at 2x12, 2x12 on cpu, float32 "
                                                         "parameters runs it") == 1
    fraction = _budget(mod, calls)
    for kind, rep, held, keep_all in calls[3:]:
        assert held <= 1.05 * fraction * keep_all, (kind, rep, held, keep_all)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_new_length_right_after_a_plan_was_made_follows_the_call_before_it(
        tmp_path, name, monkeypatch, capfd):
    """HF causal LMs' first call is planned again along its branches, so no call has followed
    that plan yet when a new length comes: the new length's first call follows the template
    of the call recorded on the plan before (its packs are eager's whatever the plan), held
    to the new plan's fraction of the keep-all bytes; the next call records on the new plan,
    borrowed, and lines up. No trace but the one along the branches."""
    traced = _spy_traces(monkeypatch)
    shapes = [(2, 16), (2, 24), (2, 24), (2, 24)]
    mod, calls = _run(tmp_path, name, MODELS[name], shapes)
    assert [c[0] for c in calls] == ["first", "new_shape", "first", "steady"]
    assert len(traced) == 1 and traced[0]                   # along the first call's branches
    shape_run, recorded = calls[1][1], calls[2][1]
    assert shape_run["borrowed"] and not shape_run["recorded"] and not shape_run["left_template"]
    assert recorded["borrowed"] and recorded["fraction"] >= 0.99, recorded
    assert recorded["budget_bytes"] == shape_run["budget_bytes"]   # the new-shape call settled it
    assert "new inputs" not in capfd.readouterr().err
    fraction = _budget(mod, calls)
    for kind, rep, held, keep_all in calls[1:]:
        assert held <= 1.05 * fraction * keep_all, (kind, rep, held, keep_all)
        assert rep["budget_bytes"] <= 1.05 * fraction * keep_all, rep


def _spy_traces(monkeypatch) -> list:
    """Each fake trace a patched model plans from (`replan.replan_table`): the values it was
    handed (None: a trace at new shapes, not along a call's branches), then the trace."""
    from slackswap_cli.run.eager import replan
    traced, trace = [], replan.replan_table

    def spy(*args, **kwargs):
        traced.append(kwargs.get("values"))
        return trace(*args, **kwargs)
    monkeypatch.setattr(replan, "replan_table", spy)
    return traced


def _fraction_at_profile(mod, src) -> float:
    """The plan's budget as a fraction of what eager holds at the profiled shapes (measured
    without a patched call)."""
    work = load_workload(str(src))
    mod.patch(work.model)
    return mod.META["budget_bytes"] / _keep_all(work.model, work.inputs)


@pytest.mark.parametrize("start", [(2, 48), (4, 8)])
def test_the_runs_first_call_at_shapes_not_profiled_borrows_the_plan_without_a_trace(
        tmp_path, start, monkeypatch, capfd):
    """HF BERT profiled at batch 2, length 16; the run starts at other shapes (a longer
    length; a larger batch of shorter ones): its first call is recorded on the profiled plan
    (ops lined up by rank), held by the guard to a limit guessed from the profile's saved
    bytes and settled by the call; no fake trace, there or at the shapes after it."""
    traced = _spy_traces(monkeypatch)
    name = "bert"
    shapes = [start, start, start, (2, 24), (3, 16)]
    mod, calls = _run(tmp_path, name, MODELS[name], shapes)
    assert traced == []
    kinds = [c[0] for c in calls]
    assert kinds == ["first", "steady", "steady", "new_shape", "new_shape"], kinds
    first = calls[0][1]
    assert first["recorded"] and first["borrowed"] and first["fraction"] >= 0.99, first
    fraction = _fraction_at_profile(mod, tmp_path / f"{name}.py")
    for kind, rep, held, keep_all in calls:
        assert held <= 1.05 * fraction * keep_all, (kind, rep, held, keep_all)
        assert rep["held_bytes"] == held and rep["budget_bytes"] <= 1.05 * fraction * keep_all
    assert calls[0][1]["budget_bytes"] == calls[1][1]["budget_bytes"]   # settled by the call
    assert "new inputs" not in capfd.readouterr().err


def test_a_branchy_models_first_call_at_a_length_not_profiled_costs_one_trace_along_it(
        tmp_path, monkeypatch, capfd):
    """HF Llama builds its mask otherwise under fake tensors: its first call, at 48 (profiled
    at 16), is recorded on the profiled plan, lines up less and is held to the budget at 48;
    the one trace after it is along the branches it took (none at the new shapes first)."""
    traced = _spy_traces(monkeypatch)
    mod, calls = _run(tmp_path, "llama", MODELS["llama"], [(2, 48), (2, 48), (2, 48)])
    assert len(traced) == 1 and traced[0], traced          # along the eager call's values
    assert [c[0] for c in calls] == ["first", "first", "steady"]
    (_, first, held, keep_all), (_, second, _, _) = calls[:2]
    assert first["borrowed"] and first["fraction"] < 0.99, first
    fraction = _fraction_at_profile(mod, tmp_path / "llama.py")
    assert held <= 1.05 * first["budget_bytes"] <= 1.05 * fraction * keep_all, (first, held)
    assert not second["borrowed"] and second["fraction"] >= 0.99, second
    for _, rep, held, _ in calls[1:]:
        assert held <= 1.05 * rep["budget_bytes"], (rep, held)
    err = capfd.readouterr().err
    assert "new inputs" not in err and err.count("along the branches this call took") == 1


def test_a_shape_run_that_leaves_its_template_settles_the_exact_budget(tmp_path):
    """HF BERT at batch 1 saves tensors its batch-2 template does not have: the first call at
    (1, 64) leaves the template. What a keep-all run holds there is still counted pack by pack
    (not predicted from the template's packs it never met), so the budget it settles for the
    calls after it is the plan's fraction of the true keep-all bytes."""
    shapes = [(2, 16), (2, 16), (2, 16), (1, 64), (1, 64)]
    mod, calls = _run(tmp_path, "bert", MODELS["bert"], shapes)
    fraction = _fraction_at_profile(mod, tmp_path / "bert.py")
    kind, rep, held, keep_all = calls[3]
    assert kind == "new_shape" and rep["left_template"], rep
    for kind, rep, held, keep_all in calls[3:]:
        assert held <= 1.05 * fraction * keep_all, (kind, rep, held, keep_all)
        assert rep["budget_bytes"] == pytest.approx(fraction * keep_all, rel=0.01), (kind, rep)


def test_a_re_plans_fake_copy_takes_a_modules_recurrent_state_kept_as_an_attribute():
    """A module that keeps a tensor with autograd history as a plain attribute (Hugging Face
    RecurrentGemma's `recurrent_states`, `conv1d_state`): the re-plan's fake copy of the model
    (`replan.fake_copy`) makes it a FakeTensor, detached, where deepcopy alone refuses a
    non-leaf tensor; the real model keeps its own."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from slackswap_cli.run.eager.replan import fake_copy

    class Scan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.state = None

        def forward(self, x):
            self.state = torch.tanh(self.lin(x))      # kept after forward, with its graph
            return self.state.sum()

    model = Scan()
    model(torch.randn(2, 4))
    assert model.state.grad_fn is not None
    state = model.state
    shadow = fake_copy(model, FakeTensorMode())
    assert isinstance(shadow.state, FakeTensor) and shadow.state.grad_fn is None
    assert isinstance(shadow.lin.weight, torch.nn.Parameter)
    assert isinstance(shadow.lin.weight.data, FakeTensor)
    assert model.state is state and not isinstance(model.state, FakeTensor)
