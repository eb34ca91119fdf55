"""`slackswap apply` (the patched module) and `slackswap verify` (original against patched,
eager or --compile): the commands of the run side, which need torch."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError, VerifyFailed
from .common import (
    app,
    check_output_path,
    help_examples,
    json_option,
    plan_profile,
    quiet_option,
    renderer,
)
from .output import Result, Sink


# The library's modules are imported inside the functions, not here: `plan`, `show`, `simulate`
# and `compare` start without importing torch (tests/test_torch_free.py).
@app.command(short_help="Emit a patched training module that carries a plan out.",
             epilog=help_examples(
                 "slackswap apply model.plan.json -o model_patched.py",
             ))
def apply(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="plan JSON"),
    output: Path = typer.Option(..., "-o", "--output", help="path of the patched module (.py)"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="profile JSON [default: the one the plan records]"),
    model: Optional[Path] = typer.Option(None, "--model", help="workload file [default: the one the profile records]"),
    as_json: bool = json_option("{patched, module, plan, ...}"),
    quiet: bool = quiet_option(),
) -> None:
    """Emit a patched training module that carries the plan out on the real model."""
    sink = Sink(as_json, quiet)
    from ..run.emit import apply_plan
    from ..schema import load_plan, write_atomic
    if output.suffix != ".py":
        raise InputError(f"output {output} does not end in .py",
                         hint="the patched module is imported by your training script: "
                              f"name it e.g. {output.with_suffix('.py').name}")
    p = load_plan(plan_path)
    prof = plan_profile(p, profile_path)
    check_output_path(output, "-o", [plan_path, profile_path or p.profile_path, model,
                                      prof.workload.get("path")], example="patched.py")
    with sink.working("writing the patched module (re-tracing the model)"):
        source = apply_plan(p, prof, model_path=str(model) if model else None)
    write_atomic(output, source.encode())
    if not output.stem.isidentifier():
        sink.warn(f"'{output.stem}' is not a Python module name, so `import` cannot load it as "
                  "is: rename it (letters, digits, underscores) or load it with importlib")
    sink.show(Result({"patched": str(output), "module": output.stem,
                      "importable": output.stem.isidentifier(), "plan": str(plan_path),
                      "planner": p.planner, "feasible": p.feasible},
                     views=lambda: [f"wrote {output}", renderer().patch_usage(output.stem)]))


@app.command(short_help="Compare original and patched: losses, gradients, memory.",
             epilog=help_examples(
                 "slackswap verify model_patched.py --steps 3",
                 "slackswap verify model_patched.py --compile --also-at seq=24",
             ))
def verify(
    patched: Path = typer.Argument(..., metavar="PATCHED", help="patched module from `slackswap apply`"),
    model: Optional[Path] = typer.Option(None, "--model", help="workload file [default: the one the patched module records]"),
    steps: int = typer.Option(1, "--steps", min=1, help="training steps to compare"),
    plan: Optional[Path] = typer.Option(None, "--plan", help="the plan the module was made from, for the simulator's timeline [default: a matching plan next to the module]"),
    as_json: bool = json_option("the report"),
    compile_: bool = typer.Option(False, "--compile", help="check compile_planned instead: the partitioned graphs' saved, offloaded and recomputed against the plan, and values against eager"),
    backend: str = typer.Option("inductor", "--backend", help="with --compile: inductor or aot_eager"),
    also_at: List[str] = typer.Option([], "--also-at", metavar="KEY=VALUE", help="with --compile: as many steps again with this workload argument changed (another length: seq=24), which torch recompiles with symbolic sizes, judged like the first; repeatable"),
    quiet: bool = quiet_option(),
) -> None:
    """Run original and patched for N steps: losses and gradients equal, memory (op by op, against the simulator) and time measured."""
    sink = Sink(as_json, quiet)
    if also_at and not compile_:
        raise InputError("--also-at is for --compile", hint="add --compile to check "
                         "compile_planned at the profiled shapes and at these")
    if compile_:
        _verify_compiled(patched, model, steps, backend, sink, also_at)
        return
    from ..run.verify.verify import verify as run_verify
    plan_obj = None
    if plan is not None:
        from ..schema import load_plan
        plan_obj = load_plan(plan)
    with sink.working(f"running original and patched step{'s' if steps > 1 else ''}"):
        report = run_verify(str(patched), model_path=str(model) if model else None,
                            steps=steps, plan=plan_obj, progress=sink.progress)
    sink.show(Result(dataclasses.asdict(report) if dataclasses.is_dataclass(report) else report,
                     views=lambda: [renderer().verify_view(report),
                                    renderer().verify_memory_view(report)]))
    if not report.passed:
        raise VerifyFailed("verify failed: " + "; ".join(report.reasons),
                           "if the model or its code changed since it was profiled, run "
                           "`slackswap profile`, `plan` and `apply` again; a mismatch that "
                           "persists is a bug in slackswap, please report it")


def _verify_compiled(patched: Path, model: Optional[Path], steps: int, backend: str,
                     sink: Sink, also_at: List[str] = ()) -> None:
    """`verify --compile`: the report of run/verify/compiled.py (`--also-at`: its `also_at`)."""
    from ..run.compiled.backend import BACKENDS  # torch: a command imports it when it runs
    if backend not in BACKENDS:
        raise InputError(f"--backend must be {' or '.join(BACKENDS)}, not {backend!r}",
                         hint="compile_planned sets the partitioner of these two backends")
    for item in also_at:
        if "=" not in item:
            raise InputError(f"bad --also-at {item!r}: expected key=value",
                             hint="e.g. --also-at seq=24")
    from ..run.verify.compiled import verify_compiled
    from ..trace.workload import parse_workload_args
    with sink.working(f"compiling with the plan ({backend}) and running eager beside it"):
        report = verify_compiled(str(patched), str(model) if model else None,
                                 backend=backend, steps=steps,
                                 also_at=parse_workload_args(list(also_at)))
    sink.show(Result(report, views=lambda: [renderer().verify_compiled_view(report, backend)]))
    if not report["passed"]:
        raise VerifyFailed("verify --compile failed: " + "; ".join(report["reasons"]),
                           "if the model changed since it was profiled, run `slackswap "
                           "profile`, `plan` and `apply` again; a mismatch that persists is a "
                           "bug in slackswap")
