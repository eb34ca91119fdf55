"""Comments and docstrings stay true to the code: they name no module or class that is gone, and
no issue number (a comment says what the code does and why, not which ticket asked for it).

Read are the comments (`#`) and the docstrings (module, class, function) of every Python file in
slackswap_cli/, slackswap_testkit/, benchmarks/ and tests/. Three checks:

- RETIRED: names of modules and classes that moved or went away, each with what holds its job
  now; a comment naming one points a reader at nothing;
- every path written like `run/foo.py` or `slackswap_cli/run/foo.py`, and every dotted
  `slackswap_cli.x.y` name, resolves to a file of the repository or a name in a module;
- no `issue 21`, `#29` or "the issue's" in them.

The pages (README.md, docs/) are held to RETIRED too.
"""
import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("slackswap_cli", "slackswap_testkit", "benchmarks", "tests")
THIS = Path(__file__).resolve()

# retired name (a regular expression on comment text) -> what does its job now
RETIRED: dict[str, str] = {
    r"\bpartition\.py\b|slackswap_cli[./]partition\b": "run/step_code.py",
    r"\breplay\.py\b|slackswap_cli[./]replay\b|`replay`": "run/inplace.py (patch(model))",
    r"\bruntime\.py\b|slackswap_cli[./]runtime\b|`runtime\.\w+":
        "run/swap.py (the swap engine) and run/step.py (PatchedStep)",
    r"\b_Template\b": "run/steady.py's Template",
    r"\btrace[./]memtrace\b": "run/memtrace.py",
    r"\btrace[./]replan\b": "run/replan.py",
    r"(?<![\w/.])cli\.py\b": "the cli/ package (cli/__init__.py, cli/cmd_*.py)",
    r"(?<![\w/.])render\.py\b": "the cli/render/ package",
    r"\brender_fit\b": "cli/render/fit.py",
    r"(?<![\w/.])schema\.py\b": "the schema/ package (types, load, validate, write)",
    r"(?<![\w/.])apply\.py\b|slackswap_cli[./]apply\b": "run/emit.py",
    r"\bonnx_import\b": "onnx/importer.py",
    r"\bonnx_grad_rules\b": "onnx/grad_rules.py",
    r"slackswap_cli[./]output\b": "cli/output.py",
    r"slackswap_cli[./]chrome_trace\b": "cli/chrome_trace.py",
    r"slackswap_cli[./]verify\b": "run/verify.py",
    r"slackswap_cli[./]synthetic\b": "slackswap_testkit/synthetic.py",
    r"slackswap_cli[./]local_search\b|planners[./]local_search\b":
        "slackswap_testkit/local_search.py",
    r"\bverify\.(TimelineRow|MeasuredStep|align|measure_eager_step|measure_patched_step"
    r"|predicted_timeline|synchronous_copies|worst_divergence)\b": "run/verify_timeline.py",
    r"\bverify\.(check_fits|saved_bytes_original)\b": "run/verify_memory.py",
    r"\bverify\.(compare_steps|rel_diff|tolerances)\b": "run/verify_steps.py",
}
# (file, retired pattern) pairs still to fix in files another change owns right now
PENDING: set[tuple[str, str]] = set()
ISSUE = re.compile(r"\bissues?\s*#?\d+|(?<![\w&/#])#\d+\b|\bthe issue's\b", re.IGNORECASE)

# a path (`run/foo.py`, `slackswap_cli/x.py`) or a bare file name (`foo.py`)
PATH = re.compile(r"(?<![\w./<-])((?:[\w.]+/)*\w+\.py)\b")
# a dotted name in the packages (`slackswap_cli.run.api.plan_model`)
DOTTED = re.compile(r"\b((?:slackswap_cli|slackswap_testkit)(?:\.\w+)+)")
# file names comments use for a user's files or torch's, not this repository's
NOT_OURS = {"model.py", "file.py", "patched.py", "OLD.py", "sgd.py"}


