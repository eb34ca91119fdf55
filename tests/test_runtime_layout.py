"""The eager runtime's layout: one door for patched files, few modules at import, the tracer and
planners only on a re-plan, and every runtime class declaring the state it reads."""
import ast
import json
import subprocess
import sys
from pathlib import Path

from workloads import ROOT, plan_at, profiled, write_patched

from slackswap_cli.run.eager import call_state

RUN = ROOT / "slackswap_cli" / "run" / "eager"
# the call machinery: its classes declare their state (slots), its functions over a call's
# state (`s`) read only `CallState`'s fields
MACHINERY = ["call_state", "holding", "backward", "first_call", "steady_call", "new_shape",
             "templates", "packs", "tables", "inplace"]
# (classes that keep a __dict__ on purpose: the dispatch mode's base has one; the patched
# forward stands in for a bound method, whose attributes wrappers may read or set)
UNSLOTTED = {"first_call.Recorder", "inplace._PatchedForward"}
TRACER_AND_PLANNERS = ("slackswap_cli.trace.joint", "slackswap_cli.trace.graph_profile",
                       "slackswap_cli.trace.workload", "slackswap_cli.trace.fake_build",
                       "slackswap_cli.planners", "slackswap_cli.simulate",
                       "slackswap_cli.chains", "slackswap_cli.run.eager.replan")


def _loaded_after(code: str) -> dict:
    """Run `code` in a fresh interpreter; its last stdout line is JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT),
                                                    "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_door_loads_at_most_15_modules_and_no_tracer():
    got = _loaded_after("import sys, json\nimport slackswap_cli.run.door\n"
                        "print(json.dumps(sorted(k for k in sys.modules "
                        "if k.startswith('slackswap_cli'))))")
    assert "slackswap_cli.run.door" in got and len(got) <= 15, got
    said = _design_text().split("Patched files import run/door.py only (")[1].split(" ")[0]
    assert int(said) == len(got), f"docs/design.md says the door loads {said} modules: {got}"
    assert not [m for m in got if m.startswith(("slackswap_cli.trace", "slackswap_cli.schema",
                                                "slackswap_cli.planners"))], got


def test_a_patched_file_imports_only_the_door(files, tmp_path):
    prof = profiled(files, "tiny_gpt")
    text = write_patched(tmp_path, plan_at(prof, prof.summary["peak_activation_bytes"] // 2),
                         prof).read_text()
    imports = [ln for ln in text.splitlines() if ln.startswith(("import ", "from "))]
    assert imports == ["import torch", "from slackswap_cli.run import door",
                       "from slackswap_cli.run.door import GraphRow, OpRow"], imports


def test_training_calls_load_neither_the_tracer_nor_the_planners(files, tmp_path):
    """A fresh process imports a patched file, patches the tiny GPT and trains three steps
    at its profiled shapes (a recorded call, then steady ones): the plan runs (recomputes or
    swaps), and no tracer or planner module was imported."""
    prof = profiled(files, "tiny_gpt")
    path = write_patched(tmp_path, plan_at(prof, prof.summary["peak_activation_bytes"] // 2),
                         prof)
    got = _loaded_after(f"""
