"""A model's own gradient checkpointing (timm's `set_grad_checkpointing`, Hugging Face's
`gradient_checkpointing_enable`) is seen: said once by plan_model and once by the patch; the
profile, and so the budget and the plan, count what the checkpointed step holds (its regions
re-run in the traced backward: trace/checkpointed.py), which the patched run stays within."""
import copy

import pytest
import torch
import torch.utils.checkpoint as ckpt

import slackswap_cli as slackswap
from slackswap_cli.budget import first_feasible_budget
from slackswap_cli.errors import InfeasibleError
from slackswap_cli.hardware import load_hardware
from slackswap_cli.run.notes import checkpointing_on
from slackswap_testkit.alive import AliveStorages


def test_timms_set_grad_checkpointing_is_seen():
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet10t", pretrained=False, num_classes=4)
    assert checkpointing_on(model) is None
    model.set_grad_checkpointing(True)
    said = checkpointing_on(model)
    assert said.startswith("timm gradient checkpointing is on")
    assert "model.set_grad_checkpointing(False)" in said


class _Stages(torch.nn.Module):
    """timm's way: a `grad_checkpointing` flag, its blocks run through `checkpoint`; a stem
    and a head outside them."""

    def __init__(self, width=16, on=True, drop=0.1):
        super().__init__()
        self.grad_checkpointing = on
        self.stem, self.head = torch.nn.Linear(width, width), torch.nn.Linear(width, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
            torch.nn.Dropout(drop) if drop else torch.nn.Identity(),
            torch.nn.Linear(4 * width, width)) for _ in range(3))

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        for b in self.blocks:
            x = ckpt.checkpoint(b, x, use_reentrant=False) if self.grad_checkpointing else b(x)
        return self.head(torch.relu(x))


def test_plan_model_and_patch_say_so_once_each(capfd):
    torch.manual_seed(0)
    model, x = _Stages(), torch.randn(8, 16)
    plan = slackswap.plan_model(model, (x,), budget=1.0, device="fake:cpu",
                                loss_fn=lambda out, inputs: out.pow(2).mean())
    err = capfd.readouterr().err
    assert err.count("timm gradient checkpointing is on") == 1
    assert "the plan and its budget count what the model holds with it" in err
    slackswap.patch(model, plan)
    for _ in range(2):
        model(x).pow(2).mean().backward()
    assert capfd.readouterr().err.count("timm gradient checkpointing is on") == 1


def _loss(out, inputs):
    return out.pow(2).mean()


def _held_after_forward(model, x):
    mode = AliveStorages()
    with mode:
        out = model(x)
    held = mode.held(out, model, x)
    _loss(out, None).backward()
    return held


def _plan(model, x, planner):
    kw = dict(loss_fn=_loss, device="fake:cpu", planner=planner)
    try:
        return slackswap.plan_model(model, (x,), budget=0.5, **kw)
    except InfeasibleError as e:
        first = first_feasible_budget(e.plan.profile, load_hardware(None), planner)
        return slackswap.plan_model(model, (x,), budget=int(first), **kw)


def check_counts_what_it_holds(build, x, planner="slackswap"):
    """The checkpointed model's profile saves what its eager step holds after forward, as
    the plain model's does (the same difference: the loss's own), less than the plain one;
    the patched step bitwise, steady from call 2, within 1.05x its budget. (A model whose
    regions draw random numbers is counted more: their results are held through backward in
    the profile, re-drawn by the checkpoint; trace/checkpointed.py.)"""
    got = {}
    for on in (False, True):
        torch.manual_seed(0)
        model = build(on)
        plan = _plan(model, x, planner)
        held = _held_after_forward(copy.deepcopy(model), x)
        got[on] = (plan.profile.summary["saved_bytes"], held, model, plan)
    (saved_off, held_off, _, _), (saved_on, held_on, model, plan) = got[False], got[True]
    assert saved_on - held_on == saved_off - held_off, got
    assert held_on < held_off and plan.profile.summary["checkpoint_held"]
    twin = copy.deepcopy(model)
    slackswap.patch(model, plan)
    state = model.forward.__slackswap__
    state.measure_held = True
    for k in range(3):
        grads = []
        for m in (twin, model):
            torch.manual_seed(k)
            mode = AliveStorages()
            with mode:
                out = m(x)
            if m is model:     # (on a CPU a swap's host copy is a CPU storage as well:
                held = (mode.held(out, m, x) if not plan.actions()["swap"]  # where the plan
                        else state.last_run.held_device_bytes())    # swaps, the patch's count)
            _loss(out, None).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        assert held <= 1.05 * state.last_report["budget_bytes"], (held, state.last_report)
        assert state.last_report["recorded"] == (k == 0)


@pytest.mark.parametrize("planner", ["slackswap", "recompute-only"])
def test_the_plan_counts_what_the_checkpointed_model_holds(planner):
    check_counts_what_it_holds(lambda on: _Stages(64, on, drop=0.0), torch.randn(32, 64),
                               planner)


@pytest.mark.slow_tier   # test_the_plan_counts_what_the_checkpointed_model_holds covers it
@pytest.mark.parametrize("name,side", [("resnet10t", 64), ("vit_tiny_patch16_224", 32)])
@pytest.mark.parametrize("planner", ["slackswap", "recompute-only"])
def test_timms_checkpointed_models_are_planned_for_what_they_hold(name, side, planner):
    timm = pytest.importorskip("timm")

    def build(on):
        kw = {"img_size": side, "depth": 4} if name.startswith("vit") else {}
        model = timm.create_model(name, pretrained=False, num_classes=4, **kw)
        model.set_grad_checkpointing(on)
        return model
    check_counts_what_it_holds(build, torch.randn(2, 3, side, side), planner)
