"""`slackswap simulate` (a plan re-simulated, a Perfetto trace) and `slackswap show` (a
profile or a plan in the terminal)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from ..errors import InfeasibleError, InputError
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
def _pp_option():
    return typer.Option(None, "--pp", help="pipeline ranks: the profile is one stage's (one microbatch), every stage priced as it; prints the per-rank table [default: the workload's declared pipeline, if any]")


def _pipeline_options():
    """The pipeline's options after --pp (schedule, microbatches, stages per rank, budget)."""
    return (typer.Option(None, "--schedule", help="with --pp: GPipe | 1F1B | Interleaved1F1B | ZBVZeroBubble | DualPipeV [default: the workload's, else 1F1B]"),
            typer.Option(None, "--microbatches", help="with --pp: microbatches per step [default: the workload's, else 2 x --pp]"),
            typer.Option(None, "--stages-per-rank", help="with --pp and Interleaved1F1B: stages per rank [default: the workload's, else 2]"),
            typer.Option(None, "--rank-budget", help="with --pp: activation memory per rank (20GiB); a rank over it is marked"))


_SCHEDULE, _MICROBATCHES, _STAGES_PER_RANK, _RANK_BUDGET = _pipeline_options()


def _pipeline(pp, schedule, microbatches, stages_per_rank, rank_budget, declared=None):
    """The checked pipeline settings (flags over the workload's `declared` pipeline), or None
    where neither gives one (refusing the pipeline's options alone)."""
    from ..pipeline.orders import pipeline_spec
    spec = pipeline_spec(pp, schedule, microbatches, stages_per_rank, declared)
    if spec is None:
        if rank_budget is not None:
            raise InputError("--rank-budget describes a pipeline, and --pp is not given",
                             hint="add --pp N (the pipeline's ranks), e.g. --pp 4 --rank-budget ...")
        return None
    from ..budget import parse_size
    budget = 0 if rank_budget is None else parse_size(rank_budget, "--rank-budget")
    return (*spec, budget)


def _declared(prof) -> dict | None:
    """The pipeline the profile's workload declared (`Workload.pipeline`), if any."""
    return (prof.workload or {}).get("pipeline")


def _pipeline_result(settings, prof, plan, hw, data: dict) -> Result:
    """The per-rank table of a pipeline of stages like `prof` under `plan`."""
    from ..pipeline.step import pipeline_figures
    schedule, pp, microbatches, per_rank, budget = settings
    figs = pipeline_figures(prof, plan, schedule, pp, microbatches, per_rank, budget,
                            1.0 / hw.d2h_bytes_per_s * 1e6 if hw.d2h_bytes_per_s else 0.0,
                            hw=hw)

    def views():
        from .render.pipeline import pipeline_views
        return pipeline_views(figs, "every stage as this profile")
    from .render.pipeline import figures_json
    return Result({**data, "pipeline": figures_json(figs)}, views=views)


@app.command(short_help="Re-simulate a plan (what-if on other hardware).",
             epilog=help_examples(
                 "slackswap simulate model.plan.json --hardware gh200-c2c",
                 "slackswap simulate model.plan.json --trace step.trace.json   # open in ui.perfetto.dev",
                 "slackswap simulate stage.plan.json --pp 4 --schedule 1F1B --microbatches 8",
             ))