def comment_lines(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a Python file."""
    src = path.read_text(encoding="utf-8")
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(src).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src, filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                out += [(doc.lineno + i, line) for i, line in enumerate(doc.value.value.splitlines())]
    return sorted(out)


def scanned_files(root: Path = REPO) -> list[Path]:
    return [p for d in SCANNED for p in sorted((root / d).rglob("*.py")) if p.resolve() != THIS]


def retired_names(files: list[Path], root: Path = REPO) -> list[str]:
    """`file:line: name -> where it is now` for each retired name a comment uses."""
    found = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        for line, text in comment_lines(path):
            for pattern, now in RETIRED.items():
                m = re.search(pattern, text)
                if m and (rel, pattern) not in PENDING:
                    found.append(f"{rel}:{line}: {m.group(0)} (now: {now})")
    return found


def issue_numbers(files: list[Path], root: Path = REPO) -> list[str]:
    return [f"{path.relative_to(root).as_posix()}:{line}: {m.group(0)}"
            for path in files for line, text in comment_lines(path)
            for m in [ISSUE.search(text)] if m]


def _path_resolves(ref: str, path: Path, root: Path, names: set[str]) -> bool:
    if ref in NOT_OURS or ref.startswith("torch/"):
        return True
    if "/" not in ref:
        return ref in names            # a bare file name: some file of the repository
    bases = (root, root / "slackswap_cli", path.parent, path.parent.parent)
    return any((base / ref).is_file() for base in bases)


def _top_level_names(module: Path) -> set[str]:
    tree = ast.parse(module.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                try:
                    names |= set(ast.literal_eval(node.value))
                except ValueError:      # an __all__ built by code: its parts are names above
                    pass
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _dotted_resolves(ref: str, root: Path) -> bool:
    parts = ref.split(".")
    for k in range(len(parts), 0, -1):     # the longest prefix that is a module
        base = root.joinpath(*parts[:k])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            return k == len(parts) or parts[k] in _top_level_names(module)
    return False


def unresolved_references(files: list[Path], root: Path = REPO) -> list[str]:
    """`file:line: ref` for each path or dotted name in a comment that names nothing here."""
    names = {p.name for d in (*SCANNED, "examples") for p in (root / d).rglob("*.py")}
    bad = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        for line, text in comment_lines(path):
            bad += [f"{rel}:{line}: {m.group(1)}" for m in PATH.finditer(text)
                    if not _path_resolves(m.group(1), path, root, names)]
            bad += [f"{rel}:{line}: {m.group(1)}" for m in DOTTED.finditer(text)
                    if not _dotted_resolves(m.group(1), root)]
    return bad


def test_no_comment_names_a_retired_module_or_class():
    found = retired_names(scanned_files())
    assert not found, "comments naming what is gone:\n" + "\n".join(found)


def test_no_page_names_a_retired_module_or_class():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [f"{page.relative_to(REPO).as_posix()}:{n}: {m.group(0)} (now: {now})"
             for page in pages for n, text in enumerate(page.read_text("utf-8").splitlines(), 1)
             for pattern, now in RETIRED.items() for m in [re.search(pattern, text)] if m]
    assert not found, "pages naming what is gone:\n" + "\n".join(found)


def test_every_path_and_dotted_name_in_a_comment_exists():
    bad = unresolved_references(scanned_files())
    assert not bad, "comments naming files or names that do not exist:\n" + "\n".join(bad)


def test_no_issue_numbers_in_comments():
    found = issue_numbers(scanned_files())
    assert not found, "issue numbers in comments (say what the code does):\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for(tmp_path):
    # each check finds a planted case, in a comment and in a docstring, and passes a true one
    pkg = tmp_path / "slackswap_cli"
    (pkg / "run").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "run" / "__init__.py").write_text("")
    (pkg / "run" / "swap.py").write_text("class StepStore:\n    pass\n")
    (pkg / "m.py").write_text(
        '"""Uses `runtime.swap` and run/swap.py; see issue 21."""\n'
        "# `_Template` holds the records; slackswap_cli.run.swap.StepStore is fine\n"
        "def f():\n    '''run/gone.py and slackswap_cli.run.swap.Gone (#29)'''\n")
    files = [pkg / "m.py"]
    assert [f.split(": ")[1].split(" (now")[0] for f in retired_names(files, tmp_path)] == [
        "`runtime.swap", "_Template"]
    assert [f.split(": ")[1] for f in unresolved_references(files, tmp_path)] == [
        "run/gone.py", "slackswap_cli.run.swap.Gone"]
    assert [f.split(": ")[1] for f in issue_numbers(files, tmp_path)] == ["issue 21", "#29"]
    assert retired_names(files, tmp_path)[0].startswith("slackswap_cli/m.py:1:")
