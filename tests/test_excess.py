"""plan_model measures its plan on the model (run/verify/excess.py): eager holds what Python still
names longer than the simulator counts, so a plan predicted at its budget can peak above it
(a tiny GPT at 0.38: 266496 bytes against 250885); where it does, plan_model plans
again below the budget by that excess. The measurement runs on the user's model itself and
leaves it, its gradients, buffers and random number generators as they were."""
import copy
import importlib.util
import re
from pathlib import Path

import pytest
import torch

import slackswap_cli as slackswap
from slackswap_cli.errors import InputError
from slackswap_cli.run.verify.excess import measured_peak
from slackswap_cli.run.verify.memtrace import step_peaks

ROOT = Path(__file__).resolve().parents[1]


def _tiny_gpt():
    spec = importlib.util.spec_from_file_location("tiny_gpt_excess", ROOT / "examples" /
                                                  "tiny_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.workload(dropout=0.0)


def _patched_peak(model, plan, inputs) -> int:
    """The activation peak of a patched copy's second step, measured apart from excess.py."""
    m = copy.deepcopy(model)
    slackswap.patch(m, plan)
    step_peaks(m, inputs)                       # the recording call
    return max(step_peaks(m, inputs))


def test_measured_plan_fits_its_budget_where_the_simulated_one_does_not():
    """A fake trace is measured when asked (measure=True: on the model itself). (At 0.38 the
    tiny GPT's plan holds 266496 bytes against a budget of 250885.)"""
    model, inputs = _tiny_gpt()
    plain = slackswap.plan_model(model, inputs, budget=0.38, device="fake:cpu")
    assert plain.measured is None                                      # fake: not by default
    assert _patched_peak(model, plain, inputs) > plain.budget_bytes   # eager's excess
    plan = slackswap.plan_model(model, inputs, budget=0.38, device="fake:cpu", measure=True)
    m = plan.measured
    assert m.first_measured > plan.budget_bytes and m.rounds >= 2, m
    assert m.first_predicted == plain.predicted.peak_bytes
    assert plan.budget_bytes == plain.budget_bytes          # the budget asked for, kept
    assert m.planned_at < plan.budget_bytes and any("planned at" in n for n in plan.plan.notes)
    assert _patched_peak(model, plan, inputs) == m.measured <= plan.budget_bytes
    assert plan.decisions != plain.decisions


def test_a_plan_that_fits_when_measured_is_left_as_it_is():
    """At 0.5 the measured step fits: the plan's decisions are the unmeasured plan's."""
    model, inputs = _tiny_gpt()
    plain = slackswap.plan_model(model, inputs, budget=0.5, device="fake:cpu")
    plan = slackswap.plan_model(model, inputs, budget=0.5, device="fake:cpu", measure=True)
    assert plan.measured.rounds == 1 and plan.measured.measured <= plan.budget_bytes
    assert plan.decisions == plain.decisions and plan.plan.notes == plain.plan.notes


class _Net(torch.nn.Module):
    """BatchNorm (buffers a training step writes) and dropout (the RNG a step draws)."""

    def __init__(self):
        super().__init__()
        self.a, self.bn = torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64)
        self.b, self.drop = torch.nn.Linear(64, 64), torch.nn.Dropout(0.3)
        self.c = torch.nn.Linear(64, 4)

    def forward(self, x):
        h = self.drop(torch.nn.functional.gelu(self.bn(self.a(x))))
        return self.c(torch.tanh(self.b(h))).square().mean()


def _state(model):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [b.clone() for b in model.buffers()])


