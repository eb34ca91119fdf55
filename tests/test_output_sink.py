"""The output sink and the planner registry, through the commands (fast, no torch needed).

One sink: a command's result shows as tables (a person), one JSON document (--json: nothing
else on stdout, no status lines) or nothing (--quiet), and the files it writes are the same
in all three. The registry: a planner registered in `planners.PLANNERS` alone is offered by
`plan` and `compare`, gets `--time-limit` when its settings have a time limit, has its bound
reported, and is stood in for inside a training step when it is slow.
"""
from dataclasses import dataclass

import orjson
import pytest
from typer.testing import CliRunner

from slackswap_cli import planners, schema
from slackswap_cli.cli import app
from slackswap_cli.planners.settings import Settings
from slackswap_cli.schema import Decision
from slackswap_testkit.synthetic import chain_profile

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    schema.save(chain_profile(6, act_bytes=1 << 20), tmp_path / "chain.profile.json")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("args", [("plan", "chain.profile.json", "--budget", "0.5"),
                                  ("compare", "chain.profile.json", "--budget", "0.5",
                                   "--planners", "slackswap,swap-all")])
def test_one_result_three_ways(ws, args):
    human, as_json, quiet = run(*args), run(*args, "--json"), run(*args, "--quiet")
    assert human.exit_code == as_json.exit_code == quiet.exit_code == 0, human.stderr
    assert "retention" in human.stdout
    orjson.loads(as_json.stdout)                 # the whole of stdout is one document
    assert quiet.stdout == "" and quiet.stderr == ""
    if args[0] == "compare":                     # status lines are for a person only
        assert "planning with slackswap" in human.stderr
        assert as_json.stderr == ""
    else:                                        # and the file is written all the same
        assert schema.load_plan(ws / "chain.plan.json").feasible


def test_quiet_still_says_why_it_failed(ws):
    r = run("plan", "chain.profile.json", "--budget", "0.01", "-q")
    assert r.exit_code == 4 and r.stdout == ""
    assert r.stderr.startswith("Error:") and "Hint:" in r.stderr


def _swap_everything(profile, hw, budget_bytes):
    return [Decision(t.id, "swap") for t in profile.saved_activations]


def test_a_planner_registered_alone_is_offered_by_plan_and_compare(ws, monkeypatch):
    monkeypatch.setitem(planners.PLANNERS, "dummy",
                        planners.PlannerSpec("swap everything (a test's)", _swap_everything))
    r = run("plan", "chain.profile.json", "--budget", "0.9", "--planner", "dummy", "--json")
    assert r.exit_code == 0, r.stderr
    doc = orjson.loads(r.stdout)
    assert doc["planner"] == "dummy" and "bound_retention" not in doc
    assert doc["actions"] == {"keep": 0, "swap": 6, "recompute": 0}
    assert schema.load_plan(ws / "chain.plan.json").planner == "dummy"

    monkeypatch.delitem(planners.PLANNERS, "optimal")   # a MILP: seconds this test need not take
    r = run("compare", "chain.profile.json", "--budget", "0.9", "--json")   # every planner
    assert r.exit_code == 0, r.stderr
    rows = {row["planner"]: row for row in orjson.loads(r.stdout)["results"]}
    assert list(rows) == planners.planner_names() and rows["dummy"]["feasible"]
    r = run("compare", "chain.profile.json", "--budget", "0.9", "--planners", "dummy,slackswap")
    assert r.exit_code == 0 and "dummy" in r.stdout


@dataclass(frozen=True)
class _SlowSettings(Settings):
    time_limit_s: float = 7.0


