"""Local search over plans, judged by the simulator: how much a planner's plan leaves behind.

A *1-move* changes one saved activation's action (keep, swap, recompute; recompute only where
the tensor can be re-run); a *2-move* exchanges the actions of two tensors (one swapped, one
recomputed, say). A move is taken when the simulated plan fits the budget and its retention
rises by more than `min_gain` (first improvement: a pass tries every move once, in a fixed
order, taking each that helps); passes repeat until one finds nothing, a pass limit or a time
limit. Deterministic: the order depends on tensor ids and sizes only. 2-moves are tried
between each tensor and its `pair_window` nearest tensors in size (an exchange between similar
sizes keeps memory about level; all pairs would be quadratic).

Prefetch pins (`prefetch_at`) of unchanged swaps are kept; a tensor that becomes a swap has
none. A plan the simulator refuses (a recompute chain through a random op nobody saved) is
skipped. This is a measuring tool for benchmarks and tests, not a planner.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from slackswap_cli.errors import InputError
from slackswap_cli.hardware import HardwareSpec
from slackswap_cli.planners.polish import neighbourhood
from slackswap_cli.schema import Decision, Profile
from slackswap_cli.simulate import simulate


@dataclass(frozen=True)
class SearchResult:
    decisions: tuple[Decision, ...]
    retention: float | None   # of the best feasible plan found (None: none fits)
    start_retention: float | None
    moves: int                # moves taken
    evaluated: int            # plans simulated
    seconds: float


def _score(prof, decisions, hw, budget) -> float | None:
    try:
        res = simulate(prof, decisions, hw, budget, record=False)
    except InputError:
        return None
    return res.predicted.retention if res.feasible else None


def improve(prof: Profile, hw: HardwareSpec, budget_bytes: int, decisions,
            two_moves: bool = True, max_passes: int = 20, time_limit_s: float = 60.0,
            pair_window: int = 4, min_gain: float = 1e-9) -> SearchResult:
    """First-improvement local search from `decisions` (a list of `Decision`)."""
    t0 = time.perf_counter()
    cur = {d.tensor: d for d in decisions}
    for t in prof.saved_activations:
        cur.setdefault(t.id, Decision(t.id, "keep"))
    ids = sorted(cur)
    recomputable = {t.id: t.recomputable for t in prof.saved_activations}
    size = {t.id: t.size_bytes for t in prof.saved_activations}
    best = _score(prof, list(cur.values()), hw, budget_bytes)
    start = best
    moves = evaluated = 0

    def with_actions(changes: dict[int, str]):
        out = dict(cur)
        for tid, act in changes.items():
            out[tid] = Decision(tid, act)
        return list(out.values())

    passes = 0
    out_of_time = False
    while passes < max_passes and not out_of_time:
        passes += 1
        improved = False
        for change in list(neighbourhood(cur, size, recomputable, two_moves, pair_window)):
            if time.perf_counter() - t0 > time_limit_s:
                out_of_time = True
                break
            if any(cur[t].action == a for t, a in change.items()):
                continue                        # stale: an earlier move changed it
            val = _score(prof, with_actions(change), hw, budget_bytes)
            evaluated += 1
            if val is not None and (best is None or val > best + min_gain):
                cur = {d.tensor: d for d in with_actions(change)}
                best = val
                moves += 1
                improved = True
        if not improved:
            break
    return SearchResult(tuple(cur[t] for t in ids), best, start,
                        moves, evaluated, time.perf_counter() - t0)
