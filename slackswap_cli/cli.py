"""The `slackswap` command: parse options, call the library, render, map errors to exit codes.

This is the only module that prints or exits. Library code raises `SlackswapError(message,
hint)`; here it becomes `Error: ...` / `Hint: ...` on stderr and the error's exit code (2 bad
input, 3 tracing failed, 4 no plan fits, 5 verify found a mismatch). Usage errors (a missing
option, an unknown command) get the same two lines and exit 2. Any other exception is a bug in
slackswap: users see `Error: internal error ...` and exit 1, never a raw traceback, unless
SLACKSWAP_DEBUG=1 asks for it. Imports of heavy modules (torch, the tracer, the planners)
happen inside the commands, so `plan`, `show`, `simulate` and `compare` start without
importing torch.
"""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from .errors import InputError, SlackswapError

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
            _error_lines(exc.format_message(), f"see `{sub} --help`")
            raise typer.Exit(2) from None
        except ClickException:
            raise
        except SlackswapError as exc:      # raised outside a command's own try block
            _fail(exc)
        except KeyboardInterrupt:
            _error_lines("interrupted", None)
            raise typer.Exit(130) from None
        except SystemExit as exc:          # our exits are typer.Exit: this one is user code's
            if isinstance(exc.__context__, BrokenPipeError):
                _closed_pipe()             # Rich's exit when stdout closed early (`| head`)
            who = ("the patched module or the workload" if ctx.invoked_subcommand == "verify"
                   else "the workload")
            _error_lines(f"{who} called sys.exit({exc.code!r}) while slackswap ran it",
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
            _error_lines(f"`slackswap {ctx.invoked_subcommand or ''}` needs torch, which is not "
                         "installed", "pip install 'slackswap[torch]' (or a torch build for your "
                         "CUDA version from pytorch.org); plan, show, simulate and compare run "
                         "without it")
            raise typer.Exit(2) from None
        except Exception as exc:  # noqa: BLE001 - the boundary: a bug must not print a traceback
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
out = Console(highlight=False, soft_wrap=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _error_lines(message: str, hint: str | None) -> None:
    err.print(f"[bold red]Error:[/] {escape(message)}", markup=True, highlight=False)
    if hint:
        err.print(f"[bold]Hint:[/] {escape(hint)}", markup=True, highlight=False)


def _fail(exc: SlackswapError) -> None:
    _error_lines(exc.message, exc.hint)
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
    _error_lines(f"internal error: {type(exc).__name__}" + (f": {text}" if text else ""), hint)
    raise typer.Exit(1)


def _print_json(data) -> None:
    from .schema import dumps
    sys.stdout.write(dumps(data).decode() + "\n")


def _render(items) -> None:
    for item in items:
        out.print(item)


def _working(message: str, quiet: bool = False):
    """A spinner with the elapsed time on stderr while a slow step runs, on a terminal only
    (scripts and pipes see nothing; --json output stays the only thing on stdout)."""
    if quiet or not err.is_terminal:
        return _nullcontext()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=err, transient=True)
    progress.add_task(message, total=None)
    return progress


def _status(message: str) -> None:
    err.print(f"[dim]{escape(message)}[/]", markup=True)


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
    as_json: bool = typer.Option(False, "--json", help="print the profile summary as JSON instead of tables"),
) -> None:
    """Trace one training step and write its profile (every saved activation, its cost and lifetime)."""
    try:
        from .hardware import load_hardware
        from .schema import save
        hw = load_hardware(hardware)
        if not model.exists():
            raise InputError(f"model file {model} does not exist", hint="pass a workload .py file or an .onnx file")
        if model.is_dir():
            raise InputError(f"{model} is a directory, not a workload file",
                             hint="pass a workload .py file or an .onnx file")
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
            with err.status("tracing the training step...") if err.is_terminal else _nullcontext():
                prof = profile_workload(str(model), entry=entry, args=args, device=device,
                                        hardware=hw, autocast=autocast, progress=_status)
        save(prof, target)
    except SlackswapError as exc:
        _fail(exc)
    from .profile_build import attention_warning
    warnings = [*warnings, *filter(None, [attention_warning(prof)])]
    for w in warnings:
        err.print(f"[yellow]Warning:[/] {escape(w)}", markup=True)
    if as_json:
        _print_json({"profile": str(target), "fingerprint": prof.fingerprint,
                     "workload": prof.workload, "env": prof.env, "summary": prof.summary})
        return
    from .render import profile_views
    _render(profile_views(prof))
    out.print(f"wrote {target}", markup=False)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------------------------
