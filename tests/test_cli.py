"""End-to-end tests of the `slackswap` commands on synthetic profiles (fast, no torch needed)."""
import orjson
import pytest
from helpers import assert_clean_error
from typer.testing import CliRunner

from slackswap_cli import schema
from slackswap_cli.cli import app
from slackswap_testkit.synthetic import chain_profile

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def profile_path(tmp_path):
    prof = chain_profile(6, act_bytes=64 << 20, fwd_us=1000.0)
    path = tmp_path / "chain.profile.json"
    schema.save(prof, path)
    return path


def test_plan_writes_plan_and_prints_summary(profile_path, tmp_path):
    out = tmp_path / "p.json"
    r = run("plan", profile_path, "--budget", "0.5", "-o", out)
    assert r.exit_code == 0, r.output + r.stderr
    plan = schema.load_plan(out)
    assert plan.feasible and plan.planner == "slackswap"
    assert plan.budget_fraction == 0.5
    assert plan.predicted.peak_bytes <= plan.budget_bytes
    assert len(plan.decisions) == 6
    assert "retention" in r.stdout.lower()


def test_plan_json_output_is_a_summary_naming_the_file(profile_path, tmp_path):
    r = run("plan", profile_path, "--budget", "200MiB", "-o", tmp_path / "p.json", "--json")
    assert r.exit_code == 0, r.stderr
    doc = orjson.loads(r.stdout)
    assert doc["plan"] == str(tmp_path / "p.json") and doc["budget_bytes"] == 200 << 20
    assert doc["budget_fraction"] is None and "schedule" not in doc
    assert schema.load_plan(tmp_path / "p.json").budget_bytes == 200 << 20


@pytest.mark.parametrize("args,code,needle", [
    (["--budget", "banana"], 2, "budget"),
    (["--budget", "0.5", "--planner", "magic"], 2, "magic"),
    (["--budget", "0.5", "--hardware", "tpu-v9"], 2, "tpu-v9"),
])
def test_plan_bad_options(profile_path, tmp_path, args, code, needle):
    out = tmp_path / "p.json"
    r = run("plan", profile_path, *args, "-o", out)
    assert_clean_error(r, code, needle)
    assert not out.exists()


def test_plan_budget_below_floor_writes_the_closest_plan_and_exits_4(profile_path, tmp_path):
    # README: exit 4 "no plan fits the budget (the best plan is still written, feasible: false)"
    out = tmp_path / "p.json"
    r = run("plan", profile_path, "--budget", "1KiB", "-o", out)
    assert r.exit_code == 4
    assert "Traceback" not in r.stderr
    assert "Error:" in r.stderr and "below the floor" in r.stderr and "Hint:" in r.stderr
    assert "feasible: false" in r.stderr
    plan = schema.load_plan(out)
    assert plan.feasible is False and plan.budget_bytes == 1024
    assert plan.decisions                       # a whole plan, one decision per saved tensor


def test_plan_rejects_non_profile(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"format": "something-else", "version": 1}')
    assert_clean_error(run("plan", bad, "--budget", "0.5"), 2, "format")
    assert_clean_error(run("plan", tmp_path / "missing.json", "--budget", "0.5"), 2, "does not exist")


def test_show_simulate_compare(profile_path, tmp_path):
    plan_path = tmp_path / "p.json"
    assert run("plan", profile_path, "--budget", "0.5", "-o", plan_path).exit_code == 0
    r = run("show", profile_path)
    assert r.exit_code == 0 and "a0" in r.stdout
    r = run("show", plan_path)
    assert r.exit_code == 0 and "retention" in r.stdout.lower()
    trace = tmp_path / "trace.json"
    r = run("simulate", plan_path, "--hardware", "h100-pcie5", "--trace", trace)
    assert r.exit_code == 0, r.stderr
    events = orjson.loads(trace.read_bytes())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("ph") == "C" for e in events)
    r = run("compare", profile_path, "--budget", "0.5", "--json")
    assert r.exit_code == 0, r.stderr
    results = orjson.loads(r.stdout)["results"]
    names = {row["planner"] for row in results}
    assert {"slackswap", "optimal", "recompute-only", "swap-all", "checkpoint-layers"} <= names
    best = max(row["predicted"]["retention"] for row in results if row["feasible"])
    ours = next(row for row in results if row["planner"] == "slackswap")
    assert ours["feasible"] and ours["predicted"]["retention"] >= best - 0.005