def simulate(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="plan JSON from `slackswap plan`"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="re-simulate on this preset or JSON file [default: the plan's]"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="profile JSON [default: the one the plan records]"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="write a Chrome/Perfetto trace JSON here"),
    pp: Optional[int] = _pp_option(),
    schedule: Optional[str] = _SCHEDULE,
    microbatches: Optional[int] = _MICROBATCHES,
    stages_per_rank: Optional[int] = _STAGES_PER_RANK,
    rank_budget: Optional[str] = _RANK_BUDGET,
    as_json: bool = json_option("the prediction"),
    quiet: bool = quiet_option(),
) -> None:
    """Re-simulate a plan (what-if on other hardware); optionally write a Perfetto timeline.
    With --pp: the per-rank table of a pipeline of stages like the plan's profile."""
    sink = Sink(as_json, quiet)
    if pp is not None:      # the flags' own errors before loading anything
        _pipeline(pp, schedule, microbatches, stages_per_rank, rank_budget)
    from ..hardware import HardwareSpec, load_hardware
    from ..profile_build import recost
    from ..schema import load_plan
    from ..simulate import simulate as run_sim
    p = load_plan(plan_path)
    prof = plan_profile(p, profile_path)
    pipe = _pipeline(pp, schedule, microbatches, stages_per_rank, rank_budget, _declared(prof))
    hw = load_hardware(hardware) if hardware else HardwareSpec.from_dict(p.hardware, "plan hardware")
    prof = recost(prof, hw)  # what-if: a roofline profile's ops are re-timed on `hw` too
    if trace is not None:
        check_output_path(trace, "--trace",
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
        return renderer().plan_views(shown, prof, result, planned=p)
    if pipe is not None:
        shown = dataclasses.replace(p, hardware=hw.to_dict(), predicted=result.predicted)
        sink.show(_pipeline_result(pipe, prof, shown, hw, {
            "plan": str(plan_path), "hardware": hw.name, "feasible": result.feasible,
            "predicted": result.predicted}))
        return
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
             epilog=help_examples(
                 "slackswap show model.profile.json",
                 "slackswap show model.plan.json --json",
                 "slackswap show stage.plan.json --pp 4 --schedule Interleaved1F1B --microbatches 8",
             ))
def show(
    path: Path = typer.Argument(..., metavar="FILE", help="a profile or a plan JSON"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="for a plan: its profile [default: the one it records]"),
    pp: Optional[int] = _pp_option(),
    schedule: Optional[str] = _SCHEDULE,
    microbatches: Optional[int] = _MICROBATCHES,
    stages_per_rank: Optional[int] = _STAGES_PER_RANK,
    rank_budget: Optional[str] = _RANK_BUDGET,
    as_json: bool = json_option("the summary"),
    quiet: bool = quiet_option(),
) -> None:
    """Inspect a profile or a plan in the terminal. With --pp: the per-rank table of a
    pipeline of stages like it (a profile: keeping everything)."""
    from ..schema import PROFILE_FORMAT, load_plan, load_profile, sniff_format
    pipe = _pipeline(pp, schedule, microbatches, stages_per_rank, rank_budget)
    if pipe is not None:
        Sink(as_json, quiet).show(_show_pipeline(path, profile_path, pipe))
        return
    if sniff_format(path) == PROFILE_FORMAT:
        prof = load_profile(path)
        result = Result({"fingerprint": prof.fingerprint, "workload": prof.workload,
                         "env": prof.env, "summary": prof.summary},
                        views=lambda: renderer().profile_views(prof))
    else:
        p = load_plan(path)
        result = Result(p, views=lambda: _simulated_plan_views(p, profile_path))
    Sink(as_json, quiet).show(result)


def _show_pipeline(path: Path, profile_path: Optional[Path], pipe) -> Result:
    from ..hardware import HardwareSpec, load_hardware
    from ..schema import PROFILE_FORMAT, load_plan, load_profile, sniff_format
    if sniff_format(path) == PROFILE_FORMAT:
        prof = load_profile(path)
        hw_name = (prof.env or {}).get("hardware") or "a100-pcie4"
        return _pipeline_result(pipe, prof, None, load_hardware(hw_name), {"profile": str(path)})
    p = load_plan(path)
    return _pipeline_result(pipe, plan_profile(p, profile_path), p,
                            HardwareSpec.from_dict(p.hardware, "plan hardware"),
                            {"plan": str(path)})


def _simulated_plan_views(p, profile_path: Optional[Path]) -> list:
    """`show PLAN`: the plan's views, simulated again on its own hardware for the timeline."""
    from ..hardware import HardwareSpec
    from ..profile_build import recost
    from ..simulate import simulate as run_sim
    hw = HardwareSpec.from_dict(p.hardware, "plan hardware")
    prof = recost(plan_profile(p, profile_path), hw)
    return renderer().plan_views(p, prof, run_sim(prof, p.decisions, hw, p.budget_bytes))