def _plan_inputs(profile_path: Path, budget: str, hardware: Optional[str]):
    from .budget import parse_budget
    from .hardware import load_hardware, stored_hardware
    from .schema import load_profile
    from .profile_build import recost
    prof = load_profile(profile_path)
    hw = (load_hardware(hardware) if hardware else
          stored_hardware(prof.env.get("hardware"), str(profile_path)) or load_hardware(None))
    prof = recost(prof, hw)  # a roofline profile is re-timed for the hardware planned for
    budget_bytes, fraction = parse_budget(budget, prof)
    return prof, hw, budget_bytes, fraction


@app.command(short_help="Decide keep / swap / recompute; simulate; write the plan.",
             epilog=_examples(
                 "slackswap plan model.profile.json --budget 0.5",
                 "slackswap plan model.profile.json --budget 20GiB --hardware h100-pcie5 -o p.json",
                 "slackswap plan model.profile.json --budget 0.4 --planner optimal --time-limit 30",
             ))
def plan(
    profile_path: Path = typer.Argument(..., metavar="PROFILE", help="profile JSON from `slackswap profile`"),
    budget: str = typer.Option(..., "--budget", "-b", help="fraction of the keep-all activation peak (0.5) or bytes (20GiB, 512MiB, 2e9)"),
    planner: str = typer.Option("slackswap", "--planner", "-p", help="slackswap | optimal | recompute-only | swap-all | checkpoint-layers"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="preset or JSON file [default: the profile's, else a100-pcie4]"),
    time_limit: float = typer.Option(60.0, "--time-limit", min=1.0, help="seconds the whole command may take with --planner optimal"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="plan path [default: <profile name>.plan.json in the current directory]"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON instead of tables"),
) -> None:
    """Decide keep / swap / recompute for every saved activation, simulate, write the plan."""
    import time
    started = time.perf_counter()
    try:
        from .budget import first_feasible_budget, floor_message
        from .planners import get_planner, plan_and_simulate
        from .schema import save
        prof, hw, budget_bytes, fraction = _plan_inputs(profile_path, budget, hardware)
        get_planner(planner)
        # below the floor no plan fits, but the planner's closest plan is still written
        below = floor_message(budget_bytes, prof)
        target = output or Path(_sibling(profile_path, ".plan.json").name)
        _check_output_path(target, "-o", [profile_path, hardware])
        # optimal keeps its own reserve for the simulation and writing that follow
        left = max(1.0, time_limit - (time.perf_counter() - started))
        options = {"time_limit_s": left} if planner == "optimal" else {}
        with _working(f"planning with {planner}", as_json):
            result, sim = plan_and_simulate(planner, prof, hw, budget_bytes, fraction,
                                            record=True, **options)
        result = _with_paths(result, profile_path, prof)
        save(result, target)
        reach = None
        if not result.feasible and below is None and planner != "optimal":
            reach = first_feasible_budget(prof, hw, planner)   # optimal: a MILP per step
    except SlackswapError as exc:
        _fail(exc)
    if as_json:
        summary = _plan_summary(result, target)
        if planner == "optimal":
            summary["bound_retention"] = _bound_retention(planner, prof, hw, budget_bytes)
        _print_json(summary)
    else:
        from .render import plan_views
        _render(plan_views(result, prof, sim))
        out.print(f"wrote {target}", markup=False)
    if not result.feasible:
        wrote = f"wrote the closest plan found to {target} with feasible: false"
        if below is not None:
            _error_lines(f"{below[0]}; {wrote}", below[1])
        else:
            from .simulate import budget_floor_bytes
            from .units import fmt_bytes
            peak, floor = prof.keep_all_peak_bytes, budget_floor_bytes(prof)
            fits = ("" if reach is None else
                    f"; planner {planner} first fits at {fmt_bytes(reach)}"
                    + (f" ({reach / peak:.3f})" if peak else ""))
            _error_lines(f"planner {planner} found no plan under the budget{fits}; {wrote}",
                         f"the floor is {fmt_bytes(floor)}"
                         + (f" ({floor / peak:.3f})" if peak else "")
                         + ": `--planner swap-all` fits every budget from there up; or raise "
                           "--budget, or try --planner optimal")
        raise typer.Exit(4)


def _plan_summary(p, path: Path) -> dict:
    """What a script wants from `plan --json`: where the plan is and what it predicts; the
    file holds the whole plan (every decision and the schedule)."""
    from .schema import Action
    counts = {a.value: 0 for a in Action}
    for d in p.decisions:
        counts[str(d.action)] = counts.get(str(d.action), 0) + 1
    return {"plan": str(path), "planner": p.planner, "feasible": p.feasible,
            "hardware": p.hardware.get("name"), "budget_bytes": p.budget_bytes,
            "budget_fraction": p.budget_fraction, "actions": counts,
            "predicted": p.predicted, "solve_ms": p.solve_ms, "notes": list(p.notes)}


def _bound_retention(planner: str, prof, hw, budget_bytes: int) -> float | None:
    """The sound bound `optimal` computed (cached on the profile), None for heuristics or
    when it was not computed in time."""
    if planner != "optimal":
        return None
    from .planners.bound import sound_bound
    return sound_bound(prof, hw, budget_bytes, time_limit_s=0.0).retention


def _sibling(path: Path, suffix: str) -> Path:
    name = path.name
    for ext in (".profile.json", ".plan.json", ".json"):
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    return path.with_name(name + suffix)


def _with_paths(plan_obj, profile_path: Path, prof):
    import dataclasses
    return dataclasses.replace(plan_obj, profile_path=str(profile_path.resolve()),
                               model_path=prof.workload.get("path"))


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
    time_limit: float = typer.Option(60.0, "--time-limit", min=1.0, help="seconds the optimal planner may take"),
    planners: Optional[str] = typer.Option(None, "--planners", help="comma-separated subset [default: all]"),
    as_json: bool = typer.Option(False, "--json", help="print {results: [...]} as JSON"),
    with_torch_compile: bool = typer.Option(False, "--with-torch-compile", help="add a row for torch.compile's own choice: its min-cut partitioner on the profile's graph (re-traced from the workload with fake tensors; needs torch), activation_memory_budget searched to meet the budget"),
    model: Optional[Path] = typer.Option(None, "--model", help="with --with-torch-compile: the workload file [default: the one the profile records]"),
) -> None:
    """Every planner side by side on one profile: retention, peak, stall, recompute, solve time."""
    try:
        from .budget import check_budget
        from .planners import make_plan, planner_names
        if model is not None and not with_torch_compile:
            raise InputError("--model is the workload file for --with-torch-compile",
                             hint="add --with-torch-compile, or leave --model out")
        prof, hw, budget_bytes, fraction = _plan_inputs(profile_path, budget, hardware)
        check_budget(budget_bytes, prof)
        names = planner_names() if planners is None else [p.strip() for p in planners.split(",") if p.strip()]
        if not names:
            raise InputError(f"--planners '{planners}' names no planner",
                             hint=f"a comma-separated subset of: {', '.join(planner_names())}")
        unknown = [n for n in names if n not in planner_names()]
        if unknown:   # before any planner runs: optimal alone can take a minute
            raise InputError(f"unknown planner '{unknown[0]}' in --planners",
                             hint=f"planners: {', '.join(planner_names())}")
        rows = []
        for name in names:
            if not as_json:
                _status(f"planning with {name}..." if name != "optimal" else
                        f"planning with optimal (a MILP, solver limit {time_limit:g} s: set it with "
                        "--time-limit, or leave optimal out with --planners)...")
            options = {"time_limit_s": time_limit} if name == "optimal" else {}
            with _working(f"planning with {name}", as_json):
                p = make_plan(name, prof, hw, budget_bytes, budget_fraction=fraction, **options)
            rows.append({"planner": name, "feasible": p.feasible, "predicted": p.predicted,
                         "solve_ms": p.solve_ms, "notes": list(p.notes),
                         "bound_retention": _bound_retention(name, prof, hw, budget_bytes)})
        if with_torch_compile:
            rows.append(_torch_compile_row(prof, profile_path, model, hw, budget_bytes, fraction,
                                           as_json))
    except SlackswapError as exc:
        _fail(exc)
    if as_json:
        _print_json({"profile": str(profile_path), "hardware": hw.name, "budget_bytes": budget_bytes,
                     "budget_fraction": fraction, "results": rows})
        return
    from .render import compare_table
    out.print(compare_table(rows, budget_bytes, hardware=hw.name,
                            keep_all_bytes=prof.keep_all_peak_bytes))
    for row in rows:   # say why a planner does not fit, in its own words
        if "activation_memory_budget" in row:
            out.print(f"torch.compile: activation_memory_budget={row['activation_memory_budget']:.4g} "
                      + ("meets the budget" if row["met_budget"] else "(no value meets the budget)")
                      + f"; {len(row['knob_tried'])} values tried", markup=False)
        if not row["feasible"] and row["notes"]:
            from rich.table import Table
            from rich.text import Text
            grid = Table.grid(padding=(0, 1))
            grid.add_column(no_wrap=True)
            grid.add_column(style="dim")
            for note in row["notes"]:
                grid.add_row("  -", Text(str(note)))
            out.print(f"{row['planner']} does not fit:", style="bold", highlight=False, markup=False)
            out.print(grid)


