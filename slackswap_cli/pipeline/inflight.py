"""Stage plans made for what a microbatch holds in flight, not only for its own peak.

A rank of a pipeline holds several microbatches between their forward and their backward;
its peak is about what each of the others holds then (`StageCost.held_bytes`) plus one
microbatch's own peak. A plan made for the peak alone stops evicting once the peak fits, so
what it holds from forward to backward can stay large: the tensors live across the end of
forward are kept wherever the peak is elsewhere (in backward, say). So a stage's plan is
asked for two limits: its peak `P` (the planner's budget) and the bytes live at its last
forward op `H` (what the rank holds of it while other microbatches run). The planner is not
changed: it plans the stage's profile with a **hold** added (`with_hold`), an unsaved
output of the last forward op of `P - H` bytes that nobody reads, so any plan that fits `P`
there holds at most `H` of its own at the end of forward; the planner spends its slack on
swaps first and recomputes the rest, as for any budget, and the simulator judges the result
(a copy to host still running at the end of forward counts, as it does in the rank's judge).
The plan is then judged again on the stage's own profile (`plan_held`): its figures are the
stage's, and the profile's fingerprint and op ids are the same, so the runtime executes its
decisions as any other plan's.

`search` is the per-rank search `stages._search` and `windows.search_rank` run over the two
limits: the largest peak fraction that fits with no hold (the plans a stage makes alone),
then, at a few peak fractions, the largest hold fraction that fits (bisected), and of all
that fit the one whose rank takes the least time. Torch-free.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..schema import Plan, Profile, Tensor

__all__ = ["HOLD_NAME", "PEAKS", "with_hold", "held_floor", "held_limit", "plan_held",
           "search"]

HOLD_NAME = "slackswap.in_flight_hold"   # the added tensor's name (never in a plan)
PEAKS = (1.0, 0.5, 0.0)     # the peak fractions the held search tries (beside the best alone)


def with_hold(prof: Profile, hold_bytes: int) -> Profile:
    """`prof` with an unsaved activation of `hold_bytes` written by its last forward op and
    read by none: live during that op only (module docstring)."""
    last = prof.n_forward - 1
    tid = len(prof.tensors)
    hold = Tensor(id=tid, name=HOLD_NAME, kind="activation", producer=last, consumers=(),
                  shape=(int(hold_bytes),), dtype="uint8", size_bytes=int(hold_bytes),
                  saved=False, recomputable=False)
    ops = list(prof.ops)
    ops[last] = replace(ops[last], outputs=tuple(ops[last].outputs) + (tid,))
    return replace(prof, ops=tuple(ops), tensors=tuple(prof.tensors) + (hold,))


def held_floor(prof: Profile) -> int:
    """The least any plan holds at the last forward op: what is live there (keep-all) less
    every saved activation root whose gap covers it (produced and last read in forward
    before it, first read again in backward)."""
    end = prof.n_forward - 1
    if end < 0:
        return 0
    live = prof.live_bytes_per_op[end]
    free = sum(t.size_bytes for t in prof.saved_activations
               if prof.last_forward_use(t.id) < end < (prof.first_backward_use(t.id) or 0))
    return max(0, live - free)


def held_limit(prof: Profile, held: float) -> int | None:
    """The bytes a stage may hold at its last forward op at hold fraction `held`: its floor
    (`held_floor`) at 0, what keeping everything holds there at 1 (None: no limit)."""
    if held >= 1.0 or prof.n_forward == 0:
        return None
    floor, top = held_floor(prof), prof.live_bytes_per_op[prof.n_forward - 1]
    return floor + int(max(0.0, held) * (top - floor))


def plan_held(planner: Callable[[Profile, int], Plan], prof: Profile, budget_bytes: int,
              limit_bytes: int, pinned: frozenset = frozenset()) -> Plan:
    """The plan `planner(profile, budget)` makes for `prof` under peak `budget_bytes` holding
    at most `limit_bytes` at its last forward op (`with_hold`), judged again on `prof`
    itself (infeasible where the planner found no plan with the hold). `pinned`: roots the
    pipeline holds whatever the plan says (`Boundary.pinned`): an eviction of one frees
    nothing, so it is kept where the plan still fits its peak so."""
    from ..hardware import HardwareSpec
    from ..planners import judge
    from ..schema import Action, Decision
    hold = max(0, budget_bytes - limit_bytes)
    plan = planner(with_hold(prof, hold), budget_bytes)
    if not plan.feasible:
        return plan
    note = (f"planned for what a microbatch holds in flight: at most {limit_bytes} bytes "
            "live at the end of forward (pipeline.inflight)")
    hw = HardwareSpec.from_dict(plan.hardware, "plan")

    def judged(decisions):
        return judge(plan.planner, prof, hw, budget_bytes, list(decisions),
                     tuple(plan.notes) + (note,), plan.solve_ms, plan.budget_fraction)[0]
    if any(d.tensor in pinned and d.action != Action.KEEP for d in plan.decisions):
        kept = judged(d if d.tensor not in pinned else Decision(tensor=d.tensor,
                                                                action=Action.KEEP)
                      for d in plan.decisions)
        if kept.feasible:
            return kept
    return judged(plan.decisions)


def _bisect(attempt: Callable[[float], object], steps: int, low=None):
    """The fit at the largest x in [0, 1) that `attempt(x)` fits at (bisected `steps` times;
    `low`: the fit at 0 when known), else None."""
    lo, hi, best = 0.0, 1.0, None
    for _ in range(steps):
        mid = (lo + hi) / 2
        got = attempt(mid)
        if got is not None:
            lo, best = mid, got
        else:
            hi = mid
    if best is not None:
        return best
    return low if low is not None else attempt(0.0)


def search(attempt: Callable[[float, float], object], time_of: Callable[[object], float],
           bisections: int = 8, held_bisections: int = 5, peaks: Sequence[float] = PEAKS):
    """Of the fits `attempt(peak fraction, hold fraction)` gives (None where the rank's
    plans do not fit), the quickest by `time_of` (ties: the first found): keeping everything
    if that fits; else the largest peak fraction with no hold (bisected), then at each of
    `peaks` above it the largest hold fraction (bisected from the hold's floor)."""
    got = attempt(1.0, 1.0)
    if got is not None:
        return got
    alone = _bisect(lambda f: attempt(f, 1.0), bisections)
    found = [alone] if alone is not None else []
    # a hold at a peak fraction at or below the best alone only adds evictions to its plans
    fractions = [f for f in peaks if alone is None or f > alone.fraction]
    for f in sorted(fractions, reverse=True):
        floor = attempt(f, 0.0)
        if floor is not None:
            found.append(_bisect(lambda h, f=f: attempt(f, h), held_bisections, floor))
    return min(found, key=time_of) if found else None
