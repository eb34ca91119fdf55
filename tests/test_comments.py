"""Comments and docstrings stay true to the code: they name no module or class that is gone, and
no issue number (a comment says what the code does and why, not which ticket asked for it).

Read are the comments (`#`) and the docstrings (module, class, function) of every Python file in
slackswap_cli/, slackswap_testkit/, benchmarks/ and tests/. Three checks:

- RETIRED: names of modules and classes that moved or went away, each with what holds its job
  now; a comment naming one points a reader at nothing;
- every path written like `run/foo.py` or `slackswap_cli/run/foo.py`, and every dotted
  `slackswap_cli.x.y` name, resolves to a file of the repository or a name in a module;
- no `issue 21`, `#29` or "the issue's" in them;
- every backticked name (`module.Name`, `Class.attr`, `module.Class.attr`, `torch.x.y`) names
  something that exists: the rules of what is resolved, and against what, are stated above
  `NAME_SPAN` below.

The pages (README.md, docs/*.md, outside their fenced code blocks) are held to RETIRED, to the
backticked names and to their paths (`run/swap.py`, `torch/_functorch/partitioners.py`) too.
"""
import ast
import functools
import io
import re
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("slackswap_cli", "slackswap_testkit", "benchmarks", "tests")
THIS = Path(__file__).resolve()

# retired name (a regular expression on comment text) -> what does its job now
RETIRED: dict[str, str] = {
    r"\bpartition\.py\b|slackswap_cli[./]partition\b": "run/written/code.py",
    r"\breplay\.py\b|slackswap_cli[./]replay\b|`replay`": "run/eager/inplace.py (patch(model))",
    r"\bruntime\.py\b|slackswap_cli[./]runtime\b|`runtime\.\w+":
        "run/swap.py (the swap engine) and run/written/step.py (PatchedStep)",
    r"\b_Template\b": "run/steady.py's Template",
    r"\btrace[./]memtrace\b": "run/verify/memtrace.py",
    r"\btrace[./]replan\b": "run/eager/replan.py",
    r"(?<![\w/.])cli\.py\b": "the cli/ package (cli/__init__.py, cli/cmd_*.py)",
    r"(?<![\w/.])render\.py\b": "the cli/render/ package",
    r"\brender_fit\b": "cli/render/fit.py",
    r"(?<![\w/.])schema\.py\b": "the schema/ package (types, load, validate, write)",
    r"(?<![\w/.])apply\.py\b|slackswap_cli[./]apply\b": "run/emit.py",
    r"\bonnx_import\b": "onnx/importer.py",
    r"\bonnx_grad_rules\b": "onnx/grad_rules.py",
    r"slackswap_cli[./]output\b": "cli/output.py",
    r"slackswap_cli[./]chrome_trace\b": "cli/chrome_trace.py",
    r"slackswap_cli[./]verify\b": "run/verify/verify.py",
    r"slackswap_cli[./]synthetic\b": "slackswap_testkit/synthetic.py",
    r"slackswap_cli[./]local_search\b|planners[./]local_search\b":
        "slackswap_testkit/local_search.py",
    r"\bverify\.(TimelineRow|MeasuredStep|align|measure_eager_step|measure_patched_step"
    r"|predicted_timeline|synchronous_copies|worst_divergence)\b": "run/verify/timeline.py",
    r"\bverify\.(check_fits|saved_bytes_original)\b": "run/verify/memory.py",
    r"\bverify\.(compare_steps|rel_diff|tolerances)\b": "run/verify/steps.py",
}
# (file, retired pattern) pairs still to fix in files another change owns right now
PENDING: set[tuple[str, str]] = set()
ISSUE = re.compile(r"\bissues?\s*#?\d+|(?<![\w&/#])#\d+\b|\bthe issue's\b", re.IGNORECASE)

# a path (`run/foo.py`, `slackswap_cli/x.py`) or a bare file name (`foo.py`)
PATH = re.compile(r"(?<![\w./<-])((?:[\w.]+/)*\w+\.py)\b")
# a dotted name in the packages (`slackswap_cli.run.api.plan_model`)
DOTTED = re.compile(r"\b((?:slackswap_cli|slackswap_testkit)(?:\.\w+)+)")
# file names comments use for a user's files or torch's, not this repository's
NOT_OURS = {"model.py", "file.py", "patched.py", "OLD.py", "sgd.py", "other.py", "empty_meta.py",
            "train.py", "fake_tensor.py"}


@functools.cache
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
    if ref in NOT_OURS:
        return True
    if _library_path(ref) is not None:
        return bool(_library_path(ref))
    if "/" not in ref:
        return ref in names            # a bare file name: some file of the repository
    bases = (root, root / "slackswap_cli", path.parent, path.parent.parent)
    return any((base / ref).is_file() for base in bases)


