"""SlackSwap: spend the copy time compute can hide on what is dearest to recompute.

The published idea, in passes over the static model of `common` (the simulator judges the
result):

1. **Where is memory short?** With everything kept, the ops whose activation memory exceeds
   the budget. Only a tensor live across such an op (its gap covers it) is worth evicting.
2. **Spend the slack.** Slack is the copy time compute can hide: D2H copies during forward
   after each tensor's producer, H2D copies during backward before its first use. Take the
   useful candidates from the most to the least expensive to recompute per byte freed (random
   ops' outputs, which cannot be recomputed, first) and swap each one whose copies still fit
   the slack (`SlackLedger`).
3. **Recompute the rest** (`common.recompute_until_fits`): while memory exceeds the budget,
   take the tightest over-budget op (the one the fewest kept tensors can still relieve) and
   recompute, among the kept tensors live across it, the one with the cheapest recompute chain
   per byte, unless its chain would pull evicted inputs back early into a new overflow.
4. **Trim waste.** Undo evictions that buy nothing at any over-budget moment (dearest
   recomputes first, then swaps), turn recomputes into swaps where slack freed up, and try to
   undo the dearest recomputes one by one, letting the greedy free the bytes elsewhere, kept
   when the total recompute time drops.

What a swap saves per byte is the price of the bytes recompute would otherwise free; that price
is not known before the plan is (swaps make the marginal recompute cheaper), so the first try
makes a plan at each of a few prices (`SlackswapSettings.price_quantiles`) and the simulator
picks. Then the simulator runs the plan. If compute stalls, the swaps it waited for (a late
prefetch, an offload still running when memory ran out) become recomputes and the greedy frees
what that costs; failing that, the plan is made again with prefetches pinned just in time and
with less of the slack trusted. A plan without swaps is always tried as well (so slackswap
never loses to recomputing alone), and when no plan fits, swapping everything (the least memory
any plan needs). The best plan the simulator saw is then polished (`polish`): moves of one,
two or a few decisions the simulator judges better, then, with allowance left, a plain 1-/2-move
local search, within a fixed allowance of work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..hardware import HardwareSpec
from ..schema import Profile
from ..simulate import simulate
from ..units import fmt_us
from .common import (
    KEEP,
    RECOMPUTE,
    SWAP,
    CostModel,
    PlannerOutput,
    SlackLedger,
    State,
    StaticSettings,
    build_cost_model,
    copy_schedule,
    memory,
    prefetch_points,
    recompute_until_fits,
)
from .polish import polish


@dataclass(frozen=True)
class SlackswapSettings(StaticSettings):
    """The `slackswap` planner's tuning (and `StaticSettings`': `max_tries`,
    `prefetch_margin`). The tries bound planning time; the defaults are what the tests and
    benchmarks ran with."""

    upgrade_tries: int = 20
    """Recomputes the upgrade pass (pass 4) tries to turn into swaps."""

    exchange_tries: int = 4
    """Recomputes the exchange pass (pass 4) tries to undo, dearest first. (With the polish
    after the passes, 40 upgrade and 8 exchange tries gave the same retentions as 20 and 4 at
    budgets 0.2-0.8 on the four samples and the tiny GPT, and took 0.1 s longer on Llama-7B
    at 0.3.)"""

    exchange_steps: int = 40
    """Greedy steps each exchange try may take to free the bytes elsewhere."""

    slack_safety: float = 0.97
    """Share of the copy slack the `SlackLedger` trusts when `plan_static` is given none (the
    planner gives each of `repairs` its own; its plan without swaps never asks the ledger)."""

    repairs: tuple[tuple[float, bool], ...] = (
        (1.05, False), (1.0, False), (0.97, False), (0.97, True), (0.85, False), (0.7, False))
    """(slack trusted, prefetches pinned just in time) of each plan tried, in order. The first
    trusts 5% more slack than the static ledger grants (its D2H deadline, the end of forward,
    is earlier than the moments memory is short); if the simulator shows a stall or an
    overshoot, the next trust less (the static model leaves out queueing behind stalls and the
    duplex derate)."""

    price_quantiles: tuple[float, ...] = (1.0, 0.9, 0.75, 0.5)
    """The swap prices the first repair tries, as quantiles of the recompute cost per byte in
    the plan without swaps (1.0: its dearest recompute). What a swap saves per byte is the
    price of the last bytes recompute would otherwise free, and that price falls as swaps take
    over: with swaps the marginal recompute is cheaper than the dearest one without. Each
    price makes a plan; the simulator picks, and the repairs after the first go on with the
    price that won."""

    no_swap: tuple[int, ...] = ()
    """Candidate roots that may not be swapped, only kept or recomputed: what
    `compile_planned` cannot offload (`compile_limits.not_offloadable`, given by
    `plan --for-compile`). Empty: every candidate may be swapped (eager plans)."""

    no_recompute: tuple[int, ...] = ()
    """Candidate roots that may not be recomputed either (`plan --for-compile per-block`: a
    value one block's graph makes and another's saves, which neither can re-run)."""

    def _check_ranges(self) -> None:
        super()._check_ranges()
        self._require(len(self.price_quantiles) > 0
                      and all(0 <= q <= 1 for q in self.price_quantiles),
                      "price_quantiles", "at least one quantile, each between 0 and 1")
        for name in ("upgrade_tries", "exchange_tries", "exchange_steps"):
            self._require(getattr(self, name) >= 0, name, "at least 0")
        self._require(0 < self.slack_safety <= 10, "slack_safety", "above 0 and at most 10")
        self._require(len(self.repairs) > 0 and all(0 < t <= 10 for t, _ in self.repairs),
                      "repairs", "at least one (slack trusted, pinned) pair, each share of "
                      "slack trusted above 0 and at most 10")


def _over_mask_useful(m: CostModel, mem: np.ndarray, budget_bytes: int) -> np.ndarray:
    """Candidates whose gap covers at least one op where `mem` exceeds the budget."""
    over = (mem > budget_bytes).astype(np.int64)
    cnt = np.concatenate(([0], np.cumsum(over)))
    lo, hi = m.lf + 1, m.fb            # gap [lo, hi)
    return (hi > lo) & (cnt[np.maximum(hi, lo)] - cnt[lo] > 0)


def _swaps(state: State) -> list[int]:
    return [c for c, a in enumerate(state.actions) if a == SWAP]


def plan_static(m: CostModel, budget_bytes: int, s: SlackswapSettings, use_swap: bool = True,
                slack_safety: float | None = None,
                price_per_byte: float | None = None) -> tuple[State, np.ndarray, bool]:
    """Passes 1-4. Returns (state, static memory, fits in the static model).

    `slack_safety`: the share of the slack trusted (default `s.slack_safety`).

    `price_per_byte`: the recompute time per byte of the dearest tensor a plan without swaps
    recomputes. A swap that avoids a dearer recompute, or frees a tensor that cannot be
    recomputed, saves about that much per byte either way (the bytes would otherwise be freed
    at that price), so those tie, and ties go to the earliest produced: its offload ends long
    before the moments memory is short, where a late one may still be in flight.
    """
    state = State(m)
    mem = m.live_keep.astype(np.int64)
    if mem.max(initial=0) <= budget_bytes:
        return state, mem, True
    useful = _over_mask_useful(m, mem, budget_bytes)
    ledger = SlackLedger(m, safety=s.slack_safety if slack_safety is None else slack_safety)
    if use_swap:
        per_byte = np.where(np.isfinite(state.cost), state.cost / np.maximum(m.size, 1), np.inf)
        if price_per_byte is not None:
            per_byte = np.minimum(per_byte, price_per_byte)
        order = sorted(np.nonzero(useful & m.swappable)[0], key=lambda c: (-per_byte[c], m.p[c]))
        for c in order:
            if ledger.fits(c, state.need[c]):
                ledger.add(c, state.need[c])
                state.set(int(c), SWAP)
    mem = memory(m, state)
    mem, fits = recompute_until_fits(m, state, budget_bytes, mem, max_tries=s.max_tries)
    if not fits and use_swap:
        # swaps still in flight at the worst moment: recompute them instead
        mem, fits = _unswap_in_flight(m, state, budget_bytes, s)
    if not fits and use_swap:
        # what recompute cannot free (random ops' outputs): swap it even if the copy shows
        mem, fits = _force_swaps(m, state, budget_bytes, s)
    for _ in range(3):
        changed = _trim(m, state, budget_bytes)
        if use_swap:
            changed |= _upgrade_to_swap(m, state, budget_bytes, ledger, s)
        if not changed:
            break
    if fits:
        _exchange(m, state, budget_bytes, s)
    mem = memory(m, state)
    return state, mem, bool(mem.max(initial=0) <= budget_bytes)


def _exchange(m: CostModel, state: State, budget_bytes: int, s: SlackswapSettings) -> None:
    """Undo the dearest recomputes one at a time and let the greedy free the bytes elsewhere;
    keep the change when the total recompute time drops (the greedy's early picks are not
    always the best ones: one cheap eviction can force a dear one later)."""
    best = state.recompute_us()
    rec = sorted((c for c, a in enumerate(state.actions) if a == RECOMPUTE),
                 key=lambda c: -state.cost[c])
    allow = np.ones(len(m.cands), dtype=bool)
    for c in rec[:s.exchange_tries]:
        if state.actions[c] != RECOMPUTE:
            continue
        snapshot = list(state.actions)
        state.set(c, KEEP)
        allow[c] = False
        _, fits = recompute_until_fits(m, state, budget_bytes, memory(m, state), allow=allow,
                                       max_steps=s.exchange_steps, max_tries=s.max_tries)
        allow[c] = True
        if fits:
            _trim(m, state, budget_bytes)
        cost = state.recompute_us()
        if fits and cost < best - 1e-9 and memory(m, state).max(initial=0) <= budget_bytes:
            best = cost
        else:
            state.__init__(m, snapshot, state.ch)


def _unswap_in_flight(m: CostModel, state: State, budget_bytes: int,
                      s: SlackswapSettings) -> tuple[np.ndarray, bool]:
    """Where memory is over only because swapped tensors are still being offloaded or already
    being fetched back, recompute those (cheapest per byte first), then let the greedy go on."""
    for _ in range(len(m.cands)):
        mem = memory(m, state)
        i = int(np.argmax(mem))
        if mem[i] <= budget_bytes:
            return mem, True
        swaps = [c for c, a in enumerate(state.actions) if a == SWAP]
        if not swaps:
            return mem, False
        sched = copy_schedule(m, swaps, state.need)
        hit = [c for c in swaps
               if m.lf[c] < i < state.need[c] and np.isfinite(state.cost[c])
               and (i <= sched.offload_done_op[c] or i >= sched.prefetch_op[c])]
        if not hit:
            return mem, False
        c = min(hit, key=lambda c: (state.cost[c] / max(int(m.size[c]), 1), c))
        state.set(c, RECOMPUTE)
        mem, fits = recompute_until_fits(m, state, budget_bytes, memory(m, state),
                                         max_tries=s.max_tries)
        if fits:
            return mem, True
    mem = memory(m, state)
    return mem, bool(mem.max(initial=0) <= budget_bytes)


def _force_swaps(m: CostModel, state: State, budget_bytes: int,
                 s: SlackswapSettings) -> tuple[np.ndarray, bool]:
    for _ in range(len(m.cands)):
        mem = memory(m, state)
        i = int(np.argmax(mem))
        if mem[i] <= budget_bytes:
            return mem, True
        kept = np.array([a == KEEP for a in state.actions])
        cover = kept & m.swappable & (m.lf < i) & (state.need > i)
        if not cover.any():
            return mem, False
        idx = np.nonzero(cover)[0]
        c = int(idx[np.argmax(m.size[idx])])  # the biggest frees most per copy latency
        state.set(c, SWAP)
        mem, fits = recompute_until_fits(m, state, budget_bytes, memory(m, state),
                                         max_tries=s.max_tries)
        if fits:
            return mem, True
    mem = memory(m, state)
    return mem, bool(mem.max(initial=0) <= budget_bytes)


def _trim(m: CostModel, state: State, budget_bytes: int) -> bool:
    """Keep evicted tensors whose eviction is not needed anywhere (dearest first)."""
    changed = False
    mem = memory(m, state)
    rec = [c for c, a in enumerate(state.actions) if a == RECOMPUTE]
    rec.sort(key=lambda c: -state.cost[c] / max(int(m.size[c]), 1))
    for c in rec:
        lo, hi = int(m.lf[c]) + 1, int(state.need[c])
        if hi <= lo or int(mem[lo:hi].max()) + int(m.size[c]) <= budget_bytes:
            if hi > lo:
                mem[lo:hi] += m.size[c]
            e = int(state.extra_bytes[c])
            if e and hi < m.n:
                mem[hi] -= e
            state.set(c, KEEP, refresh=False)   # inputs' needs move later: memory only drops
            changed = True
    if changed:
        state.refresh_need()
    swaps = _swaps(state)
    if swaps:
        sched = copy_schedule(m, swaps, state.need)
        for c in sorted(swaps, key=lambda c: -m.p[c]):
            lo, hi = int(m.lf[c]) + 1, int(state.need[c])
            if hi <= lo:
                state.set(c, KEEP)
                changed = True
                continue
            # memory the swap already costs (offload tail, prefetch head) stays; the rest returns
            add = np.full(hi - lo, int(m.size[c]), dtype=np.int64)
            tail_end = min(sched.offload_done_op[c] + 1, hi)
            add[:max(0, tail_end - lo)] = 0
            head = max(sched.prefetch_op[c], tail_end, lo)
            add[head - lo:] = 0
            if int((mem[lo:hi] + add).max()) <= budget_bytes:
                mem[lo:hi] += add
                state.set(c, KEEP)
                changed = True
    return changed


def _upgrade_to_swap(m: CostModel, state: State, budget_bytes: int, ledger: SlackLedger,
                     s: SlackswapSettings) -> bool:
    """Recomputes that fit the slack left over become swaps, if memory still holds."""
    ledger.__init__(m, safety=ledger.safety)
    for c in _swaps(state):
        ledger.add(c, state.need[c])
    changed = False
    rec = [c for c, a in enumerate(state.actions) if a == RECOMPUTE]
    rec.sort(key=lambda c: -state.cost[c] / max(int(m.size[c]), 1))
    tries = 0
    for c in rec:
        if tries >= s.upgrade_tries:
            break
        if not m.swappable[c] or not ledger.fits(c, state.need[c]):
            continue
        tries += 1
        # inputs' needs stay as early as they were (memory overstated, safe); settled below
        state.set(c, SWAP, need_before=state.need)
        mem = memory(m, state)
        if mem.max(initial=0) <= budget_bytes:
            ledger.add(c, state.need[c])
            changed = True
        else:
            state.set(c, RECOMPUTE)
    if changed:
        state.refresh_need()
    return changed


def _fix_stalls(m: CostModel, state: State, profile: Profile, hw: HardwareSpec,
                budget_bytes: int, s: SlackswapSettings) -> tuple[State, int] | None:
    """Where the simulator shows compute waiting, stop swapping what it waited for.

    A late prefetch at op i: the swapped tensors needed at i are recomputed (or kept, when they
    cannot be). Memory full at op i: the swapped tensors whose offload was still running then
    are. The greedy then frees whatever memory that costs. Returns the repaired state and how
    many swaps it changed; None when nothing stalled.
    """
    res = simulate(profile, state.decisions(), hw, budget_bytes, record=True)
    stalls = [e for e in res.events if e.kind == "stall" and e.op is not None]
    if not stalls:
        return None
    fixed = State(m, state.actions, state.ch)
    swaps = np.array([c for c, a in enumerate(fixed.actions) if a == SWAP], dtype=np.int64)
    if not len(swaps):
        return None
    offload_end = {e.tensor: e.end_us for e in res.events if e.kind == "offload"}
    hit: set[int] = set()
    for e in stalls:
        if e.cause == "late_prefetch":
            hit.update(int(c) for c in swaps[fixed.need[swaps] == e.op])
        else:
            hit.update(int(c) for c in swaps
                       if offload_end.get(m.cands[c], 0.0) > e.start_us
                       and m.p[c] <= e.op)
    if not hit:
        return None
    for c in hit:
        fixed.set(c, RECOMPUTE if np.isfinite(fixed.cost[c]) else KEEP)
    mem, fits = recompute_until_fits(m, fixed, budget_bytes, memory(m, fixed),
                                     max_tries=s.max_tries)
    if not fits:
        return None
    _trim(m, fixed, budget_bytes)
    return fixed, len(hit)


class _Tried(NamedTuple):
    """A plan `plan` tried, with the simulator's verdict (`key`: feasible, then retention)."""
    key: tuple[bool, float]
    state: State
    decisions: list
    fits: bool                  # fits in the static model
    safety: float | str | None  # the slack trusted (None: no swaps; "swap-all": the fallback)
    pin: bool                   # prefetches pinned just in time
    res: object                 # its SimResult
    price: float | None         # the swap price it was made at
    stall_fixed: int = 0        # stalling swaps `_fix_stalls` changed


