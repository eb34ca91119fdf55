"""Several stage files for `simulate --pp` and `show --pp`: one profile or plan per pipeline
stage (or the first stage's, a middle one's and the last's), each stage priced as its own
(`pipeline.step.pipeline_figures`). Torch-free, as `show` and `simulate` start."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

from ..errors import InputError
from .common import plan_profile
from .output import Sink


def one_file(paths: list[Path], command: str) -> Path:
    """The one file a command without --pp takes; several refused."""
    if len(paths) > 1:
        raise InputError(f"{command} takes one file; {len(paths)} are for a pipeline's "
                         "stages, with --pp",
                         hint="give one file, or add --pp N (the pipeline's ranks) with one "
                              "file per stage")
    return paths[0]


def stage_files(paths: list[Path], profile_path: Optional[Path]):
    """(profiles, plans or None): the files all profiles or all plans, in the order given."""
    from ..schema import PROFILE_FORMAT, load_plan, load_profile, sniff_format
    kinds = [sniff_format(p) == PROFILE_FORMAT for p in paths]
    if len(set(kinds)) > 1:
        raise InputError("the stage files mix profiles and plans",
                         hint="give every stage's profile (keeping everything) or every "
                              "stage's plan")
    if profile_path is not None and len(paths) > 1:
        raise InputError("--profile names one plan's profile; several plans are given",
                         hint="leave --profile out: each plan records its own profile")
    if kinds[0]:
        return [load_profile(p) for p in paths], None
    plans = [load_plan(p) for p in paths]
    return [plan_profile(p, profile_path) for p in plans], plans


def simulate_stages(plan_paths: list[Path], pp, hardware: Optional[str],
                    profile_path: Optional[Path], trace: Optional[Path], sink: Sink,
                    pipe_of: Callable, result_of: Callable) -> bool:
    """`simulate` with several plans, one per stage: each re-simulated on `hardware` (the first
    plan's by default), the per-rank table shown; False (nothing done) for one plan.
    `pipe_of(plans)`: the pipeline settings (None: no pipeline); `result_of`: the table's
    Result (`cmd_simulate._pipeline_result`)."""
    if len(plan_paths) == 1:
        return False
    if trace is not None:
        raise InputError("--trace writes one plan's timeline; several plans are given",
                         hint="simulate one stage's plan with --trace, without --pp")
    from ..hardware import HardwareSpec, load_hardware
    from ..profile_build import recost
    from ..simulate import simulate as run_sim
    profs, plans = stage_files(plan_paths, profile_path)
    if plans is None:
        raise InputError("simulate takes plans; these are profiles",
                         hint="show them with `slackswap show FILE... --pp N`, or plan each "
                              "with `slackswap plan`")
    pipe = pipe_of(list(zip(plans, profs)))
    if pipe is None:
        one_file(plan_paths, "simulate")
    hw = load_hardware(hardware) if hardware else HardwareSpec.from_dict(plans[0].hardware,
                                                                         "plan hardware")
    profs = [recost(prof, hw) for prof in profs]
    results = [run_sim(prof, p.decisions, hw, p.budget_bytes, record=False)
               for prof, p in zip(profs, plans)]
    shown = [dataclasses.replace(p, hardware=hw.to_dict(), predicted=r.predicted)
             for p, r in zip(plans, results)]
    sink.show(result_of(pipe, profs, shown, hw, {
        "plans": [str(p) for p in plan_paths], "hardware": hw.name,
        "feasible": all(r.feasible for r in results),
        "predicted": [r.predicted for r in results]}))
    return True

