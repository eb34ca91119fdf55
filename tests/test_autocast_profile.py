"""Profiling under torch.autocast (`--autocast`, `Workload(autocast=...)`), and fake traces whose
random ops follow the device the plan will run on (`--device fake` = CUDA, `fake:cpu`)."""
import textwrap
from pathlib import Path

import orjson
import pytest
import torch
from typer.testing import CliRunner

from slackswap_cli import schema
from slackswap_cli.cli import app
from slackswap_cli.errors import InputError, TraceError
from slackswap_cli.hardware import load_hardware
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.joint import capture_joint
from slackswap_cli.trace.workload import load_workload

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HW = load_hardware("a100-pcie4")
runner = CliRunner()

MLP = """
    import torch
    from slackswap_cli import Workload

    class MLP(torch.nn.Module):
        def __init__(self, dropout):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                           torch.nn.Dropout(dropout), torch.nn.LayerNorm(32),
                                           torch.nn.Linear(32, 4))

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.net(x), y)

    def workload(autocast=None, dropout=0.0, dtype="float32"):
        torch.manual_seed(0)
        model = MLP(dropout).to(getattr(torch, dtype))
        x = torch.randn(8, 16, dtype=getattr(torch, dtype))
        y = torch.randint(0, 4, (8,))
        return Workload(model, (x, y), autocast=autocast)
"""


