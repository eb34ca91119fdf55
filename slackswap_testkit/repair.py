"""Turn any plan into one that fits a budget (tests: every planner's plan repaired above the
floor, the floor exact)."""
from __future__ import annotations

from slackswap_cli.budget import check_budget
from slackswap_cli.errors import InfeasibleError, InputError
from slackswap_cli.schema import Action, Decision, Profile
from slackswap_cli.simulate import budget_floor_bytes, min_peak_bytes
from slackswap_cli.units import fmt_bytes


def repair_to_fit(profile: Profile, decisions, budget_bytes: int) -> list:
    """`decisions` changed as little as found so that the plan fits `budget_bytes`.

    Returns the decisions unchanged when they fit. Otherwise the saved activations they keep
    or recompute are turned into swaps, largest first: the shortest prefix of that order that
    fits (bisection; swapping all of them is the swap-everything plan, which fits every budget
    at or above the floor). Decisions the simulator cannot carry out (a recompute chain that
    needs a random op's output backward does not save) do not fit either, and are repaired the
    same way. Raises `InfeasibleError` below the floor.
    """
    def fits(ds: list) -> bool:
        try:
            return min_peak_bytes(profile, ds) <= budget_bytes
        except InputError:   # a recompute chain through a random op's unsaved output
            return False

    decisions = list(decisions)
    if fits(decisions):
        return decisions
    check_budget(budget_bytes, profile)
    by_tensor = {d.tensor: d for d in decisions}
    order = sorted((t for t in profile.saved_activations
                    if by_tensor.get(t.id, Decision(t.id, Action.KEEP)).action != Action.SWAP),
                   key=lambda t: (-t.size_bytes, t.id))

    def swapped(k: int) -> list:
        turn = {t.id for t in order[:k]}
        out = [Decision(d.tensor, Action.SWAP) if d.tensor in turn else d for d in decisions]
        out += [Decision(t, Action.SWAP) for t in turn - set(by_tensor)]
        return out

    lo, hi = 0, len(order)             # invariant: prefix lo does not fit, prefix hi does
    if not fits(swapped(hi)):   # pragma: no cover - the floor is exact
        raise InfeasibleError(
            f"swapping every saved activation does not fit {fmt_bytes(budget_bytes)} "
            f"(floor {fmt_bytes(budget_floor_bytes(profile))})",
            hint="this is a bug: the floor should be the swap-everything plan's peak")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(swapped(mid)):
            hi = mid
        else:
            lo = mid
    return swapped(hi)
