"""`slackswap simulate` (a plan re-simulated, a Perfetto trace) and `slackswap show` (a
profile or a plan in the terminal)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InfeasibleError, InputError
from .common import (
    app,
    buffers_option,
    check_output_path,
    help_examples,
    json_option,
    pipeline_buffers,
    plan_profile,
    quiet_option,
    renderer,
)
from .output import Result, Sink


# The library's modules are imported inside the functions, not here: `plan`, `show`, `simulate`
# and `compare` start without importing torch (tests/test_torch_free.py).
def _pp_option():
    return typer.Option(None, "--pp", help="pipeline ranks: each file one stage's (one microbatch): one file prices every stage as it, one per stage (or 3: the first, middle, last) each as it is; prints the per-rank table [default: the workload's declared pipeline, if any]")


def _pipeline_options():
    """The pipeline's options after --pp (schedule, microbatches, stages per rank, budget)."""
    return (typer.Option(None, "--schedule", help="with --pp: GPipe | 1F1B | Interleaved1F1B | ZBVZeroBubble | DualPipeV [default: the workload's, else 1F1B]"),
            typer.Option(None, "--microbatches", help="with --pp: microbatches per step [default: the workload's, else 2 x --pp]"),
            typer.Option(None, "--stages-per-rank", help="with --pp and Interleaved1F1B: stages per rank [default: the workload's, else 2]"),
            typer.Option(None, "--rank-budget", help="with --pp: activation memory per rank (20GiB); a rank over it is marked"))


_SCHEDULE, _MICROBATCHES, _STAGES_PER_RANK, _RANK_BUDGET = _pipeline_options()


def _pipeline(pp, schedule, microbatches, stages_per_rank, rank_budget, declared=None,
              buffers=None):
    """The checked pipeline settings (flags over the workload's `declared` pipeline), or None
    where neither gives one (refusing the pipeline's options alone)."""
    from ..pipeline.orders import pipeline_spec
    spec = pipeline_spec(pp, schedule, microbatches, stages_per_rank, declared)
    if spec is None:
        for flag, value in (("--rank-budget", rank_budget), ("--buffers", buffers)):
            if value is not None:
                raise InputError(f"{flag} describes a pipeline, and --pp is not given",
                                 hint=f"add --pp N (the pipeline's ranks), e.g. --pp 4 {flag} ...")
        return None
    pipeline_buffers(buffers)       # refused now if it is not one
    from ..budget import parse_size
    budget = 0 if rank_budget is None else parse_size(rank_budget, "--rank-budget")
    return (*spec, budget)


def _declared(prof) -> dict | None:
    """The pipeline the profile's workload declared (`Workload.pipeline`), if any."""
    return (prof.workload or {}).get("pipeline")


def _stage_static(prof, fsdp: int):
    """A stage's static memory (AdamW, sharded over `fsdp`) from its profile's parameters,
    buffers and inputs."""
    import math

    from ..fit import ModelFacts, ParamFact, static_memory
    params = tuple(ParamFact(numel=math.prod(t.shape), itemsize=t.size_bytes // max(1, math.prod(t.shape)),
                             dim0=t.shape[0] if t.shape else None, trainable=True,
                             storage_bytes=t.size_bytes)
                   for t in prof.tensors if t.kind == "parameter" and t.alias_of is None)
    size = {k: sum(t.size_bytes for t in prof.tensors if t.kind == k and t.alias_of is None
                   and not t.name.startswith("tangent"))      # (the loss's seed gradient)
            for k in ("buffer", "input")}
    facts = ModelFacts(params, buffers_bytes=size["buffer"], inputs_bytes=size["input"])
    return static_memory(facts, "adamw", shard=fsdp)


def _mesh_static(settings, prof, fsdp: int, tp: int | None) -> dict:
    """The static memory of the rank that holds most on a pp x fsdp x tp mesh of stages like
    `prof`, or of stages each priced as its own (a list of profiles) (AdamW, as
    `fit --pp --fsdp` counts it: `pipeline.fit.rank_static`); `tp`: the degree the profile's
    local shard was built for (its workload's `tp` argument), checked against the one given."""
    from ..pipeline.fit import rank_static
    from ..pipeline.orders import order
    from ..pipeline.step import stage_profiles
    if fsdp < 1:
        raise InputError(f"--fsdp {fsdp} must be at least 1", hint="--fsdp 8 for 8 ranks")
    profs = prof if isinstance(prof, list) else [prof]
    built = ((profs[0].workload or {}).get("args") or {}).get("tp", 1)
    if tp is not None and tp != built:
        raise InputError(f"--tp {tp}, but the profile is one rank's local shard at tp={built}",
                         hint=f"leave --tp out (or --tp {built}), or profile the workload "
                              f"with --arg tp={tp}")
    schedule, pp, microbatches, per_rank, _ = settings
    steps = order(schedule, pp, microbatches, per_rank)
    n_stages = 1 + max(st for each in steps.values() for _, st, _ in each)
    statics = {st: _stage_static(p, fsdp)
               for st, p in stage_profiles(profs, n_stages).items()}
    ranks = {r: rank_static([statics[st] for st in sorted({x for _, x, _ in each})], shard=fsdp)
             for r, each in steps.items()}
    worst = max(sorted(ranks), key=lambda r: ranks[r].total)
    st = ranks[worst]
    return {"fsdp": fsdp, "tp": built, "ranks": pp * fsdp * built, "optimizer": "adamw",
            "rank": worst, "total_bytes": st.total, **dataclasses.asdict(st)}


