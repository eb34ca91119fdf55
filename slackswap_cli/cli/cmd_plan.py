"""`slackswap plan`: plan a profile under a budget, simulate, write the plan (exit 4 when none fits)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from ..errors import InfeasibleError
from ..planners import DEFAULT_PLANNER
from .common import (
    PLANNER_HELP,
    SLOW_PLANNERS,
    app,
    check_output_path,
    help_examples,
    json_option,
    load_plan_inputs,
    plan_with_paths,
    quiet_option,
    renderer,
    sibling_file,
)
from .output import Result, Sink


# The library's modules are imported inside the functions, not here: `plan`, `show`, `simulate`
# and `compare` start without importing torch (tests/test_torch_free.py).
@app.command(short_help="Decide keep / swap / recompute; simulate; write the plan.",
             epilog=help_examples(
                 "slackswap plan model.profile.json --budget 0.5",
                 "slackswap plan model.profile.json --budget 20GiB --hardware h100-pcie5 -o p.json",
                 "slackswap plan model.profile.json --budget 0.4 --planner optimal --time-limit 30",
             ))
def plan(
    profile_path: Path = typer.Argument(..., metavar="PROFILE", help="profile JSON from `slackswap profile`"),
    budget: str = typer.Option(..., "--budget", "-b", help="fraction of the keep-all activation peak (0.5) or bytes (20GiB, 512MiB, 2e9)"),
    planner: str = typer.Option(DEFAULT_PLANNER, "--planner", "-p", help=PLANNER_HELP),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="preset or JSON file [default: the profile's, else a100-pcie4]"),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", min=1.0, help=f"seconds the whole command may take with a planner that has a time limit ({SLOW_PLANNERS}) [default: the planner's]"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="plan path [default: <profile name>.plan.json in the current directory]"),
    for_compile: Optional[str] = typer.Option(None, "--for-compile", metavar="MODE", help="plan for compile_planned: model (the whole model) or per-block (per_block=True); what it cannot offload is kept or recomputed [default: an eager plan]"),
    as_json: bool = json_option("a summary of the plan (the file holds it all)"),
    quiet: bool = quiet_option(),
) -> None:
    """Decide keep / swap / recompute for every saved activation, simulate, write the plan."""
    started = time.perf_counter()
    sink = Sink(as_json, quiet)
    from ..budget import first_feasible_budget, floor_message
    from ..planners import planner_spec
    from ..planning import plan_profile
    from ..schema import save
    prof, hw, budget_bytes, fraction = load_plan_inputs(profile_path, budget, hardware)
    spec = planner_spec(planner)
    if for_compile is not None:
        from ..compile_limits import check_mode
        check_mode(for_compile)                     # an unknown mode before planning
    # below the floor no plan fits, but the planner's closest plan is still written
    below = floor_message(budget_bytes, prof)
    target = output or Path(sibling_file(profile_path, ".plan.json").name)
    check_output_path(target, "-o", [profile_path, hardware])
    # a planner with a time limit keeps its own reserve for the simulation and writing
    with sink.working(f"planning with {planner}"):
        result, sim = plan_profile(prof, hw, budget_bytes, fraction, planner,
                                   time_limit=time_limit, started=started, record=True,
                                   for_compile=for_compile)
    result = plan_with_paths(result, profile_path, prof)
    save(result, target)
    reach = None
    if not result.feasible and below is None and spec.quick:   # slow: a solve per step
        reach = first_feasible_budget(prof, hw, planner)
    summary = _plan_summary(result, target, prof)
    if spec.bound:
        summary["bound_retention"] = spec.bound_retention(prof, hw, budget_bytes)
    sink.show(Result(summary, views=lambda: renderer().plan_views(result, prof, sim),
                     lines=[f"wrote {target}"]))
    if not result.feasible:
        _plan_failed(prof, planner, target, below, reach)


def _plan_failed(prof, planner: str, target: Path, below, reach: Optional[int]) -> None:
    """`plan` found no plan under the budget: say where it would fit, and exit 4."""
    from ..planning import infeasible_message
    message, hint = infeasible_message(prof, planner, below, reach)
    raise InfeasibleError(f"{message}; wrote the closest plan found to {target} with feasible: "
                          "false", hint)


def _plan_summary(p, path: Path, prof) -> dict:
    """What a script wants from `plan --json`: where the plan is and what it predicts; the
    file holds the whole plan (every decision and the schedule)."""
    return {"plan": str(path), "planner": p.planner, "feasible": p.feasible,
            "hardware": p.hardware.get("name"), "budget_bytes": p.budget_bytes,
            "budget_fraction": p.budget_fraction, "actions": p.action_counts(prof),
            "predicted": p.predicted, "solve_ms": p.solve_ms, "notes": list(p.notes)}