def _torch_compile_row(prof, profile_path: Path, model: Optional[Path], hw, budget_bytes: int,
                       fraction, quiet: bool) -> dict:
    """compare's `torch.compile` row: torch's partitioner on the re-traced step, knob searched."""
    from .trace.torch_choice import PLANNER_NAME, baseline_for
    if not quiet:
        _status("re-tracing the workload with fake tensors for torch.compile's partitioner...")
    with _working("re-tracing the workload", quiet):
        base = baseline_for(prof, profile_path, model)
    if not quiet:
        _status("searching torch's activation_memory_budget (a min-cut partition per try)...")
    with _working("partitioning with torch's min-cut partitioner", quiet):
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
    from .planners import get_planner
    hw = load_hardware(hardware)
    if memory is not None:
        hw = dataclasses.replace(hw, memory_bytes=parse_size(memory, "--memory"))
    if hw.memory_bytes <= 0:
        raise InputError(f"hardware {hw.name} has no device memory",
                         hint="give the device's memory with --memory 80GiB")
    check_optimizer(optimizer)
    get_planner(planner)
    if shard < 1:
        raise InputError(f"--shard {shard} must be at least 1", hint="--shard 8 for 8 ranks")
    return FitSettings(hardware=hw, memory_bytes=hw.memory_bytes,
                       reserve_bytes=(default_reserve(hw.memory_bytes) if reserve is None
                                      else parse_size(reserve, "--reserve")),
                       optimizer=optimizer, shard=shard, step_on_device=fused, planner=planner,
                       planner_options={"time_limit_s": time_limit} if planner == "optimal" else {})