def _pipeline_result(settings, prof, plan, hw, data: dict, fsdp: int = 1,
                     tp: int | None = None, buffers: str | None = None) -> Result:
    """The per-rank table of a pipeline of stages like `prof` under `plan`, and each rank's
    static memory on the mesh (`_mesh_static`); `buffers`: --buffers as given
    (`common.pipeline_buffers`)."""
    from ..pipeline.step import pipeline_figures
    from ..units import fmt_bytes
    schedule, pp, microbatches, per_rank, budget = settings
    note = ("every stage as this profile" if not isinstance(prof, list) or len(prof) == 1
            else f"{len(prof)} stage profiles, each stage as its own")
    figs = pipeline_figures(prof, plan, schedule, pp, microbatches, per_rank, budget,
                            1.0 / hw.d2h_bytes_per_s * 1e6 if hw.d2h_bytes_per_s else 0.0,
                            hw=hw, buffers=pipeline_buffers(buffers, prof))
    static = _mesh_static(settings, prof, fsdp, tp)

    def views():
        from rich.text import Text

        from .render.pipeline import pipeline_views
        return [*pipeline_views(figs, note), Text(
            f"  static per rank (the largest, rank {static['rank']}; AdamW; mesh pp {pp} x fsdp {fsdp} x tp {static['tp']} = "
            f"{static['ranks']} ranks): {fmt_bytes(static['total_bytes'])} (parameters "
            f"{fmt_bytes(static['params_bytes'])}, gradients {fmt_bytes(static['grads_bytes'])}"
            f", optimizer {fmt_bytes(static['optimizer_bytes'])}, unsharded "
            f"{fmt_bytes(static['unsharded_bytes'])}, buffers and inputs "
            f"{fmt_bytes(static['buffers_bytes'] + static['inputs_bytes'])})", style="dim")]
    from .render.pipeline import figures_json
    return Result({**data, "pipeline": {**figures_json(figs), "static": static}}, views=views)


@app.command(short_help="Re-simulate a plan (what-if on other hardware).",
             epilog=help_examples(
                 "slackswap simulate model.plan.json --hardware gh200-c2c",
                 "slackswap simulate model.plan.json --trace step.trace.json   # open in ui.perfetto.dev",
                 "slackswap simulate stage.plan.json --pp 4 --schedule 1F1B --microbatches 8",
                 "slackswap simulate stage.plan.json --pp 2 --fsdp 2 --tp 2",
             ))
