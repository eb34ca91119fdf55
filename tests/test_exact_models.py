"""Exact gradients on model kinds the other apply tests do not cover.

Each tiny model goes profile -> plan -> apply -> verify, and must match eager PyTorch within
`verify`'s tolerances (or be refused cleanly):

- user `torch.utils.checkpoint` regions with dropout inside (re-run in the traced backward as
  the checkpoint re-runs them, their masks read from forward, never drawn again: the patched
  step draws eager's masks), reentrant and not; a hand-written RNG replay is refused;
- `nn.LSTM` (CPU oneDNN kernel): a fake trace, which cannot see its workspace, is refused;
  `nn.GRU` fake and real traces agree; the cpu profile's patched step runs both (the LSTM's
  workspace is defined in grad mode);
- a `loss_fn` that reads the workload's `inputs` (tuple, list, dict, one tensor);
- a tied-embedding model: swap-all meets the floor, `repair_to_fit` turns the default
  planner's miss just above the floor into a plan that runs exactly, and `plan` below the floor
  writes the closest plan with `feasible: false` (exit 4).
"""

import pytest
from typer.testing import CliRunner

from slackswap_cli import schema
from slackswap_cli.budget import first_feasible_budget
from slackswap_cli.cli import app
from slackswap_cli.errors import TraceError
from slackswap_cli.hardware import PRESETS
from slackswap_cli.planners import make_plan
from slackswap_cli.run.emit import apply_plan
from slackswap_cli.run.verify.verify import verify
from slackswap_cli.simulate import budget_floor_bytes, min_peak_bytes, simulate
from slackswap_cli.trace import profile_workload
from slackswap_testkit.repair import repair_to_fit

HW = PRESETS["a100-pcie4"]

CKPT = '''
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
class Block(nn.Module):
    def __init__(s, d):
        super().__init__()
        s.ln, s.fc, s.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(0.5)
    def forward(s, x):
        return x + s.drop(F.gelu(s.fc(s.ln(x))))
class Net(nn.Module):
    def __init__(s, d=16, n=2, reentrant=False):
        super().__init__()
        s.blocks, s.head = nn.ModuleList(Block(d) for _ in range(n)), nn.Linear(d, 4)
        s.inp, s.reentrant = nn.Linear(d, d), reentrant
    def forward(s, x):
        x = s.inp(x)     # reentrant checkpoint trains a region only if its input needs grad
        for b in s.blocks:
            x = checkpoint(b, x, use_reentrant=s.reentrant)
        return s.head(x).pow(2).mean()
def workload(reentrant=False):
    torch.manual_seed(0)
    return Net(reentrant=reentrant), (torch.randn(4, 8, 16),)
'''
# a hand-written recompute: the generator state is restored to draw the same mask twice
RNG_REPLAY = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.fc = nn.Linear(8, 8)
    def forward(s, x):
        state = torch.get_rng_state()
        a = F.dropout(s.fc(x), 0.5)
        torch.set_rng_state(state)
        b = F.dropout(s.fc(x), 0.5)
        return (a * b).mean()
def workload():
    torch.manual_seed(0)
    return Net(), (torch.randn(4, 8),)
'''
RNN = '''
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(s, kind):
        super().__init__()
        s.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(8, 16, num_layers=2, batch_first=True)
        s.head = nn.Linear(16, 4)
    def forward(s, x):
        return s.head(s.rnn(x)[0]).pow(2).mean()
def workload(kind="lstm"):
    torch.manual_seed(0)
    return Net(kind), (torch.randn(2, 5, 8),)
