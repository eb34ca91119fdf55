"""The `slackswap` command: parse options, call the library, hand the result to the output
sink, map errors to exit codes.

A command computes its result (the data --json prints, and the render views that show it)
and hands it once to `output.Sink`, which decides how it shows (tables, --json, --quiet):
commands do not branch on the output format. `output.py` alone prints; this module alone
exits. Library code raises `SlackswapError(message, hint)`; here it becomes `Error: ...` /
`Hint: ...` on stderr and the error's exit code (2 bad input, 3 tracing failed, 4 no plan
fits, 5 verify found a mismatch). Usage errors (a missing option, an unknown command) get the
same two lines and exit 2. Any other exception is a bug in slackswap: users see `Error:
internal error ...` and exit 1, never a raw traceback, unless SLACKSWAP_DEBUG=1 asks for it.

Planner names, the default planner and what each planner takes come from the registry
(`planners.PLANNERS`, light to import). Imports of heavy modules (torch, the tracer, the
planners' code, render) happen inside the commands, so `plan`, `show`, `simulate` and
`compare` start without importing torch.
"""
from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from typer.core import TyperGroup

from .errors import InputError, SlackswapError, require_file
from .output import Result, Sink, error_lines
from .planners import DEFAULT_PLANNER, PLANNERS, planner_names

DEBUG_ENV = "SLACKSWAP_DEBUG"


class _Group(TyperGroup):
    """Runs every command behind one error boundary (see the module docstring)."""

    def invoke(self, ctx):
        try:   # typer >= 0.2x vendors click; older ones use click itself
            from typer._click.exceptions import ClickException, UsageError
        except ImportError:  # pragma: no cover
            from click.exceptions import ClickException, UsageError
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except UsageError as exc:
            sub = exc.ctx.command_path if exc.ctx is not None else "slackswap"
            error_lines(exc.format_message(), f"see `{sub} --help`")
            raise typer.Exit(2) from None
        except ClickException:
            raise
        except SlackswapError as exc:      # the one handler of every command's errors
            _fail(exc)
        except KeyboardInterrupt:
            error_lines("interrupted", None)
            raise typer.Exit(130) from None
        except SystemExit as exc:          # our exits are typer.Exit: this one is user code's
            if isinstance(exc.__context__, BrokenPipeError):
                _closed_pipe()             # Rich's exit when stdout closed early (`| head`)
            who = ("the patched module or the workload" if ctx.invoked_subcommand == "verify"
                   else "the workload")
            error_lines(f"{who} called sys.exit({exc.code!r}) while slackswap ran it",
                        "a module slackswap imports must not exit: put script code under "
                        "`if __name__ == \"__main__\":`")
            raise typer.Exit(3) from None
        except OSError as exc:
            if exc.errno == errno.EPIPE:   # `slackswap show ... | head`: not an error
                _closed_pipe()
            _internal_error(exc)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "torch":
                _internal_error(exc)
            error_lines(f"`slackswap {ctx.invoked_subcommand or ''}` needs torch, which is not "
                        "installed", "pip install 'slackswap[torch]' (or a torch build for your "
                        "CUDA version from pytorch.org); plan, show, simulate and compare run "
                        "without it")
            raise typer.Exit(2) from None
        except Exception as exc:
            _internal_error(exc)


def _closed_pipe() -> None:
    """Stdout was closed by the reader (`slackswap show ... | head -1`): a normal end. Point
    stdout at /dev/null so the interpreter's final flush does not fail, and exit 0."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a descriptor
        pass
    raise typer.Exit(0)


def _examples(*lines: str) -> str:
    """A command's help epilog: example command lines, kept as written (click's \\b)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


app = typer.Typer(cls=_Group, add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_enable=False,
                  help="Fit training into GPU memory: keep, swap or recompute each saved activation.",
                  epilog="Exit codes: 0 ok, 1 internal error (a bug: SLACKSWAP_DEBUG=1 prints its "
                         "traceback), 2 bad input, 3 the model could not be traced, 4 no plan fits "
                         "the budget, 5 verify found a difference.")
PLANNER_HELP = " | ".join(planner_names())
SLOW_PLANNERS = ", ".join(n for n, spec in PLANNERS.items() if not spec.quick)


def _json_option(what: str):
    return typer.Option(False, "--json", help=f"print {what} as JSON")


