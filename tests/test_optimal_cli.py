"""`optimal` through the real console script: its stdout under --json is one JSON document
(HiGHS writes from C straight to file descriptor 1, so this needs a real process), it reports
the sound bound, and two runs give the same plan."""
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from slackswap_cli import schema
from slackswap_cli.hardware import PRESETS
from slackswap_cli.planners import make_plan
from slackswap_testkit.synthetic import transformer_profile

EXE = Path(sys.executable).with_name("slackswap")


def _cli(*args):
    cmd = [str(EXE)] if EXE.exists() else [sys.executable, "-c",
                                          "from slackswap_cli.cli import app; app()"]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def prof_path(tmp_path_factory):
    p = transformer_profile("gpt2", layers=3, hidden=128, heads=4, batch=2, seq=64,
                            hw=PRESETS["a100-pcie4"], name="small")
    path = tmp_path_factory.mktemp("opt") / "small.profile.json"
    schema.save(p, path)
    return path


def test_quiet_fds_silences_writes_to_the_file_descriptors():
    code = ("import os\nfrom slackswap_cli.planners.bound import quiet_fds\n"
            "with quiet_fds():\n    os.write(1, b'from C\\n'); os.write(2, b'err\\n')\n"
            "print('after')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == b"after\n" and r.stderr == b""


def test_compare_json_is_pure_json_with_bound_retention(prof_path):
    r = _cli("compare", prof_path, "--budget", "0.5", "--time-limit", "10", "--json")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)               # the whole stdout: nothing else was printed
    rows = {row["planner"]: row for row in doc["results"]}
    bound = rows["optimal"]["bound_retention"]
    assert isinstance(bound, float) and 0 < bound <= 1
    for name, row in rows.items():
        if name != "optimal":
            assert row["bound_retention"] is None
        if row["feasible"]:
            assert row["predicted"]["retention"] <= bound + 1e-9, name


def test_plan_optimal_json_is_pure_json_with_bound(prof_path, tmp_path):
    r = _cli("plan", prof_path, "--budget", "0.4", "--planner", "optimal", "--time-limit", "10",
             "--json", "-o", tmp_path / "o.plan.json")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)
    assert doc["planner"] == "optimal" and doc["bound_retention"] >= doc["predicted"]["retention"]
    assert any(n.startswith("sound bound:") for n in doc["notes"])
    # the written plan is a normal plan (the bound is in its notes, not a new field)
    assert schema.load_plan(tmp_path / "o.plan.json").planner == "optimal"


def test_optimal_is_deterministic():
    p = transformer_profile("bert", layers=3, hidden=128, heads=4, batch=2, seq=64,
                            hw=PRESETS["a100-pcie4"])
    budget = p.summary["peak_activation_bytes"] * 45 // 100
    a = make_plan("optimal", p, PRESETS["a100-pcie4"], budget, time_limit_s=20)
    b = make_plan("optimal", p, PRESETS["a100-pcie4"], budget, time_limit_s=20)
    assert a.decisions == b.decisions
    assert a.predicted == b.predicted


def _add(a, b):
    return a + b


def _boom():
    raise ValueError("inside the child")


def _sleep():
    import time
    time.sleep(30)


def test_run_quietly_stops_at_its_limit_and_surfaces_errors():
    from slackswap_cli.planners.bound import run_quietly
    assert run_quietly(_add, {"a": 1, "b": 2}, 5.0) == 3
    assert run_quietly(_add, {"a": 1, "b": 2}) == 3          # no limit: runs here
    assert run_quietly(_sleep, {}, 0.5) is None            # stopped, not waited for
    with pytest.raises(ValueError, match="inside the child"):
        run_quietly(_boom, {}, 5.0)