def test_simulate_refuses_plan_for_another_profile(profile_path, tmp_path):
    plan_path = tmp_path / "p.json"
    assert run("plan", profile_path, "--budget", "0.5", "-o", plan_path).exit_code == 0
    other = tmp_path / "other.json"
    schema.save(chain_profile(3), other)
    assert_clean_error(run("simulate", plan_path, "--profile", other), 2, "profile")


def test_hardware_listing():
    r = run("hardware")
    assert r.exit_code == 0 and "a100-pcie4" in r.stdout and "gh200-c2c" in r.stdout
    r = run("hardware", "h200-pcie5", "--json")
    assert orjson.loads(r.stdout)["name"] == "h200-pcie5"
    assert_clean_error(run("hardware", "nope"), 2, "nope")


def test_profile_missing_file(tmp_path):
    out = tmp_path / "p.json"
    assert_clean_error(run("profile", tmp_path / "nope.py", "-o", out), 2, "does not exist")
    assert not out.exists()


def _roofline(prof, hw):
    """`prof` as `profile --device fake --hardware hw` writes it: roofline times priced by the
    cost model, spec and cost model stored."""
    import dataclasses

    from slackswap_cli.op_cost import price_profile
    ops = tuple(dataclasses.replace(o, flops=10**12, bytes=10**9, time_source="roofline")
                for o in prof.ops)
    return price_profile(dataclasses.replace(prof, ops=ops, env={}), hw)


def test_a_profile_costed_on_a_custom_spec_plans_without_naming_it_again(tmp_path):
    """`profile --hardware my-a100.json` then `plan p.json`: the profile carries the spec."""
    import dataclasses

    from slackswap_cli.hardware import PRESETS
    # an edited copy that even keeps the preset's name: its own numbers are what count
    mine = dataclasses.replace(PRESETS["a100-pcie4"], h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    schema.save(_roofline(chain_profile(6, act_bytes=64 << 20), mine), tmp_path / "p.json")
    r = run("plan", tmp_path / "p.json", "--budget", "0.5", "-o", tmp_path / "plan.json")
    assert r.exit_code == 0, r.stderr
    plan = schema.load_plan(tmp_path / "plan.json")
    assert plan.hardware == mine.to_dict() != PRESETS["a100-pcie4"].to_dict()


def test_an_old_profile_naming_its_preset_still_plans(profile_path, tmp_path):
    raw = orjson.loads(profile_path.read_bytes())
    raw["env"] = {"hardware": "h100-pcie5"}
    (tmp_path / "old.json").write_bytes(orjson.dumps(raw))
    r = run("plan", tmp_path / "old.json", "--budget", "0.5", "-o", tmp_path / "plan.json")
    assert r.exit_code == 0, r.stderr
    assert schema.load_plan(tmp_path / "plan.json").hardware["name"] == "h100-pcie5"
    raw["env"] = {"hardware": "my-a100"}        # a custom spec known by name only
    (tmp_path / "old.json").write_bytes(orjson.dumps(raw))
    r = run("plan", tmp_path / "old.json", "--budget", "0.5", "-o", tmp_path / "plan.json")
    assert_clean_error(r, 2, "env.hardware names 'my-a100'")
    assert "--hardware FILE.json" in r.stderr


def test_simulate_shows_the_change_against_the_plan_not_its_old_notes(profile_path, tmp_path):
    plan_path, trace = tmp_path / "p.json", tmp_path / "t.json"
    assert run("plan", profile_path, "--budget", "0.5", "-o", plan_path).exit_code == 0
    planned = schema.load_plan(plan_path)
    from slackswap_cli.hardware import PRESETS
    slow = tmp_path / "slow.json"       # a link 25x slower: copies no longer hide
    slow.write_bytes(orjson.dumps(PRESETS["a100-pcie4"].to_dict() | {
        "name": "slow-link", "h2d_bytes_per_s": 1e9, "d2h_bytes_per_s": 1e9}))
    r = run("simulate", plan_path, "--hardware", slow, "--trace", trace)
    assert r.exit_code in (0, 4), r.stderr
    assert "solve time" not in r.stdout and "planned on a100-pcie4: retention" in r.stdout
    r = run("simulate", plan_path)
    assert "same as predicted on a100-pcie4" in r.stdout
    # the trace carries the budget as a second series of the memory counter
    counters = [e for e in orjson.loads(trace.read_bytes())["traceEvents"] if e["ph"] == "C"]
    assert counters and all(e["args"]["budget_bytes"] == planned.budget_bytes for e in counters)


def test_help_lists_every_command_whole_and_shows_examples():
    r = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0
    commands = r.stdout.split("Commands:")[1].split("Exit codes")[0]
    assert "..." not in commands and len(commands.strip().splitlines()) == 10
    assert all(len(line) <= 80 for line in r.stdout.splitlines())
    r = runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "80"})
    assert "--arg KEY=VALUE" in r.stdout and "list[str]" not in r.stdout
    assert "Examples:\n    slackswap profile model.py --device fake" in r.stdout
    for cmd in ("plan", "compare", "simulate", "show", "apply", "verify", "hardware"):
        r = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "80"})
        assert r.exit_code == 0 and f"Examples:\n    slackswap {cmd}" in r.stdout, cmd