def _quiet_option():
    return typer.Option(False, "--quiet", "-q", help="print nothing but warnings and errors "
                                                     "(the exit code and the files say the rest)")


def _render():
    """render.py, imported when a person is shown a view (not for --json or --quiet)."""
    from . import render
    return render


def _fail(exc: SlackswapError) -> None:
    error_lines(exc.message, exc.hint)
    raise typer.Exit(exc.exit_code)


def _internal_error(exc: BaseException) -> None:
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        import traceback
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        hint = "this is a bug in slackswap; please report it with the traceback above"
    else:
        hint = (f"this is a bug in slackswap, not in your input; please report it with the "
                f"command you ran (run it again with {DEBUG_ENV}=1 to print the traceback)")
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    error_lines(f"internal error: {type(exc).__name__}" + (f": {text}" if text else ""), hint)
    raise typer.Exit(1)


def _check_output_path(path: Path, option: str = "-o", inputs=(), example: str = "out.json") -> None:
    """Refuse, before any work is done, an output that cannot be written or that would
    overwrite one of the command's own inputs (`-o model.py` must not eat the model).
    A missing parent directory is fine: it is created when the file is written."""
    if path.is_dir():
        raise InputError(f"output path {path} is a directory",
                         hint=f"pass a file name with {option}, e.g. {path / example}, "
                              "or another name for the file")
    if path.exists():
        for src in inputs:
            if src is None:
                continue
            try:
                same = Path(src).exists() and os.path.samefile(path, src)
            except OSError:
                same = False
            if same:
                raise InputError(f"output path {path} is also an input of this command; "
                                 "writing it would destroy the input",
                                 hint=f"choose another file name with {option}")
    parent = path.parent if str(path.parent) else Path(".")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"cannot write {path}: {parent} is not a directory",
                         hint=f"choose another path with {option}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"cannot write {path}: directory {parent} is not writable",
                         hint=f"choose another path with {option}")


# --------------------------------------------------------------------------------------------
@app.command(short_help="Trace one training step and write its profile.",
             epilog=_examples(
                 "slackswap profile model.py --device fake -o model.profile.json",
                 "slackswap profile examples/tiny_gpt.py --arg n_layer=2 --arg seq=256",
                 "slackswap profile model.onnx --input-shape input=8x3x224x224",
             ))
def profile(
    model: Path = typer.Argument(..., metavar="MODEL", help="workload file (model.py with a workload() function) or an ONNX file"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="profile path [default: <model>.profile.json]"),
    entry: str = typer.Option("workload", "--entry", help="function in the workload file that returns (model, inputs[, loss_fn])"),
    arg: List[str] = typer.Option([], "--arg", metavar="KEY=VALUE", help="key=value passed to the entry function (Python literal); repeatable"),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu | fake (FakeTensorMode: nothing allocated, roofline costs; random ops traced as CUDA runs them) | fake:cpu (the same, random ops as a CPU runs them: for a plan to run on a CPU)"),
    autocast: Optional[str] = typer.Option(None, "--autocast", help="bf16 | fp16: trace the step under torch.autocast in that dtype (forward and loss inside, backward outside)"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="preset or JSON file for roofline costs [default: a100-pcie4]"),
    input_shape: List[str] = typer.Option([], "--input-shape", metavar="NAME=SHAPE", help="ONNX only: name=1x3x224x224 for a dynamic input; repeatable"),
    as_json: bool = _json_option("the profile summary"),
    quiet: bool = _quiet_option(),
) -> None:
    """Trace one training step and write its profile (every saved activation, its cost and lifetime)."""
    sink = Sink(as_json, quiet)
    from .hardware import load_hardware
    from .schema import save
    hw = load_hardware(hardware)
    require_file(model, "model file", hint="pass a workload .py file or an .onnx file")
    if model.suffix.lower() == ".json":
        raise InputError(f"{model} is a JSON file, not a workload",
                         hint="profile takes a workload .py file or an .onnx file; to plan "
                              f"an existing profile run `slackswap plan {model} --budget 0.5`")
    from .trace import split_device
    split_device(device)   # refuses an unknown --device before anything is written
    target = output or model.with_suffix(".profile.json")
    _check_output_path(target, "-o", [model, hardware])
    warnings: list[str] = []
    if hardware and not device.startswith("fake") and model.suffix.lower() != ".onnx":
        warnings.append(f"--hardware {hardware} is not used: --device {device} measures op "
                        "times (the roofline costs only --device fake and ONNX profiles)")
    if model.suffix.lower() == ".onnx":
        from .onnx.importer import parse_input_shapes, profile_onnx
        if autocast:
            raise InputError("--autocast applies to workload files only",
                             hint="an ONNX graph's dtypes are the ones it was exported with")
        shapes = parse_input_shapes(input_shape)
        prof, warnings = profile_onnx(str(model), hw, input_shapes=shapes or None)
    else:
        if input_shape:
            raise InputError("--input-shape applies to ONNX files only",
                             hint="for a workload file, set shapes with --arg")
        from .trace import profile_workload
        from .trace.workload import parse_workload_args
        args = parse_workload_args(arg)
        with sink.working("tracing the training step"):
            prof = profile_workload(str(model), entry=entry, args=args, device=device,
                                    hardware=hw, autocast=autocast, progress=sink.status)
    save(prof, target)
    from .profile_build import attention_warning
    for w in [*warnings, *filter(None, [attention_warning(prof)])]:
        sink.warn(w)
    sink.show(Result({"profile": str(target), "fingerprint": prof.fingerprint,
                      "workload": prof.workload, "env": prof.env, "summary": prof.summary},
                     views=lambda: _render().profile_views(prof), lines=[f"wrote {target}"]))


