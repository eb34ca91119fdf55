"""`slackswap simulate` (a plan re-simulated, a Perfetto trace) and `slackswap show` (a
profile or a plan in the terminal)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from ..errors import InfeasibleError
from .common import (
    _check_output_path,
    _examples,
    _json_option,
    _plan_profile,
    _quiet_option,
    _render,
    app,
)
from .output import Result, Sink


# The library's modules are imported inside the functions, not here: `plan`, `show`, `simulate`
# and `compare` start without importing torch (tests/test_torch_free.py).
@app.command(short_help="Re-simulate a plan (what-if on other hardware).",
             epilog=_examples(
                 "slackswap simulate model.plan.json --hardware gh200-c2c",
                 "slackswap simulate model.plan.json --trace step.trace.json   # open in ui.perfetto.dev",
             ))
def simulate(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="plan JSON from `slackswap plan`"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="re-simulate on this preset or JSON file [default: the plan's]"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="profile JSON [default: the one the plan records]"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="write a Chrome/Perfetto trace JSON here"),
    as_json: bool = _json_option("the prediction"),
    quiet: bool = _quiet_option(),
) -> None:
    """Re-simulate a plan (what-if on other hardware); optionally write a Perfetto timeline."""
    sink = Sink(as_json, quiet)
    from ..hardware import HardwareSpec, load_hardware
    from ..profile_build import recost
    from ..schema import load_plan
    from ..simulate import simulate as run_sim
    p = load_plan(plan_path)
    prof = _plan_profile(p, profile_path)
    hw = load_hardware(hardware) if hardware else HardwareSpec.from_dict(p.hardware, "plan hardware")
    prof = recost(prof, hw)  # what-if: a roofline profile's ops are re-timed on `hw` too
    if trace is not None:
        _check_output_path(trace, "--trace",
                           [plan_path, profile_path or p.profile_path, hardware])
    # the timeline feeds the trace file and the views; --json and --quiet need neither
    result = run_sim(prof, p.decisions, hw, p.budget_bytes,
                     record=trace is not None or sink.human)
    if trace is not None:
        from .chrome_trace import write_chrome_trace
        write_chrome_trace(trace, result, prof, p.budget_bytes)

    def views():
        shown = dataclasses.replace(p, hardware=hw.to_dict(), predicted=result.predicted,
                                    feasible=result.feasible)
        return _render().plan_views(shown, prof, result, planned=p)
    sink.show(Result({"plan": str(plan_path), "hardware": hw.name, "feasible": result.feasible,
                      "reason": result.reason, "predicted": result.predicted,
                      "trace": str(trace) if trace is not None else None}, views=views,
                     lines=[f"wrote {trace} (open it in https://ui.perfetto.dev)"]
                     if trace is not None else []))
    if not result.feasible:
        raise InfeasibleError(f"on {hw.name} this plan does not keep activation memory under "
                              f"its budget" + (f": {result.reason}" if result.reason else ""),
                              f"plan again for this hardware: slackswap plan PROFILE --budget "
                              f"... --hardware {hardware or hw.name}")


@app.command(short_help="Inspect a profile or a plan in the terminal.",
             epilog=_examples(
                 "slackswap show model.profile.json",
                 "slackswap show model.plan.json --json",
             ))
def show(
    path: Path = typer.Argument(..., metavar="FILE", help="a profile or a plan JSON"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="for a plan: its profile [default: the one it records]"),
    as_json: bool = _json_option("the summary"),
    quiet: bool = _quiet_option(),
) -> None:
    """Inspect a profile or a plan in the terminal."""
    from ..schema import PROFILE_FORMAT, load_plan, load_profile, sniff_format
    if sniff_format(path) == PROFILE_FORMAT:
        prof = load_profile(path)
        result = Result({"fingerprint": prof.fingerprint, "workload": prof.workload,
                         "env": prof.env, "summary": prof.summary},
                        views=lambda: _render().profile_views(prof))
    else:
        p = load_plan(path)
        result = Result(p, views=lambda: _simulated_plan_views(p, profile_path))
    Sink(as_json, quiet).show(result)


def _simulated_plan_views(p, profile_path: Optional[Path]) -> list:
    """`show PLAN`: the plan's views, simulated again on its own hardware for the timeline."""
    from ..hardware import HardwareSpec
    from ..profile_build import recost
    from ..simulate import simulate as run_sim
    hw = HardwareSpec.from_dict(p.hardware, "plan hardware")
    prof = recost(_plan_profile(p, profile_path), hw)
    return _render().plan_views(p, prof, run_sim(prof, p.decisions, hw, p.budget_bytes))