def _dotted_resolves(ref: str, root: Path) -> bool:
    parts = ref.split(".")
    for k in range(len(parts), 0, -1):     # the longest prefix that is a module
        base = root.joinpath(*parts[:k])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            return k == len(parts) or parts[k] in _Source(module).names
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


# --- backticked names: `module.Name`, `Class.attr`, `module.Class.attr`, `torch.x.y` ----------
#
# What is resolved, and what is not (the stated rules):
# - the span between backticks must be a dotted name, optionally followed by a call or a
#   subscript (`guard.Guard`, `Templates.superseded_of`, `notes.tell(text)`, `PARTS["compile"]`);
#   other spans (code, shell lines, file names such as `profile.json`) are not names;
# - the head is one of this repository's modules (a file of slackswap_cli/, slackswap_testkit/,
#   tests/, benchmarks/ or examples/, by its base name; a package by its folder name; the
#   package's own name, and `slackswap`, the alias the pages import it as), a class defined in
#   them, or an installed library found on sys.path (torch, typer, transformers, the standard
#   library). Any other head is a variable of an example (`model.forward`, `x.detach()`,
#   `ctx.store`) and names nothing to check;
# - a module's name must be defined at its top level (def, class, assignment, import,
#   `__all__`; a module with a `__getattr__` answers the string keys it holds), or be a
#   submodule; a class's attribute must be set in its body or on `self` in its methods, in
#   it or a base class of this repository; an attribute of anything else (a function, a value,
#   an imported name) is not followed;
# - where a head has several candidates (`plan`: cli/render/plan.py; `verify`: two modules),
#   the name resolves if any of them holds it;
# - a library module whose names come from a compiled extension (`from torch._C import *`,
#   a built-in module such as `sys`) answers every name: its source cannot say;
# - `aten.x` is torch's operator namespace too (torch.ops.aten, registered by C++): it resolves
#   if torchgen's native_functions.yaml declares operator x; `Tensor.x` is torch's Tensor too:
#   it resolves if torch's `_tensor.py` or its `_C` stubs define x;
# - a format name the files carry (`slackswap.profile`, schema/types.py's string constants) is
#   a string, not a name.
# - a key path of a file or report the package writes (`workload.path` in a profile,
#   `compiled.saved_bytes` in verify --compile's report): `KEY_HEADS` names the sections; it
#   resolves where each key is a string the package spells or a field of one of its classes.
NAME_SPAN = re.compile(r"`([^`\n]+)`")
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?=$|[(\[])")
FILE_SUFFIXES = {"py", "json", "md", "onnx", "txt", "csv", "yaml", "yml", "toml", "pt", "html",
                 "sh", "so", "whl", "log", "jsonl", "pkl", "bin", "safetensors", "cfg", "ini"}
ALIASES = {"slackswap": "slackswap_cli"}     # `import slackswap_cli as slackswap` in the pages
KEY_HEADS = {          # a section of a file or report -> where it is
    "workload": "a profile's workload header (docs/formats.md)",
    "compiled": "verify --compile's report: the partitioned graphs",
    "plan": "verify --compile's report: the plan as the graphs hold it",
    "inplace": "verify's report: each call of the model patched in place",
}
MODULE_DIRS = ("slackswap_cli", "slackswap_testkit", "tests", "benchmarks", "examples")


class _Source:
    """What a Python file defines: top-level names, classes (their attributes and bases), and
    whether a star import or a `__getattr__` leaves its names open."""

    def __init__(self, path: Path):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        self.names: set[str] = set()
        self.classes: dict[str, tuple[set[str], list[str]]] = {}
        self.open = False
        self._top(tree.body)
        self.strings = {n.value for n in ast.walk(tree)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if "__getattr__" in self.names:
            self.names |= self.strings

    def _top(self, body) -> None:
        for node in body:
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                self._top(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                          + [s for h in getattr(node, "handlers", []) for s in h.body])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                self.names.add(node.name)
                self.classes[node.name] = (_class_attributes(node),
                                           [b.split(".")[-1] for b in map(_dotted, node.bases) if b])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    try:
                        self.names |= set(ast.literal_eval(node.value))
                    except ValueError:      # an __all__ built by code: its parts are above
                        pass
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any(a.name == "*" for a in node.names):
                    self.open = True
                self.names |= {(a.asname or a.name).split(".")[0] for a in node.names}


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: its body's defs, classes and assignments (fields, slots, enum
    members) and every `self.x` its methods assign."""
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                out |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                        and isinstance(c.value, str)}
    for node in ast.walk(cls):
        if isinstance(node, (ast.Attribute,)) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            out.add(node.attr)
    return out


class _Index:
    """The repository's modules and classes, and installed libraries, read on demand."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, list[Path]] = {}      # head -> module files or package dirs
        for d in MODULE_DIRS:
            if not (root / d).is_dir():
                continue
            self.modules.setdefault(d, []).append(root / d)
            for p in (root / d).rglob("*"):
                if p.suffix == ".py" and p.stem != "__init__":
                    self.modules.setdefault(p.stem, []).append(p)
                elif p.is_dir() and (p / "__init__.py").is_file():
                    self.modules.setdefault(p.name, []).append(p)
        self._sources: dict[Path, _Source | None] = {}
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}
        for paths in list(self.modules.values()):
            for p in paths:
                src = self.source(p)
                for name, cls in (src.classes.items() if src else ()):
                    self.classes.setdefault(name, []).append(cls)

    def source(self, path: Path) -> "_Source | None":
        if path.is_dir():
            path = path / "__init__.py"
        if path not in self._sources:
            try:
                self._sources[path] = _Source(path) if path.is_file() else None
            except (SyntaxError, UnicodeDecodeError):
                self._sources[path] = None
        return self._sources[path]

    @functools.cache
    def library(self, head: str) -> list[Path] | None:
        """An installed top-level module's file or package folder (found, not imported); [] for
        a built-in module (no source); None when no such module is installed."""
        if head in sys.builtin_module_names:
            return []
        for base in sys.path[1:]:
            if not base or Path(base).resolve() == self.root or not Path(base).is_dir():
                continue
            for cand in (Path(base) / head, Path(base) / f"{head}.py"):
                if cand.is_file() or (cand / "__init__.py").is_file():
                    return [cand]
        return None

    def has_attribute(self, cls_name: str, attr: str, seen=()) -> bool:
        for attrs, bases in self.classes.get(cls_name, ()):
            if attr in attrs or any(self.has_attribute(b, attr, (*seen, cls_name))
                                    for b in bases if b not in seen and b in self.classes):
                return True
        return False

    def resolves(self, parts: list[str], places: list[Path]) -> bool:
        """Does `parts` name something in one of `places` (module files or package folders)?"""
        return any(self._in_module(parts, p) for p in places)

    def _in_module(self, parts: list[str], place: Path) -> bool:
        if not parts:
            return True
        if place.is_dir():
            sub = [p for p in (place / parts[0], place / f"{parts[0]}.py")
                   if p.is_file() or (p / "__init__.py").is_file()]
            if sub:
                return self._in_module(parts[1:], sub[0])
        src = self.source(place)
        if src is None or src.open:
            return True                # a compiled module's names, or a star import's
        if parts[0] not in src.names:
            return False
        if len(parts) > 1 and parts[0] in src.classes:
            attrs, bases = src.classes[parts[0]]
            return parts[1] in attrs or any(self.has_attribute(b, parts[1]) for b in bases)
        return True

    def check(self, name: str) -> bool | None:
        """True: `name` resolves; False: it names nothing; None: not a name this checks."""
        parts = name.split(".")
        if parts[-1] in FILE_SUFFIXES or name in self.strings:
            return None
        head = ALIASES.get(parts[0], parts[0])
        places = self.modules.get(head, []) + ([self.root / "slackswap_cli" / "planners" /
                                                "slackswap.py"] if parts[0] == "slackswap" else [])
        lib = self.library(head)
        if not (places or head in self.classes or lib is not None or head in KEY_HEADS
                or head in ("aten", "Tensor")):
            return None
        if lib == [] or (places + (lib or [])) and self.resolves(parts[1:], places + (lib or [])):
            return True
        if head in self.classes and self.has_attribute(head, parts[1]):
            return True
        if head in KEY_HEADS and all(k in self.keys for k in parts[1:]):
            return True
        if head == "aten":
            return parts[1] in self.aten_ops
        if head == "Tensor":
            return parts[1] in self.torch_tensor_methods
        return False

    @functools.cached_property
    def strings(self) -> set[str]:
        src = (self.root / "slackswap_cli" / "schema" / "types.py").read_text("utf-8")
        return {n.value for n in ast.walk(ast.parse(src))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    @functools.cached_property
    def keys(self) -> set[str]:
        """Every string the package spells and every attribute of its classes."""
        out = {a for found in self.classes.values() for attrs, _ in found for a in attrs}
        for path in (self.root / "slackswap_cli").rglob("*.py"):
            src = self.source(path)
            out |= src.strings if src else set()
        return out

    @functools.cached_property
    def aten_ops(self) -> set[str]:
        found = self.library("torchgen") or []
        yaml = [p / "packaged" / "ATen" / "native" / "native_functions.yaml" for p in found]
        text = yaml[0].read_text("utf-8") if yaml and yaml[0].is_file() else ""
        return set(re.findall(r"^- func: (\w+)", text, re.MULTILINE))

    @functools.cached_property
    def torch_tensor_methods(self) -> set[str]:
        found = self.library("torch") or []
        text = "".join(p.read_text("utf-8") for t in found
                       for p in (t / "_tensor.py", t / "_C" / "__init__.pyi") if p.is_file())
        return set(re.findall(r"^\s+def (\w+)\(", text, re.MULTILINE))


@functools.cache
def _index(root: Path) -> _Index:
    return _Index(root)


def backticked_names(text: str) -> list[str]:
    """The dotted names written between backticks in a line of text."""
    out = []
    for span in NAME_SPAN.findall(text):
        m = DOTTED_NAME.match(span.strip())
        if m:
            out.append(m.group(0))
    return out


def page_lines(page: Path) -> list[tuple[int, str]]:
    """(line, text) of a page outside its fenced code blocks (examples of a user's code)."""
    out, fenced = [], False
    for n, line in enumerate(page.read_text("utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def unresolved_names(sources: list[tuple[str, list[tuple[int, str]]]], root: Path = REPO
                     ) -> list[str]:
    """`file:line: name` for each backticked name that names nothing (see the rules above)."""
    index = _index(root)
    return [f"{rel}:{line}: {name}" for rel, lines in sources for line, text in lines
            for name in backticked_names(text) if index.check(name) is False]


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_backticked_name_in_a_comment_exists():
    sources = [(p.relative_to(REPO).as_posix(), comment_lines(p)) for p in scanned_files()]
    bad = unresolved_names(sources)
    assert not bad, "comments naming what does not exist:\n" + "\n".join(bad)


def test_every_backticked_name_and_path_in_a_page_exists():
    names = {p.name for d in (*SCANNED, "examples") for p in (REPO / d).rglob("*.py")}
    sources = [(p.relative_to(REPO).as_posix(), page_lines(p)) for p in pages()]
    bad = unresolved_names(sources)
    bad += [f"{rel}:{line}: {m.group(1)}" for rel, lines in sources for line, text in lines
            for m in PATH.finditer(text) if not _page_path_resolves(m.group(1), names)]
    assert not bad, "pages naming what does not exist:\n" + "\n".join(bad)


def _library_path(ref: str) -> bool | None:
    """A path into an installed library (`torch/_functorch/partitioners.py`): whether that file
    exists there; None when its first folder is no installed library."""
    head = ref.split("/")[0]
    for base in sys.path[1:]:
        if base and (Path(base) / head / "__init__.py").is_file() and Path(base).resolve() != REPO:
            return (Path(base) / ref).is_file()
    return None


def _page_path_resolves(ref: str, names: set[str]) -> bool:
    if ref in NOT_OURS:
        return True
    if "/" not in ref:
        return ref in names
    lib = _library_path(ref)
    if lib is not None:
        return lib
    return any((base / ref).is_file() for base in (REPO, REPO / "slackswap_cli", REPO / "docs"))


def test_the_name_resolver_sees_what_it_looks_for(tmp_path):
    # a renamed constant, a method of a base class, a gone attribute, an example's variable,
    # torch's operators and Tensor methods, a key path, a format name
    pkg = tmp_path / "slackswap_cli"
    (pkg / "run").mkdir(parents=True)
    (pkg / "schema").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "run" / "__init__.py").write_text("")
    (pkg / "schema" / "__init__.py").write_text("")
    (pkg / "schema" / "types.py").write_text('PROFILE_FORMAT = "slackswap.profile"\n')
    (pkg / "run" / "lineup.py").write_text("TRACE_ONLY = frozenset()\n")
    (pkg / "run" / "packing.py").write_text("class Packing:\n    def _fresh(self):\n        pass\n")
    (pkg / "run" / "record.py").write_text(
        "from .packing import Packing\n\nclass PlanRun(Packing):\n"
        "    def __init__(self):\n        self.guard = None\n\n"
        "class _Patched:\n    __slots__ = ('plans',)\n")
    (pkg / "run" / "verify.py").write_text('REPORT = {"saved_bytes": 0}\n')
    text = ("`record.TRACE_ONLY` `lineup.TRACE_ONLY` `PlanRun._fresh` `PlanRun.guard` "
            "`PlanRun._gone` `_Patched.plans` `_Patched.superseded` `model.forward(x)` "
            "`aten.mm.default` `aten.no_such_op` `Tensor.as_strided` `Tensor.no_such_method` "
            "`compiled.saved_bytes` `compiled.no_such_key` `slackswap.profile` `profile.json` "
            "`torch._functorch.partitioners.min_cut_rematerialization_partition` "
            "`torch._functorch.partitioners.no_such_name`")
    bad = [b.split(": ")[1] for b in unresolved_names([("page.md", [(1, text)])], tmp_path)]
    assert bad == ["record.TRACE_ONLY", "PlanRun._gone", "_Patched.superseded", "aten.no_such_op",
                   "Tensor.no_such_method", "compiled.no_such_key",
                   "torch._functorch.partitioners.no_such_name"]