def plan(profile: Profile, hw: HardwareSpec, budget_bytes: int,
         settings: SlackswapSettings = SlackswapSettings()):
    """The `slackswap` planner: (profile, hardware, budget) -> decisions and notes.

    It tries `SlackswapSettings.repairs` in order, and a plan without swaps too (so slackswap never
    loses to recomputing alone); the best plan the simulator saw is kept.
    """
    s = settings
    m = build_cost_model(profile, hw, s.no_swap, s.no_recompute)
    ideal = m.ideal_us
    best = None

    def consider(state, fits, safety, pin, price=None, stall_fixed=0):
        nonlocal best
        decisions = state.decisions(prefetch_points(m, state, s.prefetch_margin) if pin
                                    else None)
        res = simulate(profile, decisions, hw, budget_bytes, record=False)
        key = (res.feasible, res.predicted.retention)
        if best is None or key > best.key:
            best = _Tried(key, state, decisions, fits, safety, pin, res, price, stall_fixed)
        return res.feasible and res.predicted.stall_us <= 1e-6 * ideal

    prices: list[float | None] = [None]
    if int(m.live_keep.max(initial=0)) > budget_bytes:
        state, _, fits = plan_static(m, budget_bytes, s, use_swap=False)
        consider(state, fits, None, False)
        rec = [c for c, a in enumerate(state.actions) if a == RECOMPUTE]
        if rec:
            per_byte = np.sort([float(state.cost[c]) / max(int(m.size[c]), 1) for c in rec])
            prices = list(dict.fromkeys(
                float(per_byte[int(round(q * (len(per_byte) - 1)))])
                for q in s.price_quantiles))
    best_price = None   # set after the first pass; later passes try only that price
    for k, (safety, pin) in enumerate(s.repairs):
        clean = False
        for price in (prices if k == 0 else [best_price]):
            state, _, fits = plan_static(m, budget_bytes, s, slack_safety=safety,
                                         price_per_byte=price)
            if consider(state, fits, safety, pin, price):
                clean = True
            elif k == 0:   # fix the stalls where the simulator shows them, then judge again
                fixed = _fix_stalls(m, state, profile, hw, budget_bytes, s)
                if fixed is not None:
                    clean |= consider(fixed[0], True, safety, pin, price, fixed[1])
        if clean:
            break
        best_price = best.price if best.price is not None else prices[0]
    if not best.key[0]:
        # nothing fits yet: swapping everything needs the least memory of any plan (it meets
        # every budget at or above the floor, compute waiting for copies where it must)
        consider(State(m, [SWAP if ok else KEEP for ok in m.swappable]), True, "swap-all",
                 False)
    polished = polish(profile, hw, budget_bytes, best.decisions, best.res,
                      work_ops=settings.polish_work_ops, no_swap=frozenset(s.no_swap),
                      no_recompute=frozenset(s.no_recompute))
    decisions = list(polished.decisions)
    return PlannerOutput(decisions, _notes(best, decisions, polished, s))


def _notes(best: _Tried, decisions, polished, s) -> tuple[str, ...]:
    """What the plan's notes say: its counts, the repair that made it, the polish."""
    state, fits, safety, pin, res = best.state, best.fits, best.safety, best.pin, best.res
    notes = [f"{sum(d.action == SWAP for d in decisions)} swapped, "
             f"{sum(d.action == RECOMPUTE for d in decisions)} recomputed"
             + ("" if polished.moves else
                f" ({fmt_us(state.recompute_us())} of recompute in the static model)")]
    if safety == "swap-all":
        notes.append("no other plan fitted in simulation: every saved activation swapped"
                     + (", then polished" if polished.moves else ""))
    elif safety is None:
        notes.append("recomputing alone beat every plan with swaps in simulation")
    elif best.stall_fixed:
        notes.append(f"repaired after simulation: {best.stall_fixed} stalling swaps "
                     "recomputed or kept")
    elif safety != s.repairs[0][0] or pin:
        notes.append(f"repaired after simulation: {100 * safety:.0f}% of the slack trusted"
                     + (", prefetches pinned just in time" if pin else ""))
    if polished.moves:
        notes.append(polished.note(res))
    if not fits:
        notes.append("the static model found no plan under the budget; best effort")
    return tuple(notes)
