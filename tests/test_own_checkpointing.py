"""A model's own gradient checkpointing (timm's `set_grad_checkpointing`, Hugging Face's
`gradient_checkpointing_enable`) is seen: said once by plan_model and once by the patch."""
import pytest
import torch
import torch.utils.checkpoint as ckpt

import slackswap_cli as slackswap
from slackswap_cli.run.notes import checkpointing_on


def test_timms_set_grad_checkpointing_is_seen():
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet10t", pretrained=False, num_classes=4)
    assert checkpointing_on(model) is None
    model.set_grad_checkpointing(True)
    said = checkpointing_on(model)
    assert said.startswith("timm gradient checkpointing is on")
    assert "model.set_grad_checkpointing(False)" in said


class _Stages(torch.nn.Module):
    """timm's way: a `grad_checkpointing` flag, its blocks run through `checkpoint`."""

    def __init__(self):
        super().__init__()
        self.grad_checkpointing = True
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16),
                                                              torch.nn.GELU()) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = ckpt.checkpoint(b, x, use_reentrant=False) if self.grad_checkpointing else b(x)
        return x


def test_plan_model_and_patch_say_so_once_each(capfd):
    torch.manual_seed(0)
    model, x = _Stages(), torch.randn(8, 16)
    plan = slackswap.plan_model(model, (x,), budget=0.6, device="fake:cpu",
                                loss_fn=lambda out, inputs: out.pow(2).mean())
    err = capfd.readouterr().err
    assert err.count("timm gradient checkpointing is on") == 1
    assert "the plan is made for the model without it" in err
    slackswap.patch(model, plan)
    for _ in range(2):
        model(x).pow(2).mean().backward()
    assert capfd.readouterr().err.count("timm gradient checkpointing is on") == 1
