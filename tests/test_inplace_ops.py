"""In-place ops whose backward reads what they overwrite or their own result, under plans.

The ops come from torch's own derivatives (`slackswap_testkit.inplace_ops.overwriting_ops`:
torchgen's derivatives.yaml matched to native_functions.yaml as autograd's codegen does), not
from a hand list. One small model runs every op that can be called on small float tensors
(`OpsModel`: each op on a value of its own `Linear`); it is planned three ways (keep all,
swap all, recompute all it can) and run in place (`patch`), as the written-out step
(`step_module`) and compiled (`compile_planned`, aot_eager): gradients, losses and parameters
bitwise eager's. And the two models of the report: three conv-BatchNorm-SiLU(inplace=True)
blocks, and an MLP-Mixer (a Linear on a transposed input: eager adds its bias in place, but
out of place under a dispatch mode).
"""
import copy

import pytest
import torch
from helpers import two_us_kernels
from workloads import HW

from slackswap_cli.planners import make_plan
from slackswap_cli.run.emit import load_patched
from slackswap_cli.trace import profile_workload
from slackswap_testkit.inplace_ops import callable_ops, overwriting_ops


@pytest.fixture(autouse=True)
def _costs(monkeypatch):
    two_us_kernels(monkeypatch)   # plans that recompute as well as swap (see helpers)


# derivatives the op has no formula for (igamma's input) or a random op (rrelu_with_noise_)
NOT_RUN = {"igamma_.default", "igammac_.default", "rrelu_with_noise_.default"}

WORKLOAD = '''
import torch
from slackswap_testkit.inplace_ops import OpsModel


def workload():
    torch.manual_seed(0)
    return OpsModel({names!r}), (torch.randn(2, 4),)
'''


@pytest.fixture(scope="module")
def ops_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("inplace_ops") / "ops_model.py"
    path.write_text(WORKLOAD.format(names=callable_ops()[0]))
    return path, profile_workload(str(path), device="fake", hardware=HW)


@pytest.fixture(scope="module")
def ops_trace(ops_profile):
    """The workload traced once and checked against its profile (what `apply` does per plan)."""
    from slackswap_cli.trace.retrace import trace_matching
    path, prof = ops_profile
    return trace_matching(prof, str(path))


def test_the_ops_come_from_torchs_derivatives_and_all_but_three_run():
    ops = {name: (reads_self, reads_result) for name, reads_self, reads_result in
           overwriting_ops()}
    for name in ("silu_.default", "hardswish_.default", "mul_.Tensor", "div_.Tensor",
                 "clamp_.default", "mish_.default", "hardsigmoid_.default"):
        assert ops[name][0], name                    # backward reads the overwritten value
    for name in ("exp_.default", "sigmoid_.default", "tanh_.default", "elu_.default",
                 "leaky_relu_.default", "relu_.default"):
        assert ops[name][1], name                    # backward reads the result
    assert "add_.Tensor" not in ops and "copy_.default" not in ops   # reads neither
    run, skipped = callable_ops()
    assert set(skipped) == NOT_RUN
    assert set(run) | NOT_RUN == set(ops) and len(run) >= 70


def test_what_an_op_makes_before_an_in_place_write_is_never_recomputed(ops_profile):
    from slackswap_cli.trace.aten import is_inplace_target
    _, prof = ops_profile

    def root(t):
        a = prof.tensors[t].alias_of
        return t if a is None else a
    fwd = [o for o in prof.ops if o.phase == "forward"]
    written = {}                                # root -> the last forward op writing it
    for i, o in enumerate(fwd):
        if is_inplace_target(o.target):
            written[root(o.inputs[0])] = i
    stale = [o for i, o in enumerate(fwd) if o.target == "aten.clone.default"
             and written.get(root(o.inputs[0]), -1) > i]
    overwriting = {n for n, reads_self, _ in overwriting_ops() if reads_self}
    assert len(stale) >= len(overwriting & set(callable_ops()[0])) // 2
    for op in stale:
        assert not any(prof.tensors[t].recomputable for t in op.outputs), op.name