def simulate(
    plan_paths: List[Path] = typer.Argument(..., metavar="PLAN...", help="plan JSON from `slackswap plan`; with --pp one per stage (or 3: the first, middle, last stage's)"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="re-simulate on this preset or JSON file [default: the plan's]"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="profile JSON [default: the one the plan records]"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="write a Chrome/Perfetto trace JSON here"),
    pp: Optional[int] = _pp_option(),
    schedule: Optional[str] = _SCHEDULE,
    microbatches: Optional[int] = _MICROBATCHES,
    stages_per_rank: Optional[int] = _STAGES_PER_RANK,
    rank_budget: Optional[str] = _RANK_BUDGET,
    fsdp: int = typer.Option(1, "--fsdp", help="with --pp: FSDP2 ranks over each stage; each rank's static memory (AdamW) is printed under the table"),
    tp: Optional[int] = typer.Option(None, "--tp", help="with --pp: tensor parallel ranks, as the profile's local shard was built (its workload's tp argument) [default: that]"),
    buffers: Optional[str] = buffers_option(),
    as_json: bool = json_option("the prediction"),
    quiet: bool = quiet_option(),
) -> None:
    """Re-simulate a plan (what-if on other hardware); optionally write a Perfetto timeline.
    With --pp: the per-rank table of a pipeline of stages like the plan's profile, or of
    stages each priced as its own plan (one plan per stage), and the static memory of the
    rank that holds most on the pp x fsdp x tp mesh."""
    sink = Sink(as_json, quiet)
    if pp is not None:      # the flags' own errors before loading anything
        _pipeline(pp, schedule, microbatches, stages_per_rank, rank_budget, buffers=buffers)
    from .stage_files import simulate_stages
    if simulate_stages(plan_paths, pp, hardware, profile_path, trace, sink,
                       lambda plans: _pipeline(pp, schedule, microbatches, stages_per_rank,
                                               rank_budget, _declared(plans[0][1]), buffers),
                       lambda *a: _pipeline_result(*a, fsdp=fsdp, tp=tp, buffers=buffers)):
        return
    plan_path = plan_paths[0]
    from ..hardware import HardwareSpec, load_hardware
    from ..profile_build import recost
    from ..schema import load_plan
    from ..simulate import simulate as run_sim
    p = load_plan(plan_path)
    prof = plan_profile(p, profile_path)
    pipe = _pipeline(pp, schedule, microbatches, stages_per_rank, rank_budget, _declared(prof),
                     buffers)
    if pipe is None and (fsdp != 1 or tp is not None):
        raise InputError("--fsdp and --tp describe a pipeline's mesh, and --pp is not given",
                         hint="add --pp N (the pipeline's ranks), e.g. --pp 2 --fsdp 2 --tp 2")
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
            "predicted": result.predicted}, fsdp, tp, buffers))
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
    paths: List[Path] = typer.Argument(..., metavar="FILE...", help="a profile or a plan JSON; with --pp one per stage (or 3: the first, middle, last stage's)"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="for a plan: its profile [default: the one it records]"),
    pp: Optional[int] = _pp_option(),
    schedule: Optional[str] = _SCHEDULE,
    microbatches: Optional[int] = _MICROBATCHES,
    stages_per_rank: Optional[int] = _STAGES_PER_RANK,
    rank_budget: Optional[str] = _RANK_BUDGET,
    buffers: Optional[str] = buffers_option(),
    as_json: bool = json_option("the summary"),
    quiet: bool = quiet_option(),
) -> None:
    """Inspect a profile or a plan in the terminal. With --pp: the per-rank table of a
    pipeline of stages like it (a profile: keeping everything)."""
    from ..schema import PROFILE_FORMAT, load_plan, load_profile, sniff_format
    pipe = _pipeline(pp, schedule, microbatches, stages_per_rank, rank_budget, buffers=buffers)
    from .stage_files import one_file
    if pipe is not None:
        Sink(as_json, quiet).show(_show_pipeline(paths, profile_path, pipe, buffers))
        return
    path = one_file(paths, "show")
    if sniff_format(path) == PROFILE_FORMAT:
        prof = load_profile(path)
        result = Result({"fingerprint": prof.fingerprint, "workload": prof.workload,
                         "env": prof.env, "summary": prof.summary},
                        views=lambda: renderer().profile_views(prof))
    else:
        p = load_plan(path)
        result = Result(p, views=lambda: _simulated_plan_views(p, profile_path))
    Sink(as_json, quiet).show(result)


def _show_pipeline(paths: list[Path], profile_path: Optional[Path], pipe,
                   buffers: Optional[str]) -> Result:
    """`show --pp`: profiles (keeping everything) or plans, one or one per stage."""
    from ..hardware import HardwareSpec, load_hardware
    from .stage_files import stage_files
    profs, plans = stage_files(paths, profile_path)
    key = "profile" if plans is None else "plan"
    data = {key: str(paths[0])} if len(paths) == 1 else {key + "s": [str(p) for p in paths]}
    if plans is None:     # a roofline profile records its hardware's fields, a timed one none
        costed = (profs[0].env or {}).get("hardware") or "a100-pcie4"
        hw = (HardwareSpec.from_dict(costed, "the profile's hardware")
              if isinstance(costed, dict) else load_hardware(costed))
        return _pipeline_result(pipe, profs, None, hw, data, buffers=buffers)
    return _pipeline_result(pipe, profs, plans,
                            HardwareSpec.from_dict(plans[0].hardware, "plan hardware"), data,
                            buffers=buffers)


def _simulated_plan_views(p, profile_path: Optional[Path]) -> list:
    """`show PLAN`: the plan's views, simulated again on its own hardware for the timeline."""
    from ..hardware import HardwareSpec
    from ..profile_build import recost
    from ..simulate import simulate as run_sim
    hw = HardwareSpec.from_dict(p.hardware, "plan hardware")
    prof = recost(plan_profile(p, profile_path), hw)
    return renderer().plan_views(p, prof, run_sim(prof, p.decisions, hw, p.budget_bytes))
