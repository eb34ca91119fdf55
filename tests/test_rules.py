"""The rules docs/design.md states about the package hold in its code (read as Python ASTs, so
the checks cost no import and no torch):

- who prints: the CLI prints only through cli/output.py, the library speaks only through
  run/notes.py (`notes.tell`, one `slackswap: ...` line on stderr);
- who exits: only the error boundary (cli/boundary.py) ends a command; commands raise
  `SlackswapError` (findings such as a failed verify included) and handle no errors of their own;
- what the library raises: `SlackswapError` for what a user can act on; a built-in exception
  only where `ALLOWED_RAISES` says why (Python's protocols, internal invariants whose message
  says "this is a bug in slackswap");
- the budget is converted in one place: only budget.py (`fraction_bytes`) multiplies a fraction
  by a keep-all peak;
- helpers another module uses are public: no module imports another's `_name` (from-import or
  `module._name`), so what one module lends another is named as such;
- the memory guard's rule has one owner: `guard.Guard` is the only class that decides what a
  plan cannot place, and the runtime and `guard.guarded_decisions` both apply it;
- plans identical on every machine: the planning core (everything but the run side, the
  tracers and the CLI) calls no numpy or math function whose answer depends on the CPU's
  instruction set or its maths library (`CPU_DEPENDENT`: SIMD selection and unstable sorts,
  BLAS products, functions that are not correctly rounded); tests/test_plans_identical.py
  checks the plans themselves.

Each rule's exceptions are listed below with the reason; an entry that matches nothing fails
too, so the lists stay true.
"""
from __future__ import annotations

import ast
import builtins
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "slackswap_cli"

# (module, what it calls) -> why it may print
ALLOWED_PRINTS: dict[tuple[str, str], str] = {
    ("cli/output.py", "print"): "the CLI's one printer (Rich consoles `out` and `err`)",
    ("cli/output.py", "sys.stdout.write"): "the CLI's one printer: --json's document",
    ("run/notes.py", "print"): "the library's one voice: `notes.tell`, a line on stderr",
    ("cli/boundary.py", "traceback.print_exception"):
        "the traceback a user asked for with SLACKSWAP_DEBUG=1, before the Error: line",
    ("run/api.py", "warnings.warn"):
        "plan_model's note about the plan it made: a Python warning, which the caller can filter",
}
# (module, function) -> why it may end the process or the command
ALLOWED_EXITS: dict[tuple[str, str], str] = {
    ("cli/boundary.py", "*"): "the error boundary: the one place that turns errors into exits",
    ("cli/common.py", "_version_flag"):
        "`--version` is an eager option: it ends the command with 0 after printing, no error",
    ("trace/static_memory.py", "_child"):
        "`fit --jobs 2`'s forked child process ends (os._exit) once it sent its profile back; "
        "the command goes on in the parent",
}
# (module, function, exception) -> why a built-in exception is right there
ALLOWED_RAISES: dict[tuple[str, str, str], str] = {
    ("__init__.py", "__getattr__", "AttributeError"): "a module's __getattr__: Python's protocol",
    ("__init__.py", "__getattr__", "ImportError"):
        "a lazy attribute whose optional dependency is missing: what `import` raises, with "
        "the pip command in the message",
    ("units.py", "fmt_bytes", "AssertionError"): "unreachable: the loop returns at TiB",
    ("trace/joint.py", "_trace_real_tensors", "RuntimeError"):
        "raised and caught in the same function: the signal to trace the real step instead",
    ("profile_build.py", "add_op", "ValueError"):
        "ProfileBuilder's contract with its frontends (trace/, onnx/): a tensor given two "
        "producers is a frontend's bug, not the user's input",
}
# misuse still raised as a built-in exception in a file another change owns right now
PENDING_RAISES: dict[tuple[str, str, str], str] = {}
BUG = "this is a bug in slackswap"      # an internal invariant's message: exit 1, report it

# numpy / math functions whose answer can differ between CPUs (docs/planning.md, "Plans
# identical on every machine"): selections and unstable sorts pick differently among ties with
# each SIMD kernel, products go through BLAS kernels chosen per CPU, and transcendental
# functions are not correctly rounded (numpy's SIMD versions and libm's FMA variants differ)
CPU_DEPENDENT = {"argpartition", "partition", "dot", "vdot", "inner", "matmul", "einsum",
                 "tensordot", "exp", "expm1", "exp2", "log", "log1p", "log2", "log10", "power",
                 "float_power", "pow", "sin", "cos", "tan", "tanh", "sinh", "cosh", "arcsin",
                 "arccos", "arctan", "arctan2", "atan", "atan2", "cbrt", "hypot", "erf"}
