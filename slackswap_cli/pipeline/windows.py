"""Plans that spend a pipeline's idle windows on swaps: `plan_stages(..., windows=Windows(...))`.

A stage planned alone swaps only what its own microbatch's compute hides. Under a pipeline a
copy has longer: between a microbatch's forward and its backward the rank runs other
microbatches' actions, or waits in a bubble. But every microbatch in flight shares the
rank's copy engines, so the whole forward-to-backward window is not one microbatch's: the
honest per-microbatch copy time is about the rank's step over its microbatches, per
direction. So the planner is asked for plans as if the link were `factor` times faster
(`Windows.factors`, 1 included: the plan alone), which makes it swap more and recompute less,
and every such plan is judged by `pipeline_copies.judge` on the rank's own schedule with the
real link: the rank's peak, with what copies in flight hold, must stay under the budget, and
of the plans that fit, the one whose rank finishes first (its compute, recomputes and exposed
copy time: run back to back, without bubbles, so a plan judged so keeps its promise with
them) wins. A plan made at a factor above 1 records that link in its `hardware` and says so in
a note: re-simulated alone on it, its copies hide; on the real link alone they do not, and
that is the point. A factor below 1 goes the other way: where the copies of the microbatches
in flight, all on the rank's two engines, hold more than the budget leaves (a stage whose plan
made alone swaps most of what it holds), a plan made as if the link were slower swaps less
and recomputes more, and the judge may keep it under the budget where no plan at 1 is.
Each factor's search runs over the peak and the hold fractions (`inflight.search`): plans
made for what each microbatch holds from its forward to its backward as well as for its peak.

Torch-free.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, NamedTuple, Sequence

from ..schema import Plan, Profile
from .copies import Judged, judge, stage_work
from .inflight import search
from .stages import Boundary, Step, hold_peaks, plans_at

__all__ = ["Windows", "faster_link", "search_rank", "FACTORS"]

FACTORS = (1.0, 2.0, 4.0)


class Windows:
    """How plan_stages spends the windows: `planner(profile, budget_bytes, hw)` makes a stage's
    plan on hardware `hw`; `hw` is the real one (the judge's); `factors`: the link speed-ups
    tried (module docstring)."""

    def __init__(self, planner: Callable, hw, factors: Sequence[float] = FACTORS):
        if not factors or any(not f > 0 for f in factors):
            from ..errors import InputError
            raise InputError(f"window factors {tuple(factors)!r}: each must be above 0",
                             hint="factors=(1, 2, 4), or (0.5, 1, 2, 4) to try a slower link")
        self.planner, self.hw, self.factors = planner, hw, tuple(sorted(set(factors)))
        self._work: dict = {}
        self.shared: dict = {}      # factor -> (profile, budget, limit) -> plan, all ranks'

    def plain_planner(self):
        """The stage planner on the real link: `plan_stages`' `planner` argument."""
        return lambda prof, b: self.planner(prof, b, self.hw)

    def work(self, prof: Profile, plan: Plan | None, boundary: Boundary):
        """`stage_work` on the real hardware, once per (profile, plan, boundary) object."""
        key = (id(prof), id(plan), boundary)
        if key not in self._work:
            self._work[key] = (prof, plan, stage_work(prof, plan, self.hw, boundary))
        return self._work[key][2]

    def search(self, rank, steps, stages, profiles, budget, boundary):
        """What `pipeline.plan_stages` calls per rank (`search_rank`)."""
        return search_rank(rank, steps, stages, profiles, budget, boundary, self)


def faster_link(hw, factor: float):
    """`hw` with both copy directions `factor` times faster (the same hardware at 1; slower
    below 1)."""
    if factor == 1.0:
        return hw
    return replace(hw, name=f"{hw.name} (copy link x{factor:g}: pipeline windows)",
                   h2d_bytes_per_s=hw.h2d_bytes_per_s * factor,
                   d2h_bytes_per_s=hw.d2h_bytes_per_s * factor)


class Found(NamedTuple):
    fraction: float
    plans: dict
    costs: dict
    judged: Judged
    factor: float
    held: float = 1.0


def _judged(rank, steps, stages, profiles, plans, boundary, windows, budget) -> Judged:
    work = {s: windows.work(profiles[s], plans[s], boundary.get(s, Boundary())) for s in stages}
    return judge({rank: steps}, work, budget, alone=True)


def _at_factor(rank, steps, stages, profiles, budget, boundary, windows, factor
               ) -> Found | None:
    """The plans at `factor` the judge keeps under budget and whose rank ends first, over
    the peak and hold fractions (`inflight.search`)."""
    hw = faster_link(windows.hw, factor)

    def planner(prof, b):
        return windows.planner(prof, b, hw)
    memo: dict = {}
    shared = windows.shared.setdefault(factor, {})

    def attempt(fraction, held):
        if factor != 1.0 and fraction >= 1.0 and held >= 1.0:
            return None     # keeping everything is the same at every factor: tried at 1
        plans, cost = plans_at(fraction, stages, profiles, planner, memo, boundary, held,
                               shared)
        if plans is None:
            return None
        got = _judged(rank, steps, stages, profiles, plans, boundary, windows, budget)
        ok = got.ranks[rank].peak_bytes <= budget
        return Found(fraction, plans, cost, got, factor, held) if ok else None
    return search(attempt, lambda found: found.judged.ranks[rank].end_us,
                  peaks=hold_peaks(steps))


def search_rank(rank: int, steps: Sequence[Step], stages, profiles: Mapping[int, Profile],
                budget: int, boundary: Mapping[int, Boundary], windows: Windows
                ) -> Found | None:
    """Of each factor's plans that fit (`_at_factor`), those whose rank ends first (ties: the
    smaller factor); None when none fits."""
    best = None
    for factor in windows.factors:
        got = _at_factor(rank, steps, stages, profiles, budget, boundary, windows, factor)
        if got is None:
            continue
        if best is None or got.judged.ranks[rank].end_us < best.judged.ranks[rank].end_us - 1e-6:
            best = got
    if best is not None and best.factor != 1.0:
        why = ("the pipeline's idle windows hide its copies" if best.factor > 1.0 else
               "the microbatches in flight share the rank's copy engines")
        note = (f"planned with the copy link x{best.factor:g}: {why} (judged on the rank's "
                "schedule with the real link)")
        best = best._replace(plans={s: _noted(p, note) for s, p in best.plans.items()})
    return best


def _noted(plan: Plan | None, note: str) -> Plan | None:
    return None if plan is None else replace(plan, notes=tuple(plan.notes) + (note,))