def _write_best(result, plan_target: Path, model: Path) -> Path:
    """The best row's plan, and next to it the profile it was made from."""
    from .schema import save
    prof_target = _sibling(plan_target, ".profile.json")
    save(result.best_profile, prof_target)
    save(_with_paths(result.best_plan, prof_target, result.best_profile), plan_target)
    return prof_target


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
    planner: str = typer.Option("slackswap", "--planner", "-p", help="slackswap | optimal | recompute-only | swap-all | checkpoint-layers"),
    time_limit: float = typer.Option(60.0, "--time-limit", min=1.0, help="seconds per batch with --planner optimal"),
    entry: str = typer.Option("workload", "--entry", help="function in the workload file that returns (model, inputs[, loss_fn])"),
    arg: List[str] = typer.Option([], "--arg", metavar="KEY=VALUE", help="key=value passed to the entry function; repeatable"),
    device: str = typer.Option("fake", "--device", help="fake (default: nothing allocated, roofline costs) | fake:cpu | cpu | cuda"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="the best plan [default: <model>.fit.plan.json here]; its profile goes next to it"),
    profile_each: bool = typer.Option(False, "--profile-each", help="trace every batch; by default a batch after the first two is derived from the last two traced where that is exact (same step, sizes affine in the batch)"),
    jobs: int = typer.Option(2, "--jobs", min=1, help="traces in forked processes, ahead of planning: 2 overlaps a trace with planning (same rows; helps only with idle cores); 1: one process"),
    as_json: bool = typer.Option(False, "--json", help="print {rows, best, baselines} as JSON"),
) -> None:
    """Profile each batch, take parameters, gradients and optimizer state off the device's
    memory, plan the activations in what is left, and pick the batch that trains fastest."""
    try:
        from .fit import check_static_fits, parse_batches, static_memory, sweep
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
                            on_facts=lambda f: check_static_fits(
                                static_memory(f, s.optimizer, shard=s.shard,
                                              step_on_device=s.step_on_device), s),
                            workers=jobs)
        try:
            result = sweep(batches, profiler, s, progress=_status,
                           derive_batch_arg=None if profile_each else batch_arg)
        finally:
            profiler.close()
        if result.best_plan is not None:
            prof_target = _write_best(result, target, model)
    except SlackswapError as exc:
        _fail(exc)
    _fit_report(result, s, target if result.best_plan else None,
                prof_target if result.best_plan else None, as_json)