def _train(model, x, call=None, steps=2):
    """`steps` AdamW steps of `call(x)` (the model's forward unless given) training `model`'s
    parameters: (losses, gradients per step, parameters after)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        loss = (model if call is None else call)(x)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _differs(got, want) -> list[str]:
    (gl, gg, gp), (wl, wg, wp) = got, want
    bad = [f"loss {i}" for i, (a, b) in enumerate(zip(gl, wl)) if not torch.equal(a, b)]
    for i, (a, b) in enumerate(zip(gg, wg)):
        bad += [f"step {i} grad {n}" for n in b if n not in a or not torch.equal(a[n], b[n])]
    return bad + [f"param {n}" for n in wp if not torch.equal(gp[n], wp[n])]


@pytest.mark.parametrize("how", ["keep", "swap-all", "recompute-only"])
def test_every_op_trains_bitwise_under_keep_swap_and_recompute(how, ops_profile, ops_trace,
                                                               tmp_path):
    from slackswap_cli.run.emit import emit_module
    path, prof = ops_profile
    if how == "keep":
        plan = make_plan("slackswap", prof, HW, prof.summary["peak_activation_bytes"], 1.0)
    else:       # recompute-only at a budget it cannot reach: everything it can recompute
        plan = make_plan(how, prof, HW, 1, 0.0)
    counts = dict(plan.action_counts(prof))
    want_action = {"keep": "keep", "swap-all": "swap", "recompute-only": "recompute"}[how]
    assert counts.get(want_action, 0) >= 100, counts
    out = tmp_path / f"patched_{how}.py"
    joint, work, fingerprint = ops_trace
    out.write_text(emit_module(joint, work, prof, plan, trace_fingerprint=fingerprint,
                               workload_ref={"path": str(path), "entry": "workload", "args": {},
                                             "name": "ops_model"}))
    mod = load_patched(str(out))
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    base, (x,) = ns["workload"]()
    want = _train(copy.deepcopy(base), x)
    assert all(torch.isfinite(v).all() for v in want[0])
    patched = mod.patch(copy.deepcopy(base))
    assert _differs(_train(patched, x), want) == []
    step_model = copy.deepcopy(base)
    step = mod.step_module(step_model, check_trace=False)
    assert _differs(_train(step_model, x, call=step), want) == []
    if how == "recompute-only":   # (swapping, compiled on CPU, copies to the same device)
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        compiled = mod.compile_planned(model, backend="aot_eager", quiet=True)
        assert _differs(_train(model, x, call=compiled), want) == []


def _silu_blocks(batch_norm: bool):
    def block(i, o):
        norm = [torch.nn.BatchNorm2d(o)] if batch_norm else []
        return torch.nn.Sequential(torch.nn.Conv2d(i, o, 3, padding=1), *norm,
                                   torch.nn.SiLU(inplace=True))
    return torch.nn.Sequential(block(3, 8), block(8, 8), block(8, 8), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 8 * 8, 4))


class _Mlp(torch.nn.Module):
    """timm's `timm.layers.Mlp`: fc1, GELU, dropout, (no norm), fc2, dropout."""

    def __init__(self, dim, hidden, drop):
        super().__init__()
        self.fc1, self.act = torch.nn.Linear(dim, hidden), torch.nn.GELU()
        self.drop1, self.norm = torch.nn.Dropout(drop), torch.nn.Identity()
        self.fc2, self.drop2 = torch.nn.Linear(hidden, dim), torch.nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class _MixerBlock(torch.nn.Module):
    """timm's `MixerBlock`: token mixing on the transposed tokens, then channel mixing."""

    def __init__(self, dim, seq_len, drop):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim, eps=1e-6)
        self.mlp_tokens = _Mlp(seq_len, dim // 2, drop)
        self.drop_path = torch.nn.Identity()
        self.norm2 = torch.nn.LayerNorm(dim, eps=1e-6)
        self.mlp_channels = _Mlp(dim, 4 * dim, drop)

    def forward(self, x):
        x = x + self.drop_path(self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))
        return x + self.drop_path(self.mlp_channels(self.norm2(x)))


class _Mixer(torch.nn.Module):
    """timm's `MlpMixer` in small: patch embedding (conv, flatten, transpose), blocks,
    LayerNorm, mean over tokens, head."""

    def __init__(self, dim=24, img=20, patch=4, depth=2, drop=0.0):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, dim, patch, patch)
        self.blocks = torch.nn.Sequential(*[_MixerBlock(dim, (img // patch) ** 2, drop)
                                            for _ in range(depth)])
        self.norm = torch.nn.LayerNorm(dim, eps=1e-6)
        self.head_drop, self.head = torch.nn.Dropout(drop), torch.nn.Linear(dim, 10)

    def forward(self, x):
        x = self.blocks(self.proj(x).flatten(2).transpose(1, 2))
        return self.head(self.head_drop(self.norm(x).mean(dim=1)))


def _library_api_trains_bitwise(model, x, budget, planner="slackswap", steps=3):
    """plan_model (fake profile) + patch, `steps` AdamW steps against an eager twin from the
    same RNG state: (plan, the first difference or None)."""
    import slackswap_cli as slackswap
    eager = copy.deepcopy(model)
    plan = slackswap.plan_model(model, (x,), budget=budget, device="fake:cpu",
                                planner=planner, loss_fn=lambda out, inp: out.square().mean())
    slackswap.patch(model, plan)
    got = []
    for m in (eager, model):
        torch.manual_seed(1)
        got.append(_train(m, x, call=lambda h, m=m: m(h).square().mean(), steps=steps))
    bad = _differs(got[1], got[0])
    return plan, (bad[0] if bad else None)


@pytest.mark.parametrize("batch_norm,budget", [(True, 0.5), (False, 0.6)])
def test_three_silu_inplace_blocks_train_bitwise(batch_norm, budget):
    torch.manual_seed(0)
    plan, bad = _library_api_trains_bitwise(_silu_blocks(batch_norm), torch.randn(2, 3, 8, 8),
                                            budget)
    assert plan.actions().get("recompute", 0) + plan.actions().get("swap", 0) > 0
    assert bad is None, bad


@pytest.mark.parametrize("planner,drop", [("slackswap", 0.0), ("recompute-only", 0.0),
                                          ("slackswap", 0.1)])
def test_mlp_mixer_trains_bitwise_past_its_first_step(planner, drop):
    # the recorded first call adds fc1's bias out of place, later calls in place (`add_`)
    torch.manual_seed(0)
    plan, bad = _library_api_trains_bitwise(_Mixer(drop=drop), torch.randn(2, 3, 20, 20),
                                            0.5 if drop == 0 else 0.6, planner)
    assert plan.actions().get("recompute", 0) > 0
    assert bad is None, bad