def test_a_slow_planners_traits_come_from_its_record(ws, monkeypatch):
    limits = []

    def slow(profile, hw, budget_bytes, settings):
        limits.append(settings.time_limit_s)
        return _swap_everything(profile, hw, budget_bytes)

    monkeypatch.setitem(planners.PLANNERS, "slow", planners.PlannerSpec(
        "a slow test planner", slow, _SlowSettings, quick=False, bound=lambda p, h, b: 0.25))
    r = run("compare", "chain.profile.json", "--budget", "0.9", "--planners", "slow,swap-all",
            "--time-limit", "3", "--json")
    assert r.exit_code == 0, r.stderr
    rows = orjson.loads(r.stdout)["results"]
    assert limits == [3.0]                        # --time-limit went to it (and swap-all has none)
    assert [row["bound_retention"] for row in rows] == [0.25, None]

    r = run("plan", "chain.profile.json", "--budget", "0.9", "--planner", "slow", "--json")
    assert r.exit_code == 0, r.stderr
    assert orjson.loads(r.stdout)["bound_retention"] == 0.25
    assert 1.0 <= limits[-1] <= 7.0               # its own default, less the time spent
    assert planners.quick_planner("slow") == planners.DEFAULT_PLANNER   # not in a training step
    assert planners.quick_planner("optimal") == "slackswap"
    assert planners.quick_planner("swap-all") == "swap-all"


def test_the_registry_names_each_planners_settings_and_time_limit():
    """The CLI passes --time-limit by the settings field: the planners not quick enough for a
    training step are the ones that have one."""
    for name, spec in planners.PLANNERS.items():
        has_limit = spec.option_default("time_limit_s") is not None
        assert has_limit == (not spec.quick), name
        assert spec.accepted(time_limit_s=5.0) == ({"time_limit_s": 5.0} if has_limit else {})


def test_a_planner_said_to_fit_from_the_floor_does():
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.simulate import budget_floor_bytes
    prof = chain_profile(6, act_bytes=1 << 20)
    sure = [n for n, spec in planners.PLANNERS.items() if spec.fits_from_floor]
    assert sure                                   # `plan`'s hint names one
    for name in sure:
        assert planners.make_plan(name, prof, PRESETS["a100-pcie4"],
                                  budget_floor_bytes(prof)).feasible, name


def test_the_json_of_each_command_keeps_its_fields_in_order(ws):
    """The documents scripts read (docs/formats.md) keep their fields and their order
    whatever the sink does (the field lists as they were before the sink)."""
    def doc(*args):
        r = run(*args, "--json")
        assert r.exit_code == 0, r.stderr
        return orjson.loads(r.stdout)
    plan = doc("plan", "chain.profile.json", "--budget", "0.5")
    assert list(plan) == ["plan", "planner", "feasible", "hardware", "budget_bytes",
                          "budget_fraction", "actions", "predicted", "solve_ms", "notes"]
    assert list(plan["actions"]) == ["keep", "swap", "recompute"]
    assert list(plan["predicted"]) == ["step_us", "ideal_us", "retention", "peak_bytes",
                                       "stall_us", "recompute_us", "swapped_bytes",
                                       "prefetched_bytes", "recomputed_bytes", "stall_by_cause"]
    cmp = doc("compare", "chain.profile.json", "--budget", "0.5", "--planners", "swap-all")
    assert list(cmp) == ["profile", "hardware", "budget_bytes", "budget_fraction", "results"]
    assert list(cmp["results"][0]) == ["planner", "feasible", "predicted", "solve_ms", "notes",
                                       "bound_retention"]
    assert list(doc("simulate", "chain.plan.json")) == ["plan", "hardware", "feasible",
                                                        "reason", "predicted", "trace"]
    assert list(doc("show", "chain.profile.json")) == ["fingerprint", "workload", "env",
                                                       "summary"]
    assert list(doc("show", "chain.plan.json"))[:2] == ["format", "version"]
    assert list(doc("version")) == ["version", "python", "torch"]
    hw = run("hardware", "a100-pcie4", "--json").stdout
    assert hw.startswith('{\n  "name": "a100-pcie4"')      # indented: a file to edit by hand