def _fit_report(result, s, target: Optional[Path], prof_target: Optional[Path],
                as_json: bool) -> None:
    if as_json:
        _print_json({**result.to_json(), "hardware": s.hardware.name,
                     "memory_bytes": s.memory_bytes, "reserve_bytes": s.reserve_bytes,
                     "optimizer": s.optimizer, "shard": s.shard,
                     "plan": str(target) if target else None,
                     "profile": str(prof_target) if prof_target else None})
    else:
        from .render_fit import fit_views
        _render(fit_views(result, planner=s.planner, hardware=s.hardware.name,
                          memory_bytes=s.memory_bytes, optimizer=s.optimizer, shard=s.shard))
        if target:
            out.print(f"wrote {target} (the best batch's plan) and {prof_target}", markup=False)
    if target is None:
        _error_lines("no batch of the sweep fits the device; wrote no plan",
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
    as_json: bool = typer.Option(False, "--json", help="print the prediction as JSON"),
) -> None:
    """Re-simulate a plan (what-if on other hardware); optionally write a Perfetto timeline."""
    try:
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
        result = run_sim(prof, p.decisions, hw, p.budget_bytes, record=trace is not None or not as_json)
        if trace is not None:
            from .chrome_trace import write_chrome_trace
            write_chrome_trace(trace, result, prof, p.budget_bytes)
    except SlackswapError as exc:
        _fail(exc)
    if as_json:
        _print_json({"plan": str(plan_path), "hardware": hw.name, "feasible": result.feasible,
                     "reason": result.reason, "predicted": result.predicted,
                     "trace": str(trace) if trace is not None else None})
    else:
        import dataclasses
        from .render import plan_views
        shown = dataclasses.replace(p, hardware=hw.to_dict(), predicted=result.predicted,
                                    feasible=result.feasible)
        _render(plan_views(shown, prof, result, planned=p))
        if trace is not None:
            out.print(f"wrote {trace} (open it in https://ui.perfetto.dev)", markup=False)
    if not result.feasible:
        _error_lines(f"on {hw.name} this plan does not keep activation memory under its "
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
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Inspect a profile or a plan in the terminal."""
    try:
        from .schema import PROFILE_FORMAT, load_plan, load_profile, sniff_format
        fmt = sniff_format(path)
        if fmt == PROFILE_FORMAT:
            prof = load_profile(path)
            if as_json:
                _print_json({"fingerprint": prof.fingerprint, "workload": prof.workload,
                             "env": prof.env, "summary": prof.summary})
                return
            from .render import profile_views
            _render(profile_views(prof))
            return
        p = load_plan(path)
        if as_json:
            _print_json(p)
            return
        from .hardware import HardwareSpec
        from .profile_build import recost
        from .simulate import simulate as run_sim
        hw = HardwareSpec.from_dict(p.hardware, "plan hardware")
        prof = recost(_plan_profile(p, profile_path), hw)
        result = run_sim(prof, p.decisions, hw, p.budget_bytes)
    except SlackswapError as exc:
        _fail(exc)
    from .render import plan_views
    _render(plan_views(p, prof, result))


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
    as_json: bool = typer.Option(False, "--json", help="print {patched, module, plan, ...} as JSON"),
) -> None:
    """Emit a patched training module that carries the plan out on the real model."""
    try:
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
        with _working("writing the patched module (re-tracing the model)", as_json):
            source = apply_plan(p, prof, model_path=str(model) if model else None)
        write_atomic(output, source.encode())
    except SlackswapError as exc:
        _fail(exc)
    if as_json:
        _print_json({"patched": str(output), "module": output.stem,
                     "importable": output.stem.isidentifier(), "plan": str(plan_path),
                     "planner": p.planner, "feasible": p.feasible})
        return
    out.print(f"wrote {output}", markup=False)
    if not output.stem.isidentifier():
        err.print(f"[yellow]Warning:[/] '{escape(output.stem)}' is not a Python module name, so "
                  "`import` cannot load it as is: rename it (letters, digits, underscores) or "
                  "load it with importlib", markup=True)
    out.print("use it in your training loop:\n"
              f"    from {output.stem} import patch\n"
              "    patch(model)               # in place: same model, hooks, DDP, Trainer\n"
              "    loss = model(*inputs)      # trains under the plan\n"
              "    loss.backward(); optimizer.step()", markup=False)


@app.command(short_help="Compare original and patched: losses, gradients, memory.",
             epilog=_examples(
                 "slackswap verify model_patched.py --steps 3",
             ))
def verify(
    patched: Path = typer.Argument(..., metavar="PATCHED", help="patched module from `slackswap apply`"),
    model: Optional[Path] = typer.Option(None, "--model", help="workload file [default: the one the patched module records]"),
    steps: int = typer.Option(1, "--steps", min=1, help="training steps to compare"),
    plan: Optional[Path] = typer.Option(None, "--plan", help="the plan the module was made from, for the simulator's timeline [default: a matching plan next to the module]"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    compile_: bool = typer.Option(False, "--compile", help="check compile_planned instead: the partitioned graphs' saved, offloaded and recomputed against the plan, and values against eager"),
    backend: str = typer.Option("inductor", "--backend", help="with --compile: inductor or aot_eager"),
) -> None:
    """Run original and patched for N steps: losses and gradients equal, memory (op by op, against the simulator) and time measured."""
    if compile_:
        _verify_compiled(patched, model, steps, backend, as_json)
        return
    try:
        from .run.verify import verify as run_verify
        plan_obj = None
        if plan is not None:
            from .schema import load_plan
            plan_obj = load_plan(plan)
        with _working(f"running original and patched step{'s' if steps > 1 else ''}", as_json):
            report = run_verify(str(patched), model_path=str(model) if model else None,
                                steps=steps, plan=plan_obj,
                                progress=None if err.is_terminal else _status)
    except SlackswapError as exc:
        _fail(exc)
    if as_json:
        import dataclasses
        _print_json(dataclasses.asdict(report) if dataclasses.is_dataclass(report) else report)
    else:
        from .render import verify_memory_view, verify_view
        out.print(verify_view(report))
        out.print(verify_memory_view(report))
    if not report.passed:
        _error_lines("verify failed: " + "; ".join(report.reasons),
                     "if the model or its code changed since it was profiled, run `slackswap "
                     "profile`, `plan` and `apply` again; a mismatch that persists is a bug in "
                     "slackswap, please report it")
        raise typer.Exit(5)


def _verify_compiled(patched: Path, model: Optional[Path], steps: int, backend: str,
                     as_json: bool) -> None:
    """`verify --compile`: the report of run/verify_compiled.py, as JSON or as lines."""
    if backend not in ("inductor", "aot_eager"):
        _fail(InputError(f"--backend must be inductor or aot_eager, not {backend!r}",
                         hint="compile_planned sets the partitioner of these two backends"))
    try:
        from .run.verify_compiled import verify_compiled
        with _working(f"compiling with the plan ({backend}) and running eager beside it", as_json):
            report = verify_compiled(str(patched), str(model) if model else None,
                                     backend=backend, steps=steps)
    except SlackswapError as exc:
        _fail(exc)
    if as_json:
        _print_json(report)
    else:
        c, p = report["compiled"], report["plan"]
        out.print(f"compiled ({backend}): {c['graphs']} graph(s), {c['lined_up_ops']} of "
                  f"{c['graph_ops']} forward ops line up")
        out.print(f"{'':<20}{'compiled':>11}{'plan':>11}{'in graph':>11}")
        for label, got, key in (("saved / kept B", c["saved_bytes"], "kept_bytes"),
                                ("offloaded / swapped B", c["offloaded_bytes"], "swapped_bytes")):
            out.print(f"{label:<21}{got:>10}{p[key]:>11}{p[key + '_in_graph']:>11}")
        out.print(f"{'recomputed ops':<21}{c['recomputed_ops']:>10}{p['recomputed_ops']:>11}"
                  f"   (+ {c['rederived_views']} views re-derived)")
        out.print(f"saved by ops that did not line up: {c['saved_bytes_not_lined_up']} B")
        out.print(f"vs eager (relative): loss {report['max_loss_rel_diff']:.1e}, gradients "
                  f"{report['max_grad_rel_diff']:.1e}, parameters {report['max_param_rel_diff']:.1e}")
    if not report["passed"]:
        _error_lines("verify --compile failed: " + "; ".join(report["reasons"]),
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
    as_json: bool = typer.Option(False, "--json", help="print as JSON (a starting point for a custom --hardware file)"),
) -> None:
    """List hardware presets, or print one (its fields are the format of a --hardware JSON file)."""
    from .hardware import PRESETS, load_hardware
    try:
        specs = [load_hardware(name)] if name else list(PRESETS.values())
    except SlackswapError as exc:
        _fail(exc)
    if as_json:
        import orjson   # indented: this is the starting point of a hand-edited --hardware file
        data = specs[0].to_dict() if name else {s.name: s.to_dict() for s in specs}
        sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    from .render import hardware_table
    out.print(hardware_table(specs))


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
def version(as_json: bool = typer.Option(False, "--json", help="print {version, python, torch} as JSON")) -> None:
    """Print the version (with --json: also Python's and torch's, null if torch is missing)."""
    from . import __version__
    if not as_json:
        typer.echo(__version__)
        return
    import platform
    from importlib import metadata
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    _print_json({"version": __version__, "python": platform.python_version(),
                 "torch": torch_version})


def main() -> None:
    app()
