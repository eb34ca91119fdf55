"""The planners and their registry: (profile, hardware, budget) -> a Plan the simulator judged.

Every planner is a function `fn(profile, hw, budget_bytes)` returning either a list of
`schema.Decision` (one per saved activation root) or a `PlannerOutput` (decisions plus notes);
a planner with tuning takes its settings (a frozen dataclass) as a fourth argument.
`make_plan` runs one by name, times it, simulates its decisions and fills in a `schema.Plan`:
whether it fits (the simulator's verdict, not the planner's), the schedule and the predicted
numbers. Planners never print; they explain themselves in `notes`.

`PLANNERS` is the one place that knows the planners: each `PlannerSpec` names its function and
settings (imported on first use: the CLI reads names, help and traits without numpy or HiGHS)
and the traits callers ask about (whether it is quick enough for a training step and a budget
search, the bound it proves). The CLI's --planner help, default, options (`--time-limit`
goes to a planner whose settings have `time_limit_s`) and special cases, and the re-plan
inside a training step (run/eager/replan.py), all read it: adding a planner touches its own module
and this table, nothing else.

- `slackswap` (default): swap what the copy slack hides, recompute the rest (slackswap.py).
- `optimal`: a MILP over the same choices, solved by HiGHS with a time limit (optimal.py);
  slackswap's plan is its fallback and the plan to beat, passed in here.
- `recompute-only`, `swap-all`, `checkpoint-layers`: baselines (baselines.py), no settings.
- `torchtitan-sac`, `full-ac`, `megatron-selective`: the activation-checkpointing settings
  users run (ac_settings.py), no settings.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, fields
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Union

from ..errors import InputError
from .settings import Settings, from_options

if TYPE_CHECKING:   # imported where used: the CLI reads the registry before anything else
    from ..hardware import HardwareSpec
    from ..schema import Decision, Plan, Profile
    from ..simulate import SimResult
    from .common import PlannerOutput


PlannerFn = Callable[..., Union["list[Decision]", "PlannerOutput"]]


def _resolve(ref):
    """A "module:name" reference inside this package, imported now; anything else as is."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


@dataclass(frozen=True)
class PlannerSpec:
    """One planner: what it is, where its code is (imported on first use), and its traits."""

    summary: str
    """One line: what it does (the CLI's status lines and help say it)."""

    plan: str | PlannerFn
    """Its function: "module:function" in this package, or the function itself."""

    settings: str | type[Settings] | None = None
    """Its settings dataclass ("module:Class" or the class); None: it takes no options."""

    fallback: str | None = None
    """A planner whose function is passed to this one as `fallback=` (its plan to beat), and
    that runs instead where this one is too slow (see `quick`)."""

    quick: bool = True
    """Fast enough to run inside a training step (a re-plan for new shapes, run/eager/replan.py) and
    a dozen times over in a budget search (`plan` saying where a planner first fits). A MILP
    with a time limit of a minute is not."""

    bound: str | Callable[["Profile", "HardwareSpec", int], float | None] | None = None
    """"module:function" giving the retention bound this planner proved for a budget (None
    when it had no time to): `plan --json` and `compare` report it beside its plan."""

    fits_from_floor: bool = False
    """Its plan fits every budget from the floor up (swapping everything leaves only what no
    plan can free): `plan` suggests it when another planner finds nothing."""

    def function(self) -> PlannerFn:
        fn = _resolve(self.plan)
        return partial(fn, fallback=PLANNERS[self.fallback].function()) if self.fallback else fn

    def settings_class(self) -> type[Settings] | None:
        return _resolve(self.settings)

    def option_default(self, option: str) -> Any:
        """The default of one of its options (a settings field); None if it has no such one."""
        cls = self.settings_class()
        return next((f.default for f in fields(cls) if f.name == option), None) if cls else None

    def accepted(self, **options) -> dict:
        """Those of `options` it takes (its settings have the field): the CLI's --time-limit
        goes to the planners with a time limit and no other."""
        cls = self.settings_class()
        names = set(cls.option_names()) if cls else set()
        return {k: v for k, v in options.items() if k in names}

    def bound_retention(self, profile: Profile, hw: HardwareSpec, budget_bytes: int
                        ) -> float | None:
        return _resolve(self.bound)(profile, hw, budget_bytes) if self.bound else None


DEFAULT_PLANNER = "slackswap"

