"""The whole pipeline as a user runs it, on the real tiny GPT example (one small layer, CPU):
profile -> plan at half the activation peak -> show / simulate --trace / compare -> apply ->
verify, plus a plan that cannot fit its budget (exit 4, written with feasible: false)."""
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from slackswap_cli import schema
from slackswap_cli.cli import app
from slackswap_cli.simulate import budget_floor_bytes

pytest.importorskip("torch")

runner = CliRunner()
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_gpt.py"
SMALL = ("--arg", "n_layer=1", "--arg", "d_model=32", "--arg", "seq=16", "--arg", "vocab=64")


def run(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    r = run("profile", EXAMPLE, "--device", "cpu", *SMALL, "-o", d / "tiny.profile.json")
    assert r.exit_code == 0, r.stderr
    assert "wrote" in r.stdout and "Largest saved activations" in r.stdout
    return d


def test_profile_records_the_workload_and_its_args(work):
    prof = schema.load_profile(work / "tiny.profile.json")
    assert prof.workload["name"] == "tiny_gpt"
    assert prof.workload["args"] == {"n_layer": 1, "d_model": 32, "seq": 16, "vocab": 64}
    assert prof.env["device"] == "cpu"
    assert all(op.time_source == "measured" for op in prof.ops)
    assert prof.saved_activations


def test_plan_apply_verify(work):
    plan_path, patched = work / "tiny.plan.json", work / "tiny_patched.py"
    r = run("plan", work / "tiny.profile.json", "--budget", "0.5", "-o", plan_path)
    assert r.exit_code == 0, r.stderr
    plan = schema.load_plan(plan_path)
    assert plan.feasible and plan.budget_fraction == 0.5
    assert plan.predicted.peak_bytes <= plan.budget_bytes
    assert "retention" in r.stdout and f"wrote {plan_path}" in r.stdout

    r = run("apply", plan_path, "-o", patched)
    assert r.exit_code == 0, r.stderr
    assert "from tiny_patched import patch" in r.stdout

    r = run("verify", patched, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    report = orjson.loads(r.stdout)
    assert report["passed"] and report["reasons"] == []
    assert report["max_grad_rel_diff"] <= report["grad_tolerance"]
    assert report["patched_peak_bytes"] <= report["budget_bytes"] * 1.05
    r = run("verify", patched)
    assert r.exit_code == 0 and "PASSED" in r.stdout


def test_show_simulate_trace_and_compare(work):
    plan_path = work / "show.plan.json"
    assert run("plan", work / "tiny.profile.json", "-b", "0.5", "-o", plan_path).exit_code == 0
    r = run("show", plan_path)
    assert r.exit_code == 0 and "Actions per layer" in r.stdout
    trace = work / "t.json"
    r = run("simulate", plan_path, "--hardware", "h100-pcie5", "--trace", trace)
    assert r.exit_code == 0, r.stderr
    assert "h100-pcie5" in r.stdout and "op times as measured" in r.stdout
    doc = orjson.loads(trace.read_bytes())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    threads = {e["args"]["name"].lower() for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert any("compute" in t for t in threads)
    assert any("d2h" in t for t in threads) and any("h2d" in t for t in threads)
    assert any(e.get("ph") == "C" for e in events)              # the memory counter
    assert sum(e.get("ph") == "X" for e in events) >= len(schema.load_profile(
        work / "tiny.profile.json").ops)
    r = run("compare", work / "tiny.profile.json", "-b", "0.5",
            "--planners", "slackswap,recompute-only,swap-all")
    assert r.exit_code == 0, r.stderr
    assert "Planners compared" in r.stdout and "recompute-only" in r.stdout


def test_infeasible_plan_exits_4_and_is_written_as_such(work):
    # recompute-only cannot free dropout masks (random ops are never recomputed), so a budget
    # just above the floor that swapping reaches is out of its reach
    prof = schema.load_profile(work / "tiny.profile.json")
    budget = budget_floor_bytes(prof) + 1024
    out = work / "inf.plan.json"
    r = run("plan", work / "tiny.profile.json", "-b", str(budget), "-p", "recompute-only",
            "-o", out)
    assert r.exit_code == 4, r.stdout + r.stderr
    assert "Error:" in r.stderr and "Hint:" in r.stderr and "feasible: false" in r.stderr
    assert schema.load_plan(out).feasible is False


def test_verify_refuses_a_model_this_machine_cannot_hold(work):
    """A module whose model would need terabytes (as one made from a --device fake profile of a
    large model) is refused before anything is built, instead of the kernel killing it."""
    plan_path, patched = work / "big.plan.json", work / "big_patched.py"
    assert run("plan", work / "tiny.profile.json", "-b", "0.5", "-o", plan_path).exit_code == 0
    assert run("apply", plan_path, "-o", patched).exit_code == 0
    source = patched.read_text()
    assert "'params': [['tok.weight', [64, 32], 'torch.float32']" in source
    patched.write_text(source.replace("'params': [['tok.weight', [64, 32],",
                                      "'params': [['tok.weight', [1000000, 1000000],", 1))
    r = run("verify", patched)
    assert r.exit_code == 2, r.stdout + r.stderr
    assert "verify needs at least" in r.stderr and "Hint:" in r.stderr


def test_resnet_with_batchnorm_through_the_whole_pipeline(tmp_path):
    """A CNN from Hugging Face's ResNetConfig (BatchNorm in training mode, residual adds)."""
    example = EXAMPLE.parent / "resnet50.py"
    tiny = ("--arg", "depths=[1,1]", "--arg", "widths=[32,64]", "--arg", "embedding=16",
            "--arg", "image=32", "--arg", "batch=2", "--arg", "dtype=float32",
            "--arg", "classes=10")
    prof, plan, patched = tmp_path / "r.json", tmp_path / "r.plan.json", tmp_path / "r_patched.py"
    assert run("profile", example, "--device", "fake", *tiny, "-o", prof).exit_code == 0
    # slackswap's plan (it swaps here), and a plan that recomputes through BatchNorm
    for planner, evicts in (("slackswap", {"swap", "recompute"}), ("recompute-only", {"recompute"})):
        r = run("plan", prof, "--budget", "0.7", "-p", planner, "-o", plan)
        assert r.exit_code == 0, r.stdout + r.stderr
        actions = {d.action for d in schema.load_plan(plan).decisions}
        assert actions & evicts and "keep" in actions, (planner, actions)
        assert run("apply", plan, "-o", patched).exit_code == 0
        r = run("verify", patched, "--steps", "2", "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        report = orjson.loads(r.stdout)
        assert report["passed"] and report["max_grad_rel_diff"] <= 1e-4
        assert report["max_buffer_rel_diff"] <= 1e-4   # running statistics updated once, as eager
        assert report["patched_peak_bytes"] < report["original_peak_bytes"]
