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
that is the point.

Torch-free.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, NamedTuple, Sequence

from ..schema import Plan, Profile
from .copies import Judged, judge, stage_work
from .stages import Boundary, Step, plans_at

__all__ = ["Windows", "faster_link", "search_rank", "FACTORS"]

FACTORS = (1.0, 2.0, 4.0)


class Windows:
    """How plan_stages spends the windows: `planner(profile, budget_bytes, hw)` makes a stage's
    plan on hardware `hw`; `hw` is the real one (the judge's); `factors`: the link speed-ups
    tried (module docstring)."""

    def __init__(self, planner: Callable, hw, factors: Sequence[float] = FACTORS):
        if not factors or any(f < 1.0 for f in factors):
            from ..errors import InputError
            raise InputError(f"window factors {tuple(factors)!r}: each must be at least 1",
                             hint="factors=(1, 2, 4)")
        self.planner, self.hw, self.factors = planner, hw, tuple(sorted(set(factors)))
        self._work: dict = {}

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
    """`hw` with both copy directions `factor` times faster (the same hardware at 1)."""
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


def _judged(rank, steps, stages, profiles, plans, boundary, windows, budget) -> Judged:
    work = {s: windows.work(profiles[s], plans[s], boundary.get(s, Boundary())) for s in stages}
    return judge({rank: steps}, work, budget, alone=True)


def _at_factor(rank, steps, stages, profiles, budget, boundary, windows, factor,
               bisections: int = 8) -> Found | None:
    """The largest fraction (bisected) whose plans at `factor` the judge keeps under budget."""
    hw = faster_link(windows.hw, factor)

    def planner(prof, b):
        return windows.planner(prof, b, hw)
    memo: dict = {}

    def attempt(fraction):
        plans, cost = plans_at(fraction, stages, profiles, planner, memo, boundary)
        if plans is None:
            return None
        got = _judged(rank, steps, stages, profiles, plans, boundary, windows, budget)
        ok = got.ranks[rank].peak_bytes <= budget
        return Found(fraction, plans, cost, got, factor) if ok else None
    best = attempt(1.0) if factor == 1.0 else None
    if best is not None:
        return best
    lo, hi = 0.0, 1.0
    for _ in range(bisections):
        mid = (lo + hi) / 2
        got = attempt(mid)
        if got is not None:
            lo, best = mid, got
        else:
            hi = mid
    return best or attempt(0.0)


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
        note = (f"planned with the copy link x{best.factor:g}: the pipeline's idle windows "
                "hide its copies (judged on the rank's schedule with the real link)")
        best = best._replace(plans={s: _noted(p, note) for s, p in best.plans.items()})
    return best


def _noted(plan: Plan | None, note: str) -> Plan | None:
    return None if plan is None else replace(plan, notes=tuple(plan.notes) + (note,))
