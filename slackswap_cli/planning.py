"""A profile in, a plan out: what `slackswap plan` does between reading its options and
writing its file, as functions the library API (`slackswap_cli.plan_model`) calls too.

- `plan_inputs(prof, budget, hardware)`: the hardware planned for (`--hardware`, else the one
  the profile was costed on, else the default preset), the profile re-costed for it (a
  roofline profile is re-timed), and the budget read as `--budget` reads it; a profile priced
  by other cost constants than this slackswap's is refused (`op_cost.check_cost_model`), and
  so is a pair whose step could outlast what a plan file records
  (`simulate.check_step_range`);
- `planner_time_options(spec, time_limit, started)`: `--time-limit` as a planner option;
- `plan_profile(...)`: the planner run and its plan simulated (`plan_and_simulate`).

Torch-free, like the rest of the planning core.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

from .budget import fraction_hint, parse_budget
from .compile_limits import no_swap_option
from .hardware import HardwareSpec, load_hardware, stored_hardware
from .op_cost import check_cost_model
from .planners import PLANNERS, plan_and_simulate, planner_spec
from .profile_build import recost
from .schema import Profile, check_target, save
from .simulate import budget_floor_bytes, check_step_range

__all__ = ["plan_inputs", "planner_time_options", "plan_profile"]


def plan_inputs(prof: Profile, budget, hardware=None, source: str = "profile"):
    """(profile re-costed, hardware, budget bytes, budget fraction or None).

    `hardware`: a preset name, a JSON file or a `HardwareSpec`; None takes the profile's own
    (`env.hardware`), else the default preset. `budget`: what `--budget` takes (0.5, "50%",
    "20GiB", bytes). `source` names the profile in errors."""
    check_cost_model(prof, source)   # its op times and ours must come from one cost model
    if isinstance(hardware, HardwareSpec):
        hw = hardware
    else:
        hw = (load_hardware(hardware) if hardware else
              stored_hardware(prof.env.get("hardware"), source) or load_hardware(None))
    prof = recost(prof, hw)  # a roofline profile is re-timed for the hardware planned for
    check_step_range(prof, hw, source)
    budget_bytes, fraction = parse_budget(budget, prof)
    return prof, hw, budget_bytes, fraction


def planner_time_options(spec, time_limit: Optional[float],
                         started: Optional[float] = None) -> dict:
    """--time-limit as the planner's `time_limit_s` option, for a planner that has one ({} for
    the others): what is left of it since `started`; without --time-limit, the planner's own
    default."""
    limit = spec.option_default("time_limit_s") if time_limit is None else time_limit
    if limit is None:
        return {}
    if started is not None:
        limit = max(1.0, limit - (time.perf_counter() - started))
    return spec.accepted(time_limit_s=limit)


def plan_profile(prof: Profile, hw, budget_bytes: int, fraction: Optional[float],
                 planner: str, *, time_limit: Optional[float] = None,
                 started: Optional[float] = None, record: bool = False,
                 for_compile: Optional[str] = None):
    """(plan, its simulation) of `planner` on `prof` at `budget_bytes`, as `slackswap plan`
    makes it (a planner with a time limit gets what is left of it since `started`).
    `for_compile` ("model", "per-block": `plan --for-compile`): what `compile_planned` cannot
    offload is kept or recomputed (`compile_limits`); None: an eager plan."""
    options = planner_time_options(planner_spec(planner), time_limit, started)
    options.update(no_swap_option(prof, for_compile))
    return plan_and_simulate(planner, prof, hw, budget_bytes, fraction, record=record,
                             **options)


def sibling_path(path, suffix: str):
    """`model.plan.json` -> `model<suffix>` beside it (".profile.json", ".plan.json")."""
    path = Path(path)
    name = path.name
    for ext in (".profile.json", ".plan.json", ".json"):
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    return path.with_name(name + suffix)


def with_paths(plan_obj, profile_path, prof):
    """The plan recording where its profile lies and the profile's workload file."""
    return dataclasses.replace(plan_obj, profile_path=str(Path(profile_path).resolve()),
                               model_path=prof.workload.get("path"))


def save_with_profile(plan_obj, prof: Profile, plan_target):
    """Write `prof` next to `plan_target` (`X.plan.json` -> `X.profile.json`) and the plan,
    recording it, at `plan_target`: the two files `show`, `simulate`, `compare` and `apply`
    read. Returns the profile's path. Both targets are checked first (`check_target`), and a
    profile this call wrote is removed again when the plan cannot be written: both or
    neither."""
    prof_target = sibling_path(plan_target, ".profile.json")
    for target in (plan_target, prof_target):
        check_target(target)
    fresh = not prof_target.exists()
    save(prof, prof_target)
    try:
        save(with_paths(plan_obj, prof_target, prof), plan_target)
    except BaseException:
        if fresh:                   # no profile left behind without its plan
            prof_target.unlink(missing_ok=True)
        raise
    return prof_target


def infeasible_message(prof: Profile, planner: str, below, reach: Optional[int]
                       ) -> tuple[str, str]:
    """(message, hint) when planner `planner` found no plan under the budget: `below` is
    `budget.floor_message`'s pair when the budget is under the floor, `reach` the least budget
    the planner fits (`first_feasible_budget`) when known."""
    if below is not None:
        return below
    peak, floor = prof.keep_all_peak_bytes, budget_floor_bytes(prof)
    fits = ("" if reach is None else
            f"; planner {planner} first fits at {fraction_hint(reach, peak)}")
    sure = [n for n, spec in PLANNERS.items() if spec.fits_from_floor]
    exact = [n for n, spec in PLANNERS.items() if spec.bound and n != planner]
    hint = (f"the floor is {fraction_hint(floor, peak)}"
            + (f": `--planner {sure[0]}` fits every budget from there up; or" if sure
               else "; ")
            + " raise --budget" + ("" if reach is None else
                                   f" to {fraction_hint(reach, peak)} for {planner}")
            + "".join(f", or try --planner {n}" for n in exact))
    return f"planner {planner} found no plan under the budget{fits}", hint