NOT_CORE = ("run/", "trace/", "onnx/", "cli/")   # the planning core is everything else

BUILTIN_ERRORS = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
                  and issubclass(getattr(builtins, n), BaseException)}
PRINTERS = {"print", "typer.echo", "typer.secho", "click.echo", "click.secho", "pprint.pprint",
            "sys.stdout.write", "sys.stderr.write", "sys.stdout.writelines",
            "sys.stderr.writelines", "traceback.print_exception", "traceback.print_exc",
            "traceback.print_stack", "os.write", "warnings.warn"}
EXITS = {"sys.exit", "exit", "quit", "os._exit", "typer.Exit", "typer.Abort", "SystemExit",
         "click.exceptions.Exit", "ctx.exit"}


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` of a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


@functools.cache
def _modules(root: Path = PKG) -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(root).as_posix(), ast.parse(p.read_text("utf-8")))
            for p in sorted(root.rglob("*.py"))]


def _with_functions(tree: ast.AST):
    """(innermost enclosing function's name or "<module>", node) for every node."""
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            yield inner, child
            yield from walk(child, inner)
    yield from walk(tree, "<module>")


def _consoles(tree: ast.Module) -> set[str]:
    """Names bound to a Rich Console in a module, or imported from cli/output.py's."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and (_dotted(node.value.func) or "").split(".")[-1] == "Console":
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("output"):
            names |= {a.asname or a.name for a in node.names if a.name in ("out", "err")}
    return names


def printing_calls(root: Path = PKG) -> list[tuple[str, str, int]]:
    """(module, what it calls, line) for every call that writes to the terminal."""
    found = []
    for rel, tree in _modules(root):
        consoles = _consoles(tree)
        for _, node in _with_functions(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func) or ""
            head, _, attr = name.rpartition(".")
            if name in PRINTERS:
                found.append((rel, name, node.lineno))
            elif attr in ("print", "log", "rule", "print_json") and head in consoles:
                found.append((rel, "print", node.lineno))
    return found


def exits(root: Path = PKG) -> list[tuple[str, str, int]]:
    """(module, function, line) for every exit: a call of sys.exit and its kin, or a raise of
    typer.Exit / SystemExit."""
    found = []
    for rel, tree in _modules(root):
        for fn, node in _with_functions(tree):
            target = node.func if isinstance(node, ast.Call) else node.exc \
                if isinstance(node, ast.Raise) and not isinstance(node.exc, ast.Call) else None
            if target is not None and _dotted(target) in EXITS:
                found.append((rel, fn, node.lineno))
    return found


def builtin_raises(root: Path = PKG) -> list[tuple[str, str, str, int, str]]:
    """(module, function, exception, line, message) for every raise of a built-in exception."""
    found = []
    for rel, tree in _modules(root):
        for fn, node in _with_functions(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            call = node.exc if isinstance(node.exc, ast.Call) else None
            name = _dotted(call.func if call else node.exc)
            if name in BUILTIN_ERRORS:
                text = " ".join(c.value for a in (call.args if call else ()) for c in ast.walk(a)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
                found.append((rel, fn, name, node.lineno, text))
    return found


def cpu_dependent_calls(root: Path = PKG) -> list[tuple[str, str, int]]:
    """(module, call, line) for every call in the planning core whose answer may depend on the
    CPU: a `CPU_DEPENDENT` function of numpy or math (or the array methods `argpartition`
    and `dot`), an `argsort` that does not ask for `kind="stable"`, a `@` product."""
    found = []
    for rel, tree in _modules(root):
        if rel.startswith(NOT_CORE):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                found.append((rel, "@", node.lineno))
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name = _dotted(node.func) or f"?.{node.func.attr}"
            head, attr = name.split(".")[0], node.func.attr
            stable = any(k.arg == "kind" and isinstance(k.value, ast.Constant)
                         and k.value.value == "stable" for k in node.keywords)
            if (attr in CPU_DEPENDENT and (head in ("np", "numpy", "math")
                                           or attr in ("argpartition", "dot"))) or \
                    (attr == "argsort" and not stable):
                found.append((rel, name, node.lineno))
    return found


def test_plans_do_not_depend_on_the_cpu():
    bad = [f"slackswap_cli/{rel}:{line}: {name}" for rel, name, line in cpu_dependent_calls()]
    assert not bad, ("calls in the planning core whose answer depends on the CPU (break ties "
                     "by a stated rule, e.g. np.lexsort((index, key)); sum in a fixed order or "
                     "with math.fsum; see docs/planning.md):\n" + "\n".join(bad))


def test_only_output_and_notes_print():
    bad = [f"slackswap_cli/{rel}:{line}: {name}" for rel, name, line in printing_calls()
           if (rel, name) not in ALLOWED_PRINTS]
    assert not bad, ("prints outside cli/output.py (the CLI) and run/notes.py (the library: "
                     "notes.tell):\n" + "\n".join(bad))


def test_only_the_error_boundary_exits():
    bad = [f"slackswap_cli/{rel}:{line} in {fn}" for rel, fn, line in exits()
           if (rel, "*") not in ALLOWED_EXITS and (rel, fn) not in ALLOWED_EXITS]
    assert not bad, ("exits outside cli/boundary.py (raise a SlackswapError: the boundary turns "
                     "it into Error:/Hint: and its exit code):\n" + "\n".join(bad))


def test_commands_handle_no_errors_of_their_own():
    """No command module catches what the boundary handles (SlackswapError and its kin,
    Exception, everything): a command that did would print and exit its own way."""
    from slackswap_cli import errors
    caught = {n for n in dir(errors) if isinstance(getattr(errors, n), type)
              and issubclass(getattr(errors, n), Exception)} | {"Exception", "BaseException"}
    bad = []
    for rel, tree in _modules():
        if not (rel.startswith("cli/cmd_") or rel == "cli/common.py"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler):
                types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
                names = {(_dotted(t) or "").split(".")[-1] for t in types if t is not None}
                if node.type is None or names & caught:
                    bad.append(f"slackswap_cli/{rel}:{node.lineno}")
    assert not bad, "commands catching errors the boundary handles:\n" + "\n".join(bad)


def test_the_library_raises_slackswap_errors():
    bad = [f"slackswap_cli/{rel}:{line} in {fn}: {name}({text[:60]!r})"
           for rel, fn, name, line, text in builtin_raises()
           if BUG not in text and (rel, fn, name) not in ALLOWED_RAISES | PENDING_RAISES.keys()]
    assert not bad, ("built-in exceptions raised where a user may meet them (raise a "
                     "SlackswapError with a hint, or say in ALLOWED_RAISES why not):\n"
                     + "\n".join(bad))


def test_every_allowance_is_used():
    """An allowance that matches nothing is stale: remove it."""
    printed = {(rel, name) for rel, name, _ in printing_calls()}
    exited = {(rel, fn) for rel, fn, _ in exits()} | {(rel, "*") for rel, _, _ in exits()}
    raised = {(rel, fn, name) for rel, fn, name, _, _ in builtin_raises()}
    stale = ([k for k in ALLOWED_PRINTS if k not in printed]
             + [k for k in ALLOWED_EXITS if k not in exited]
             + [k for k in (*ALLOWED_RAISES, *PENDING_RAISES) if k not in raised])
    assert not stale, f"allowances that match nothing (remove them): {stale}"


def test_the_guard_has_one_owner():
    """`guard.Guard` is the only class that decides keep-or-swap for what a plan cannot place
    (the only `admit`); every guard the runtime builds is one; `guarded_decisions` (the
    simulator's input for a run that departs from its plan, tests/test_guard.py) applies it."""
    admits, built = [], []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(f, ast.FunctionDef) and f.name == "admit" for f in node.body):
                admits.append(f"{rel}:{node.name}")
            if isinstance(node, ast.Assign) and any(
                    (_dotted(t) or "").endswith(".guard") for t in node.targets) \
                    and isinstance(node.value, ast.Call):
                built.append((rel, _dotted(node.value.func)))
    assert admits == ["guard.py:Guard"]
    assert built and {rel.split("/")[0] for rel, _ in built} == {"run"}
    assert {name for _, name in built} == {"Guard"}, built
    for rel, tree in _modules():
        if rel.startswith("run/") and any(name == "Guard" for r, name in built if r == rel):
            imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                       and (n.module or "") == "guard"
                       and n.level == rel.count("/") + 1 for a in n.names}
            assert "Guard" in imports, f"{rel} builds a Guard that is not guard.py's"
    guard = dict(_modules())["guard.py"]
    fn = next(n for n in guard.body if isinstance(n, ast.FunctionDef)
              and n.name == "guarded_decisions")
    calls = {_dotted(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)}
    assert {"Guard", "guard.admit", "guard.hold"} <= calls


def private_borrows(root: Path = PKG) -> list[tuple[str, str]]:
    """(module, name) for each private name (`_x`, not `__x__`) a module takes from another
    module of the package: `from .other import _x`, or `other._x` where `other` is a module
    of the package it imported."""
    def private(name):
        return name.startswith("_") and not name.startswith("__")
    found = []
    for rel, tree in _modules(root):
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "")
                                                     .startswith("slackswap_cli")):
                found += [(rel, a.name) for a in node.names if private(a.name)]
                modules |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in modules and private(node.attr):
                found.append((rel, f"{node.value.id}.{node.attr}"))
    return found


def test_no_module_borrows_another_modules_private_names():
    borrowed = private_borrows()
    assert not borrowed, f"private names taken from another module (make them public): {borrowed}"


def fraction_times_peak(root: Path = PKG) -> list[tuple[str, int]]:
    """(module, line) of each product of a fraction and a keep-all peak (a name holding
    `frac` times one holding `keep_all`) outside budget.py."""
    found = []
    for rel, tree in _modules(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                sides = [ast.unparse(node.left), ast.unparse(node.right)]
                if any("frac" in x for x in sides) and any("keep_all" in x for x in sides) \
                        and rel != "budget.py":
                    found.append((rel, node.lineno))
    return found


def test_the_budget_is_converted_in_one_place():
    """A fraction of the keep-all peak becomes bytes through `budget.fraction_bytes` alone
    (docs/design.md says so): one rounding, wherever a plan is made."""
    assert not fraction_times_peak(), fraction_times_peak()


def test_the_checks_see_what_they_look_for(tmp_path):
    (tmp_path / "planners").mkdir()      # before the first scan: `_modules` caches a root
    (tmp_path / "planners" / "x.py").write_text(
        "import math\nimport numpy as np\n"
        "def pick(a, b):\n    top = np.argpartition(a, 3)\n    o = a.argsort()\n"
        "    s = np.argsort(a, kind='stable')\n    return a @ b, math.log(2), a.dot(b), top, o, s\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "cmd_x.py").write_text(
        "import sys, typer\nfrom .output import err\n"
        "def go():\n    print('x')\n    err.print('y')\n    sys.stderr.write('z')\n"
        "    raise typer.Exit(4)\n"
        "def other():\n    sys.exit(1)\n    raise ValueError('bad input')\n"
        "def fine():\n    raise RuntimeError('x; this is a bug in slackswap, report it')\n")
    assert [(n, line) for _, n, line in printing_calls(tmp_path)] == [
        ("print", 4), ("print", 5), ("sys.stderr.write", 6)]
    assert [(fn, line) for _, fn, line in exits(tmp_path)] == [("go", 7), ("other", 9)]
    assert [(fn, n, BUG in t) for _, fn, n, _, t in builtin_raises(tmp_path)] == [
        ("other", "ValueError", False), ("fine", "RuntimeError", True)]
    assert [(n, line) for _, n, line in cpu_dependent_calls(tmp_path)] == [
        ("np.argpartition", 4), ("a.argsort", 5), ("@", 7), ("math.log", 7), ("a.dot", 7)]
    (tmp_path / "b").mkdir()          # (another root: `_modules` keeps what it read)
    (tmp_path / "b" / "stage.py").write_text("b = int(prof.keep_all_peak_bytes * fraction)\n")
    (tmp_path / "b" / "cmd_y.py").write_text(
        "from .cmd_x import _go, fine\nfrom . import cmd_x\ncmd_x._other()\ncmd_x.fine()\n")
    assert private_borrows(tmp_path / "b") == [("cmd_y.py", "_go"), ("cmd_y.py", "cmd_x._other")]
    assert fraction_times_peak(tmp_path / "b") == [("stage.py", 1)]
