"""torch.compile's own choice as a simulated baseline (`compare --with-torch-compile`,
trace/torch_choice.py): torch's min-cut partitioner on the profile's re-traced joint graph."""
import json

import pytest
from helpers import assert_clean_error
from typer.testing import CliRunner
from workloads import HW

from slackswap_cli.cli import app
from slackswap_cli.errors import FingerprintMismatch, InputError
from slackswap_cli.schema import save
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.torch_choice import (
    PLANNER_NAME,
    SEARCH_STEPS,
    baseline_for,
    check_torch_version,
    choice_from_saved,
    resolve_workload,
    torch_saved,
)

# Four Linear+GELU layers: backward reads each addmm (gelu_backward) and each gelu (the next
# layer's weight gradient). torch keeps the matmul outputs and recomputes the cheap GELUs first.
DEEP = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
    def forward(self, x):
        for lin in self.layers:
            x = F.gelu(lin(x))
        return x.sum()
def workload():
    return Deep(), (torch.randn(32, 64),)
'''


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    d = tmp_path_factory.mktemp("torch_choice")
    path = d / "deep.py"
    path.write_text(DEEP)
    prof = profile_workload(str(path), device="fake", hardware=HW)
    save(prof, d / "deep.profile.json")
    return path, prof, baseline_for(prof, d / "deep.profile.json")


def _actions(prof, choice):
    return {prof.tensors[d.tensor].name: str(d.action) for d in choice.decisions}


def test_what_torch_saves_is_what_the_plan_keeps(deep):
    _, prof, base = deep
    names = {t.name for t in prof.saved_activations}
    assert names == {"addmm", "gelu", "addmm_1", "gelu_1", "addmm_2", "gelu_2", "addmm_3"}
    for knob in (0.0, 0.5, 1.0):
        saved = set(torch_saved(base.joint, knob))
        acts = _actions(prof, base.choice(knob))
        assert {n for n, a in acts.items() if a == "keep"} == names & saved, knob
        assert {n for n, a in acts.items() if a == "recompute"} == names - saved, knob
    # the hand-checked choices: torch's default saves every value backward reads; at 0.5 it
    # keeps the matmul outputs and recomputes the GELUs; at 0 it saves only inputs/parameters
    assert set(_actions(prof, base.choice(1.0)).values()) == {"keep"}
    assert _actions(prof, base.choice(0.5)) == {
        n: ("keep" if n.startswith("addmm") else "recompute") for n in names}
    assert set(_actions(prof, base.choice(0.0)).values()) == {"recompute"}
    assert all(n.startswith(("param_list", "input_list")) for n in torch_saved(base.joint, 0.0))


def test_partitioning_leaves_the_traced_graph_alone(deep):
    _, _, base = deep
    before = [(n.name, n.op, n.target) for n in base.joint.gm.graph.nodes]
    torch_saved(base.joint, 0.3)
    assert [(n.name, n.op, n.target) for n in base.joint.gm.graph.nodes] == before


def test_a_value_torch_moves_into_forward_keeps_what_it_is_computed_from(deep):
    _, prof, base = deep
    # sum's backward expands the tangent; gelu_backward of the last layer reads addmm_3 in
    # backward. Saving that backward-phase node stands in for addmm_3.
    bwd = next(n for n in base.joint.gm.graph.nodes
               if base.joint.phase.get(n.name) == "backward" and n.target.__name__.startswith("gelu_backward")
               and any(a.name == "addmm_3" for a in n.all_input_nodes))
    choice = choice_from_saved(prof, base.joint, [bwd.name], 0.5)
    acts = _actions(prof, choice)
    assert acts["addmm_3"] == "keep" and choice.kept_stand_in == 1 and choice.kept_saved == 0
    assert [n for n, a in acts.items() if a == "keep"] == ["addmm_3"]


def test_the_knob_search_meets_the_budget(deep):
    _, prof, base = deep
    budget = int(0.75 * prof.keep_all_peak_bytes)
    res = base.plan(HW, budget, 0.75)
    assert res.met_budget and res.plan.feasible and res.plan.planner == PLANNER_NAME
    assert res.plan.predicted.peak_bytes <= budget
    assert 0.0 <= res.knob < 1.0          # torch's default (1.0) does not fit here
    assert (1.0, False, prof.keep_all_peak_bytes) in [(k, f, b) for k, f, b in res.tried]
    # the plan shown is torch's choice at the knob reached, and the best feasible one tried
    assert res.plan.decisions == tuple(base.choice(res.knob).decisions)
    assert any("met the budget" in n for n in res.plan.notes)


def test_no_knob_meets_a_budget_below_what_recompute_reaches(deep):
    _, prof, base = deep
    budget = int(0.3 * prof.keep_all_peak_bytes)
    res = base.plan(HW, budget, 0.3)
    assert not res.met_budget and not res.plan.feasible
    peaks = [b for _, _, b in res.tried]
    assert res.plan.predicted.peak_bytes == min(peaks) > budget   # the closest plan
    # 1.0, the grid, then midpoints around the lowest peak for SEARCH_STEPS rounds
    assert 5 < len(res.tried) <= 5 + 2 * SEARCH_STEPS and len({k for k, _, _ in res.tried}) == len(res.tried)
    assert any(n.startswith("simulator:") for n in res.plan.notes)
    assert any("no activation_memory_budget tried meets the budget" in n for n in res.plan.notes)


def test_compare_with_torch_compile_row(deep, tmp_path, monkeypatch):
    path, prof, _ = deep
    profile_path = path.parent / "deep.profile.json"
    r = CliRunner().invoke(app, ["compare", str(profile_path), "--budget", "0.75", "--planners",
                                 "slackswap,recompute-only", "--with-torch-compile", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["planner"]: row for row in json.loads(r.stdout)["results"]}
    assert list(rows) == ["slackswap", "recompute-only", "torch.compile"]
    tc = rows["torch.compile"]
    assert tc["feasible"] and tc["met_budget"] and 0 <= tc["activation_memory_budget"] < 1
    assert tc["predicted"]["peak_bytes"] <= json.loads(r.stdout)["budget_bytes"]
    assert tc["knob_tried"][0] == {"activation_memory_budget": 1.0, "feasible": False,
                                   "peak_bytes": prof.keep_all_peak_bytes}
    r = CliRunner().invoke(app, ["compare", str(profile_path), "--budget", "0.75", "--planners",
                                 "slackswap", "--with-torch-compile"])
    assert r.exit_code == 0, r.output
    assert "torch.compile" in r.stdout and "activation_memory_budget=" in r.stdout


def test_a_relative_workload_path_is_found_next_to_the_profile(deep, tmp_path, monkeypatch):
    path, prof, _ = deep
    import dataclasses
    rel = dataclasses.replace(prof, workload={**prof.workload, "path": path.name})
    monkeypatch.chdir(tmp_path)                        # not in the current directory
    assert resolve_workload(rel, path.parent / "sub" / "p.json") == path.parent / path.name
    with pytest.raises(InputError, match="does not exist") as exc:
        resolve_workload(rel, tmp_path / "p.json")
    assert "--model" in exc.value.hint
    assert resolve_workload(rel, None, model=path) == path      # --model overrides
    onnx = dataclasses.replace(prof, workload={**prof.workload, "path": "m.onnx"})
    with pytest.raises(InputError, match="ONNX"):
        resolve_workload(onnx, None)


def test_cli_errors(deep, tmp_path):
    path, prof, _ = deep
    import dataclasses
    moved = dataclasses.replace(prof, workload={**prof.workload, "path": str(tmp_path / "gone.py")})
    save(moved, tmp_path / "moved.profile.json")
    args = ["compare", str(tmp_path / "moved.profile.json"), "--budget", "0.5", "--planners",
            "recompute-only", "--with-torch-compile"]
    assert_clean_error(CliRunner().invoke(app, args), 2, "does not exist")
    # --model names another file: a trace failure exits 3, a changed model is refused (2)
    broken = tmp_path / "broken.py"
    broken.write_text("def workload():\n    raise RuntimeError('boom')\n")
    assert_clean_error(CliRunner().invoke(app, [*args, "--model", str(broken)]), 3, "boom")
    changed = tmp_path / "changed.py"
    changed.write_text(DEEP.replace("range(4)", "range(3)"))
    assert_clean_error(CliRunner().invoke(app, [*args, "--model", str(changed)]), 2,
                       "now traces to graph")
    with pytest.raises(FingerprintMismatch):
        baseline_for(moved, None, changed)
    r = CliRunner().invoke(app, [*args[:-1], "--model", str(path)])
    assert_clean_error(r, 2, "--with-torch-compile")


def test_other_torch_versions_are_refused():
    check_torch_version("2.13.0+cpu")
    check_torch_version("2.13.1")
    check_torch_version("2.14.1")
    check_torch_version("2.15.0+cu132")
    for v in ("2.12.1", "2.16.0", "2.130.0", "2.150.0"):
        with pytest.raises(InputError, match=v.replace(".", r"\.")):
            check_torch_version(v)


OFF = '''
import torch, torch.nn as nn
class Off(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
    def forward(self, x):
        y = self.a(x)            # backward never reads y: not a saved root of the profile
        z = y * 2                # sin's backward reads z
        return self.b(torch.sin(z)).sum()
def workload():
    return Off(), (torch.randn(8, 16),)
'''


def test_a_root_torch_recomputes_from_a_value_no_plan_can_keep_is_kept(tmp_path):
    path = tmp_path / "off.py"
    path.write_text(OFF)
    prof = profile_workload(str(path), device="fake", hardware=HW)
    base = baseline_for(prof, None, path)
    assert {t.name for t in prof.saved_activations} == {"mul", "sin"}
    # torch saving the Linear's output y (addmm) and recomputing z = y * 2 from it: a plan cannot
    # keep y, and recomputing z would re-run the matmul, so z is kept; sin(z) is recomputed
    choice = choice_from_saved(prof, base.joint, ["addmm"], 0.5)
    assert _actions(prof, choice) == {"mul": "keep", "sin": "recompute"}
    assert choice.off_profile == [prof.tensors[[t.name for t in prof.tensors].index("addmm")].id]
    assert any("are kept instead" in n for n in choice.notes(prof))
    # saving z itself keeps it as torch does
    assert _actions(prof, choice_from_saved(prof, base.joint, ["mul"], 0.5)) == {
        "mul": "keep", "sin": "recompute"}
    assert _actions(prof, choice_from_saved(prof, base.joint, [], 0.0)) == {
        "mul": "recompute", "sin": "recompute"}
