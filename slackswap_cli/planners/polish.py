"""Polish a plan against the simulator: the last pass of `slackswap`.

The static model the planners reason with leaves things out (copy queueing, chains that share
ops, swaps the ledger placed where a cheaper tensor would have done), so a plan it calls best
can often be improved by changing one or two decisions. This pass tries such changes and
keeps each that the simulator judges better (feasible, higher retention), first improvement,
until a pass finds nothing or the work allowance is spent.

**Moves**, from the most promising (static chain time, the ops recomputing a tensor re-runs
when everything else is at hand):
1. a recomputed tensor r becomes a swap, or is kept;
2. *exchange with a swap*: r becomes a swap and a swapped s of about its size (at least half)
   with a cheaper chain is recomputed instead (the copy time s used goes to r);
3. *exchange with a kept tensor*: r is kept and a kept k of at least r's size with a cheaper
   chain is recomputed instead;
4. when the plan stalls: a swapped tensor is recomputed or kept.

**Filter.** A plan's step is its ideal time plus recompute time plus stalls, so a move whose
recompute time (exact, from `chains.lay_out`, about a fifth of a simulation) is not below
the current plan's overhead cannot help and is not simulated.

**Allowance.** Work is counted in op-visits (a simulation costs the profile's op count, a
static pass a quarter of it) and capped at `work_ops` (default: `WORK_OPS`, or
`MIN_SIMULATIONS` simulations' worth on a small profile): the pass is deterministic (no
clock), and on large profiles its time stays about constant. Prefetch pins of
unchanged swaps are kept; a new swap has none.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..chains import candidate_chain
from ..chains import tables as chain_tables
from ..errors import InputError
from ..hardware import HardwareSpec
from ..schema import Action, Decision, Profile

KEEP, SWAP, RECOMPUTE = Action.KEEP, Action.SWAP, Action.RECOMPUTE
WORK_OPS = 300_000        # default allowance in op-visits: about 0.4 s on the Llama-7B sample
MIN_SIMULATIONS = 1_000   # ... but at least this many simulations' worth on a profile of
SMALL_OPS = 1_000         # at most this many ops (a simulation there takes under a millisecond)


@dataclass(frozen=True)
class PolishResult:
    decisions: tuple[Decision, ...]
    result: object            # the SimResult of `decisions`
    moves: int                # moves taken
    simulated: int            # plans simulated
    laid_out: int             # plans whose recompute time was computed


def _chain_time(tab, r: int) -> float | None:
    ch = candidate_chain(tab, r)
    return None if ch is None else sum(tab.time[o] for o in ch.ops)


def polish(prof: Profile, hw: HardwareSpec, budget_bytes: int, decisions, result,
           work_ops: int | None = None, pairs: int = 3, batch_size: int = 24,
           min_gain: float = 1e-9) -> PolishResult:
    """Improve `decisions` (whose simulation is `result`) move by move; a plan that does not
    fit is returned as it is."""
    from ..simulate import simulate, static_costs
    if not result.feasible:
        return PolishResult(tuple(decisions), result, 0, 0, 0)
    tab = chain_tables(prof)
    n_ops = max(1, tab.n_ops)
    if work_ops is None:
        work_ops = max(WORK_OPS, MIN_SIMULATIONS * n_ops) if n_ops <= SMALL_OPS else WORK_OPS
    cur = {d.tensor: d for d in decisions}
    ids = list(tab.saved_roots)
    for t in ids:
        cur.setdefault(t, Decision(t, KEEP))
    cost = {t: _chain_time(tab, t) for t in ids}
    size = tab.size
    lfu, nf = tab.last_fwd_use, tab.n_fwd
    ideal = result.predicted.ideal_us
    best_res, best = result, result.predicted.retention
    spent = moves = simulated = laid_out = 0

    def fits_forward(change, F) -> bool:
        """Keeping a recomputed r adds its bytes to every forward op after its last forward
        reader, recomputing a kept k takes them off: a necessary condition, checked on the
        current plan's forward memory `F` before any static pass."""
        add = [t for t, a in change.items() if a == KEEP]
        if not add:
            return True
        lo = min(lfu[t] for t in add) + 1
        if lo >= nf:
            return True
        seg = F[lo:].copy()
        for t, a in change.items():
            if a == KEEP:
                seg[max(0, lfu[t] + 1 - lo):] += size[t]
            elif a == RECOMPUTE and cur[t].action == KEEP:
                seg[max(0, lfu[t] + 1 - lo):] -= size[t]
        return float(seg.max()) <= budget_bytes

    def moves_from(plan):
        """This pass's moves, the largest static saving first."""
        by = {a: [t for t in ids if plan[t].action == a] for a in (KEEP, SWAP, RECOMPUTE)}
        out = []
        for r in by[RECOMPUTE]:
            out += [(cost[r], {r: SWAP}), (cost[r], {r: KEEP})]
            near = sorted((s for s in by[SWAP] if cost[s] is not None),
                          key=lambda s: (abs(size[s] - size[r]), s))
            out += [(cost[r] - cost[s], {r: SWAP, s: RECOMPUTE}) for s in near[:pairs]]
            near = sorted((k for k in by[KEEP] if cost[k] is not None and size[k] >= size[r]),
                          key=lambda k: (size[k] - size[r], k))
            out += [(cost[r] - cost[k], {r: KEEP, k: RECOMPUTE}) for k in near[:pairs]]
        if best_res.predicted.stall_us > 0:
            for s in by[SWAP]:
                if cost[s] is not None:
                    out.append((-cost[s], {s: RECOMPUTE}))
                out.append((0.0, {s: KEEP}))
        out.sort(key=lambda x: (-x[0], sorted(x[1].items())))
        return [change for _, change in out]

    def try_batch(batch, F) -> bool:
        """Static pass on each move of `batch`, then simulate the survivors, least recompute
        first; take the first that the simulator judges better."""
        nonlocal spent, laid_out, simulated, cur, best, best_res, moves
        ranked = []
        for k, change in enumerate(batch):
            if spent >= work_ops:
                break
            if not fits_forward(change, F):
                continue
            trial = dict(cur)
            for t, a in change.items():
                trial[t] = Decision(t, a)
            spent += n_ops // 4
            laid_out += 1
            try:
                sc = static_costs(prof, list(trial.values()))
            except InputError:
                continue
            overhead = best_res.predicted.step_us - ideal
            if sc.peak_bytes <= budget_bytes and sc.recompute_us < overhead - min_gain * ideal:
                ranked.append((sc.recompute_us, k, trial))
        ranked.sort(key=lambda x: (x[0], x[1]))
        for rec, _, trial in ranked:
            if spent >= work_ops or ideal / (ideal + rec) <= best + min_gain:
                break
            spent += n_ops
            simulated += 1
            # a better plan stalls less than its recompute leaves room for
            room = best_res.predicted.step_us - ideal - rec - min_gain * ideal
            res = simulate(prof, list(trial.values()), hw, budget_bytes, record=False,
                           give_up_stall_us=room)
            if res is not None and res.feasible and res.predicted.retention > best + min_gain:
                cur, best, best_res = trial, res.predicted.retention, res
                moves += 1
                return True
        return False

    improved = True
    while improved and spent < work_ops:
        improved = False
        here = static_costs(prof, list(cur.values()))
        spent += n_ops // 4
        F = np.asarray(here.forward_req, dtype=np.int64)
        todo = moves_from(cur)
        for b in range(0, len(todo), batch_size):
            if spent >= work_ops:
                break
            if try_batch(todo[b:b + batch_size], F):
                improved = True
                break
    return PolishResult(tuple(cur[t] for t in sorted(cur)), best_res, moves, simulated,
                        laid_out)
