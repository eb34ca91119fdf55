"""`slackswap_cli.check` and `patch(model, plan, check=True)`: one step eager against one step
patched, bitwise, on the first samples of a batch; a corrupted runtime is caught and named."""
import re

import pytest
import torch
from helpers import two_us_kernels
from workloads import ROOT

import slackswap_cli as slackswap
from slackswap_cli.errors import CheckFailed, InputError
from slackswap_cli.run.eager import backward
from slackswap_cli.run.eager.inplace import is_patched
from slackswap_cli.run.eager.packs import RecomputedRef
from slackswap_cli.run.verify import check as check_module
from slackswap_cli.trace.workload import load_workload


@pytest.fixture(autouse=True)
def _costs(monkeypatch):
    two_us_kernels(monkeypatch)   # plans that recompute as well as swap (see helpers)


TINY_GPT = ROOT / "examples" / "tiny_gpt.py"


@pytest.fixture(scope="module")
def gpt():
    """The tiny GPT at batch 8 (dropout on) and its plan at 0.3: swaps and recomputes."""
    work = load_workload(str(TINY_GPT), args={"batch": 8})
    with pytest.MonkeyPatch.context() as mp:   # module-scoped: before _costs applies
        two_us_kernels(mp)
        plan = slackswap.plan_model(work.model, work.inputs, budget=0.3, device="fake:cpu")
    counts = plan.actions()
    assert counts["swap"] and counts["recompute"], counts
    return work, plan


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state(),
            model.training)


def _unchanged(model, snap) -> bool:
    state, rng, training = snap
    return (all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
            and torch.equal(rng, torch.get_rng_state()) and model.training == training
            and all(p.grad is None for p in model.parameters()) and not is_patched(model))


def _corrupt(monkeypatch, steady_only: bool) -> None:
    """The patched runtime hands back every recomputed saved tensor 1% off (with
    `steady_only`: in calls after the first at a signature only)."""
    unpack = backward.unpack

    def wrong(s, packed):
        out = unpack(s, packed)
        if isinstance(packed, RecomputedRef) \
                and out.is_floating_point() and (s.tpl is not None or not steady_only):
            return out * 1.01
        return out
    monkeypatch.setattr(backward, "unpack", wrong)


@pytest.fixture
def corrupt_recompute(monkeypatch):
    _corrupt(monkeypatch, steady_only=False)


def test_check_passes_a_correct_plan_on_a_slice_and_leaves_the_model(gpt):
    work, plan = gpt
    work.model.eval()                                   # the check trains, then puts it back
    snap = _snapshot(work.model)
    report = slackswap.check(work.model, plan, work.inputs)
    assert (report.samples, report.batch) == (2, 8)     # 8 x the budget fraction 0.3, >= 2
    assert report.ops_rerun > 0 and report.roots_swapped > 0 and report.lined_up > 0.9
    assert report.parameters == len(list(work.model.parameters()))
    assert _unchanged(work.model, snap)
    assert slackswap.check(work.model, plan, work.inputs, samples=None).samples == 8
    assert _unchanged(work.model, snap)
    with pytest.raises(InputError, match="samples="):
        slackswap.check(work.model, plan, work.inputs, samples=0)


def test_check_names_the_gradient_a_corrupted_recompute_changes(gpt, corrupt_recompute):
    work, plan = gpt
    snap = _snapshot(work.model)
    with pytest.raises(CheckFailed) as failed:
        slackswap.check(work.model, plan, work.inputs)
    found = re.search(r"the gradient of (\S+) differs from eager by ([0-9.e+-]+) of its "
                      r"largest value", failed.value.message)
    assert found, failed.value.message
    assert found.group(1) in dict(work.model.named_parameters()) and float(found.group(2)) > 0
    assert "first 2 of 8 samples, the patched model's first call" in failed.value.message
    assert failed.value.hint and _unchanged(work.model, snap)


def test_check_runs_the_steady_state_too(gpt, monkeypatch):
    work, plan = gpt
    _corrupt(monkeypatch, steady_only=True)
    with pytest.raises(CheckFailed, match="the patched model's second call: the gradient of"):
        slackswap.check(work.model, plan, work.inputs)


def test_patch_with_check_checks_the_first_training_call_once(gpt, monkeypatch):
    work, plan = gpt
    calls = []
    step = check_module.check_step
    monkeypatch.setattr(slackswap.run.api, "check_step",
                        lambda *a, **kw: calls.append(1) or step(*a, **kw))
    work.model.train()
    slackswap.patch(work.model, plan, check=True)
    try:
        for _ in range(2):
            work.model(*work.inputs).backward()
        assert len(calls) == 1
        assert work.model.forward.__slackswap__.check_report.samples == 2
        assert work.model.forward.__slackswap__.last_run.rerun_ops > 0  # the patch then ran
    finally:
        slackswap.unpatch(work.model)
        work.model.zero_grad(set_to_none=True)


def test_patch_with_check_stops_the_first_call_of_a_wrong_run(gpt, corrupt_recompute):
    work, plan = gpt
    work.model.train()
    slackswap.patch(work.model, plan, check=True)
    try:
        with pytest.raises(CheckFailed, match="the gradient of"):
            work.model(*work.inputs)
        assert is_patched(work.model)
    finally:
        slackswap.unpatch(work.model)


def test_a_slice_a_loss_closure_cannot_take_says_to_check_the_whole_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                  for _ in range(4)], torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    plan = slackswap.plan_model(model, x, budget=0.6, device="fake:cpu",
                                loss_fn=lambda out, inputs: torch.nn.functional.cross_entropy(out, y))
    with pytest.raises(InputError) as refused:
        slackswap.check(model, plan, x)
    assert "first 4 of 8 samples" in refused.value.message
    follow = re.search(r"pass (samples=None)", refused.value.hint)
    assert follow, refused.value.hint
    report = slackswap.check(model, plan, x, **{follow.group(1).split("=")[0]: None})
    assert report.samples == 8


def test_the_trainer_callback_check_flag_off_runs_no_check(monkeypatch):
    pytest.importorskip("transformers")
    calls = []
    monkeypatch.setattr(slackswap.run.api, "check_step", lambda *a, **kw: calls.append(1))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                  for _ in range(4)])
    callback = slackswap.SlackswapCallback(budget=0.6, check=False,
                                           loss_fn=lambda out, inputs: out.square().mean())
    callback.on_step_begin(None, None, None, model=model)
    model(torch.randn(8, 16)).square().mean().backward()
    assert callback.plan is not None and callback.check_report is None and calls == []
