"""Swapped tensors come back when the plan's schedule fetched them, in plain `patch(model)`
too: the in-place runtime issues each copy back at the backward op where the simulator issued
it (`chains.copy_back_pins`). Unpinned, it fetched every swapped tensor as backward began and
held them all at once (a tiny GPT at 0.35, at the op costs before their fp32 refit: 610568
bytes through backward against 230912 simulated, near eager's 660232)."""
import copy
import importlib.util
from pathlib import Path

import torch

import slackswap_cli as slackswap
from slackswap_cli.chains import copy_back_pins
from slackswap_cli.run.verify.memtrace import step_peaks
from slackswap_cli.schema import Action, Decision, ScheduleEvent

ROOT = Path(__file__).resolve().parents[1]


def test_schedule_pins_a_swap_and_wins_over_the_decision():
    decisions = [Decision(1, Action.SWAP), Decision(2, Action.SWAP, 9), Decision(3, Action.KEEP),
                 Decision(4, Action.SWAP, 7)]
    schedule = [ScheduleEvent("prefetch", 1, 12, 0.0, 1.0), ScheduleEvent("offload", 2, 3, 0, 1),
                ScheduleEvent("prefetch", 4, 8, 0.0, 1.0), ScheduleEvent("prefetch", 3, 5, 0, 1)]
    assert copy_back_pins(decisions, schedule) == {1: 12, 2: 9, 4: 8}
    assert copy_back_pins(decisions) == {2: 9, 4: 7}


def _tiny_gpt():
    spec = importlib.util.spec_from_file_location("tiny_gpt_pins", ROOT / "examples" /
                                                  "tiny_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.workload(dropout=0.0)


def test_plain_patch_holds_swapped_tensors_no_longer_than_simulated():
    """A plan that swaps and keeps and recomputes nothing (at the fitted op costs the tiny GPT's
    plan does so at 0.6; lower budgets recompute too): the patched backward holds what the
    simulator predicts (+ a few bytes), and trains bitwise."""
    model, inputs = _tiny_gpt()
    eager = copy.deepcopy(model)
    plan = slackswap.plan_model(model, inputs, budget=0.6, device="fake:cpu")
    acts = plan.actions()
    assert acts["swap"] >= 10 and acts["recompute"] == 0, acts
    slackswap.patch(model, plan)
    for _ in range(2):                                  # the recording call, then a steady one
        peak = step_peaks(model, inputs)[1]
        assert peak <= plan.predicted.peak_bytes + 1024, (peak, plan.predicted.peak_bytes)
    eager_loss, loss = eager(*inputs), model(*inputs)
    eager_loss.backward()
    loss.backward()
    assert torch.equal(eager_loss, loss)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(),
                                                           model.parameters()))
