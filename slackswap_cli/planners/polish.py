"""Polish a plan against the simulator: the last pass of `slackswap`.

The static model the planners reason with leaves things out (copy queueing, chains that share
ops, swaps the ledger placed where a cheaper tensor would have done), so a plan it calls best
can often be improved by changing one or two decisions. This pass tries such changes in order
and takes each that the simulator judges better (feasible, higher retention) as it goes on
down the list (a local search's first improvement); passes repeat until one finds nothing or
the work allowance is spent. A plan already at the ideal step is left as it is.

**Moves**, from the most promising (static chain time, the ops recomputing a tensor re-runs
when everything else is at hand):
1. a recomputed tensor r becomes a swap, or is kept;
2. *exchange with a swap*: r becomes a swap and a swapped s of about its size (at least half)
   with a cheaper chain is recomputed instead (the copy time s used goes to r);
3. *exchange with a kept tensor*: r is kept and a kept k of at least r's size with a cheaper
   chain is recomputed instead;
4. *one kept for several recomputes*: a kept k is recomputed and the recomputes whose gaps lie
   inside its gap, up to its size, are kept, when their chains cost more together than k's
   (no one of them need be dearer than k, which move 3 requires);
5. when the plan stalls: a swapped tensor is recomputed or kept;
6. *swap where compute waits for memory*: at each op before which the plan waits for memory,
   the biggest kept tensors live across it are swapped, ranked by that wait (an earlier
   tensor's offload can free its bytes before the one the wait is for ends; on the tiny GPT
   at 0.3 it is taken twice), each alone and each in exchange for a swap whose gap lies
   inside its gap and whose size is at most its size (that swap is kept: the bytes are freed
   over at least the same span, with a longer window for the copies).

**Then the plain neighbourhood.** When a pass of these moves finds nothing and allowance is
left (small profiles, or plans the moves above settle quickly), the rest of the allowance goes
to first-improvement passes over a plain local search's moves (`neighbourhood`: every 1-move,
and exchanges between tensors of neighbouring sizes, the same moves `local_search` measures
planners with), each simulated (docs/results.md, "Figures behind the planners' design", has
what it finds on the tiny GPT); on the four samples the allowance is spent or the moves above
already left a local optimum of this neighbourhood.

**Filter.** A plan's step is its ideal time plus recompute time plus stalls, so a move whose
recompute time (exact, from `simulate.static_costs`: one static pass, `STATIC_SHARE` of a
simulation) is not below the current plan's overhead, or whose least peak is over the
budget, cannot help and is not simulated; a simulation gives up once its stalls leave no
room to win. A recompute that becomes a swap skips the static pass (its recompute time only
drops; the simulator judges its copies and memory). Moves alike (`_Polisher.signature`: the
same actions on tensors of the same size and times, as in repeated layers) wait for a second
sweep of the pass once the simulator refused one of them.

**Allowance.** Work is counted in op-visits (a simulation costs the profile's op count, a
static pass `STATIC_SHARE` of it) and capped at `work_ops` (default: `WORK_OPS`, or
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
from ..simulate import MEMORY_FULL, simulate, static_costs

KEEP, SWAP, RECOMPUTE = Action.KEEP, Action.SWAP, Action.RECOMPUTE
WORK_OPS = 300_000        # default allowance in op-visits (its time: docs/results.md)
MIN_SIMULATIONS = 1_000   # ... but at least this many simulations' worth on a profile of
SMALL_OPS = 1_000         # at most this many ops (a simulation there takes under a millisecond)
STATIC_SHARE = 0.4        # a static pass's cost in simulations (measured: docs/results.md)


@dataclass(frozen=True)
class PolishResult:
    decisions: tuple[Decision, ...]
    result: object            # the SimResult of `decisions`
    moves: int                # moves taken
    simulated: int            # plans simulated
    laid_out: int             # plans whose recompute time was computed

    def note(self, start, what: str = "") -> str | None:
        """The planner's note on the polish (None when it moved nothing); `start` is the
        simulation of the plan it started from."""
        if not self.moves:
            return None
        gain = self.result.predicted.retention - start.predicted.retention
        return (f"polished {what}in simulation: {self.moves} moves, "
                f"+{100 * gain:.2f} points of retention")


def _chain_time(tab, r: int) -> float | None:
    ch = candidate_chain(tab, r)
    return None if ch is None else sum(tab.time[o] for o in ch.ops)


def polish(prof: Profile, hw: HardwareSpec, budget_bytes: int, decisions, result,
           work_ops: int | None = None, pairs: int = 3, batch_size: int = 24,
           min_gain: float = 1e-9, no_swap: frozenset = frozenset(),
           no_recompute: frozenset = frozenset()) -> PolishResult:
    """Improve `decisions` (whose simulation is `result`) move by move; a plan that does not
    fit is returned as it is. No move swaps a root of `no_swap` or recomputes one of
    `no_recompute` (the planner's options: what the compiled path cannot)."""
    pred = result.predicted
    if not result.feasible or pred.step_us - pred.ideal_us <= min_gain * pred.ideal_us:
        return PolishResult(tuple(decisions), result, 0, 0, 0)     # nothing to gain
    p = _Polisher(prof, hw, budget_bytes, decisions, result, work_ops, pairs, min_gain)
    p.barred = {SWAP: no_swap, RECOMPUTE: no_recompute}
    improved = True
    while improved and p.spent < p.work_ops:
        improved = False
        F = p.forward_memory()
        todo, p.deferred = p.moves(), []
        for defer in (True, False):     # moves like a refused one wait for the second sweep
            for b in range(0, len(todo), batch_size):
                if p.spent >= p.work_ops:
                    break
                if p.try_batch(todo[b:b + batch_size], F, defer):
                    improved = True             # go on down the list from the new plan
                    F = p.forward_memory()
            todo = p.deferred
    if p.spent < p.work_ops:
        p.sweep_neighbourhood()
    return PolishResult(tuple(p.cur[t] for t in sorted(p.cur)), p.best_res, p.moves_taken,
                        p.simulated, p.laid_out)


def neighbourhood(cur: dict, size: dict, recomputable: dict, two_moves: bool = True,
                  pair_window: int = 4):
    """The moves of a plain local search from `cur` (tensor id -> Decision), in a fixed
    order: every 1-move (one tensor to another action; recompute only where it can be re-run),
    then, with `two_moves`, every exchange of the actions of two tensors within `pair_window`
    of each other in size order."""
    ids = sorted(cur)
    for t in ids:
        for act in (KEEP, SWAP, RECOMPUTE):
            if act != cur[t].action and (act != RECOMPUTE or recomputable[t]):
                yield {t: act}
    if two_moves:
        by_size = sorted(ids, key=lambda t: (size[t], t))
        for k, a in enumerate(by_size):
            for b in by_size[k + 1:k + 1 + pair_window]:
                aa, ab = cur[a].action, cur[b].action
                if aa == ab:
                    continue
                if (ab == RECOMPUTE and not recomputable[a]) or \
                        (aa == RECOMPUTE and not recomputable[b]):
                    continue
                yield {a: ab, b: aa}


class _Polisher:
    """The search's state: the current plan and its simulation, and the work spent."""

    def __init__(self, prof, hw, budget_bytes, decisions, result, work_ops, pairs, min_gain):
        self.prof, self.hw, self.budget = prof, hw, budget_bytes
        self.tab = tab = chain_tables(prof)
        self.n_ops = n_ops = max(1, tab.n_ops)
        self.static_ops = max(1, int(STATIC_SHARE * n_ops))
        if work_ops is None:
            work_ops = max(WORK_OPS, MIN_SIMULATIONS * n_ops) if n_ops <= SMALL_OPS else WORK_OPS
        self.work_ops, self.pairs, self.min_gain = work_ops, pairs, min_gain
        self.cur = {d.tensor: d for d in decisions}
        self.ids = list(tab.saved_roots)
        for t in self.ids:
            self.cur.setdefault(t, Decision(t, KEEP))
        self.cost = {t: _chain_time(tab, t) for t in self.ids}
        self.ideal = result.predicted.ideal_us
        self.best_res, self.best = result, result.predicted.retention
        self.spent = self.moves_taken = self.simulated = self.laid_out = 0
        self.failed: set = set()   # signatures of moves the simulator refused since the last win
        self.deferred: list = []   # this pass's moves like a refused one

    barred: dict = {}

    def swaps_no_swap(self, change) -> bool:
        """Whether `change` swaps or recomputes a root the planner may not (`barred`)."""
        return any(t in self.barred.get(a, ()) for t, a in change.items())

    def trial(self, change) -> dict:
        """The current plan with `change` (tensor id -> new action) made; a changed tensor
        loses its prefetch pin."""
        out = dict(self.cur)
        for t, a in change.items():
            out[t] = Decision(t, a)
        return out

    def signature(self, change) -> frozenset:
        """What makes two moves alike: per tensor changed, its new action, its size, its
        producer's time and its chain's time. The repeated layers of a model give many moves
        with one signature, and when the simulator refuses one (its copy cannot hide), it
        refuses the others about as surely: they wait for the pass's second sweep."""
        tab = self.tab
        return frozenset((a, tab.size[t], round(tab.time[tab.producer[t]], 1)
                          if tab.producer[t] >= 0 else None,
                          None if self.cost[t] is None else round(self.cost[t], 1))
                         for t, a in change.items())

    def forward_memory(self) -> np.ndarray:
        """The current plan's least memory during each forward op (one static pass)."""
        self.spent += self.static_ops
        return np.asarray(static_costs(self.prof, list(self.cur.values())).forward_req,
                          dtype=np.int64)

    def fits_forward(self, change, F) -> bool:
        """Keeping an evicted r adds its bytes to every forward op after its last forward
        reader, evicting (recomputing or swapping) a kept k takes them off: a necessary
        condition, checked on the current plan's forward memory `F` before any static pass."""
        lfu, size = self.tab.last_fwd_use, self.tab.size
        add = [t for t, a in change.items() if a == KEEP]
        if not add:
            return True
        lo = min(lfu[t] for t in add) + 1
        if lo >= self.tab.n_fwd:
            return True
        seg = F[lo:].copy()
        for t, a in change.items():
            if a == KEEP:
                seg[max(0, lfu[t] + 1 - lo):] += size[t]
            elif self.cur[t].action == KEEP:        # recomputed or swapped
                seg[max(0, lfu[t] + 1 - lo):] -= size[t]
        return float(seg.max()) <= self.budget

    def moves(self) -> list[dict]:
        """This pass's moves, the largest static saving first."""
        cost, size, pairs = self.cost, self.tab.size, self.pairs
        by = {a: [t for t in self.ids if self.cur[t].action == a] for a in (KEEP, SWAP, RECOMPUTE)}
        out = []
        for r in by[RECOMPUTE]:
            out += [(cost[r], {r: SWAP}), (cost[r], {r: KEEP})]
            near = sorted((s for s in by[SWAP] if cost[s] is not None),
                          key=lambda s: (abs(size[s] - size[r]), s))
            out += [(cost[r] - cost[s], {r: SWAP, s: RECOMPUTE}) for s in near[:pairs]]
            near = sorted((k for k in by[KEEP] if cost[k] is not None and size[k] >= size[r]),
                          key=lambda k: (size[k] - size[r], k))
            out += [(cost[r] - cost[k], {r: KEEP, k: RECOMPUTE}) for k in near[:pairs]]
        out += self._one_for_many(by[KEEP], by[RECOMPUTE])
        if self.best_res.predicted.stall_us > 0:
            for s in by[SWAP]:
                if cost[s] is not None:
                    out.append((-cost[s], {s: RECOMPUTE}))
                out.append((0.0, {s: KEEP}))
            out += self.swap_where_memory_waits()
        out.sort(key=lambda x: (-x[0], sorted(x[1].items())))
        return [change for _, change in out]

    def _one_for_many(self, kept, recomputed) -> list[tuple[float, dict]]:
        """*One kept tensor for several recomputes*: k is recomputed and the recomputed
        tensors whose gaps lie inside k's gap (dearest per byte first, while their sizes add up
        to at most k's) are kept, when their chains cost more than k's together. Where memory
        was full k frees at least what they take back, so the exchange stays level; move 3
        exchanges one for one and misses it when no single recompute is dearer than k."""
        cost, size = self.cost, self.tab.size
        lfu, fbu = self.tab.last_fwd_use, self.tab.first_bwd_use
        rs = sorted((r for r in recomputed if cost[r] is not None),
                    key=lambda r: (-cost[r] / max(size[r], 1), r))
        out = []
        for k in kept:
            if cost[k] is None:
                continue
            room, gain, take = size[k], -cost[k], {}
            for r in rs:
                if size[r] <= room and lfu[k] <= lfu[r] and fbu[r] <= fbu[k]:
                    take[r] = KEEP
                    room -= size[r]
                    gain += cost[r]
            if len(take) >= 2 and gain > 0:
                out.append((gain, {k: RECOMPUTE, **take}))
        return out

    def swap_where_memory_waits(self) -> list[tuple[float, dict]]:
        """*Swap where compute waits for memory*: at each op before which the current plan
        waits for memory (one recorded simulation), the `pairs` biggest kept tensors live
        across it become swaps, ranked by that wait (the most they can save): their bytes can
        leave during the wait instead of staying until backward."""
        if not self.best_res.predicted.stall_by_cause.get(MEMORY_FULL):
            return []
        self.spent += self.n_ops
        res = simulate(self.prof, list(self.cur.values()), self.hw, self.budget)
        waits: dict[int, float] = {}
        for e in res.events:
            if e.kind == "stall" and e.cause == MEMORY_FULL and e.op is not None:
                waits[e.op] = waits.get(e.op, 0.0) + e.end_us - e.start_us
        size, producer, last_use = self.tab.size, self.tab.producer, self.tab.last_use
        kept = [t for t in self.ids if self.cur[t].action == KEEP]
        out = []
        for op, wait in sorted(waits.items()):
            live = sorted((k for k in kept if producer[k] < op <= last_use[k]),
                          key=lambda k: (-size[k], k))
            for k in live[:self.pairs]:
                out.append((wait, {k: SWAP}))
                out += [(wait, {k: SWAP, s: KEEP}) for s in self._narrower_swaps(k)]
        return out

    def _narrower_swaps(self, k) -> list:
        """The `pairs` swaps (nearest in size first) that kept `k` can stand in for: of at
        most k's size, their gap (producer to first backward use) inside k's. Swapping k
        instead frees at least their bytes over all their gap, and its copies get a longer
        window to hide in (on ResNet-50 at 0.3 this removes a wait for memory)."""
        tab, size = self.tab, self.tab.size
        prod, fbu = tab.producer, tab.first_bwd_use
        narrower = [s for s in self.ids if self.cur[s].action == SWAP and size[s] <= size[k]
                    and prod[k] <= prod[s] and fbu[s] <= fbu[k]]
        narrower.sort(key=lambda s: (size[k] - size[s], s))
        return narrower[:self.pairs]

    def try_batch(self, batch, F, defer: bool) -> bool:
        """Static pass on each move of `batch`, then simulate the survivors, least recompute
        first; take the first that the simulator judges better. With `defer`, a move like
        one the simulator refused (`signature`) goes to `self.deferred` instead."""
        ranked = []
        for k, change in enumerate(batch):
            if self.spent >= self.work_ops:
                break
            if any(self.cur[t].action == a for t, a in change.items()) or \
                    self.swaps_no_swap(change):
                continue                # stale (a move taken since changed it), or barred
            if not self.fits_forward(change, F):
                continue
            sig = self.signature(change)
            if defer and sig in self.failed:
                self.deferred.append(change)
                continue
            trial = self.trial(change)
            rec = self._swap_instead(change)
            if rec is None:
                rec = self._static_recompute(trial)
            if rec is not None:
                ranked.append((rec, k, trial, change, sig))
        ranked.sort(key=lambda x: (x[0], x[1]))
        for rec, _, trial, change, sig in ranked:
            if self.spent >= self.work_ops:
                break
            if defer and sig in self.failed:     # refused since this batch was ranked
                self.deferred.append(change)
                continue
            won = self._judge(rec, trial)
            if won is True:
                self.failed.clear()
                return True
            if won is False:
                self.failed.add(sig)
        return False

    def sweep_neighbourhood(self) -> None:
        """With allowance left once the targeted moves find nothing: first-improvement passes
        over the plain local-search neighbourhood (`neighbourhood`), every move simulated
        (giving up once its stalls alone leave it no better), until a pass finds nothing or
        the allowance is spent."""
        tab = self.tab
        size = {t: tab.size[t] for t in self.ids}
        rec = {t: tab.recomputable[t] for t in self.ids}
        improved = True
        while improved and self.spent < self.work_ops:
            improved = False
            for change in list(neighbourhood(self.cur, size, rec)):
                if self.spent >= self.work_ops:
                    return
                if any(self.cur[t].action == a for t, a in change.items()) or \
                        self.swaps_no_swap(change):
                    continue                # stale (a move taken since changed it), or barred
                trial = self.trial(change)
                self.spent += self.n_ops
                self.simulated += 1
                pred = self.best_res.predicted
                try:
                    res = simulate(self.prof, list(trial.values()), self.hw, self.budget,
                                   record=False,
                                   give_up_stall_us=pred.step_us - self.ideal)
                except InputError:
                    continue                # a chain through a value nobody kept
                if res is None or not res.feasible or \
                        res.predicted.retention <= self.best + self.min_gain:
                    continue
                self.cur, self.best, self.best_res = trial, res.predicted.retention, res
                self.moves_taken += 1
                improved = True

    def _swap_instead(self, change) -> float | None:
        """A recompute that becomes a swap needs no static pass to be worth simulating: its
        recompute time drops (by about its chain's time, the estimate returned) and the
        simulator judges its memory. None for any other move."""
        if len(change) != 1:
            return None
        (t, a), = change.items()
        if a != SWAP or self.cur[t].action != RECOMPUTE or self.cost[t] is None:
            return None
        return max(0.0, self.best_res.predicted.recompute_us - self.cost[t])

    def _static_recompute(self, trial) -> float | None:
        """The trial's recompute time when it fits and could beat the current plan."""
        self.spent += self.static_ops
        self.laid_out += 1
        try:
            sc = static_costs(self.prof, list(trial.values()))
        except InputError:
            return None
        overhead = self.best_res.predicted.step_us - self.ideal
        if sc.peak_bytes <= self.budget and sc.recompute_us < overhead - self.min_gain * self.ideal:
            return sc.recompute_us
        return None

    def _judge(self, rec: float, trial) -> bool | None:
        """Simulate the trial (giving up once its stalls leave it no better); take it if it
        is better. True: taken; False: the simulator refused it; None: not simulated (its
        recompute alone leaves it no better)."""
        ideal, gain = self.ideal, self.min_gain
        if ideal / (ideal + rec) <= self.best + gain:
            return None
        self.spent += self.n_ops
        self.simulated += 1
        room = self.best_res.predicted.step_us - ideal - rec - gain * ideal
        res = simulate(self.prof, list(trial.values()), self.hw, self.budget, record=False,
                       give_up_stall_us=room)
        if res is None or not res.feasible or res.predicted.retention <= self.best + gain:
            return False
        self.cur, self.best, self.best_res = trial, res.predicted.retention, res
        self.moves_taken += 1
        return True