import importlib.util, json, runpy, sys
spec = importlib.util.spec_from_file_location("patched_tiny", {str(path)!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
model, inputs = runpy.run_path({str(files["tiny_gpt"])!r})["workload"]()
mod.patch(model)
model.train()
kinds, acted = [], 0
for _ in range(3):
    model(*inputs).backward()
    run = model.forward.__slackswap__.last_run
    kinds.append(run.kind)
    acted += run.rerun_ops + len(run.swaps)
print(json.dumps([sorted(k for k in sys.modules if k.startswith("slackswap_cli")), kinds,
                  acted]))
""")
    loaded, kinds, acted = got
    assert kinds == ["first", "steady", "steady"] and acted > 0, got
    assert not [m for m in loaded if m.startswith(TRACER_AND_PLANNERS)], loaded


def _declared(cls: ast.ClassDef) -> set[str] | None:
    """The names a class declares: its `__slots__`, class-level names, methods and
    properties; None when it declares no `__slots__` (and is no NamedTuple)."""
    names, slots = set(), None
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                    if t.id == "__slots__":
                        slots = set(ast.literal_eval(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    named_tuple = any(isinstance(b, ast.Name) and b.id == "NamedTuple" for b in cls.bases)
    if slots is None and not named_tuple:
        return None
    return names | (slots or set())


def _reads(tree, name: str) -> set[tuple[str, int]]:
    """(attribute, line) of every `name.attr` in `tree`."""
    return {(n.attr, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == name}


def test_every_runtime_class_declares_the_state_it_reads():
    """Each class of the call machinery has `__slots__` (or is a NamedTuple), and reads and
    writes on `self` only names it declares; each function over a call's state (`s`) reads
    only `CallState`'s declared fields and methods. A field a call kind forgot to set, or one
    set under another name, fails here rather than on the one kind of call that reads it."""
    state = set(call_state.CallState.__slots__) | {
        n for n in vars(call_state.CallState) if not n.startswith("__")}
    undeclared, unslotted = [], []
    for name in MACHINERY:
        tree = ast.parse((RUN / f"{name}.py").read_text())
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            declared = _declared(cls)
            if declared is None:
                if f"{name}.{cls.name}" not in UNSLOTTED:
                    unslotted.append(f"{name}.{cls.name}")
                continue
            undeclared += [f"{name}.{cls.name}.{a} (line {line})"
                           for a, line in _reads(cls, "self") if a not in declared]
        undeclared += [f"{name}: s.{a} (line {line})" for a, line in _reads(tree, "s")
                       if a not in state]
    assert not unslotted, f"runtime classes without __slots__: {unslotted}"
    assert not undeclared, f"attributes read but not declared: {sorted(undeclared)}"


def test_the_machinery_modules_exist():
    """(The list above names files that exist: a renamed module is not skipped silently.)"""
    assert all((RUN / f"{name}.py").is_file() for name in MACHINERY)
    assert Path(call_state.__file__).parent == RUN


def test_every_call_kind_has_the_declared_interface():
    """`call_state.CallPolicy` is what the patched forward reads of a call: each of the four
    call kinds has a `kind` of its own, `s` and `pack` (a method, or a slot `KeepAllCall` sets
    to None when no hook needs to run) and `finish`."""
    from slackswap_cli.run.eager.first_call import FirstCall
    from slackswap_cli.run.eager.new_shape import NewShapeCall
    from slackswap_cli.run.eager.steady_call import KeepAllCall, SteadyCall
    declared = set(call_state.CallPolicy.__annotations__) | {
        n for n in vars(call_state.CallPolicy) if not n.startswith("_")}
    assert declared >= {"s", "kind", "pack", "finish"}, declared
    kinds = [FirstCall, SteadyCall, KeepAllCall, NewShapeCall]
    for cls in kinds:
        has = set(cls.__slots__) | {n for n in vars(cls) if not n.startswith("__")}
        assert declared <= has, (cls.__name__, declared - has)
        assert callable(cls.finish)
    assert len({cls.kind for cls in kinds}) == len(kinds)


def _design_layout() -> set[str]:
    """The modules docs/design.md's layout (section 3) lists, as paths under slackswap_cli/:
    an entry (a module's file name opening a line of its folder) or a bare file name in the
    text of its folder's entries (`cmd_plan.py: plan`); a path with a slash is a reference,
    not a listing."""
    import re
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## 3. Layout and rules")[1].split("```")[1]
    listed, folders = set(), None          # folders: [(indent, "run/eager/"), ...]
    for line in block.splitlines():
        if line.startswith("slackswap_cli/"):
            folders = [(0, "")]
            continue
        if folders is None or not line.strip():
            continue
        if not line.startswith(" "):
            break                          # the package's block ends (slackswap_testkit/ ...)
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if indent <= 8 and re.fullmatch(r"[\w.,]+/?|__init__\.py,", first):   # an entry
            while folders[-1][0] >= indent and len(folders) > 1:
                folders.pop()
            if first.endswith("/"):
                folders.append((indent, folders[-1][1] + first))
        listed |= {folders[-1][1] + t for t in re.findall(r"(?<![\w/])(\w+\.py)\b", line)}
    return listed


def test_the_design_layout_lists_every_module_and_only_those():
    """Every module of the package is in design.md's layout, in its folder, and every module
    the layout lists exists (a package's own __init__.py may go unlisted)."""
    pkg = ROOT / "slackswap_cli"
    on_disk = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")}
    listed = _design_layout()
    missing = sorted(p for p in on_disk - listed if not p.endswith("/__init__.py"))
    assert not missing, f"modules design.md's layout does not list: {missing}"
    assert not listed - on_disk, f"design.md lists modules that do not exist: {listed - on_disk}"


def _design_text() -> str:
    return " ".join((ROOT / "docs" / "design.md").read_text().split())


def test_the_design_zoo_count_is_the_tests():
    """design.md's counts of the zoo models tests/test_zoo.py holds to their rows are the
    lengths of its SUBSET (by default) and SLOW_SUBSET (the slow tier)."""
    tree = ast.parse((ROOT / "tests" / "test_zoo.py").read_text())
    def length(name):
        return len(next(n.value for n in tree.body if isinstance(n, ast.Assign) and any(
            getattr(t, "id", None) == name for t in n.targets)).elts)
    said = _design_text().split("`tests/test_zoo.py` holds ")[1].split()
    assert (int(said[0]), int(said[said.index("more") - 1])) == (length("SUBSET"),
                                                                 length("SLOW_SUBSET"))
