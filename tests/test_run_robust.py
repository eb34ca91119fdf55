"""The plan holds where the run departs from the profiled trace: models nobody on the team
wrote line up op for op (`benchmarks/robust_models.py`), and what the plan cannot place is
held to the budget by the guard (`slackswap_cli/guard.py`), exactly."""
import pytest
import torch

from benchmarks.robust_models import MODELS, MOE
from slackswap_cli.hardware import PRESETS
from slackswap_cli.planners import make_plan
from slackswap_cli.run.emit import apply_plan, load_patched
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.joint import loss_from_output, split_inputs
from slackswap_cli.trace.workload import load_workload

HW = PRESETS["a100-pcie4"]

# a library that branches on "am I traced?": the fake trace takes the cheap branch, eager
# saves three tensors per layer the profile never saw
FAKE_BRANCH = '''
import torch, torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.fc = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
    def forward(s, x):
        h = x
        for fc in s.fc:
            h = fc(h)
            h = torch.relu(h) if isinstance(h, FakeTensor) else torch.sigmoid(h) * torch.tanh(h)
        return h.pow(2).mean()
def workload(batch=64):
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, 32),)
'''


def _patched(tmp_path, name: str, source: str, device: str, fraction: float = 0.5):
    src = tmp_path / f"{name}.py"
    src.write_text(source)
    prof = profile_workload(str(src), device=device, hardware=HW)
    peak = prof.summary["peak_activation_bytes"]
    plan = make_plan("slackswap", prof, HW, int(peak * fraction), fraction)
    out = tmp_path / f"{name}_patched.py"
    out.write_text(apply_plan(plan, prof))
    return load_patched(str(out)), src


def _steps(mod, src, steps: int = 2):
    """`steps` SGD steps of an eager model and of one patched in place: losses equal, and
    per patched call its report and the bytes it held for backward after forward."""
    eager, work = load_workload(str(src)), load_workload(str(src))
    mod.patch(work.model)
    state = work.model.forward.__slackswap__
    state.measure_held = True
    opts = [torch.optim.SGD(w.model.parameters(), lr=0.1) for w in (eager, work)]
    calls = []
    for k in range(steps):
        losses = []
        for w, opt in zip((eager, work), opts):
            torch.manual_seed(k)
            a, kw = split_inputs(w.inputs)
            loss = loss_from_output(w.model(*a, **kw), w.inputs, w.loss_fn)
            if w is work:
                calls.append((state.last_report, state.last_run.held_device_bytes()))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert torch.equal(*losses)
    assert all(torch.equal(p, q) for p, q in zip(eager.model.parameters(),
                                                  work.model.parameters()))
    return calls


# BERT and T5 in the slow tier: BERT trains patched bitwise in test_inplace, T5 in test_zoo
@pytest.mark.parametrize("name", [pytest.param("bert", marks=pytest.mark.slow_tier),
                                  pytest.param("t5", marks=pytest.mark.slow_tier), "vit",
                                  "transformer-encoder", "mha"])
def test_models_nobody_here_wrote_line_up_and_train_bitwise(tmp_path, name, capfd):
    mod, src = _patched(tmp_path, name, MODELS[name], "fake:cpu")
    (rep, held), _ = _steps(mod, src)
    assert rep["fraction"] >= 0.99, rep
    assert rep["guard_swaps"] == 0 and held <= 1.05 * rep["budget_bytes"], (rep, held)
    assert "lined up" not in capfd.readouterr().err


# Qwen2 and Mistral (the same grouped-query mask and key repeat as Llama) in the slow tier
@pytest.mark.parametrize("name,device", [
    pytest.param("qwen2", "fake:cpu", marks=pytest.mark.slow_tier), ("llama", "cpu"),
    pytest.param("mistral", "fake:cpu", marks=pytest.mark.slow_tier), ("gpt2", "fake:cpu")])
def test_causal_lms_plan_again_along_eager_branches_then_line_up(tmp_path, name, device, capfd):
    """transformers builds a mask and repeats grouped-query keys under fake tensors, not in
    eager: the first call lines up less and is held to the budget; it plans again along the
    branches it took, every later call lines up, and the third follows its template (the
    second, the first on the new plan, is recorded)."""
    mod, src = _patched(tmp_path, name, MODELS[name], device)
    calls = _steps(mod, src, steps=3)
    (first, held), later = calls[0], calls[1:]
    assert first["fraction"] < 0.99 and held <= 1.05 * first["budget_bytes"], first
    for rep, held in later:
        assert rep["fraction"] >= 0.99 and rep["run_unmatched"] == 0, rep
        assert held <= 1.05 * rep["budget_bytes"], (rep, held)
        assert rep["budget_bytes"] == first["budget_bytes"]       # the same budget, in bytes
    assert [rep["recorded"] for rep, _ in calls] == [True, True, False]
    err = capfd.readouterr().err
    assert err.count("planned again along the branches this call took") == 1, err
    # the note on the first call says that the re-plan follows, not to re-profile (which a
    # SlackswapCallback or plan_model user has no way to do)
    assert "slackswap plans again along this call's path now" in err and "re-profile" not in err


