"""The Typer app and what its commands share: option helpers, help epilogs, the lazy import
of the render views, the output-path check, and the inputs of the commands that read a
profile or a plan."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from .. import __version__
from ..errors import InputError
from ..planners import PLANNERS, planner_names
from .boundary import BoundaryGroup


def help_examples(*lines: str) -> str:
    """A command's help epilog: example command lines, kept as written (click's \\b)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


app = typer.Typer(cls=BoundaryGroup, add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_enable=False,
                  help="Fit training into GPU memory: keep, swap or recompute each saved activation.",
                  epilog="Exit codes: 0 ok, 1 internal error (a bug: SLACKSWAP_DEBUG=1 prints its "
                         "traceback), 2 bad input, 3 the model could not be traced, 4 no plan fits "
                         "the budget, 5 verify found a difference.")
PLANNER_HELP = " | ".join(planner_names())
SLOW_PLANNERS = ", ".join(n for n, spec in PLANNERS.items() if not spec.quick)


def json_option(what: str):
    return typer.Option(False, "--json", help=f"print {what} as JSON")


def quiet_option():
    return typer.Option(False, "--quiet", "-q", help="print nothing but warnings and errors "
                                                     "(the exit code and the files say the rest)")


def renderer():
    """The render package, imported when a person is shown a view (not for --json or --quiet)."""
    from . import render
    return render


def check_output_path(path: Path, option: str = "-o", inputs=(), example: str = "out.json") -> None:
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


def load_plan_inputs(profile_path: Path, budget: str, hardware: Optional[str]):
    # the library loads inside these helpers, when a command runs: the app starts light
    from ..planning import plan_inputs
    from ..schema import load_profile
    return plan_inputs(load_profile(profile_path), budget, hardware, str(profile_path))


def time_options(spec, time_limit: Optional[float], started: Optional[float] = None) -> dict:
    from ..planning import planner_time_options
    return planner_time_options(spec, time_limit, started)


def sibling_file(path: Path, suffix: str) -> Path:
    from ..planning import sibling_path
    return sibling_path(path, suffix)


def plan_with_paths(plan_obj, profile_path: Path, prof):
    from ..planning import with_paths
    return with_paths(plan_obj, profile_path, prof)


def plan_profile(p, profile_path: Optional[Path]):
    from ..schema import load_profile
    path = profile_path or (Path(p.profile_path) if p.profile_path else None)
    if path is None:
        raise InputError("the plan does not record its profile", hint="pass --profile PROFILE.json")
    if not path.exists():
        raise InputError(f"the plan's profile {path} does not exist",
                         hint="pass --profile PROFILE.json")
    prof = load_profile(path)
    p.check_profile(prof)
    return prof


BUFFERS_HELP = ("with --pp: how the pipeline's torch holds PipelineStage's buffers: reused "
                "(torch 2.13, 2.14: receive buffers allocated once, kept all step) | per-step "
                "(torch 2.15: each allocated before its receive, a sent output dropped once "
                "its send is waited) [default: the installed torch's, else the profile's]")


def buffers_option():
    return typer.Option(None, "--buffers", help=BUFFERS_HELP)


def pipeline_buffers(flag: Optional[str], prof=None) -> str:
    """How the pipeline's PipelineStages hold their buffers (`pipeline.stages.BUFFERS`): as
    `--buffers` gives it, else as the installed torch does (read from its package metadata,
    torch not imported), else as the torch that made `prof` (a Profile, or a list of them:
    the first) did, else "reused"."""
    from importlib import metadata

    from ..pipeline.stages import BUFFERS
    from ..pipeline.step import buffers_of
    if flag is not None:
        if flag not in BUFFERS:
            raise InputError(f"--buffers {flag} is not one of {', '.join(BUFFERS)}",
                             hint="--buffers per-step for torch 2.15 or later, --buffers "
                                  "reused for torch 2.13 and 2.14")
        return flag
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        first = prof[0] if isinstance(prof, list) else prof
        version = ((getattr(first, "env", None) or {}).get("torch_version")
                   if first is not None else None)
    return buffers_of(version) if version else "reused"


def _version_flag(value: bool) -> None:
    if value:
        from .output import Result, Sink
        Sink().show(Result(__version__, lines=[__version__]))
        raise typer.Exit(0)    # a normal end: the eager option's way to stop the command


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version_flag,
                                       help="print the version and exit")) -> None:
    pass