def test_plan_without_output_writes_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "profiles").mkdir()
    schema.save(chain_profile(4), tmp_path / "profiles" / "chain.profile.json")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    r = run("plan", "../profiles/chain.profile.json", "--budget", "0.6")
    assert r.exit_code == 0, r.stderr
    assert "wrote chain.plan.json" in r.stdout
    assert schema.load_plan(tmp_path / "work" / "chain.plan.json").feasible
    assert not (tmp_path / "profiles" / "chain.plan.json").exists()


def test_every_command_accepts_quiet(profile_path, tmp_path):
    """`-q/--quiet`, which the README gives for every command, is an option of each; the
    commands that only print (show, hardware, version) print nothing with it."""
    import typer.main
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        opts = {o for p in cmd.params for o in p.opts}
        assert {"-q", "--quiet"} <= opts, name
    assert run("plan", profile_path, "--budget", "0.5", "-o", tmp_path / "p.json").exit_code == 0
    for args in (("show", profile_path), ("show", tmp_path / "p.json"), ("hardware",),
                 ("hardware", "a100-pcie4"), ("version",)):
        for flag in ("-q", "--quiet"):
            r = run(*args, flag)
            assert r.exit_code == 0, (args, r.output)
            assert r.stdout == "", args
        assert run(*args).stdout != "", args


def test_saving_a_plan_onto_a_directory_writes_neither_file(profile_path, tmp_path,
                                                            monkeypatch):
    """`Plan.save` / `fit -o` (`planning.save_with_profile`): a plan target that is a directory
    is refused before the profile beside it is written; a plan that fails to write takes the
    profile written for it away again: both files or neither."""
    from slackswap_cli import planning
    from slackswap_cli.errors import InputError
    assert run("plan", profile_path, "--budget", "0.5", "-o", tmp_path / "p.json").exit_code == 0
    plan, prof = schema.load_plan(tmp_path / "p.json"), schema.load_profile(profile_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "X.plan.json").mkdir()
    with pytest.raises(InputError, match="is a directory; nothing was written") as e:
        planning.save_with_profile(plan, prof, out / "X.plan.json")
    assert sorted(p.name for p in out.iterdir()) == ["X.plan.json"]
    planning.save_with_profile(plan, prof, out / "X.plan.json" / "X.plan.json")  # the hint
    assert e.value.hint.endswith("X.plan.json/X.plan.json")
    real = planning.save

    def plan_fails(obj, path):
        if str(path).endswith(".plan.json"):
            raise InputError("disk full")
        real(obj, path)
    monkeypatch.setattr(planning, "save", plan_fails)
    with pytest.raises(InputError, match="disk full"):
        planning.save_with_profile(plan, prof, out / "Y.plan.json")
    assert not (out / "Y.profile.json").exists()
