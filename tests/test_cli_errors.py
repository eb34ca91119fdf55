"""Bad input through every `slackswap` command: a clean `Error:` / `Hint:` on stderr, the
documented exit code (2 bad input, 3 the workload cannot be traced, 4 no plan fits), no
traceback, and nothing left behind: no output file, no temp file.

Profiles here are synthetic (`chain_profile`), so most cases never import torch; the workload
cases stop before tracing (or trace a 4x4 Linear).
"""
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from helpers import assert_clean_error
from typer.testing import CliRunner

from slackswap_cli import schema
from slackswap_cli.cli import app
from slackswap_testkit.synthetic import chain_profile

runner = CliRunner()
MiB = 1 << 20


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A working directory with a profile, its plan, and assorted bad files."""
    monkeypatch.chdir(tmp_path)
    prof = chain_profile(6, act_bytes=MiB, fwd_us=100.0)
    schema.save(prof, tmp_path / "chain.profile.json")
    r = run("plan", "chain.profile.json", "--budget", "0.5", "-o", "chain.plan.json")
    assert r.exit_code == 0, r.stderr
    raw = orjson.loads((tmp_path / "chain.profile.json").read_bytes())
    plan_raw = orjson.loads((tmp_path / "chain.plan.json").read_bytes())

    def dump(name, data):
        (tmp_path / name).write_bytes(orjson.dumps(data))

    (tmp_path / "adir").mkdir()
    (tmp_path / "notjson.json").write_text("not json {")
    dump("other.json", {"a": 1})
    dump("list.json", [1, 2, 3])
    text = (tmp_path / "chain.profile.json").read_text()
    (tmp_path / "trunc.profile.json").write_text(text[: len(text) // 2])
    dump("newer.profile.json", raw | {"version": 99})
    bad = orjson.loads(orjson.dumps(raw))
    bad["tensors"][2]["producer"] = 9999
    dump("badid.profile.json", bad)
    bad = orjson.loads(orjson.dumps(raw))
    bad["ops"][1]["time_us"] = "fast"
    dump("badtype.profile.json", bad)
    dump("newer.plan.json", plan_raw | {"version": 99})
    dump("otherfp.plan.json", plan_raw | {"profile_fingerprint": "0" * 16})
    bad = orjson.loads(orjson.dumps(plan_raw))
    bad["decisions"][0]["tensor"] = 9999
    dump("badid.plan.json", bad)
    dump("badhw.plan.json", plan_raw | {"hardware": "a100"})
    (tmp_path / "nowl.py").write_text("x = 1\n")
    (tmp_path / "raises.py").write_text("def workload():\n    raise ValueError('boom')\n")
    (tmp_path / "syntax.py").write_text("def workload(:\n")
    (tmp_path / "notloss.py").write_text(
        "import torch\n"
        "def workload():\n"
        "    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    (tmp_path / "twoargs.py").write_text(
        "import torch\n"
        "def workload(n):\n"
        "    return torch.nn.Linear(n, 1), (torch.randn(2, n),), lambda out: out.sum()\n")
    (tmp_path / "exits.py").write_text("import sys\ndef workload():\n    sys.exit(0)\n")
    (tmp_path / "notmod.py").write_text("raise SystemExit('a training script: must not run')\n")
    (tmp_path / "text.onnx").write_text("this is not onnx")
    (tmp_path / "afile").write_text("")
    (tmp_path / "nul.py").write_bytes(b"x = 1\x00\ndef workload():\n    pass\n")
    (tmp_path / "int32ids.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(8, 4)\n"
        "    def forward(self, ids, labels):\n"
        "        return torch.nn.functional.cross_entropy(self.emb(ids).flatten(0, 1),\n"
        "                                                 labels.flatten())\n"
        "def workload():\n"
        "    ids = torch.randint(0, 4, (2, 3), dtype=torch.int32)\n"
        "    return M(), (ids, ids)\n")
    return tmp_path


PLAN = ("plan", "chain.profile.json", "--budget", "0.5", "-o", "out.json")

CASES = [
    # -- plan: files --------------------------------------------------------------------------
    (("plan", "missing.json", "-b", "0.5", "-o", "out.json"), 2, "does not exist"),
    (("plan", "adir", "-b", "0.5", "-o", "out.json"), 2, "directory"),
    (("plan", "notjson.json", "-b", "0.5", "-o", "out.json"), 2, "not valid JSON"),
    (("plan", "other.json", "-b", "0.5", "-o", "out.json"), 2, "not a slackswap profile"),
    (("plan", "list.json", "-b", "0.5", "-o", "out.json"), 2, "not a slackswap profile"),
    (("plan", "chain.plan.json", "-b", "0.5", "-o", "out.json"), 2, "slackswap.plan"),
    (("plan", "trunc.profile.json", "-b", "0.5", "-o", "out.json"), 2, "not valid JSON"),
    (("plan", "newer.profile.json", "-b", "0.5", "-o", "out.json"), 2, "newer"),
    (("plan", "badid.profile.json", "-b", "0.5", "-o", "out.json"), 2, "does not exist"),
    (("plan", "badtype.profile.json", "-b", "0.5", "-o", "out.json"), 2, "time_us"),
    # -- plan: options ------------------------------------------------------------------------
    (PLAN[:-2] + ("-o", "out.json", "--planner", "magic"), 2, "magic"),
    (PLAN + ("--hardware", "tpu-v9"), 2, "tpu-v9"),
    (PLAN + ("--hardware", "notjson.json"), 2, "not valid JSON"),
    (PLAN + ("--hardware", "other.json"), 2, "hardware field"),
    (PLAN + ("--hardware", "adir"), 2, "directory"),
    (("plan", "chain.profile.json", "-b", "-1", "-o", "out.json"), 2, "budget"),
    (("plan", "chain.profile.json", "-b", "0", "-o", "out.json"), 2, "budget"),
    (("plan", "chain.profile.json", "-b", "1.5", "-o", "out.json"), 2, "above 1"),
    (("plan", "chain.profile.json", "-b", "abc", "-o", "out.json"), 2, "budget"),
    (("plan", "chain.profile.json", "-b", "5XB", "-o", "out.json"), 2, "XB"),
    # (a budget below the floor exits 4 but writes the closest plan: tests/test_cli.py)
    (("plan", "chain.profile.json", "-o", "out.json"), 2, "--budget"),
    (("plan", "chain.profile.json", "-b", "0.5", "-o", "adir"), 2, "directory"),
    (("plan", "chain.profile.json", "-b", "0.5", "-o", "afile/out.json"), 2, "not a directory"),
    # -- show / simulate / compare ----------------------------------------------------------
    (("show", "missing.json"), 2, "does not exist"),
    (("show", "adir"), 2, "directory"),
    (("show", "other.json"), 2, "not a slackswap profile or plan"),
    (("show", "newer.plan.json"), 2, "newer"),
    (("show", "badid.plan.json"), 2, "9999"),
    (("show", "otherfp.plan.json"), 2, "profile"),
    (("show", "badhw.plan.json"), 2, "hardware"),
    (("show", "chain.plan.json", "--profile", "chain.plan.json"), 2, "slackswap.plan"),
    (("show", "chain.plan.json", "--profile", "missing.json"), 2, "does not exist"),
    (("simulate", "chain.profile.json"), 2, "slackswap.profile"),
    (("simulate", "otherfp.plan.json"), 2, "was made for profile"),
    (("simulate", "chain.plan.json", "--hardware", "nope"), 2, "nope"),
    (("simulate", "chain.plan.json", "--trace", "adir"), 2, "directory"),
    (("simulate", "chain.plan.json", "--trace", "chain.plan.json"), 2, "also an input"),
    (("compare", "chain.plan.json", "-b", "0.5"), 2, "slackswap.plan"),
    (("compare", "chain.profile.json", "-b", "0.5", "--planners", ","), 2, "no planner"),
    (("compare", "chain.profile.json", "-b", "0.5", "--planners", "slackswap,magic"), 2,
     "magic"),
    (("compare", "chain.profile.json", "-b", "abc"), 2, "budget"),
    (("hardware", "nope"), 2, "nope"),
    (("frobnicate",), 2, "No such command"),
    # -- profile --------------------------------------------------------------------------------
    (("profile", "missing.py", "-o", "out.json"), 2, "does not exist"),
    (("profile", "adir", "-o", "out.json"), 2, "directory"),
    (("profile", "chain.profile.json", "-o", "out.json"), 2, "JSON file, not a workload"),
    (("profile", "nowl.py", "-o", "out.json"), 2, "no function named 'workload'"),
    (("profile", "syntax.py", "-o", "out.json"), 2, "syntax"),
    (("profile", "raises.py", "-o", "out.json"), 3, "boom"),
    (("profile", "exits.py", "-o", "out.json"), 3, "sys.exit(0)"),
    (("profile", "nul.py", "-o", "out.json"), 2, "syntax error: source code string cannot contain null bytes"),
    (("profile", "int32ids.py", "--device", "cpu", "-o", "out.json"), 3, "ids and labels as torch.long"),
    (("profile", "notloss.py", "--device", "cpu", "-o", "out.json"), 3, "scalar"),
    (("profile", "twoargs.py", "--arg", "n=4", "--device", "cpu", "-o", "out.json"), 2,
     "loss_fn"),
    (("profile", "twoargs.py", "--arg", "n", "-o", "out.json"), 2, "--arg"),
    (("profile", "twoargs.py", "--arg", "m=4", "-o", "out.json"), 2, "arguments"),
    (("profile", "twoargs.py", "--input-shape", "x=1x2", "-o", "out.json"), 2, "ONNX"),
    (("profile", "twoargs.py", "--device", "tpu", "-o", "out.json"), 2, "tpu"),
    (("profile", "twoargs.py", "-o", "twoargs.py"), 2, "also an input"),
    (("profile", "text.onnx", "-o", "out.json"), 2, "ONNX"),
    # -- apply / verify -------------------------------------------------------------------------
    (("apply", "chain.plan.json"), 2, "--output"),
    (("apply", "chain.plan.json", "-o", "out.txt"), 2, ".py"),
    (("apply", "chain.profile.json", "-o", "out.py"), 2, "slackswap.profile"),
    (("apply", "otherfp.plan.json", "-o", "out.py"), 2, "was made for profile"),
    (("apply", "chain.plan.json", "-o", "adir"), 2, ".py"),
    (("verify", "missing.py"), 2, "does not exist"),
    (("verify", "adir"), 2, "directory"),
    (("verify", "notmod.py"), 2, "not a module written by `slackswap apply`"),
    (("verify", "chain.plan.json"), 2, "not a module written by `slackswap apply`"),
    (("verify", "notmod.py", "--steps", "0"), 2, "--steps"),
]


@pytest.mark.parametrize("args,code,needle", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_a_clean_error_and_leaves_nothing(ws, args, code, needle):
    before = sorted(p.name for p in ws.iterdir())
    snapshot = {p.name: p.read_bytes() for p in ws.iterdir() if p.is_file()}
    result = run(*args)
    assert_clean_error(result, code, needle)
    assert sorted(p.name for p in ws.iterdir()) == before      # no output, no temp file
    for name, data in snapshot.items():                        # no input was touched
        assert (ws / name).read_bytes() == data, name


def test_output_in_a_new_directory_is_created(ws):
    r = run(*PLAN[:-1], "new/sub/out.json")
    assert r.exit_code == 0, r.stderr
    assert schema.load_plan(ws / "new/sub/out.json").feasible


def test_written_files_are_readable_by_others_under_a_normal_umask(ws):
    old = os.umask(0o022)
    try:
        assert run(*PLAN).exit_code == 0
    finally:
        os.umask(old)
    assert (ws / "out.json").stat().st_mode & 0o777 == 0o644


def test_a_failed_write_leaves_no_temp_file(ws, monkeypatch):
    def full(*_a, **_k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)   # schema.write.os: the one os module
    r = run(*PLAN)
    assert_clean_error(r, 2, "No space left")
    assert not [p for p in ws.iterdir() if p.name.startswith(".") or p.name == "out.json"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux procfs")
def test_unwritable_directory(ws):
    # /proc takes no new files, from root either (root passes any permission check, so a
    # chmod-ed directory would not do): the failure surfaces at write time, cleanly
    r = run(*PLAN[:-1], "/proc/out.json")
    assert_clean_error(r, 2, "cannot write /proc/out.json")
    assert not [p for p in ws.iterdir() if p.name.startswith(".")]


def test_a_bug_is_an_internal_error_without_traceback(ws, monkeypatch):
    import slackswap_cli.cli.render as render

    def broken(*_a, **_k):
        raise ZeroDivisionError("division by zero")
    monkeypatch.setattr(render, "profile_views", broken)
    r = run("show", "chain.profile.json")
    assert r.exit_code == 1
    assert "Error: internal error: ZeroDivisionError" in r.stderr
    assert "SLACKSWAP_DEBUG=1" in r.stderr and "Hint:" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    r = run("show", "chain.profile.json", env={"SLACKSWAP_DEBUG": "1"})
    assert r.exit_code == 1
    assert "Traceback" in r.stderr and "internal error" in r.stderr


def test_usage_errors_through_the_real_entry_point(ws):
    """The installed command (not CliRunner): exit code and stderr as a shell sees them."""
    exe = Path(sys.executable).parent / "slackswap"
    if not exe.exists():
        pytest.skip("the slackswap entry point is not installed beside this Python")
    r = subprocess.run([str(exe), "plan", "chain.profile.json"], capture_output=True,
                       text=True, cwd=ws, timeout=60)
    assert r.returncode == 2
    assert "Error: Missing option '--budget'" in r.stderr
    assert "Hint: see `slackswap plan --help`" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("json", [False, True])
def test_stdout_closed_early_is_a_normal_end(ws, json):
    """`slackswap show plan.json | head -1`: the reader has what it wanted; exit 0, stderr
    quiet (1 would mean a bug, and the workload never ran)."""
    exe = Path(sys.executable).parent / "slackswap"
    if not exe.exists():
        pytest.skip("the slackswap entry point is not installed beside this Python")
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    try:
        p = subprocess.run([str(exe), "show", "chain.plan.json", *(["--json"] if json else [])],
                           stdout=w, stderr=subprocess.PIPE, text=True, cwd=ws, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""



def test_apply_onto_a_directory_suggests_a_module_path(ws):
    (ws / "patched.py").mkdir()
    r = run("apply", "chain.plan.json", "-o", "patched.py")
    assert_clean_error(r, 2, "is a directory")
    assert "patched.py/patched.py" in r.stderr and "out.json" not in r.stderr


def test_a_patched_module_that_exits_is_not_blamed_on_the_workload(ws):
    pytest.importorskip("torch")
    (ws / "exits_patched.py").write_text(
        '"""written by `slackswap apply`"""\nimport sys\nMETA = {}\nsys.exit(7)\n')
    r = run("verify", "exits_patched.py")
    assert_clean_error(r, 3, "the patched module or the workload called sys.exit(7)")


def test_slow_commands_show_a_spinner_on_a_terminal_only(ws, monkeypatch):
    import io

    from rich.console import Console

    import slackswap_cli.cli.output as output
    buf = io.StringIO()
    monkeypatch.setattr(output, "err", Console(file=buf, force_terminal=True, width=80))
    assert run(*PLAN).exit_code == 0
    assert "planning with slackswap" in buf.getvalue()
    assert "0:00:0" in buf.getvalue()                 # the elapsed time beside it
    buf.truncate(0)
    monkeypatch.setattr(output, "err", Console(file=buf, force_terminal=False, width=80))
    assert run(*PLAN).exit_code == 0
    assert "planning with" not in buf.getvalue()      # a pipe or a log file gets no spinner


def test_findings_end_through_the_boundary_after_the_report(ws, monkeypatch):
    """A command that finds a problem (a plan that does not fit, a verify mismatch) shows its
    result, then raises: the boundary prints Error:/Hint: and exits with the finding's code."""
    import dataclasses
    import types

    r = run("plan", "chain.profile.json", "--budget", "1KiB", "-o", "low.plan.json")
    assert_clean_error(r, 4, "below the floor")
    r = run("simulate", "low.plan.json", "--json")
    assert_clean_error(r, 4, "does not keep activation memory under its budget")
    assert orjson.loads(r.stdout)["feasible"] is False

    @dataclasses.dataclass
    class Report:
        passed: bool = False
        reasons: tuple = ("losses differ",)

    fake = types.ModuleType("slackswap_cli.run.verify.verify")
    fake.verify = lambda *a, **k: Report()
    monkeypatch.setitem(sys.modules, "slackswap_cli.run.verify.verify", fake)
    r = run("verify", "chain.plan.json", "--json")       # the report is the fake's
    assert_clean_error(r, 5, "verify failed: losses differ")
    assert orjson.loads(r.stdout) == {"passed": False, "reasons": ["losses differ"]}
