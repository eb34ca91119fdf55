"""verify: passes a faithful patched module, fails a corrupted one with reasons; gpu_check dry run."""
import importlib.util
import json
from pathlib import Path

import pytest

from slackswap_cli.apply import apply_plan
from slackswap_cli.hardware import PRESETS
from slackswap_cli.planners import make_plan
from slackswap_cli.trace import profile_workload
from slackswap_cli.verify import verify

HW = PRESETS["a100-pcie4"]
ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ROOT / "examples" / "tiny_gpt.py"


@pytest.fixture(scope="module")
def half_plan_file(tmp_path_factory):
    prof = profile_workload(str(TINY_GPT), device="fake", hardware=HW)
    peak = prof.summary["peak_activation_bytes"]
    plan = make_plan("slackswap", prof, HW, peak // 2, 0.5)
    assert plan.feasible
    path = tmp_path_factory.mktemp("verify") / "patched.py"
    path.write_text(apply_plan(plan, prof))
    return path, plan


def corrupted(src_path: Path, tmp_path: Path, extra: str) -> str:
    out = tmp_path / "corrupted.py"
    out.write_text(src_path.read_text() + "\n" + extra)
    return str(out)


def test_faithful_module_passes_over_several_steps(half_plan_file):
    path, plan = half_plan_file
    r = verify(str(path), steps=3)          # check_trace on: re-traces the model once
    assert r.passed and r.reasons == []
    assert r.steps == 3 and len(r.losses_original) == len(r.losses_patched) == 3
    assert r.losses_original == r.losses_patched
    assert r.losses_original[2] != r.losses_original[0]   # SGD steps happened in between
    assert r.max_grad_rel_diff <= 1e-4 and r.max_buffer_rel_diff == 0.0
    assert r.memory_metric.startswith("bytes held for backward")
    assert r.patched_peak_bytes <= plan.budget_bytes < r.original_peak_bytes
    assert r.budget_bytes == plan.budget_bytes
    assert r.predicted_peak_bytes == plan.predicted.peak_bytes
    assert r.predicted_step_us == pytest.approx(plan.predicted.step_us)
    assert r.swapped + r.recomputed > 0 and r.swapped_bytes_per_step > 0
    assert r.original_step_ms > 0 and r.patched_step_ms > 0


def test_gradient_mismatch_fails(half_plan_file, tmp_path):
    path, _ = half_plan_file
    bad = corrupted(path, tmp_path, (
        "_bw = backward_step\n"
        "def backward_step(*a):\n"
        "    return [None if g is None else g * 1.001 for g in _bw(*a)]\n"))
    r = verify(bad, check_trace=False)
    assert not r.passed
    assert any(x.startswith("gradient of") for x in r.reasons)
    assert r.max_grad_rel_diff == pytest.approx(1e-3, rel=1e-2)


def test_loss_mismatch_fails(half_plan_file, tmp_path):
    path, _ = half_plan_file
    bad = corrupted(path, tmp_path, (
        "_fw = forward_step\n"
        "def forward_step(*a):\n"
        "    return _fw(*a) * 1.0001\n"))
    r = verify(bad, check_trace=False)
    assert not r.passed and any(x.startswith("loss differs") for x in r.reasons)


def test_memory_over_budget_fails_and_names_the_quantity(half_plan_file, tmp_path):
    path, _ = half_plan_file
    bad = corrupted(path, tmp_path, "META['budget_bytes'] = 1000\n")
    r = verify(bad, check_trace=False)
    assert not r.passed
    assert r.reasons == [f"measured bytes held for backward at the end of forward (cpu): "
                         f"{r.patched_peak_bytes} bytes, more than 5% above the plan's budget "
                         f"of 1000 bytes"]


def test_gpu_check_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu_check.json"
    rc = gpu_check.main(["--dry-run", "--budgets", "0.5", "--steps", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0
    rows = {(r["method"], r.get("budget_fraction")): r for r in data["rows"]}
    half = rows[("slackswap", 0.5)]
    assert half["passed"] and half["measured_peak_bytes"] <= half["budget_bytes"] * 1.05
    assert half["measured_peak_bytes"] < rows[("slackswap", 1.0)]["measured_peak_bytes"]
    for key in ("predicted_peak_bytes", "predicted_step_us", "measured_step_ms",
                "measured_retention"):
        assert half[key] > 0
    assert "error" not in rows[("torch.utils.checkpoint (every block)", None)]
    compiled = [r for (m, _), r in rows.items() if m.startswith("torch.compile")]
    assert len(compiled) == 1 and ("measured_peak_bytes" in compiled[0] or "error" in compiled[0])
    assert data["hardware"]["h2d_bytes_per_s"] > 0


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_profile_apply_verify(tmp_path):
    prof = profile_workload(str(TINY_GPT), device="cuda")
    peak = prof.summary["peak_activation_bytes"]
    plan = make_plan("slackswap", prof, HW, peak // 2, 0.5)
    path = tmp_path / "patched_cuda.py"
    path.write_text(apply_plan(plan, prof))
    r = verify(str(path), steps=2)
    assert r.device == "cuda" and r.memory_metric.startswith("cuda")
    assert r.max_loss_rel_diff <= 1e-5 and r.max_grad_rel_diff <= 1e-4, r.reasons