'''
LOSS_FN = '''
import torch, torch.nn as nn, torch.nn.functional as F
def workload(form="tuple"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    if form == "tensor":     # one tensor: the labels are read back from the input itself
        return model, x, lambda out, inputs: F.cross_entropy(out, inputs[:, 0].long().abs() % 4)
    if form == "dict":
        model = Wrapped(model)
        return model, {"x": x, "labels": y}, lambda out, inputs: F.cross_entropy(out, inputs["labels"])
    inputs = (x, y) if form == "tuple" else [x, y]
    return TwoArgs(model), inputs, lambda out, inputs: F.cross_entropy(out, inputs[1])
class TwoArgs(nn.Module):
    def __init__(s, m):
        super().__init__()
        s.m = m
    def forward(s, x, y):
        return s.m(x)
class Wrapped(nn.Module):
    def __init__(s, m):
        super().__init__()
        s.m = m
    def forward(s, x, labels):
        return s.m(x)
'''
TIED = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Net(nn.Module):
    def __init__(s, v=64, d=16):
        super().__init__()
        s.emb, s.fc, s.ln = nn.Embedding(v, d), nn.Linear(d, d), nn.LayerNorm(d)
        s.drop = nn.Dropout(0.1)
    def forward(s, ids):
        h = s.ln(s.drop(F.gelu(s.fc(s.emb(ids)))))
        logits = h @ s.emb.weight.t()          # the output layer is the embedding, tied
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), ids.view(-1))
def workload():
    torch.manual_seed(0)
    return Net(), (torch.randint(0, 64, (2, 8)),)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("exact")
    out = {}
    for name, src in (("ckpt", CKPT), ("rng_replay", RNG_REPLAY), ("rnn", RNN),
                      ("loss_fn", LOSS_FN), ("tied", TIED)):
        out[name] = d / f"{name}.py"
        out[name].write_text(src)
    return out


def check_exact(tmp_path, prof, plan, name="patched.py", memory=True):
    """Apply `plan` and verify it against eager: losses, gradients, buffers (and memory)."""
    assert plan.feasible, plan.notes
    path = tmp_path / name
    path.write_text(apply_plan(plan, prof))
    r = verify(str(path), steps=2, check_trace=False)
    assert r.max_loss_rel_diff <= r.loss_tolerance, r.reasons
    assert r.max_grad_rel_diff <= r.grad_tolerance, (r.worst_grad_param, r.reasons)
    assert r.max_buffer_rel_diff <= r.grad_tolerance, r.reasons
    # and the model patched in place (what training runs) against eager
    assert r.inplace["max_loss_rel_diff"] <= r.loss_tolerance, r.inplace
    assert r.inplace["max_grad_rel_diff"] <= r.grad_tolerance, r.inplace
    if memory:
        assert r.passed, r.reasons
    return r


def plans_at(prof, fractions=(1.0, 0.8)):
    """The default planner at each fraction the floor allows, plus swap-all at the floor."""
    peak, floor = prof.summary["peak_activation_bytes"], budget_floor_bytes(prof)
    out = [make_plan("slackswap", prof, HW, int(f * peak), f) for f in fractions
           if int(f * peak) >= floor]
    out.append(make_plan("swap-all", prof, HW, floor, floor / peak))
    return out


# -- 1. user checkpoint regions with dropout --------------------------------------------------
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_dropout_gives_eager_gradients(files, tmp_path, reentrant):
    # (on this CPU's kernels: the plan counts what the checkpointed step holds, no more, so
    # a CUDA-sized mask would not be this run's)
    prof = profile_workload(str(files["ckpt"]), args={"reentrant": reentrant},
                            device="fake:cpu", hardware=HW)
    assert prof.summary["checkpoints_inlined"] == 2
    assert prof.summary["checkpoint_held"]      # the regions' inputs, kept by every plan
    # no random op runs in backward: the region's masks are forward values, never re-drawn
    random_bwd = [o.name for o in prof.ops if o.phase == "backward" and "dropout" in o.target
                  and "backward" not in o.target]
    assert random_bwd == []
    for i, plan in enumerate(plans_at(prof)):
        check_exact(tmp_path, prof, plan, name=f"p{i}.py")


@pytest.mark.slow
def test_checkpointed_model_profiled_on_cpu_applies(files, tmp_path):
    prof = profile_workload(str(files["ckpt"]), device="cpu")
    for i, plan in enumerate(plans_at(prof)):
        check_exact(tmp_path, prof, plan, name=f"c{i}.py")


def test_a_hand_written_rng_replay_is_refused_at_profile(files):
    with pytest.raises(TraceError, match="restores the random-number generator state") as exc:
        profile_workload(str(files["rng_replay"]), device="fake", hardware=HW)
    assert "checkpoint" in exc.value.hint
    r = CliRunner().invoke(app, ["profile", str(files["rng_replay"]), "--device", "fake",
                                 "-o", str(files["rng_replay"].with_suffix(".json"))])
    assert r.exit_code == 3
    assert "Error:" in r.stderr and "Hint:" in r.stderr and "Traceback" not in r.stderr
    assert not files["rng_replay"].with_suffix(".json").exists()


# -- 2./3. RNNs --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_fake_profile_is_refused_and_cpu_applies_exactly(files, tmp_path, kind):
    # the CPU LSTM kernel (oneDNN) keeps a workspace a fake trace cannot see (empty under
    # FakeTensorMode): refused, with the way that works; the CPU GRU runs
    # as plain ops, which a fake trace sees as they are
    cpu = profile_workload(str(files["rnn"]), args={"kind": kind}, device="cpu")
    for device in ("fake", "fake:cpu"):
        if kind == "gru":
            fake = profile_workload(str(files["rnn"]), args={"kind": kind}, device=device,
                                    hardware=HW)
            assert fake.fingerprint == cpu.fingerprint
            continue
        with pytest.raises(TraceError, match="workspace a fake trace cannot see") as exc:
            profile_workload(str(files["rnn"]), args={"kind": kind}, device=device, hardware=HW)
        assert "--device " + ("cuda" if device == "fake" else "cpu") in exc.value.hint
    # the cpu profile knows the kernels' real workspace bytes, so its plans hold their budget
    for i, plan in enumerate(plans_at(cpu, (1.0, 0.7))):
        check_exact(tmp_path, cpu, plan, name=f"{kind}{i}.py")
    # every action on every saved tensor runs, the workspace included
    peak = cpu.summary["peak_activation_bytes"]
    for planner in ("recompute-only",):
        check_exact(tmp_path, cpu, make_plan(planner, cpu, HW, peak, 1.0),
                    name=f"{kind}_{planner}.py".replace("-", "_"))


# -- 4. loss_fn(output, inputs) ----------------------------------------------------------------
@pytest.mark.parametrize("form", ["tuple", "list", "dict", "tensor"])
def test_loss_fn_gets_the_workloads_inputs(files, tmp_path, form):
    prof = profile_workload(str(files["loss_fn"]), args={"form": form}, device="fake",
                            hardware=HW)
    for i, plan in enumerate(plans_at(prof)):
        check_exact(tmp_path, prof, plan, name=f"{form}{i}.py")


# -- 5./6. the floor on a tied-embedding model ---------------------------------------------------
@pytest.fixture(scope="module")
def tied(files):
    return profile_workload(str(files["tied"]), device="fake", hardware=HW)


def test_tied_embedding_floor_is_met_and_repairs_run_exactly(tied, tmp_path):
    peak, floor = tied.summary["peak_activation_bytes"], budget_floor_bytes(tied)
    assert simulate(tied, {t.id: "swap" for t in tied.saved_activations}, HW, floor).feasible
    check_exact(tmp_path, tied, make_plan("swap-all", tied, HW, floor, floor / peak), "sa.py")
    ss = make_plan("slackswap", tied, HW, floor, floor / peak)
    fixed = repair_to_fit(tied, ss.decisions, floor)
    assert min_peak_bytes(tied, fixed) <= floor
    res = simulate(tied, fixed, HW, floor)
    assert res.feasible
    plan = schema.Plan(profile_fingerprint=tied.fingerprint, planner="slackswap",
                       hardware=HW.to_dict(), budget_bytes=floor, budget_fraction=None,
                       feasible=True, decisions=tuple(fixed), schedule=tuple(res.schedule),
                       predicted=res.predicted)
    check_exact(tmp_path, tied, plan, "repaired.py")
    reach = first_feasible_budget(tied, HW, "slackswap")
    assert reach is not None and floor <= reach <= peak
    assert make_plan("slackswap", tied, HW, reach).feasible


def test_plan_reports_the_floor_and_what_the_planner_reaches(tied, tmp_path):
    src = tmp_path / "tied.profile.json"
    schema.save(tied, src)
    runner = CliRunner()
    floor = budget_floor_bytes(tied)
    below = tmp_path / "below.plan.json"
    r = runner.invoke(app, ["plan", str(src), "-b", str(floor - 1), "-o", str(below)])
    assert r.exit_code == 4 and "below the floor" in r.stderr and "Hint:" in r.stderr
    assert schema.load_plan(below).feasible is False
    reach = first_feasible_budget(tied, HW, "slackswap")
    if reach > floor:      # between the floor and what the default planner reaches
        mid = tmp_path / "mid.plan.json"
        r = runner.invoke(app, ["plan", str(src), "-b", str(floor), "-o", str(mid)])
        assert r.exit_code == 4
        assert "first fits at" in r.stderr and "swap-all" in r.stderr
        assert schema.load_plan(mid).feasible is False
    r = runner.invoke(app, ["plan", str(src), "-b", str(floor), "-p", "swap-all",
                            "-o", str(tmp_path / "sa.plan.json")])
    assert r.exit_code == 0, r.stderr


def test_a_fingerprint_mismatch_names_the_first_differing_op(files):
    from slackswap_cli.errors import FingerprintMismatch
    prof = profile_workload(str(files["ckpt"]), device="fake", hardware=HW)
    plan = make_plan("swap-all", prof, HW, prof.summary["peak_activation_bytes"])
    # the same model without dropout: its ops differ from the profile's at the first dropout
    edited = files["ckpt"].with_name("ckpt_edited.py")
    edited.write_text(CKPT.replace("nn.Dropout(0.5)", "nn.Dropout(0.0)"))
    with pytest.raises(FingerprintMismatch, match=r"first difference at op \d+ \(") as exc:
        apply_plan(plan, prof, model_path=str(edited))
    assert "slackswap profile" in exc.value.hint


def test_an_undefined_output_is_no_activation_whatever_the_plan_says():
    import torch

    from slackswap_cli.run.swap import StepStore
    store = StepStore()
    store.keep("kept", None)
    store.offload("swapped", None)
    store.offload("real", torch.ones(4))
    assert store.held_device_bytes() == 0 and store.offloaded_bytes == 16
    store.prefetch("swapped")
    assert store.take("kept") is None and store.wait("swapped") is None
    assert torch.equal(store.wait("real"), torch.ones(4))