def _same(a, b) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_measuring_leaves_the_model_and_its_next_step_bitwise_as_they_were():
    """plan_model measures a real trace's plan by default, on the model itself: its
    parameters, gradients (the very tensors), buffers, training mode, the inputs' gradients
    and the random number generators are as they were, and so is the next training step."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(32, 16, requires_grad=True)
    model(x).backward()                             # gradients the user already holds
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()                     # (a Parameter's deepcopy drops its .grad)
    grads, before, rng = [p.grad for p in model.parameters()], _state(model), torch.get_rng_state()
    x_grad = x.grad.clone()
    plan = slackswap.plan_model(model, (x,), budget=0.6, device="cpu")   # measured: real trace
    assert plan.measured is not None and plan.measured.first_measured > 0
    assert measured_peak(model, (x,), None, plan) == plan.measured.measured
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert _same(_state(model), before) and not slackswap.run.eager.inplace.is_patched(model)
    assert torch.equal(x.grad, x_grad) and model.training
    for m in (model, twin):                         # the next training step, from one RNG state
        torch.manual_seed(1)
        m(x).backward()
    assert _same(_state(model), _state(twin))


def test_measuring_refuses_a_forward_that_writes_its_parameters():
    class Writes(torch.nn.Linear):
        def forward(self, x):
            with torch.no_grad():
                self.weight.mul_(1.0)
            return super().forward(x).sum()
    model = Writes(8, 8)
    plan = slackswap.plan_model(model, (torch.randn(4, 8),), budget=1.0, device="cpu",
                                measure=False)
    with pytest.raises(InputError, match="writes its parameter weight in place") as e:
        measured_peak(model, (torch.randn(4, 8),), None, plan)
    assert "measure=False" in e.value.hint
    # plan_model's default measure warns and returns the plan unmeasured; measure=True raises
    with pytest.warns(UserWarning, match="not measured: .* writes its parameter weight"):
        plan = slackswap.plan_model(model, (torch.randn(4, 8),), budget=1.0, device="cpu")
    assert plan.measured is None
    with pytest.raises(InputError, match="writes its parameter weight in place"):
        slackswap.plan_model(model, (torch.randn(4, 8),), budget=1.0, device="cpu",
                             measure=True)


def test_plan_pipeline_measures_each_stage_on_the_stage_itself(monkeypatch):
    """plan_pipeline's measure (settle_stages) runs on the stage module, not a copy of it,
    and leaves it, the inputs and the random number generators as they were."""
    from slackswap_cli.run.eager.inplace import is_patched
    from slackswap_cli.run.parallel.pipeline import plan_pipeline
    from slackswap_cli.run.verify import excess
    seen = []

    def spy(model, *args):
        seen.append(model)
        return measured_peak(model, *args)
    monkeypatch.setattr(excess, "measured_peak", spy)
    torch.manual_seed(1)
    stage = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 16))
    x = torch.randn(4, 16, requires_grad=True)
    before, rng = _state(stage), torch.get_rng_state()
    planned = plan_pipeline({1: (stage, (x,), None)}, "GPipe", pp=3, microbatches=4,
                            budget=13_000, ranks=[1])
    assert planned.plans[1] is not None and seen and all(m is stage for m in seen)
    assert _same(_state(stage), before) and not is_patched(stage)
    assert torch.equal(torch.get_rng_state(), rng) and x.grad is None


def test_settle_plans_lower_by_the_phase_where_eager_holds_more():
    """settle's rule on stand-in plans: a step that fits is left alone; one over the budget is
    planned lower by its peak's excess over the prediction, then, where that lowered only
    backward (the simulator's peak) and forward (eager's over-hold) is still over, by the
    forward's excess over its own simulated peak."""
    from types import SimpleNamespace

    from slackswap_cli.run.verify.excess import settle

    def plan(peak, fwd_sim, fwd_measured):
        return SimpleNamespace(predicted=SimpleNamespace(peak_bytes=peak), feasible=True,
                               sim=(fwd_sim, peak), got=(fwd_measured, peak))
    asked = []
    made = {85: plan(85, 80, 110), 70: plan(70, 60, 90)}

    def plan_at(at):
        asked.append(at)
        return made[at]
    first = plan(95, 80, 110)
    chosen, s = settle(first, 100, plan_at, lambda p: p.got, lambda p: p.sim)
    assert asked == [85, 70] and chosen is made[70]
    assert (s.first_measured, s.measured, s.planned_at, s.excess, s.rounds) == (110, 90, 70, 30, 3)
    fits = plan(95, 80, 99)
    chosen, s = settle(fits, 100, plan_at, lambda p: p.got, lambda p: p.sim)
    assert chosen is fits and s.rounds == 1 and asked == [85, 70]


def test_a_step_that_cannot_be_brought_under_says_so_and_the_budget_it_names_fits():
    """At the floor no plan is lower: plan_model warns with the measured figures, and the
    budget it names gives a plan whose measured step fits."""
    model, inputs = _tiny_gpt()
    from slackswap_cli.simulate import budget_floor_bytes
    floor = budget_floor_bytes(slackswap.plan_model(model, inputs, budget=0.5,
                                                    device="fake:cpu").profile)
    with pytest.warns(UserWarning, match=r"A budget of (\d+) bytes or more fits") as w:
        plan = slackswap.plan_model(model, inputs, budget=floor, device="fake:cpu",
                                    measure=True)
    assert plan.measured.measured > floor
    named = int(re.search(r"A budget of (\d+) bytes", str(w[-1].message)).group(1))
    plan = slackswap.plan_model(model, inputs, budget=named, device="fake:cpu", measure=True)
    assert plan.measured.measured <= named
