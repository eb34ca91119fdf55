"""Workload paths relative to the repository: the shipped samples record one, `make samples`
keeps it so (slackswap_testkit.sample_paths), and apply finds the file from anywhere."""
import dataclasses
import shutil

import orjson
import pytest
from workloads import ROOT, plan_at, profiled, write_patched

from slackswap_cli.schema import load_profile
from slackswap_cli.workload_spec import resolve_workload_path
from slackswap_testkit.sample_paths import relative_workload_path

SAMPLES = sorted((ROOT / "sample_profiles").glob("*.json"))


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_samples_record_a_path_relative_to_the_repo(sample):
    path = orjson.loads(sample.read_bytes())["workload"]["path"]
    assert path.startswith("examples/"), path
    assert (ROOT / path).is_file()


def test_rewrite_changes_only_the_path_and_is_idempotent(tmp_path):
    src = ROOT / "sample_profiles" / "gpt2-xl.json"
    data = orjson.loads(src.read_bytes())
    data["workload"]["path"] = "/somewhere/else/checkout/examples/gpt2_xl.py"
    copy = tmp_path / "gpt2-xl.json"
    copy.write_bytes(orjson.dumps(data))
    assert relative_workload_path(copy) == "examples/gpt2_xl.py"
    assert copy.read_bytes() == src.read_bytes()  # every other byte as shipped
    assert relative_workload_path(copy) == "examples/gpt2_xl.py"
    assert load_profile(copy).fingerprint == load_profile(src).fingerprint


def test_resolve_tries_the_current_directory_then_the_folders_above_the_profile(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "examples").mkdir(parents=True)
    (repo / "examples" / "m.py").write_text("")
    near = repo / "sample_profiles" / "m.json"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert resolve_workload_path("examples/m.py", near=str(near)) == str(repo / "examples" / "m.py")
    assert resolve_workload_path("examples/m.py") == "examples/m.py"  # nowhere to look: as given
    (elsewhere / "examples").mkdir()
    (elsewhere / "examples" / "m.py").write_text("")
    assert resolve_workload_path("examples/m.py", near=str(near)) == "examples/m.py"  # cwd first
    assert resolve_workload_path(str(repo / "x.py"), near=str(near)) == str(repo / "x.py")


def test_apply_finds_a_relative_workload_from_another_directory(files, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "examples").mkdir(parents=True)
    shutil.copy(files["tiny_gpt"], repo / "examples" / "tiny_gpt.py")
    prof = profiled(files, "tiny_gpt")
    prof = dataclasses.replace(prof, workload={**prof.workload, "path": "examples/tiny_gpt.py"})
    plan = plan_at(prof, prof.summary["peak_activation_bytes"] * 0.5)
    plan = dataclasses.replace(plan, profile_path=str(repo / "sample_profiles" / "tiny.json"),
                               model_path="examples/tiny_gpt.py")
    monkeypatch.chdir(tmp_path)
    patched = write_patched(tmp_path, plan, prof)
    assert str(repo / "examples" / "tiny_gpt.py") in patched.read_text()