def write(tmp_path, body=MLP, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def test_autocast_option_traces_matmuls_in_bf16_and_is_recorded(tmp_path):
    path = write(tmp_path)
    out = tmp_path / "p.json"
    r = run("profile", path, "--device", "fake", "--autocast", "bf16", "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    prof = schema.load_profile(out)
    assert prof.workload["autocast"] == "bf16"
    assert prof.env["autocast_device_type"] == "cpu"
    tensors = {t.id: t for t in prof.tensors}
    mm_out = [tensors[o].dtype for op in prof.ops if op.phase == "forward"
              and op.target in ("aten.addmm.default", "aten.mm.default") for o in op.outputs]
    assert mm_out and set(mm_out) == {"bfloat16"}
    assert {t.dtype for t in prof.tensors if t.kind == "parameter"} == {"float32"}
    plain = profile_workload(path, device="fake", hardware=HW)
    assert "autocast" not in plain.workload and plain.fingerprint != prof.fingerprint


def test_workload_field_equals_the_option(tmp_path):
    path = write(tmp_path)
    by_option = profile_workload(path, device="fake", hardware=HW, autocast="fp16")
    by_field = profile_workload(path, args={"autocast": "float16"}, device="fake", hardware=HW)
    assert by_option.fingerprint == by_field.fingerprint
    assert by_field.workload["autocast"] == "fp16"
    assert load_workload(path, args={"autocast": torch.bfloat16}).autocast == "bf16"


def test_conflicting_or_unknown_autocast_is_refused(tmp_path):
    path = write(tmp_path)
    with pytest.raises(InputError, match="--autocast bf16, but the workload asks for autocast fp16"):
        profile_workload(path, args={"autocast": "fp16"}, device="fake", hardware=HW,
                         autocast="bf16")
    with pytest.raises(TraceError, match="unknown autocast dtype 'fp8'"):
        load_workload(path, args={"autocast": "fp8"})
    r = run("profile", path, "--device", "fake", "--autocast", "int8", "-o", tmp_path / "x.json")
    assert r.exit_code == 2 and "unknown autocast dtype" in r.stderr
    assert not (tmp_path / "x.json").exists()


def test_traced_autocast_step_equals_eager_under_autocast(tmp_path):
    """The captured graph, run on real tensors, gives eager autocast's loss and gradients."""
    path = write(tmp_path)
    work = load_workload(path)
    joint = capture_joint(work.model, work.inputs, work.loss_fn, autocast="bf16")
    params = list(work.model.parameters())
    loss, grads = joint.gm(params, list(work.model.buffers()), list(work.inputs),
                           torch.ones(()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = work.model(*work.inputs)
    ref_grads = torch.autograd.grad(ref, params)
    assert loss.dtype == ref.dtype and torch.equal(loss, ref)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype == torch.float32 and torch.equal(g, r)
    # and it differs from the step without autocast (the casts are in the graph)
    plain_loss, _ = capture_joint(work.model, work.inputs).gm(
        params, [], list(work.inputs), torch.ones(()))
    assert not torch.equal(plain_loss, loss)


def test_fake_trace_takes_the_dropout_of_its_target_device(tmp_path):
    path = write(tmp_path)
    args = {"dropout": 0.1, "dtype": "bfloat16"}
    cuda = profile_workload(path, args=args, device="fake", hardware=HW)
    cpu = profile_workload(path, args=args, device="fake:cpu", hardware=HW)
    real = profile_workload(path, args=args, device="cpu")
    assert cuda.env["target_device"] == "cuda" and cpu.env["target_device"] == "cpu"
    assert real.env["target_device"] == "cpu"
    assert profile_workload(path, args=args, device="fake:cuda",
                            hardware=HW).fingerprint == cuda.fingerprint

    def targets(p):
        return {op.target for op in p.ops}
    assert "aten.native_dropout.default" in targets(cuda)
    assert "aten.native_dropout.default" not in targets(cpu) and "aten.bernoulli_.float" in targets(cpu)
    assert cpu.fingerprint == real.fingerprint != cuda.fingerprint


def test_unknown_device_is_refused_with_the_choices(tmp_path):
    r = run("profile", write(tmp_path), "--device", "fake:tpu", "-o", tmp_path / "x.json")
    assert r.exit_code == 2 and "fake:cpu" in r.stderr
    with pytest.raises(InputError, match="target device"):
        work = load_workload(write(tmp_path))
        capture_joint(work.model, work.inputs, work.loss_fn, target_device="tpu")


def test_fake_cpu_bf16_profile_with_dropout_verifies_on_cpu(tmp_path):
    """A fake bf16 profile of a model with dropout, planned, applied and
    verified on this CPU. `fake:cpu` traces CPU dropout, so the plan's gradients equal eager's."""
    path = write(tmp_path)
    args = ["--arg", "dropout=0.1", "--arg", "dtype=bfloat16"]
    prof, plan, patched = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "patched_m.py"
    assert run("profile", path, "--device", "fake:cpu", *args, "-o", prof).exit_code == 0
    r = run("plan", prof, "--budget", "0.75", "-o", plan)
    assert r.exit_code == 0, r.stderr
    r = run("apply", plan, "-o", patched)
    assert r.exit_code == 0, r.stderr
    r = run("verify", patched, "--steps", "2", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    report = orjson.loads(r.stdout)
    assert report["passed"]


def test_verify_runs_both_sides_under_the_profiles_autocast(tmp_path):
    """fp32 weights + `--autocast bf16`: verify runs eager under the same autocast (its loss is
    not the fp32 loss) and passes, the in-place patch included, with exact results."""
    path = write(tmp_path)
    args = ["--arg", "dropout=0.1"]
    prof, plan, patched = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "patched_a.py"
    assert run("profile", path, "--device", "fake:cpu", "--autocast", "bf16", *args,
               "-o", prof).exit_code == 0
    assert run("plan", prof, "--budget", "0.7", "-o", plan).exit_code == 0
    assert run("apply", plan, "-o", patched).exit_code == 0   # apply writes autocast plans
    r = run("verify", patched, "--steps", "2", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    report = orjson.loads(r.stdout)
    assert report["passed"] and report["recomputed"] + report["swapped"] > 0
    assert report["max_loss_rel_diff"] == 0 and report["max_grad_rel_diff"] == 0
    assert report["inplace"]["max_loss_rel_diff"] == 0
    assert report["inplace"]["max_grad_rel_diff"] == 0
    # the eager loss verify compared with is the autocast one, not the fp32 one
    work = load_workload(path, args={"dropout": 0.1})
    torch.manual_seed(1)   # verify's first step: seed + 1
    fp32 = float(work.model(*work.inputs).detach())
    assert report["losses_original"][0] != fp32