def test_a_run_that_branches_otherwise_than_its_trace_is_held_to_the_budget(tmp_path, capfd):
    mod, src = _patched(tmp_path, "fake_branch", FAKE_BRANCH, "fake:cpu")
    first, later = _steps(mod, src, steps=3)[::2]       # the recording call, a steady one
    budget = first[0]["budget_bytes"]
    for rep, held in (first, later):
        assert rep["guard_swaps"] > 0, rep
        assert held <= 1.05 * budget, (held, budget)
        assert rep["held_bytes"] == held       # the guard's count is what the run holds
    # unguarded, eager holds far more than the budget: the guard is what keeps it there
    assert first[0]["held_bytes"] + first[0]["guard_swapped_bytes"] > 1.5 * budget
    err = capfd.readouterr().err
    assert err.count("the guard swapped") == 1 and "x the budget" in err


def test_a_mixture_of_experts_on_other_routings_is_held_to_the_budget_exactly(tmp_path):
    """Profiled at one batch's routing (a real trace): on batches routed otherwise the experts
    save tensors of other sizes, which the plan cannot place; each call holds at most its
    budget and trains bitwise like eager."""
    mod, src = _patched(tmp_path, "moe", MOE, "cpu")
    eager, work = load_workload(str(src)), load_workload(str(src))
    mod.patch(work.model)
    state = work.model.forward.__slackswap__
    state.measure_held = True
    acted = 0
    for seed in (0, 1, 2, 1):
        (x,) = load_workload(str(src), args={"seed": seed}).inputs
        got = []
        for m in (eager.model, work.model):
            loss = m(x)
            if m is work.model:
                rep, held = state.last_report, state.last_run.held_device_bytes()
                assert held <= 1.05 * rep["budget_bytes"], (seed, rep, held)
                assert rep["held_bytes"] == held
                acted += rep["guard_swaps"] > 0
            loss.backward()
            got.append([loss.detach(), *(p.grad for p in m.parameters())])
            m.zero_grad(set_to_none=True)
        assert all(torch.equal(p, q) for p, q in zip(*got)), seed
    assert acted >= 2                          # the other routings needed the guard


def test_a_new_length_after_a_branchy_first_call_costs_no_trace_and_lines_up(tmp_path, capfd):
    """Once a model's calls had to be planned along their own branches, a new sequence length
    follows the template of the calls along them (`run/eager/new_shape.py`: no trace), held by the
    guard; the next call at it records on that plan and lines up."""
    mod, src = _patched(tmp_path, "llama", MODELS["llama"], "fake:cpu")
    eager, work = load_workload(str(src)), load_workload(str(src))
    mod.patch(work.model)
    state = work.model.forward.__slackswap__
    state.measure_held = True
    reps = []
    for seq in (16, 16, 24, 24):
        batch = load_workload(str(src), args={"seq": seq}).inputs
        got = []
        for m in (eager.model, work.model):
            a, kw = split_inputs(batch)
            loss = loss_from_output(m(*a, **kw), batch, None)
            if m is work.model:
                reps.append((state.last_report, state.last_run.held_device_bytes()))
            loss.backward()
            got.append([loss.detach(), *(p.grad for p in m.parameters())])
            m.zero_grad(set_to_none=True)
        assert all(torch.equal(p, q) for p, q in zip(*got)), seq
    (_, _), (at16, _), (first24, held24), (later24, _) = reps
    assert at16["fraction"] >= 0.99 and later24["fraction"] >= 0.99, (at16, later24)
    assert not first24["recorded"] and not first24["left_template"] and first24["borrowed"]
    assert held24 <= 1.05 * first24["budget_bytes"] and later24["recorded"]
    err = capfd.readouterr().err
    assert err.count("planned again along the branches") == 1     # at 16 only
    assert "new inputs" not in err                                  # no trace at 24


def test_a_fake_trace_is_answered_the_values_eager_read_and_refuses_other_branches():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from slackswap_cli.run.eager.branches import BranchesDiffer, eager_branches

    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if bool((x > 0).all()) else x - 1
    from torch.fx.experimental.proxy_tensor import make_fx
    mode = FakeTensorMode()
    m = Branchy()
    x = mode.from_tensor(torch.ones(3))
    for answer, op, other in ((True, "mul", "sub"), (False, "sub", "mul")):   # eager decides
        with eager_branches(m, [answer]):
            graph = str(make_fx(lambda t: m(t), tracing_mode="fake")(torch.ones(3)).graph)
        assert f"aten.{op}" in graph and f"aten.{other}" not in graph, graph
    with pytest.raises(BranchesDiffer, match="more values"):
        with eager_branches(m, []), mode:
            m(x)
    with pytest.raises(BranchesDiffer, match="1 of the eager call's 2"):
        with eager_branches(m, [True, True]), mode:
            m(x)
    with pytest.raises(BranchesDiffer, match="int"):
        with eager_branches(m, [3]), mode:
            m(x)
