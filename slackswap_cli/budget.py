"""Memory budgets: what `--budget` means and whether a profile can meet it.

A budget caps *activation memory* (see `schema`): the bytes of live activation roots at every
moment of the step. It is given either

- as a **fraction** of the profile's keep-everything peak (`Profile.keep_all_peak_bytes`):
  `0.5` means "half the activation memory the step needs when
  nothing is evicted". A fraction is a plain number in (0, 1]; `1` keeps everything. Numbers
  above 1 are refused: a budget above the keep-all peak buys nothing, and "1.5" is more likely
  a typo for "1.5GB" than a wish. A percentage works too: `50%` is `0.5`.
- or as **bytes**: `20GiB`, `512MiB`, `64KiB` (binary units), `20GB`, `1.5e9`, `123456789`
  (decimal units or plain bytes). A plain number above 1 is read as bytes, so `2` is two bytes,
  not twice the peak.

`check_budget` refuses a budget below the *floor*: the memory no plan can avoid (tensors while
forward or backward still reads them, transients, non-evictable values), computed by the
simulator's `budget_floor_bytes`. It raises `InfeasibleError` (exit code 4, "no plan fits the
budget"), since the input is well formed but cannot be met.

The floor is exact, not an estimate: it is the least activation peak of the plan that swaps
every saved activation, and the simulator's feasibility is static (`min_peak_bytes(plan) <=
budget`), so that plan fits every budget at or above the floor, and no plan has a lower least
peak (a kept tensor is resident longer than a swapped one; a recomputed one as long, plus the
inputs its recompute reads). A heuristic planner may still miss a budget just above the floor:

- `first_feasible_budget` finds the smallest budget (by bisection) at which a given planner's
  own plan fits, for an error message that says what that planner can reach (the tests'
  `slackswap_testkit.repair.repair_to_fit` turns any plan into one that fits).
"""
from __future__ import annotations

import math
import re

from .errors import InfeasibleError, InputError
from .planners import make_plan
from .schema import Profile
from .simulate import budget_floor_bytes
from .units import GIB, KIB, MIB, TIB, fmt_bytes

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB,
    "k": KIB, "m": MIB, "g": GIB, "t": TIB,   # bare letters: binary, like nvidia-smi
}
_BUDGET_RE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)\s*$")
_HINT = ("pass a fraction of the keep-all activation peak in (0, 1] (e.g. 0.5) "
         "or a size (e.g. 20GiB, 512MiB, 20GB, 1.5e9)")


def parse_budget(text: str | float | int, profile: Profile) -> tuple[int, float | None]:
    """`"0.5"` -> (half the keep-all peak, 0.5); `"20GiB"` -> (21474836480, None).

    Raises `InputError` (with a hint) on text that is neither a fraction nor a size.
    """
    raw = str(text)
    m = _BUDGET_RE.match(raw)
    if not m:
        raise InputError(f"cannot read budget {raw!r}", hint=_HINT)
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise InputError(f"budget {raw!r} must be in (0%, 100%]", hint=_HINT)
        return parse_budget(repr(number / 100), profile)
    if unit not in _UNITS:
        raise InputError(f"unknown unit {m.group(2)!r} in budget {raw!r}", hint=_HINT)
    if not math.isfinite(number):
        raise InputError(f"budget {raw!r} is not a finite number", hint=_HINT)
    if number <= 0:
        raise InputError(f"budget {raw!r} must be positive", hint=_HINT)
    if unit == "" and number <= 1.0:
        return fraction_bytes(number, profile.keep_all_peak_bytes), number
    if unit == "" and "." in m.group(1) and "e" not in m.group(1).lower() and number < 1024:
        # "1.5" or "2.0": a fraction above 1, almost certainly not a byte count
        raise InputError(f"budget fraction {raw} is above 1",
                         hint="a fraction must be in (0, 1]; for a size add a unit, e.g. 1.5GB")
    size = number * _UNITS[unit]
    if size < 1:
        raise InputError(f"budget {raw!r} is less than one byte", hint=_HINT)
    return int(size), None


def fraction_bytes(fraction: float, keep_all_peak_bytes: int) -> int:
    """The budget a fraction of the keep-all peak stands for, in bytes (rounded down): the one
    conversion (`parse_budget`, re-planning in a step, verify)."""
    return int(math.floor(fraction * keep_all_peak_bytes))


# how far above its budget a measured run may hold and still pass `verify` (its memory chart
# draws bars above that red)
MEMORY_TOLERANCE = 0.05


def keep_all_of(budget_bytes: int, fraction: float) -> int:
    """The keep-all peak a budget of `fraction` of it was made from (`fraction_bytes` undone,
    to within its rounding): for a patched module that records only its budget and fraction."""
    return int(round(budget_bytes / fraction))


def parse_size(text: str, option: str) -> int:
    """A size in bytes for an option such as `--memory`: `80GiB`, `1.5e9`, `40GB` (the units
    of budgets; a plain number is bytes). InputError naming `option` otherwise."""
    m = _BUDGET_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or not math.isfinite(float(m.group(1))):
        raise InputError(f"cannot read {option} {text!r} as a size",
                         hint=f"e.g. {option} 80GiB, {option} 40GB or {option} 1.5e9 (bytes)")
    size = float(m.group(1)) * _UNITS[unit]
    if size < 0:
        raise InputError(f"{option} {text!r} is negative", hint=f"e.g. {option} 80GiB")
    return int(size)


def check_budget(budget_bytes: int, profile: Profile) -> None:
    """Raise `InfeasibleError` when no plan can keep activation memory under `budget_bytes`."""
    below = floor_message(budget_bytes, profile)
    if below is not None:
        raise InfeasibleError(below[0], hint=below[1])


def ceil3(x: float) -> float:
    """x rounded up to 3 decimals, so the suggested fraction is never below the floor."""
    return math.ceil(x * 1000 - 1e-9) / 1000



def floor_message(budget_bytes: int, profile: Profile) -> tuple[str, str] | None:
    """(error, hint) when `budget_bytes` is below the floor, else None (see `check_budget`)."""
    floor = budget_floor_bytes(profile)
    if budget_bytes >= floor:
        return None
    peak = profile.keep_all_peak_bytes
    frac = f" ({floor / peak:.3f} of the keep-all peak)" if peak else ""
    return (f"budget {fmt_bytes(budget_bytes)} is below the floor {fmt_bytes(floor)}{frac}: "
            "memory that no plan can free",
            f"raise the budget to at least {ceil3(floor / peak) if peak else 1} "
            f"(fraction) or {fmt_bytes(floor)} ({floor} bytes)")


def first_feasible_budget(profile: Profile, hw, planner: str, *, hi: int | None = None,
                          steps: int = 10, **options) -> int | None:
    """The smallest budget found at which `planner`'s own plan fits, or None if none does.

    Bisection between the floor and `hi` (default: the keep-all peak) over `steps` rounds, so
    the answer is within (hi - floor) / 2**steps of the first budget where the planner
    succeeds, provided its success is monotone in the budget (a heuristic's need not be: the
    result is a budget where it fits, not a proof that it fits nowhere below).
    """
    def fits(budget: int) -> bool:
        try:
            return make_plan(planner, profile, hw, budget, **options).feasible
        except InputError:   # the simulator refused the plan (a chain through a random op's unsaved output)
            return False

    lo = budget_floor_bytes(profile)
    hi = profile.keep_all_peak_bytes if hi is None else int(hi)
    if not fits(hi):
        return None
    if fits(lo):
        return lo
    for _ in range(steps):        # invariant: lo does not fit, hi fits
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi
