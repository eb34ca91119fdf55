"""The planning core must run without torch: plan, show, simulate and compare start fast, and
the commands that need torch say so plainly.

The core is the top level of slackswap_cli and its schema/, planners/ and pipeline/ packages,
named here module by module (a new module there must be added to CORE, which makes it a core
module); the CLI and its presentation
(slackswap_cli/cli/) are torch-free too, importing torch only inside the commands that need it.
"""
from pathlib import Path

from helpers import run_torch_blocked

ROOT = Path(__file__).resolve().parents[1] / "slackswap_cli"

# the core: every module at the top level of slackswap_cli, the schema, planners and pipeline
# packages
CORE = (
    "slackswap_cli", "slackswap_cli.workload_spec", "slackswap_cli.errors",
    "slackswap_cli.units", "slackswap_cli.schema", "slackswap_cli.hardware",
    "slackswap_cli.torch_api", "slackswap_cli.profile_build", "slackswap_cli.chains",
    "slackswap_cli.layers", "slackswap_cli.simulate", "slackswap_cli.budget",
    "slackswap_cli.guard", "slackswap_cli.fit", "slackswap_cli.profile_scale",
    "slackswap_cli.planning", "slackswap_cli.table_rows",
    "slackswap_cli.pipeline", "slackswap_cli.pipeline.stages", "slackswap_cli.pipeline.fit",
    "slackswap_cli.pipeline.orders", "slackswap_cli.pipeline.step",
    "slackswap_cli.pipeline.copies", "slackswap_cli.pipeline.windows",
    "slackswap_cli.pipeline.inflight",
    "slackswap_cli.op_cost", "slackswap_cli.compile_limits",
    "slackswap_cli.planners", "slackswap_cli.planners.common", "slackswap_cli.planners.settings",
    "slackswap_cli.planners.slackswap", "slackswap_cli.planners.optimal",
    "slackswap_cli.planners.baselines", "slackswap_cli.planners.bound",
    "slackswap_cli.planners.polish", "slackswap_cli.planners.ac_settings",
    "slackswap_cli.schema.types", "slackswap_cli.schema.load", "slackswap_cli.schema.validate",
    "slackswap_cli.schema.write",
)
# the CLI and its presentation: torch-free at import (the commands import torch when they run)
PRESENTATION = (
    "slackswap_cli.cli", "slackswap_cli.cli.boundary", "slackswap_cli.cli.common",
    "slackswap_cli.cli.output", "slackswap_cli.cli.chrome_trace", "slackswap_cli.cli.render",
    *(f"slackswap_cli.cli.render.{f.stem}" for f in sorted((ROOT / "cli" / "render").glob("*.py"))
      if f.stem != "__init__"),
    *(f"slackswap_cli.cli.{f.stem}" for f in sorted((ROOT / "cli").glob("cmd_*.py"))),
)


def test_core_is_the_top_level_and_the_planners():
    # every module at the top level (and in schema/, planners/ and pipeline/) is named in CORE,
    # and nothing else is
    found = {"slackswap_cli"} | {f"slackswap_cli.{f.stem}" for f in ROOT.glob("*.py")
                                  if f.stem != "__init__"}
    for pkg in ("schema", "planners", "pipeline"):
        found |= {f"slackswap_cli.{pkg}"} | {f"slackswap_cli.{pkg}.{f.stem}"
                                             for f in (ROOT / pkg).glob("*.py")
                                             if f.stem != "__init__"}
    assert found == set(CORE), (sorted(found - set(CORE)), sorted(set(CORE) - found))


def test_each_core_and_presentation_module_imports_without_torch():
    # `import torch` raises in there, so the first module that needs torch fails by name
    r = run_torch_blocked(f"""
        import importlib
        for mod in {[*CORE, *PRESENTATION]!r}:
            try:
                importlib.import_module(mod)
            except ImportError as exc:
                raise SystemExit(f"{{mod}} does not import without torch: {{exc}}")
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_core_imports_and_plans_with_torch_blocked(tmp_path):
    r = run_torch_blocked(f"""
        from slackswap_cli import schema, hardware, profile_build, simulate, budget
        from slackswap_cli import planners, units, chains, layers, fit, profile_scale
        from slackswap_cli.cli import chrome_trace, render
        from slackswap_cli.cli.render import fit as render_fit
        from slackswap_testkit import synthetic
        from slackswap_cli.cli import app
        from slackswap_cli.hardware import PRESETS
        from slackswap_testkit.synthetic import chain_profile
        from typer.testing import CliRunner
        assert simulate.simulate(chain_profile(3), {{}}, PRESETS["a100-pcie4"]).predicted.retention == 1.0
        schema.save(chain_profile(4), r"{tmp_path}/p.json")
        r = CliRunner().invoke(app, ["plan", r"{tmp_path}/p.json", "--budget", "0.6",
                                     "-o", r"{tmp_path}/plan.json"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(app, ["show", r"{tmp_path}/plan.json"])
        assert r.exit_code == 0, r.output
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


def test_torch_commands_without_torch_say_how_to_install_it(tmp_path):
    r = run_torch_blocked(f"""
        from typer.testing import CliRunner
        from slackswap_cli.cli import app
        for args in (["profile", r"{__file__}", "--device", "fake", "-o", r"{tmp_path}/p.json"],
                     ["verify", r"{__file__}"]):
            r = CliRunner().invoke(app, args)
            assert r.exit_code == 2, (args, r.output)
            assert "needs torch" in r.stderr and "pip install 'slackswap[torch]'" in r.stderr, r.stderr
            assert "internal error" not in r.stderr and "Traceback" not in r.output
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


def _import_graph():
    """Module -> the slackswap_cli modules it imports (deferred imports in functions too)."""
    import ast
    root = ROOT
    names = {}
    for f in root.rglob("*.py"):
        parts = ("slackswap_cli",) + f.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for mod, f in names.items():
        pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    full = f"{target}.{a.name}"
                    deps.add(full if full in names else target)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[mod] = {d for d in deps if d in names and d != mod}
    return graph


def test_no_import_cycles_and_the_core_never_imports_the_run_side():
    graph = _import_graph()
    assert "slackswap_cli.run.eager.inplace" in graph and "slackswap_cli.schema" in graph
    # a package's __init__ re-exporting its modules is not a cycle through them
    edges = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in graph.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(edges[m]):
            assert state.get(d) != "open", "import cycle: " + " -> ".join(stack[stack.index(d):] + [d])
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    # the core imports only the core (never trace/, onnx/, run/ or the CLI)
    for m in CORE:
        bad = graph[m] - set(CORE)
        assert not bad, f"core module {m} imports {sorted(bad)}"
