"""`plan_model` with what a fake trace does not own: a loss_fn closing over real tensors, and
a model built on the meta device (the library and `slackswap profile`)."""
import copy
import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_clean_error, two_us_kernels
from typer.testing import CliRunner

import slackswap_cli as slackswap
from slackswap_cli.cli import app
from slackswap_cli.errors import InputError


@pytest.fixture(autouse=True)
def _costs(monkeypatch):
    two_us_kernels(monkeypatch)   # plans that recompute as well as swap (see helpers)


def _classifier(dim: int = 32, classes: int = 10) -> torch.nn.Module:
    blocks = [torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(),
                                  torch.nn.Dropout(0.1)) for _ in range(5)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(dim, classes))


def _adamw_twins(model, eager, x, y, steps: int = 3) -> bool:
    """`steps` AdamW steps of both from the same seeds: are the parameters bitwise equal?"""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    for step in range(steps):
        for m, opt in zip((model, eager), opts):
            torch.manual_seed(step)
            F.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))


def test_a_loss_fn_closing_over_real_labels_plans_with_a_fake_profile():
    torch.manual_seed(0)
    model = _classifier()
    eager = copy.deepcopy(model)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    loss_fn = lambda out, inputs: F.cross_entropy(out, y)
    plan = slackswap.plan_model(model, (x,), budget=0.5, device="fake:cpu", loss_fn=loss_fn)
    assert plan.feasible and plan.profile.env["device"] == "fake"
    assert plan.actions()["keep"] < len(plan.profile.saved_activations)
    # the closure and the model are the user's, untouched: real tensors, same values
    assert loss_fn.__closure__[0].cell_contents is y and type(y) is torch.Tensor
    assert all(type(p.data) is torch.Tensor and torch.equal(p, q)
               for p, q in zip(model.parameters(), eager.parameters()))
    slackswap.patch(model, plan)
    assert _adamw_twins(model, eager, x, y)
    assert model.forward.__slackswap__.last_run.rerun_ops > 0
    # the loss_fn's ops run after the patched forward: not counted as missed
    assert model.forward.__slackswap__.last_report["fraction"] == 1.0


def _meta_hint_device(hint: str) -> str:
    found = re.search(r"device='([a-z:]+)'", hint)
    assert found, hint
    return found.group(1)


def test_a_meta_model_plans_with_a_fake_profile_and_trains_once_materialised():
    with torch.device("meta"):
        model = _classifier()
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    loss_fn = lambda out, inputs: F.cross_entropy(out, y)
    with pytest.raises(InputError) as refused:
        slackswap.plan_model(model, (x,), budget=0.5, device="cpu", loss_fn=loss_fn)
    assert "meta device" in refused.value.message
    device = _meta_hint_device(refused.value.hint)     # the hint, followed as written
    with pytest.warns(UserWarning, match="meta device") as said:
        plan = slackswap.plan_model(model, (x,), budget=0.5, device=device, loss_fn=loss_fn)
    assert plan.feasible and plan.note and plan.note in str(said[0].message)
    assert "'a100-pcie4'" in plan.note and plan.profile.env["target_device"] == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # the default device= is "auto" too
        with pytest.raises(UserWarning, match="meta device"):
            slackswap.plan_model(model, (x,), budget=0.5, loss_fn=loss_fn)
    for fake in ("fake", "fake:cpu"):
        with pytest.warns(UserWarning):
            assert slackswap.plan_model(model, x, budget=0.5, device=fake, loss_fn=loss_fn).feasible
    assert all(p.device.type == "meta" for p in model.parameters())     # left as it was
    with pytest.raises(InputError, match="meta device") as refused:
        slackswap.check(model, plan, x, samples=None)
    assert "model.to_empty(device=" in refused.value.hint
    model.to_empty(device="cpu")                        # the hint, followed
    torch.manual_seed(0)
    eager = _classifier()
    model.load_state_dict(eager.state_dict())
    assert slackswap.check(model, plan, x, samples=None).ops_rerun > 0
    slackswap.patch(model, plan)
    assert _adamw_twins(model, eager, x, y)


META_WORKLOAD = '''
import torch

def workload():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    return model, (torch.randn(8, 16),), (lambda out, inputs: out.square().mean())
'''


def test_slackswap_profile_of_a_meta_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meta_model.py").write_text(META_WORKLOAD)
    runner = CliRunner()
    r = runner.invoke(app, ["profile", "meta_model.py", "--device", "cpu", "-o", "a.json"])
    assert_clean_error(r, 3, "meta device")
    hint = re.search(r"Hint: .*?(--device \S+ --hardware) PRESET", r.stderr.replace("\n", " "))
    assert hint, r.stderr
    follow = hint.group(1).split() + ["a100-pcie4"]
    r = runner.invoke(app, ["profile", "meta_model.py", *follow, "-q", "-o", "b.json"])
    assert r.exit_code == 0, r.stderr
    r = runner.invoke(app, ["profile", "meta_model.py", "-o", "c.json"])    # --device auto
    assert r.exit_code == 0, r.stderr
    assert "meta device" in r.stderr and "a100-pcie4" in r.stderr, r.stderr
    env = json.loads((tmp_path / "c.json").read_text())["env"]
    assert env["device"] == "fake" and env["target_device"] == "cpu"
    assert env["hardware"]["name"] == "a100-pcie4"
