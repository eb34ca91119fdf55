"""What slackswap runs of a model besides the user's step (the profile's trace, a re-plan
inside a patched call) leaves NumPy's and Python's generators as they were, as torch's: a
model that draws from them (wav2vec2's SpecAugment masks come from NumPy) trains patched
bitwise like eager (run/rng.py)."""
import copy
import random

import numpy as np
import pytest
import torch

import slackswap_cli as slackswap

hf_utils = pytest.importorskip("transformers.utils.import_utils")


class HostRandom(torch.nn.Module):
    """Scales by a NumPy and a Python draw; asks, as Hugging Face's masks do, whether its
    input is fake, and takes another path when it is: a patched call re-plans along eager's
    branches (run/eager/branches.py), tracing the forward again."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x):
        scale = float(np.random.rand()) + random.random()
        h = torch.tanh(self.a(x)) * scale
        if hf_utils.is_fake_tensor(x):        # traced: the general branch, ops eager skips
            h = h * 2 + 1
        elif bool((x > -1e9).all()):          # eager: asks a value ("no padding") instead
            h = h + 0
        return torch.tanh(self.b(h)).square().mean()


def _host_states():
    return np.random.get_state()[1].copy(), random.getstate()


def test_plan_model_and_a_replanning_call_leave_host_generators_alone():
    torch.manual_seed(0)
    model, x = HostRandom(), torch.randn(32, 64)
    eager = copy.deepcopy(model)
    np.random.seed(3)
    random.seed(3)
    before = _host_states()
    plan = slackswap.plan_model(model, (x,), budget=0.7, device="fake:cpu")
    after = _host_states()
    assert np.array_equal(before[0], after[0]) and before[1] == after[1]
    slackswap.patch(model, plan)
    for step in range(3):                 # the first call re-plans (another path than traced)
        np.random.seed(10 + step)
        random.seed(10 + step)
        want = eager(x)
        want.backward()
        drew = _host_states()
        np.random.seed(10 + step)
        random.seed(10 + step)
        got = model(x)
        got.backward()
        now = _host_states()
        assert np.array_equal(drew[0], now[0]) and drew[1] == now[1], step
        assert torch.equal(want, got)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(),
                                                               model.parameters()))