# --------------------------------------------------------------------------------------------
def _plan_inputs(profile_path: Path, budget: str, hardware: Optional[str]):
    from .planning import plan_inputs
    from .schema import load_profile
    return plan_inputs(load_profile(profile_path), budget, hardware, str(profile_path))


@app.command(short_help="Decide keep / swap / recompute; simulate; write the plan.",
             epilog=_examples(
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
    as_json: bool = _json_option("a summary of the plan (the file holds it all)"),
    quiet: bool = _quiet_option(),
) -> None:
    """Decide keep / swap / recompute for every saved activation, simulate, write the plan."""
    started = time.perf_counter()
    sink = Sink(as_json, quiet)
    from .budget import first_feasible_budget, floor_message
    from .planners import planner_spec
    from .planning import plan_profile
    from .schema import save
    prof, hw, budget_bytes, fraction = _plan_inputs(profile_path, budget, hardware)
    spec = planner_spec(planner)
    # below the floor no plan fits, but the planner's closest plan is still written
    below = floor_message(budget_bytes, prof)
    target = output or Path(_sibling(profile_path, ".plan.json").name)
    _check_output_path(target, "-o", [profile_path, hardware])
    # a planner with a time limit keeps its own reserve for the simulation and writing
    with sink.working(f"planning with {planner}"):
        result, sim = plan_profile(prof, hw, budget_bytes, fraction, planner,
                                   time_limit=time_limit, started=started, record=True)
    result = _with_paths(result, profile_path, prof)
    save(result, target)
    reach = None
    if not result.feasible and below is None and spec.quick:   # slow: a solve per step
        reach = first_feasible_budget(prof, hw, planner)
    summary = _plan_summary(result, target, prof)
    if spec.bound:
        summary["bound_retention"] = spec.bound_retention(prof, hw, budget_bytes)
    sink.show(Result(summary, views=lambda: _render().plan_views(result, prof, sim),
                     lines=[f"wrote {target}"]))
    if not result.feasible:
        _plan_failed(prof, planner, target, below, reach)


def _time_options(spec, time_limit: Optional[float], started: Optional[float] = None) -> dict:
    from .planning import planner_time_options
    return planner_time_options(spec, time_limit, started)


def _plan_failed(prof, planner: str, target: Path, below, reach: Optional[int]) -> None:
    """`plan` found no plan under the budget: say where it would fit, and exit 4."""
    from .planning import infeasible_message
    message, hint = infeasible_message(prof, planner, below, reach)
    error_lines(f"{message}; wrote the closest plan found to {target} with feasible: false", hint)
    raise typer.Exit(4)


def _plan_summary(p, path: Path, prof) -> dict:
    """What a script wants from `plan --json`: where the plan is and what it predicts; the
    file holds the whole plan (every decision and the schedule)."""
    return {"plan": str(path), "planner": p.planner, "feasible": p.feasible,
            "hardware": p.hardware.get("name"), "budget_bytes": p.budget_bytes,
            "budget_fraction": p.budget_fraction, "actions": p.action_counts(prof),
            "predicted": p.predicted, "solve_ms": p.solve_ms, "notes": list(p.notes)}


def _sibling(path: Path, suffix: str) -> Path:
    from .planning import sibling_path
    return sibling_path(path, suffix)


def _with_paths(plan_obj, profile_path: Path, prof):
    from .planning import with_paths
    return with_paths(plan_obj, profile_path, prof)


# --------------------------------------------------------------------------------------------
@app.command(short_help="Every planner side by side on one profile.",
             epilog=_examples(
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
    as_json: bool = _json_option("{results: [...]}"),
    with_torch_compile: bool = typer.Option(False, "--with-torch-compile", help="add a row for torch.compile's own choice: its min-cut partitioner on the profile's graph (re-traced from the workload with fake tensors; needs torch), activation_memory_budget searched to meet the budget"),
    model: Optional[Path] = typer.Option(None, "--model", help="with --with-torch-compile: the workload file [default: the one the profile records]"),
    quiet: bool = _quiet_option(),
) -> None:
    """Every planner side by side on one profile: retention, peak, stall, recompute, solve time."""
    sink = Sink(as_json, quiet)
    from .budget import check_budget
    if model is not None and not with_torch_compile:
        raise InputError("--model is the workload file for --with-torch-compile",
                         hint="add --with-torch-compile, or leave --model out")
    prof, hw, budget_bytes, fraction = _plan_inputs(profile_path, budget, hardware)
    check_budget(budget_bytes, prof)
    names = _compared_planners(planners)
    rows = [_compare_row(name, prof, hw, budget_bytes, fraction, time_limit, sink)
            for name in names]
    if with_torch_compile:
        rows.append(_torch_compile_row(prof, profile_path, model, hw, budget_bytes, fraction,
                                       sink))
    sink.show(Result({"profile": str(profile_path), "hardware": hw.name,
                      "budget_bytes": budget_bytes, "budget_fraction": fraction, "results": rows},
                     views=lambda: _render().compare_views(
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
    from .planners import make_plan, planner_spec
    spec = planner_spec(name)
    options = _time_options(spec, time_limit)
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
    from .trace.torch_choice import PLANNER_NAME, baseline_for
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


# --------------------------------------------------------------------------------------------
def _fit_settings(hardware, memory, reserve, optimizer, shard, fused, planner, time_limit):
    import dataclasses

    from .budget import parse_size
    from .fit import FitSettings, check_optimizer, default_reserve
    from .hardware import load_hardware
    from .planners import planner_spec
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
                       planner_options=_time_options(spec, time_limit))


def _write_best(result, plan_target: Path, model: Path) -> Path:
    """The best row's plan, and next to it the profile it was made from."""
    from .planning import save_with_profile
    return save_with_profile(result.best_plan, result.best_profile, plan_target)


@app.command(short_help="Sweep batch sizes on the whole device; write the best plan.",
             epilog=_examples(
                 "slackswap fit model.py --hardware h100-pcie5 --batch 1,2,4,8,16",
                 "slackswap fit llama_70b.py --hardware h100-pcie5 --shard 8 --batch 1,2,4",
                 "slackswap fit model.py --hardware a100-pcie4 --memory 40GiB --batch 8,16",
             ))
def fit(
    model: Path = typer.Argument(..., metavar="MODEL", help="workload file (model.py with a workload() function)"),
    batch: str = typer.Option(..., "--batch", help="batch sizes to try, comma-separated: 1,2,4,8,16"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="preset or JSON file [default: a100-pcie4]"),
    memory: Optional[str] = typer.Option(None, "--memory", help="device memory, overriding the hardware's (80GiB, 40GB)"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw | adam | adamw-amsgrad | adam-amsgrad | sgd | sgd-momentum | none"),
    fused: bool = typer.Option(False, "--fused", help="the optimizer runs with fused=True or capturable=True: its step counters live on the device"),
    shard: int = typer.Option(1, "--shard", help="FSDP2 / ZeRO-3 world size: parameters, gradients and optimizer state split over N ranks (figures per rank)"),
    reserve: Optional[str] = typer.Option(None, "--reserve", help="memory kept free for the CUDA context, fragmentation, workspaces [default: 1 GiB + 5% of the device]"),
    batch_arg: str = typer.Option("batch", "--batch-arg", help="the workload argument that sets the batch"),
    planner: str = typer.Option(DEFAULT_PLANNER, "--planner", "-p", help=PLANNER_HELP),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", min=1.0, help=f"seconds per batch for a planner with a time limit ({SLOW_PLANNERS}) [default: the planner's]"),
    entry: str = typer.Option("workload", "--entry", help="function in the workload file that returns (model, inputs[, loss_fn])"),
    arg: List[str] = typer.Option([], "--arg", metavar="KEY=VALUE", help="key=value passed to the entry function; repeatable"),
    device: str = typer.Option("fake", "--device", help="fake (default: nothing allocated, roofline costs) | fake:cpu | cpu | cuda"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="the best plan [default: <model>.fit.plan.json here]; its profile goes next to it"),
    profile_each: bool = typer.Option(False, "--profile-each", help="trace every batch; by default a batch after the first two is derived from the last two traced where that is exact (same step, sizes affine in the batch)"),
    jobs: int = typer.Option(2, "--jobs", min=1, help="traces in forked processes, ahead of planning: 2 overlaps a trace with planning (same rows; helps only with idle cores); 1: one process"),
    as_json: bool = _json_option("{rows, best, baselines}"),
    quiet: bool = _quiet_option(),
) -> None:
    """Profile each batch, take parameters, gradients and optimizer state off the device's
    memory, plan the activations in what is left, and pick the batch that trains fastest."""
    sink = Sink(as_json, quiet)
    from .fit import check_static_fits, parse_batches, sweep
    from .trace import split_device
    from .trace.workload import parse_workload_args
    batches = parse_batches(batch)
    s = _fit_settings(hardware, memory, reserve, optimizer, shard, fused, planner, time_limit)
    args = parse_workload_args(arg)
    if batch_arg in args:
        raise InputError(f"--arg {batch_arg}=... sets the batch, which --batch sweeps",
                         hint=f"leave --arg {batch_arg} out")
    split_device(device)
    if not model.is_file() or model.suffix.lower() != ".py":
        raise InputError(f"{model} is not a workload file" if model.exists()
                         else f"model file {model} does not exist",
                         hint="fit takes a workload .py file with a workload() function")
    target = output or Path(model.stem + ".fit.plan.json")
    _check_output_path(target, "-o", [model, hardware])
    _check_output_path(_sibling(target, ".profile.json"), "-o", [model, hardware])
    from .trace.static_memory import Profiler, check_batch_arg
    check_batch_arg(str(model), entry, batch_arg)
    profiler = Profiler(str(model), entry=entry, args=args, batch_arg=batch_arg,
                        device=device, hardware=s.hardware,
                        on_facts=lambda f: check_static_fits(f, s),
                        workers=jobs)
    try:
        result = sweep(batches, profiler, s, progress=sink.status,
                       derive_batch_arg=None if profile_each else batch_arg)
    finally:
        profiler.close()
    if result.best_plan is not None:
        prof_target = _write_best(result, target, model)
    _fit_report(result, s, target if result.best_plan else None,
                prof_target if result.best_plan else None, sink)


def _fit_report(result, s, target: Optional[Path], prof_target: Optional[Path],
                sink: Sink) -> None:
    def views():
        from .render_fit import fit_views
        return fit_views(result, planner=s.planner, hardware=s.hardware.name,
                         memory_bytes=s.memory_bytes, optimizer=s.optimizer, shard=s.shard)
    sink.show(Result({**result.to_json(), "hardware": s.hardware.name,
                      "memory_bytes": s.memory_bytes, "reserve_bytes": s.reserve_bytes,
                      "optimizer": s.optimizer, "shard": s.shard,
                      "plan": str(target) if target else None,
                      "profile": str(prof_target) if prof_target else None},
                     views=views, lines=[f"wrote {target} (the best batch's plan) and "
                                         f"{prof_target}"] if target else []))
    if target is None:
        error_lines("no batch of the sweep fits the device; wrote no plan",
                    "try smaller batches, --shard N, a lighter --optimizer, or less --reserve")
        raise typer.Exit(4)


# --------------------------------------------------------------------------------------------
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
    from .hardware import HardwareSpec, load_hardware
    from .profile_build import recost
    from .schema import load_plan
    from .simulate import simulate as run_sim
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
        import dataclasses
        shown = dataclasses.replace(p, hardware=hw.to_dict(), predicted=result.predicted,
                                    feasible=result.feasible)
        return _render().plan_views(shown, prof, result, planned=p)
    sink.show(Result({"plan": str(plan_path), "hardware": hw.name, "feasible": result.feasible,
                      "reason": result.reason, "predicted": result.predicted,
                      "trace": str(trace) if trace is not None else None}, views=views,
                     lines=[f"wrote {trace} (open it in https://ui.perfetto.dev)"]
                     if trace is not None else []))
    if not result.feasible:
        error_lines(f"on {hw.name} this plan does not keep activation memory under its "
                    f"budget" + (f": {result.reason}" if result.reason else ""),
                    f"plan again for this hardware: slackswap plan PROFILE --budget ... "
                    f"--hardware {hardware or hw.name}")
        raise typer.Exit(4)


def _plan_profile(p, profile_path: Optional[Path]):
    from .schema import load_profile
    path = profile_path or (Path(p.profile_path) if p.profile_path else None)
    if path is None:
        raise InputError("the plan does not record its profile", hint="pass --profile PROFILE.json")
    if not path.exists():
        raise InputError(f"the plan's profile {path} does not exist",
                         hint="pass --profile PROFILE.json")
    prof = load_profile(path)
    p.check_profile(prof)
    return prof


# --------------------------------------------------------------------------------------------
@app.command(short_help="Inspect a profile or a plan in the terminal.",
             epilog=_examples(
                 "slackswap show model.profile.json",
                 "slackswap show model.plan.json --json",
             ))
def show(
    path: Path = typer.Argument(..., metavar="FILE", help="a profile or a plan JSON"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="for a plan: its profile [default: the one it records]"),
    as_json: bool = _json_option("the summary"),
) -> None:
    """Inspect a profile or a plan in the terminal."""
    from .schema import PROFILE_FORMAT, load_plan, load_profile, sniff_format
    if sniff_format(path) == PROFILE_FORMAT:
        prof = load_profile(path)
        result = Result({"fingerprint": prof.fingerprint, "workload": prof.workload,
                         "env": prof.env, "summary": prof.summary},
                        views=lambda: _render().profile_views(prof))
    else:
        p = load_plan(path)
        result = Result(p, views=lambda: _simulated_plan_views(p, profile_path))
    Sink(as_json).show(result)


def _simulated_plan_views(p, profile_path: Optional[Path]) -> list:
    """`show PLAN`: the plan's views, simulated again on its own hardware for the timeline."""
    from .hardware import HardwareSpec
    from .profile_build import recost
    from .simulate import simulate as run_sim
    hw = HardwareSpec.from_dict(p.hardware, "plan hardware")
    prof = recost(_plan_profile(p, profile_path), hw)
    return _render().plan_views(p, prof, run_sim(prof, p.decisions, hw, p.budget_bytes))


# --------------------------------------------------------------------------------------------
@app.command(short_help="Emit a patched training module that carries a plan out.",
             epilog=_examples(
                 "slackswap apply model.plan.json -o model_patched.py",
             ))
def apply(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="plan JSON"),
    output: Path = typer.Option(..., "-o", "--output", help="path of the patched module (.py)"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="profile JSON [default: the one the plan records]"),
    model: Optional[Path] = typer.Option(None, "--model", help="workload file [default: the one the profile records]"),
    as_json: bool = _json_option("{patched, module, plan, ...}"),
    quiet: bool = _quiet_option(),
) -> None:
    """Emit a patched training module that carries the plan out on the real model."""
    sink = Sink(as_json, quiet)
    from .run.emit import apply_plan
    from .schema import load_plan, write_atomic
    if output.suffix != ".py":
        raise InputError(f"output {output} does not end in .py",
                         hint="the patched module is imported by your training script: "
                              f"name it e.g. {output.with_suffix('.py').name}")
    p = load_plan(plan_path)
    prof = _plan_profile(p, profile_path)
    _check_output_path(output, "-o", [plan_path, profile_path or p.profile_path, model,
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
                     views=lambda: [f"wrote {output}", _render().patch_usage(output.stem)]))


@app.command(short_help="Compare original and patched: losses, gradients, memory.",
             epilog=_examples(
                 "slackswap verify model_patched.py --steps 3",
             ))
def verify(
    patched: Path = typer.Argument(..., metavar="PATCHED", help="patched module from `slackswap apply`"),
    model: Optional[Path] = typer.Option(None, "--model", help="workload file [default: the one the patched module records]"),
    steps: int = typer.Option(1, "--steps", min=1, help="training steps to compare"),
    plan: Optional[Path] = typer.Option(None, "--plan", help="the plan the module was made from, for the simulator's timeline [default: a matching plan next to the module]"),
    as_json: bool = _json_option("the report"),
    compile_: bool = typer.Option(False, "--compile", help="check compile_planned instead: the partitioned graphs' saved, offloaded and recomputed against the plan, and values against eager"),
    backend: str = typer.Option("inductor", "--backend", help="with --compile: inductor or aot_eager"),
    quiet: bool = _quiet_option(),
) -> None:
    """Run original and patched for N steps: losses and gradients equal, memory (op by op, against the simulator) and time measured."""
    sink = Sink(as_json, quiet)
    if compile_:
        _verify_compiled(patched, model, steps, backend, sink)
        return
    from .run.verify import verify as run_verify
    plan_obj = None
    if plan is not None:
        from .schema import load_plan
        plan_obj = load_plan(plan)
    with sink.working(f"running original and patched step{'s' if steps > 1 else ''}"):
        report = run_verify(str(patched), model_path=str(model) if model else None,
                            steps=steps, plan=plan_obj, progress=sink.progress)
    import dataclasses
    sink.show(Result(dataclasses.asdict(report) if dataclasses.is_dataclass(report) else report,
                     views=lambda: [_render().verify_view(report),
                                    _render().verify_memory_view(report)]))
    if not report.passed:
        error_lines("verify failed: " + "; ".join(report.reasons),
                    "if the model or its code changed since it was profiled, run `slackswap "
                    "profile`, `plan` and `apply` again; a mismatch that persists is a bug in "
                    "slackswap, please report it")
        raise typer.Exit(5)


def _verify_compiled(patched: Path, model: Optional[Path], steps: int, backend: str,
                     sink: Sink) -> None:
    """`verify --compile`: the report of run/verify_compiled.py."""
    if backend not in ("inductor", "aot_eager"):
        raise InputError(f"--backend must be inductor or aot_eager, not {backend!r}",
                         hint="compile_planned sets the partitioner of these two backends")
    from .run.verify_compiled import verify_compiled
    with sink.working(f"compiling with the plan ({backend}) and running eager beside it"):
        report = verify_compiled(str(patched), str(model) if model else None,
                                 backend=backend, steps=steps)
    sink.show(Result(report, views=lambda: [_render().verify_compiled_view(report, backend)]))
    if not report["passed"]:
        error_lines("verify --compile failed: " + "; ".join(report["reasons"]),
                    "if the model changed since it was profiled, run `slackswap profile`, "
                    "`plan` and `apply` again; a mismatch that persists is a bug in slackswap")
        raise typer.Exit(5)


# --------------------------------------------------------------------------------------------
@app.command("hardware", short_help="List hardware presets, or print one.",
             epilog=_examples(
                 "slackswap hardware",
                 "slackswap hardware a100-pcie4 --json > my-a100.json",
             ))
def hardware_cmd(
    name: Optional[str] = typer.Argument(None, metavar="NAME", help="a preset to print in full"),
    as_json: bool = _json_option("the preset(s) (a starting point for a custom --hardware file)"),
) -> None:
    """List hardware presets, or print one (its fields are the format of a --hardware JSON file)."""
    from .hardware import PRESETS, load_hardware
    specs = [load_hardware(name)] if name else list(PRESETS.values())
    # indented: the JSON is the starting point of a hand-edited --hardware file
    Sink(as_json).show(Result(specs[0].to_dict() if name else {s.name: s.to_dict() for s in specs},
                              views=lambda: [_render().hardware_table(specs)], indent=True))


def _version_flag(value: bool) -> None:
    if value:
        from . import __version__
        typer.echo(__version__)
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version_flag,
                                       help="print the version and exit")) -> None:
    pass


@app.command(short_help="Print the version.",
             epilog=_examples(
                 "slackswap version --json",
             ))
def version(as_json: bool = _json_option("{version, python, torch}")) -> None:
    """Print the version (with --json: also Python's and torch's, null if torch is missing)."""
    from . import __version__
    Sink(as_json).show(Result(_versions, views=lambda: [__version__]))


def _versions() -> dict:
    """`version --json`: slackswap's, Python's and torch's (null when torch is missing)."""
    import platform
    from importlib import metadata

    from . import __version__
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"version": __version__, "python": platform.python_version(),
            "torch": torch_version}


def main() -> None:
    app()
