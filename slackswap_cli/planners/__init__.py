"""The planners and their registry: (profile, hardware, budget) -> a Plan the simulator judged.

Every planner is a function `fn(profile, hw, budget_bytes)` returning either a list of
`schema.Decision` (one per saved activation root) or a `PlannerOutput` (decisions plus notes);
a planner with tuning takes its settings (a frozen dataclass, `SETTINGS`) as a fourth argument.
`make_plan` runs one by name, times it, simulates its decisions and fills in a `schema.Plan`:
whether it fits (the simulator's verdict, not the planner's), the schedule and the predicted
numbers. Planners never print; they explain themselves in `notes`.

- `slackswap` (default): swap what the copy slack hides, recompute the rest (slackswap.py).
- `optimal`: a MILP over the same choices, solved by HiGHS with a time limit (optimal.py);
  slackswap's plan is its fallback and the plan to beat, passed in here.
- `recompute-only`, `swap-all`, `checkpoint-layers`: baselines (baselines.py), no settings.
"""
from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Callable, Union

from ..errors import InputError
from ..hardware import HardwareSpec
from ..schema import Decision, Plan, Profile
from . import baselines, optimal, slackswap
from .common import PlannerOutput
from .settings import Settings, from_options

if TYPE_CHECKING:
    from ..simulate import SimResult


PlannerFn = Callable[..., Union[list[Decision], PlannerOutput]]

PLANNERS: dict[str, PlannerFn] = {
    "slackswap": slackswap.plan,
    "optimal": partial(optimal.plan, fallback=slackswap.plan),
    "recompute-only": baselines.recompute_only,
    "swap-all": baselines.swap_all,
    "checkpoint-layers": baselines.checkpoint_layers,
}

# the settings dataclass of each planner that has tuning: its fields are the planner's options
SETTINGS: dict[str, type[Settings]] = {
    "slackswap": slackswap.SlackswapSettings,
    "optimal": optimal.OptimalSettings,
}


def planner_names() -> list[str]:
    return list(PLANNERS.keys())


def get_planner(name: str) -> PlannerFn:
    if name not in PLANNERS:
        raise InputError(f"unknown planner '{name}'",
                         hint=f"planners: {', '.join(planner_names())}")
    return PLANNERS[name]


def run_planner(name: str, profile: Profile, hw: HardwareSpec, budget_bytes: int,
                **options) -> tuple[list[Decision], tuple[str, ...], float]:
    """(decisions, notes, solve_ms) of planner `name`, without simulating.

    `options` set fields of the planner's settings (`SETTINGS`, e.g. `time_limit_s` for
    `optimal`); an option it has no field for, or a value of the wrong type or out of range, is
    an InputError.
    """
    fn = get_planner(name)
    settings = from_options(name, SETTINGS.get(name), options)
    t0 = time.perf_counter()
    out = (fn(profile, hw, int(budget_bytes)) if settings is None
           else fn(profile, hw, int(budget_bytes), settings))
    solve_ms = (time.perf_counter() - t0) * 1e3
    if isinstance(out, PlannerOutput):
        return list(out.decisions), tuple(out.notes), solve_ms
    return list(out), (), solve_ms


def make_plan(name: str, profile: Profile, hw: HardwareSpec, budget_bytes: int,
              budget_fraction: float | None = None, **options) -> Plan:
    """Run planner `name` (with `options`, see `run_planner`), simulate its decisions, and
    return the Plan.

    `feasible` is the simulator's verdict. An infeasible plan is still returned (the CLI writes
    it with `feasible: false` and exits 4); its notes say why.
    """
    return plan_and_simulate(name, profile, hw, budget_bytes, budget_fraction, **options)[0]


def plan_and_simulate(name: str, profile: Profile, hw: HardwareSpec, budget_bytes: int,
                      budget_fraction: float | None = None, *, record: bool = False,
                      **options) -> tuple[Plan, SimResult]:
    """`make_plan`, and the simulation the Plan was filled from (with its timeline when
    `record`, for the views that show it), so a caller does not simulate the plan again."""
    decisions, notes, solve_ms = run_planner(name, profile, hw, budget_bytes, **options)
    return judge(name, profile, hw, budget_bytes, decisions, notes, solve_ms,
                 budget_fraction, record=record)


def judge(name: str, profile: Profile, hw: HardwareSpec, budget_bytes: int,
          decisions: list[Decision], notes: tuple[str, ...] = (), solve_ms: float = 0.0,
          budget_fraction: float | None = None, *, record: bool = False
          ) -> tuple[Plan, SimResult]:
    """Simulate `decisions` (made by `name`: a registered planner, a fixed rule such as `fit`'s
    keep-everything, or torch's partitioner) and fill in the Plan from the simulation: the
    simulator's verdict, schedule and predictions."""
    from ..simulate import simulate

    res = simulate(profile, decisions, hw, budget_bytes, record=record)
    notes = tuple(notes)
    if not res.feasible and res.reason:
        notes = notes + (f"simulator: {res.reason}",)
    plan = Plan(profile_fingerprint=profile.fingerprint, planner=name, hardware=hw.to_dict(),
                budget_bytes=int(budget_bytes), budget_fraction=budget_fraction,
                feasible=bool(res.feasible), decisions=tuple(decisions),
                schedule=tuple(res.schedule), predicted=res.predicted, solve_ms=solve_ms,
                notes=notes)
    return plan, res
