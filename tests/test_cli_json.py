"""`--json` is for scripts: through the real console script, every command's stdout is exactly
one JSON document (no progress line, no solver chatter), and what it names exists."""
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from slackswap_cli import schema
from slackswap_testkit.synthetic import chain_profile

SCRIPT = Path(sys.executable).parent / "slackswap"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_gpt.py"
SMALL = ["--arg", "n_layer=1", "--arg", "d_model=32", "--arg", "seq=16", "--arg", "vocab=64"]


def sh(*args, cwd):
    r = subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=300, env={**os.environ, "COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return orjson.loads(r.stdout)        # the whole of stdout is one document


def test_every_planning_command_prints_one_json_document(tmp_path):
    schema.save(chain_profile(6, act_bytes=1 << 20), tmp_path / "chain.profile.json")
    doc = sh("plan", "chain.profile.json", "--budget", "0.5", "--json", cwd=tmp_path)
    # a summary naming the file, which holds the whole plan
    assert doc["plan"] == "chain.plan.json" and doc["feasible"] is True
    assert sum(doc["actions"].values()) == 6 and "decisions" not in doc
    assert doc["predicted"]["peak_bytes"] <= doc["budget_bytes"]
    assert len(schema.load_plan(tmp_path / doc["plan"]).decisions) == 6

    doc = sh("compare", "chain.profile.json", "--budget", "0.5", "--planners",
             "slackswap,swap-all,recompute-only", "--json", cwd=tmp_path)
    assert [r["planner"] for r in doc["results"]] == ["slackswap", "swap-all", "recompute-only"]

    doc = sh("simulate", "chain.plan.json", "--trace", "t.json", "--json", cwd=tmp_path)
    assert doc["trace"] == "t.json"
    assert orjson.loads((tmp_path / "t.json").read_bytes())["traceEvents"]
    assert sh("simulate", "chain.plan.json", "--json", cwd=tmp_path)["trace"] is None

    assert sh("show", "chain.plan.json", "--json", cwd=tmp_path)["format"] == "slackswap.plan"
    assert "summary" in sh("show", "chain.profile.json", "--json", cwd=tmp_path)
    assert "a100-pcie4" in sh("hardware", "--json", cwd=tmp_path)
    assert sh("hardware", "h100-pcie5", "--json", cwd=tmp_path)["name"] == "h100-pcie5"
    v = sh("version", "--json", cwd=tmp_path)
    assert v["version"] and v["python"].count(".") == 2


def test_torch_commands_print_one_json_document(tmp_path):
    pytest.importorskip("torch")
    doc = sh("profile", EXAMPLE, "--device", "cpu", *SMALL, "-o", "tiny.profile.json", "--json",
             cwd=tmp_path)
    assert doc["profile"] == "tiny.profile.json" and doc["summary"]["n_saved"] > 0
    sh("plan", "tiny.profile.json", "--budget", "0.5", "--json", cwd=tmp_path)
    doc = sh("apply", "tiny.plan.json", "-o", "tiny_patched.py", "--json", cwd=tmp_path)
    assert doc["patched"] == "tiny_patched.py" and doc["importable"] is True
    assert (tmp_path / "tiny_patched.py").is_file()
    assert sh("verify", "tiny_patched.py", "--json", cwd=tmp_path)["passed"] is True
