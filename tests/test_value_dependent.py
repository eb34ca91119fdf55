"""A model whose sizes depend on its values, planned on a real trace: a call that takes
another path is held by the guard at once, no fake trace is started (it cannot succeed), and
training stays bitwise equal to eager."""
import copy

import pytest
import torch

import slackswap_cli as slackswap
from slackswap_cli.errors import TraceError
from slackswap_cli.run.eager import replan


class Routed(torch.nn.Module):
    """Rows whose input sums above zero go through `b` (nonzero: sizes from values)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64)
        self.body = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64),
                                                              torch.nn.GELU()) for _ in range(4)))
        self.c = torch.nn.Linear(64, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        rows = h[x.sum(1) > 0]
        h = h + self.b(rows).mean(0) if rows.shape[0] > 0 else h * 2
        return self.c(self.body(torch.tanh(self.b(h))))


def _loss(out, inputs):
    return out.pow(2).mean()


def test_a_new_path_is_held_by_the_guard_at_once(monkeypatch, capfd):
    torch.manual_seed(0)
    model, x = Routed(), torch.randn(32, 16)
    with pytest.raises(TraceError, match="data-dependent"):
        slackswap.plan_model(model, (x,), budget=0.5, loss_fn=_loss, device="fake:cpu")
    plan = slackswap.plan_model(model, (x,), budget=0.5, loss_fn=_loss, device="cpu",
                                measure=False)
    twin = copy.deepcopy(model)
    slackswap.patch(model, plan)
    traced = []
    monkeypatch.setattr(replan, "replan_table", lambda *a, **k: traced.append(a))
    capfd.readouterr()
    for inp in (x, x, -x.abs(), -x.abs(), -x.abs(), x):
        grads = []
        for m in (twin, model):
            torch.manual_seed(1)
            m(inp).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    err = capfd.readouterr().err
    assert traced == []
    assert err.count("a fake trace cannot plan it again") == 1, err
    state = model.forward.__slackswap__
    assert state.meta.value_dependent
    with pytest.raises(TraceError, match="cannot plan it again"):   # (refused at once)
        _REPLAN(model, state.original_forward, (x,), {}, state.meta)


_REPLAN = replan.replan_table
