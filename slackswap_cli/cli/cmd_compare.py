"""`slackswap compare`: every planner (and optionally torch.compile's choice) on one profile."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import InputError
from ..planners import planner_names
from .common import (
    SLOW_PLANNERS,
    app,
    help_examples,
    json_option,
    load_plan_inputs,
    quiet_option,
    renderer,
    time_options,
)
from .output import Result, Sink


# The library's modules are imported inside the functions, not here: `plan`, `show`, `simulate`
# and `compare` start without importing torch (tests/test_torch_free.py).
@app.command(short_help="Every planner side by side on one profile.",
             epilog=help_examples(
                 "slackswap compare model.profile.json --budget 0.5",
                 "slackswap compare model.profile.json --budget 0.5 --planners slackswap,swap-all --json",
                 "slackswap compare model.profile.json --budget 0.5 --with-torch-compile",
             ))
def compare(
    profile_path: Path = typer.Argument(..., metavar="PROFILE", help="profile JSON"),
    budget: str = typer.Option(..., "--budget", "-b", help="fraction (0.5) or bytes (20GiB)"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="preset or JSON file"),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", min=1.0, help=f"seconds a planner with a time limit ({SLOW_PLANNERS}) may take [default: the planner's]"),
    planners: Optional[str] = typer.Option(None, "--planners", help=f"comma-separated subset of: {', '.join(planner_names())} [default: all]"),
    as_json: bool = json_option("{results: [...]}"),
    with_torch_compile: bool = typer.Option(False, "--with-torch-compile", help="add a row for torch.compile's own choice: its min-cut partitioner on the profile's graph (re-traced from the workload with fake tensors; needs torch), activation_memory_budget searched to meet the budget"),
    model: Optional[Path] = typer.Option(None, "--model", help="with --with-torch-compile: the workload file [default: the one the profile records]"),
    quiet: bool = quiet_option(),
) -> None:
    """Every planner side by side on one profile: retention, peak, stall, recompute, solve time."""
    sink = Sink(as_json, quiet)
    from ..budget import check_budget
    if model is not None and not with_torch_compile:
        raise InputError("--model is the workload file for --with-torch-compile",
                         hint="add --with-torch-compile, or leave --model out")
    prof, hw, budget_bytes, fraction = load_plan_inputs(profile_path, budget, hardware)
    check_budget(budget_bytes, prof)
    names = _compared_planners(planners)
    rows = [_compare_row(name, prof, hw, budget_bytes, fraction, time_limit, sink)
            for name in names]
    if with_torch_compile:
        rows.append(_torch_compile_row(prof, profile_path, model, hw, budget_bytes, fraction,
                                       sink))
    sink.show(Result({"profile": str(profile_path), "hardware": hw.name,
                      "budget_bytes": budget_bytes, "budget_fraction": fraction, "results": rows},
                     views=lambda: renderer().compare_views(
                         rows, budget_bytes, hardware=hw.name,
                         keep_all_bytes=prof.keep_all_peak_bytes)))


def _compared_planners(planners: Optional[str]) -> list[str]:
    """--planners as a list of names, every one checked before any planner runs (a slow one
    alone can take a minute)."""
    names = planner_names() if planners is None else [p.strip() for p in planners.split(",") if p.strip()]
    if not names:
        raise InputError(f"--planners '{planners}' names no planner",
                         hint=f"a comma-separated subset of: {', '.join(planner_names())}")
    unknown = [n for n in names if n not in planner_names()]
    if unknown:
        raise InputError(f"unknown planner '{unknown[0]}' in --planners",
                         hint=f"planners: {', '.join(planner_names())}")
    return names


def _compare_row(name: str, prof, hw, budget_bytes: int, fraction, time_limit: Optional[float],
                 sink: Sink) -> dict:
    """compare's row of one registered planner."""
    from ..planners import make_plan, planner_spec
    spec = planner_spec(name)
    options = time_options(spec, time_limit)
    sink.status(f"planning with {name}..." if "time_limit_s" not in options else
                f"planning with {name} ({spec.summary}, limit {options['time_limit_s']:g} s: set "
                f"it with --time-limit, or leave {name} out with --planners)...")
    with sink.working(f"planning with {name}"):
        p = make_plan(name, prof, hw, budget_bytes, budget_fraction=fraction, **options)
    return {"planner": name, "feasible": p.feasible, "predicted": p.predicted,
            "solve_ms": p.solve_ms, "notes": list(p.notes),
            "bound_retention": spec.bound_retention(prof, hw, budget_bytes)}


def _torch_compile_row(prof, profile_path: Path, model: Optional[Path], hw, budget_bytes: int,
                       fraction, sink: Sink) -> dict:
    """compare's `torch.compile` row: torch's partitioner on the re-traced step, knob searched."""
    from ..trace.torch_choice import PLANNER_NAME, baseline_for
    sink.status("re-tracing the workload with fake tensors for torch.compile's partitioner...")
    with sink.working("re-tracing the workload"):
        base = baseline_for(prof, profile_path, model)
    sink.status("searching torch's activation_memory_budget (a min-cut partition per try)...")
    with sink.working("partitioning with torch's min-cut partitioner"):
        res = base.plan(hw, budget_bytes, fraction)
    p = res.plan
    return {"planner": PLANNER_NAME, "feasible": p.feasible, "predicted": p.predicted,
            "solve_ms": p.solve_ms, "notes": list(p.notes), "bound_retention": None,
            "activation_memory_budget": res.knob, "met_budget": res.met_budget,
            "knob_tried": [{"activation_memory_budget": k, "feasible": f, "peak_bytes": b}
                           for k, f, b in res.tried]}
