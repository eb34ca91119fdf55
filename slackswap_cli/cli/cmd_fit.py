"""`slackswap fit`: sweep batch sizes on the whole device and write the best batch's plan."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InfeasibleError, InputError
from ..planners import DEFAULT_PLANNER
from .common import (
    PLANNER_HELP,
    SLOW_PLANNERS,
    app,
    buffers_option,
    check_output_path,
    help_examples,
    json_option,
    pipeline_buffers,
    quiet_option,
    sibling_file,
    time_options,
)
from .output import Result, Sink


# The library's modules are imported inside the functions, not here: `plan`, `show`, `simulate`
# and `compare` start without importing torch (tests/test_torch_free.py).
def _fit_settings(hardware, memory, reserve, optimizer, shard, fused, planner, time_limit):
    from ..budget import parse_size
    from ..fit import FitSettings, check_optimizer, default_reserve
    from ..hardware import load_hardware
    from ..planners import planner_spec
    hw = load_hardware(hardware)
    if memory is not None:
        hw = dataclasses.replace(hw, memory_bytes=parse_size(memory, "--memory"))
    if hw.memory_bytes <= 0:
        raise InputError(f"hardware {hw.name} has no device memory",
                         hint="give the device's memory with --memory 80GiB")
    check_optimizer(optimizer)
    spec = planner_spec(planner)
    if shard < 1:
        raise InputError(f"--shard {shard} must be at least 1", hint="--shard 8 for 8 ranks")
    return FitSettings(hardware=hw, memory_bytes=hw.memory_bytes,
                       reserve_bytes=(default_reserve(hw.memory_bytes) if reserve is None
                                      else parse_size(reserve, "--reserve")),
                       optimizer=optimizer, shard=shard, step_on_device=fused, planner=planner,
                       planner_options=time_options(spec, time_limit))


def _pipeline_flags(pp, schedule, microbatches, stages_per_rank) -> dict:
    """The pipeline flags as given (None where absent), checked now where --pp is given; the
    workload's declared pipeline fills the others once it is traced (fit_pipeline.row_maker)."""
    flags = dict(pp=pp, schedule=schedule, microbatches=microbatches,
                 stages_per_rank=stages_per_rank)
    if pp is not None:
        from ..pipeline.orders import pipeline_spec
        pipeline_spec(**flags)
    return flags


def _stage_profiles(profiler_of, args: dict, stage_arg: str, flags: dict, buffers: str):
    """(profile_at, row_maker) profiling every stage of the pipeline the flags give, stage i
    with `stage_arg`=i (`profiler_of(args, workers)`: a Profiler; pipeline.fit.StageProfiles);
    `buffers`: as `pipeline.fit.pipeline_row` takes it."""
    from ..pipeline.fit import StageProfiles, row_maker
    from ..pipeline.orders import order, pipeline_spec
    if stage_arg in args:
        raise InputError(f"--arg {stage_arg}=... picks the stage, which --stage-arg sweeps",
                         hint=f"leave --arg {stage_arg} out")
    spec = pipeline_spec(**flags)
    if spec is None:
        raise InputError("--stage-arg profiles a pipeline's stages, and --pp is not given",
                         hint=f"add --pp N (the pipeline's ranks), e.g. --pp 4 --stage-arg "
                              f"{stage_arg}")
    steps = order(spec.schedule, spec.pp, spec.microbatches, spec.stages_per_rank)
    n_stages = 1 + max(st for each in steps.values() for _, st, _ in each)
    profilers = {st: profiler_of({**args, stage_arg: st}, 1) for st in range(n_stages)}
    stages = StageProfiles(profilers)
    return stages, lambda s, prof: row_maker(s, prof, stages, buffers)


def _tp_args(args: dict, tp: int, model: Path, entry: str) -> dict:
    """The workload's arguments with `tp` (--tp N > 1: the entry builds one tensor parallel
    rank's local shard), refused where the entry takes no `tp` or --arg gives it too."""
    if tp < 1:
        raise InputError(f"--tp {tp} must be at least 1", hint="--tp 2 for two tensor parallel ranks")
    if tp == 1:
        return args
    if "tp" in args:
        raise InputError("--arg tp=... and --tp both give the tensor parallel degree",
                         hint="leave --arg tp out")
    import inspect

    from ..trace.static_memory import import_file
    fn = getattr(import_file(model), entry, None)
    try:
        params = inspect.signature(fn).parameters if callable(fn) else {}
    except (TypeError, ValueError):
        params = {}
    if callable(fn) and "tp" not in params:
        raise InputError(f"--tp {tp}: {entry}() in {model.name} takes no `tp` to build one "
                         "tensor parallel rank's local shard",
                         hint="add a `tp` argument that divides the heads and MLP width "
                              "(examples/llama_3d_stage.py), or leave --tp out and profile "
                              "the local shard yourself")
    return {**args, "tp": tp}