PLANNERS: dict[str, PlannerSpec] = {
    "slackswap": PlannerSpec("swap what the copy slack hides, recompute the rest",
                             "slackswap:plan", "slackswap:SlackswapSettings"),
    "optimal": PlannerSpec("a MILP solved by HiGHS", "optimal:plan", "optimal:OptimalSettings",
                           fallback="slackswap", quick=False, bound="optimal:bound_retention"),
    "recompute-only": PlannerSpec("recompute, never swap", "baselines:recompute_only"),
    "swap-all": PlannerSpec("swap every saved activation", "baselines:swap_all",
                            fits_from_floor=True),
    "checkpoint-layers": PlannerSpec("checkpoint whole blocks", "baselines:checkpoint_layers"),
    "torchtitan-sac": PlannerSpec("torchtitan's selective op AC: keep matmuls (every other one) "
                                  "and attention, recompute the rest of each block",
                                  "ac_settings:torchtitan_sac"),
    "full-ac": PlannerSpec("checkpoint every block (torchtitan full AC, Hugging Face "
                           "gradient_checkpointing_enable)", "ac_settings:full_ac"),
    "megatron-selective": PlannerSpec("Megatron's selective recompute: recompute the core "
                                      "attention, keep the rest",
                                      "ac_settings:megatron_selective"),
}


def planner_names() -> list[str]:
    return list(PLANNERS.keys())


def planner_spec(name: str) -> PlannerSpec:
    """The registry's record of planner `name`; an unknown name is an InputError."""
    if name not in PLANNERS:
        raise InputError(f"unknown planner '{name}'",
                         hint=f"planners: {', '.join(planner_names())}")
    return PLANNERS[name]


def quick_planner(name: str) -> str:
    """`name`, or where it is too slow to run here (inside a training step) the planner that
    stands in for it: its fallback, else the default."""
    spec = planner_spec(name)
    return name if spec.quick else spec.fallback or DEFAULT_PLANNER


def run_planner(name: str, profile: Profile, hw: HardwareSpec, budget_bytes: int,
                **options) -> tuple[list[Decision], tuple[str, ...], float]:
    """(decisions, notes, solve_ms) of planner `name`, without simulating.

    `options` set fields of the planner's settings (`PlannerSpec.settings`, e.g.
    `time_limit_s` for `optimal`); an option it has no field for, or a value of the wrong type
    or out of range, is an InputError.
    """
    # deferred, as the planners' modules are: the CLI imports this registry at start-up, and
    # common (numpy), the schema and the simulator load only when a plan is made
    from .common import PlannerOutput
    spec = planner_spec(name)
    fn = spec.function()
    settings = from_options(name, spec.settings_class(), options)
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
    # `no_swap`, `no_recompute` (plan --for-compile) go to a planner that takes them; one that
    # does not is held to them by the simulator (swap-all is refused)
    barred = {k: tuple(options.pop(k, ())) for k in ("no_swap", "no_recompute")}
    held = profile.summary.get("checkpoint_held")
    if held:    # the inputs of the model's own checkpointed regions: its checkpoints hold them
        barred = {k: tuple(sorted({*v, *held})) for k, v in barred.items()}
    options.update(planner_spec(name).accepted(**{k: v for k, v in barred.items() if v}))
    decisions, notes, solve_ms = run_planner(name, profile, hw, budget_bytes, **options)
    if held:    # (a planner that does not take them: what it would free there, kept)
        decisions = _kept(decisions, set(held))
    if barred["no_swap"] and not held:
        notes = tuple(notes) + (f"for the compiled path: {len(barred['no_swap'])} value(s) "
                                f"compile_planned cannot offload are not swapped "
                                f"({len(barred['no_recompute'])} of them kept)",)
    return judge(name, profile, hw, budget_bytes, decisions, notes, solve_ms,
                 budget_fraction, record=record, **barred)


def _kept(decisions: list, held: set) -> list:
    """`decisions` with every root of `held` kept."""
    from ..schema import Action, Decision
    return [d if d.tensor not in held or d.action == Action.KEEP else
            Decision(tensor=d.tensor, action=Action.KEEP) for d in decisions]


def judge(name: str, profile: Profile, hw: HardwareSpec, budget_bytes: int,
          decisions: list[Decision], notes: tuple[str, ...] = (), solve_ms: float = 0.0,
          budget_fraction: float | None = None, *, record: bool = False, no_swap=(),
          no_recompute=()) -> tuple[Plan, SimResult]:
    """Simulate `decisions` (made by `name`: a registered planner, a fixed rule such as `fit`'s
    keep-everything, or torch's partitioner) and fill in the Plan from the simulation: the
    simulator's verdict, schedule and predictions (`no_swap`, `no_recompute`: roots it may
    not swap, recompute)."""
    from ..schema import Plan
    from ..simulate import simulate

    res = simulate(profile, decisions, hw, budget_bytes, record=record, no_swap=no_swap,
                   no_recompute=no_recompute)
    notes = tuple(notes)
    if not res.feasible and res.reason:
        notes = notes + (f"simulator: {res.reason}",)
    plan = Plan(profile_fingerprint=profile.fingerprint, planner=name, hardware=hw.to_dict(),
                budget_bytes=int(budget_bytes), budget_fraction=budget_fraction,
                feasible=bool(res.feasible), decisions=tuple(decisions),
                schedule=tuple(res.schedule), predicted=res.predicted, solve_ms=solve_ms,
                notes=notes)
    return plan, res