def _write_best(result, plan_target: Path, model: Path) -> Path:
    """The best row's plan, and next to it the profile it was made from."""
    from ..planning import save_with_profile
    return save_with_profile(result.best_plan, result.best_profile, plan_target)


@app.command(short_help="Sweep batch sizes on the whole device; write the best plan.",
             epilog=help_examples(
                 "slackswap fit model.py --hardware h100-pcie5 --batch 1,2,4,8,16",
                 "slackswap fit llama_70b.py --hardware h100-pcie5 --shard 8 --batch 1,2,4",
                 "slackswap fit model.py --hardware a100-pcie4 --memory 40GiB --batch 8,16",
                 "slackswap fit examples/gpt_stage.py --pp 4 --schedule 1F1B --microbatches 8 --batch 1,2,4",
                 "slackswap fit examples/llama_3d_stage.py --pp 2 --fsdp 2 --tp 2 --batch 1,2,4 --memory 4MiB",
             ))
def fit(
    model: Path = typer.Argument(..., metavar="MODEL", help="workload file (model.py with a workload() function)"),
    batch: str = typer.Option(..., "--batch", help="batch sizes to try, comma-separated: 1,2,4,8,16"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="preset or JSON file [default: a100-pcie4]"),
    memory: Optional[str] = typer.Option(None, "--memory", help="device memory, overriding the hardware's (80GiB, 40GB)"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw | adam | adamw-amsgrad | adam-amsgrad | sgd | sgd-momentum | none"),
    fused: bool = typer.Option(False, "--fused", help="the optimizer runs with fused=True or capturable=True: its step counters live on the device"),
    shard: int = typer.Option(1, "--shard", "--fsdp", help="FSDP2 / ZeRO-3 world size: parameters, gradients and optimizer state split over N ranks (figures per rank)"),
    tp: int = typer.Option(1, "--tp", help="tensor parallel ranks: passed to the workload as `tp`, which builds one rank's local shard (as examples/llama_3d_stage.py); the mesh is --pp x --fsdp x --tp"),
    reserve: Optional[str] = typer.Option(None, "--reserve", help="memory kept free for the CUDA context, fragmentation, workspaces [default: 1 GiB + 5% of the device]"),
    batch_arg: str = typer.Option("batch", "--batch-arg", help="the workload argument that sets the batch"),
    planner: str = typer.Option(DEFAULT_PLANNER, "--planner", "-p", help=PLANNER_HELP),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", min=1.0, help=f"seconds per batch for a planner with a time limit ({SLOW_PLANNERS}) [default: the planner's]"),
    entry: str = typer.Option("workload", "--entry", help="function in the workload file that returns (model, inputs[, loss_fn])"),
    arg: List[str] = typer.Option([], "--arg", metavar="KEY=VALUE", help="key=value passed to the entry function; repeatable"),
    device: str = typer.Option("fake", "--device", help="fake (default: nothing allocated, roofline costs) | fake:cpu | cpu | cuda"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="the best plan [default: <model>.fit.plan.json here]; its profile goes next to it"),
    profile_each: bool = typer.Option(False, "--profile-each", help="trace every batch; by default a batch after the first two is derived from the last two traced where that is exact (same step, sizes affine in the batch)"),
    pp: Optional[int] = typer.Option(None, "--pp", help="pipeline ranks: the workload is ONE stage (as examples/gpt_stage.py), the batch its microbatch; every stage priced as it [default: the workload's declared pipeline, if any]"),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="with --pp: GPipe | 1F1B | Interleaved1F1B | ZBVZeroBubble | DualPipeV [default: the workload's, else 1F1B]"),
    microbatches: Optional[int] = typer.Option(None, "--microbatches", help="with --pp: microbatches per step [default: the workload's, else 2 x --pp]"),
    stages_per_rank: Optional[int] = typer.Option(None, "--stages-per-rank", help="with --pp and Interleaved1F1B: stages per rank [default: the workload's, else 2]"),
    stage_arg: Optional[str] = typer.Option(None, "--stage-arg", help="with --pp: the workload argument that picks the stage (0, 1, ...): each stage profiled and priced as it is [default: every stage priced as the workload]"),
    buffers: Optional[str] = buffers_option(),
    jobs: int = typer.Option(2, "--jobs", min=1, help="traces in forked processes, ahead of planning: 2 overlaps a trace with planning (same rows; helps only with idle cores); 1: one process"),
    as_json: bool = json_option("{rows, best, baselines}"),
    quiet: bool = quiet_option(),
) -> None:
    """Profile each batch, take parameters, gradients and optimizer state off the device's
    memory, plan the activations in what is left, and pick the batch that trains fastest."""
    sink = Sink(as_json, quiet)
    from ..fit import check_static_fits, parse_batches, sweep
    from ..pipeline.fit import row_maker
    from ..trace import split_device
    from ..trace.workload import parse_workload_args
    batches = parse_batches(batch)
    s = _fit_settings(hardware, memory, reserve, optimizer, shard, fused, planner, time_limit)
    s = dataclasses.replace(s, pipeline=_pipeline_flags(pp, schedule, microbatches,
                                                        stages_per_rank))
    how_held = pipeline_buffers(buffers)      # fit traces with the installed torch
    args = parse_workload_args(arg)
    if batch_arg in args:
        raise InputError(f"--arg {batch_arg}=... sets the batch, which --batch sweeps",
                         hint=f"leave --arg {batch_arg} out")
    args = _tp_args(args, tp, model, entry)
    s = dataclasses.replace(s, tp=tp)
    split_device(device)
    if not model.is_file() or model.suffix.lower() != ".py":
        raise InputError(f"{model} is not a workload file" if model.exists()
                         else f"model file {model} does not exist",
                         hint="fit takes a workload .py file with a workload() function")
    target = output or Path(model.stem + ".fit.plan.json")
    check_output_path(target, "-o", [model, hardware])
    check_output_path(sibling_file(target, ".profile.json"), "-o", [model, hardware])
    from ..trace.static_memory import Profiler, check_batch_arg
    check_batch_arg(str(model), entry, batch_arg)
    def profiler_of(args: dict, workers: int):
        return Profiler(str(model), entry=entry, args=args, batch_arg=batch_arg,
                        device=device, hardware=s.hardware,
                        on_facts=lambda f: check_static_fits(f, s), workers=workers)
    profiler = profiler_of(args, jobs)
    maker = functools.partial(row_maker, buffers=how_held, buffers_given=buffers is not None)
    if stage_arg is not None:
        profiler, maker = _stage_profiles(profiler_of, args, stage_arg, s.pipeline, how_held)
    try:
        result = sweep(batches, profiler, s, progress=sink.status,
                       derive_batch_arg=None if profile_each or stage_arg else batch_arg,
                       row_maker=maker)
    finally:
        profiler.close()
    if result.best_plan is not None:
        prof_target = _write_best(result, target, model)
    _fit_report(result, s, target if result.best_plan else None,
                prof_target if result.best_plan else None, sink)


def _fit_report(result, s, target: Optional[Path], prof_target: Optional[Path],
                sink: Sink) -> None:
    def views():
        from .render.fit import fit_views
        return fit_views(result, planner=s.planner, hardware=s.hardware.name,
                         memory_bytes=s.memory_bytes, optimizer=s.optimizer, shard=s.shard,
                         tp=s.tp)
    sink.show(Result({**result.to_json(), "hardware": s.hardware.name,
                      "memory_bytes": s.memory_bytes, "reserve_bytes": s.reserve_bytes,
                      "optimizer": s.optimizer, "shard": s.shard, "tp": s.tp,
                      "plan": str(target) if target else None,
                      "profile": str(prof_target) if prof_target else None},
                     views=views, lines=[f"wrote {target} (the best batch's plan) and "
                                         f"{prof_target}"] if target else []))
    if target is None:
        raise InfeasibleError("no batch of the sweep fits the device; wrote no plan",
                              "try smaller batches, --shard N, a lighter --optimizer, or less "
                              "--reserve")
