"""What every planner needs to reason about a profile fast: a static model of time and memory.

The simulator (`simulate.py`) is the judge of a plan, but a planner has to weigh thousands of
choices, so it works on a cheaper, *static* picture of the step, built once per profile:

- **ideal times**: op i runs from `t_start[i]` to `t_end[i]` when nothing stalls.
- **candidates**: the saved activation roots, each with its size, producer `p`, last forward
  use `lf`, first backward use `fb` and last use `lu` (op ids).
- **floor memory** `base[i]`: activation bytes live at op i when every candidate is evicted as
  hard as possible, i.e. resident only while forward still reads it (`p..lf`) and from its first
  backward use on (`fb..lu`). Whatever a plan does, it pays `base`.
- the **gap** of a candidate, `lf+1 .. fb-1`, is where an eviction can save its bytes. Keeping
  it adds its size over the whole gap; recomputing adds nothing there (but costs the producer
  chain's time at `fb`, and the chain's other outputs for a moment); swapping adds it over an
  *offload tail* (until the D2H copy is done) and a *prefetch head* (from the H2D copy's start).

Copies follow the simulator's rules: one D2H FIFO fed in production order as producers end,
one H2D FIFO in order of need. The static model schedules prefetches *just in time* (as late
as the FIFO allows while still finishing when needed), the least memory a prefetch can cost;
the simulator issues them as early as its memory reservation allows, which never costs more,
and a planner can pin the just-in-time point with `prefetch_at`.

**Slack.** A swap is free when its copies hide under compute. In this model that holds when
every D2H copy finishes before forward ends (a suffix condition on the FIFO: the copies of
everything produced from op j on fit in the forward time left after j) and every H2D copy can
start after backward starts (a prefix condition: the copies needed by op j fit in the backward
time before j). `SlackLedger` keeps both conditions as arrays and answers "does one more swap
still fit?" in one vectorised check.

**Recompute chains** (`build_chains`): the static view of `chains.candidate_chain`, the rules
the simulator and the patched module follow. Recomputing `y` re-runs its producer before `y`
is needed; non-saved forward values it reads (dead by then) are re-run first, recursively, as
temporaries; one that cannot be re-run (a dropout output nobody saved) makes the chain
impossible. Candidates it reads are obtained whatever their action (kept, fetched, or
recomputed first and then kept), so they cost no extra time, but an evicted one is then back
*earlier*: `State.need` tracks when each candidate must be resident.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..chains import ACTION_CODES, KEEP_CODE, RECOMPUTE_CODE, SWAP_CODE, candidate_chain
from ..chains import tables as chain_tables
from ..hardware import HardwareSpec
from ..layers import op_layer_indices
from ..schema import Action, Decision, Profile
from .settings import Settings

KEEP, SWAP, RECOMPUTE = Action.KEEP, Action.SWAP, Action.RECOMPUTE
INF = float("inf")


@dataclass(frozen=True)
class StaticSettings(Settings):
    """Tuning of the tools every planner shares here: the recompute greedy, the copy
    schedule and the polish. `SlackswapSettings` and `OptimalSettings` extend it (so `max_tries=...` is an
    option of either planner)."""

    max_tries: int = 8
    """Candidates `recompute_until_fits` tries at each step, cheapest per byte first, before it
    takes the first one whose chain pulls evicted inputs back into a new overflow."""

    prefetch_margin: float = 0.10
    """Prefetches are pinned this share of their copy time before the just-in-time point
    (`prefetch_points`; optimal's memory windows assume the same), to absorb what the static
    picture leaves out: stalls elsewhere, the duplex derate."""

    polish_work_ops: int | None = None
    """The allowance of the last pass, `polish.polish` (moves judged by the simulator), in
    op-visits; None: its default (about 0.4 s on the Llama-7B sample); 0 turns it off."""

    def _check_ranges(self) -> None:
        self._require(self.max_tries >= 1, "max_tries", "at least 1")
        self._require(0 <= self.prefetch_margin <= 10, "prefetch_margin", "between 0 and 10")
        self._require(self.polish_work_ops is None or self.polish_work_ops >= 0,
                      "polish_work_ops", "at least 0, or None")


@dataclass
class PlannerOutput:
    """What a planner returns: a decision per candidate, and notes for the user."""
    decisions: list[Decision]
    notes: tuple[str, ...] = ()


@dataclass
class CostModel:
    """The planners' cost model: static arrays of one profile on one hardware (see the module
    docstring; not the user's network)."""
    prof: Profile
    hw: HardwareSpec
    n: int
    nf: int
    op_us: np.ndarray
    t_start: np.ndarray
    t_end: np.ndarray
    cands: list[int]                 # candidate tensor ids (saved activation roots)
    index: dict[int, int]            # tensor id -> candidate index
    size: np.ndarray
    p: np.ndarray
    lf: np.ndarray
    fb: np.ndarray
    lu: np.ndarray
    recomputable: np.ndarray         # the tensor itself may be recomputed (not a random op's output)
    d2h_us: np.ndarray
    h2d_us: np.ndarray
    live_keep: np.ndarray            # keep-all live bytes per op
    base: np.ndarray                 # floor memory per op (every candidate evicted)
    layer: list[int | None] = field(default_factory=list)   # repeated-block index of each candidate
    swappable: np.ndarray = field(default_factory=lambda: np.ones(0, dtype=bool))  # may be
    #                                swapped (False: `no_swap`, what the compiled path cannot offload)
    no_recompute: frozenset = frozenset()   # candidate ids whose chain is barred (`build_chains`)
    chains: "Chains | None" = field(default=None, repr=False)  # `build_chains`' result, once made

    @property
    def forward_end_us(self) -> float:
        return float(self.t_end[self.nf - 1]) if self.nf else 0.0

    @property
    def ideal_us(self) -> float:
        return float(self.t_end[-1]) if self.n else 0.0



def build_cost_model(prof: Profile, hw: HardwareSpec, no_swap=(), no_recompute=()) -> CostModel:
    """The static arrays of `prof` on `hw`; `no_swap`, `no_recompute`: candidate ids that may
    not be swapped, recomputed (`compile_limits`: the compiled path cannot)."""
    n, nf = len(prof.ops), prof.n_forward
    op_us = np.array([op.time_us for op in prof.ops], dtype=np.float64)
    t_end = np.cumsum(op_us)
    t_start = t_end - op_us
    cands = [t.id for t in prof.saved_activations]
    index = {tid: c for c, tid in enumerate(cands)}
    last_use = prof.last_use
    size = np.array([prof.tensors[t].size_bytes for t in cands], dtype=np.int64)
    p = np.array([prof.tensors[t].producer for t in cands], dtype=np.int64)
    lf = np.array([prof.last_forward_use(t) for t in cands], dtype=np.int64)
    fb = np.array([prof.first_backward_use(t) for t in cands], dtype=np.int64)
    lu = np.array([last_use[t] for t in cands], dtype=np.int64)
    rec = np.array([prof.tensors[t].recomputable for t in cands], dtype=bool)
    d2h = np.array([hw.copy_us(int(s), "d2h") for s in size], dtype=np.float64)
    h2d = np.array([hw.copy_us(int(s), "h2d") for s in size], dtype=np.float64)
    live = np.array(prof.live_bytes_per_op, dtype=np.int64)
    # floor: subtract every candidate's gap (a difference array keeps this O(n + candidates))
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, lf + 1, -size)
    np.add.at(delta, fb, size)
    base = live + np.cumsum(delta)[:n]
    layers = op_layer_indices(prof)
    layer = [layers[prof.tensors[t].producer] for t in cands]
    no_swap = set(no_swap)
    swappable = np.array([t not in no_swap for t in cands], dtype=bool)
    return CostModel(prof, hw, n, nf, op_us, t_start, t_end, cands, index, size, p, lf, fb, lu, rec,
                     d2h, h2d, live, base, layer, swappable=swappable,
                     no_recompute=frozenset(no_recompute))


# --------------------------------------------------------------------------------------------
# Recompute chains (static, as the simulator runs them)
# --------------------------------------------------------------------------------------------
@dataclass
class Chains:
    """What recomputing each candidate costs, independent of the other candidates' actions.

    The simulator re-runs a recomputed tensor's producer before its first backward use; an input
    of that op that is a candidate is obtained whatever its action (kept: resident; swapped:
    fetched; recomputed: produced first and then kept until its own last use), so candidates
    never add time to another's chain. Non-saved forward values (dead in backward) are re-run
    as temporaries, recursively; one that cannot be re-run (a random op's output backward does
    not save) makes the chain impossible. So each candidate's chain time is static:

    - `cost[c]`: time of its producer plus the temporaries' producers (INF: impossible),
    - `inputs[c]`: the candidates those ops read (they must be resident when it runs),
    - `temps[c]`: the non-candidate values the chain allocates for a moment (temporaries and
      other outputs); chains run at the same op share them, so memory counts their union,
    - `extra_bytes[c]`: their total size,
    - `siblings[c]`: other candidates from the same producer op (one re-run makes them all).
    """
    cost: np.ndarray
    inputs: list[list[int]]
    extra_bytes: np.ndarray
    temps: list[tuple[int, ...]]
    ops: list[tuple[int, ...]]          # the ops its chain re-runs (producer first)
    siblings: list[list[int]]


def build_chains(m: CostModel) -> Chains:
    """Every candidate's chain under the static view (`chains.candidate_chain`). Made once
    per model and kept on it (read-only: nothing changes a chain once it is made)."""
    if m.chains is not None:
        return m.chains
    prof = m.prof
    tab = chain_tables(prof)
    n = len(m.cands)
    cost = np.full(n, INF)
    extra = np.zeros(n, dtype=np.int64)
    inputs: list[list[int]] = [[] for _ in range(n)]
    temps: list[tuple[int, ...]] = [() for _ in range(n)]
    chain_ops: list[tuple[int, ...]] = [() for _ in range(n)]
    by_op: dict[int, list[int]] = {}
    for c in range(n):
        by_op.setdefault(int(m.p[c]), []).append(c)
    siblings = [[x for x in by_op[int(m.p[c])] if x != c] for c in range(n)]
    for c, tid in enumerate(m.cands):
        ch = candidate_chain(tab, tid)
        if ch is None or tid in m.no_recompute:
            continue
        cost[c] = float(sum(m.op_us[o] for o in ch.ops))
        temps[c] = ch.temps
        chain_ops[c] = ch.ops
        extra[c] = sum(prof.tensors[t].size_bytes for t in ch.temps)
        # inputs already back when c is needed (their first backward use came first) add nothing
        ins = (m.index[x] for x in ch.inputs)
        inputs[c] = sorted(x for x in ins if not (m.fb[x] <= m.fb[c] <= m.lu[x]))
    m.chains = Chains(cost, inputs, extra, temps, chain_ops, siblings)
    return m.chains


# --------------------------------------------------------------------------------------------
# Plans in progress
# --------------------------------------------------------------------------------------------
class State:
    """Actions of all candidates, and when each evicted one is needed back in backward.

    `need[c]` is the first backward op at which c must be resident: its first backward use, or
    earlier when a recomputed candidate's chain reads it (the simulator then produces or
    fetches it for that chain and keeps it). For a kept candidate it is where it would be
    needed if it were evicted.
    """

    def __init__(self, m: CostModel, actions: list[Action] | None = None,
                 chains: Chains | None = None):
        self.m = m
        self.ch = chains if chains is not None else build_chains(m)
        self.actions = list(actions) if actions else [KEEP] * len(m.cands)
        self.cost = self.ch.cost
        self.extra_bytes = self.ch.extra_bytes
        self.code = np.array([ACTION_CODES[a] for a in self.actions], dtype=np.int8)
        self.sib_rec = np.zeros(len(m.cands), dtype=np.int64)   # recomputed siblings
        for c, a in enumerate(self.actions):
            if a == RECOMPUTE:
                for x in self.ch.siblings[c]:
                    self.sib_rec[x] += 1
        self.refresh_need()

    def refresh_need(self) -> None:
        m, ch = self.m, self.ch
        need = m.fb.copy()
        # readers are produced after what they read: settle them first (decreasing producer)
        order = np.argsort(-m.p, kind="stable")
        for y in order:
            if self.actions[y] != RECOMPUTE:
                continue
            ny = need[y]
            for s in ch.siblings[y]:
                if self.actions[s] == RECOMPUTE and need[s] < ny:
                    ny = need[s]
            need[y] = ny
            for x in ch.inputs[y]:
                if ny < need[x]:
                    need[x] = ny
        self.need = need

    def _lower_need(self, c: int, at: int) -> None:
        """c's chain now runs at `at`: its inputs are needed by then (recursively)."""
        stack = [(c, at)]
        while stack:
            y, t = stack.pop()
            for x in self.ch.inputs[y]:
                if t < self.need[x]:
                    self.need[x] = t
                    if self.actions[x] == RECOMPUTE:
                        stack.append((x, t))

    def set(self, c: int, action: Action, refresh: bool = True,
            need_before: np.ndarray | None = None) -> None:
        """Change c's action. Leaving "recompute" moves inputs' needs later: `refresh=False`
        defers that (needs stay early, which only overstates memory) and `need_before`
        restores a saved copy instead (undoing a recompute just tried)."""
        old = self.actions[c]
        if old == action:
            return
        self.actions[c] = action
        self.code[c] = ACTION_CODES[action]
        if RECOMPUTE in (old, action):
            d = 1 if action == RECOMPUTE else -1
            for x in self.ch.siblings[c]:
                self.sib_rec[x] += d
        if action == RECOMPUTE and old != RECOMPUTE:
            at = int(self.need[c])
            for s in self.ch.siblings[c]:
                if self.actions[s] == RECOMPUTE:
                    at = min(at, int(self.need[s]))
            self.need[c] = at
            self._lower_need(c, at)
        elif old == RECOMPUTE:
            if need_before is not None:
                self.need = need_before.copy()
            elif refresh:
                self.refresh_need()

    def marginal_costs(self, idx: np.ndarray) -> np.ndarray:
        """Recompute time evicting each of `idx` adds: its chain, or nothing when a sibling
        already re-runs their producer."""
        return np.where(self.sib_rec[idx] > 0, 0.0, self.cost[idx])

    def decisions(self, prefetch_at: dict[int, int] | None = None) -> list[Decision]:
        pf = prefetch_at or {}
        return [Decision(tensor=tid, action=a, prefetch_at=pf.get(c) if a == SWAP else None)
                for c, (tid, a) in enumerate(zip(self.m.cands, self.actions))]

    def recompute_us(self) -> float:
        ops_done: set[int] = set()
        total = 0.0
        for c, a in enumerate(self.actions):
            if a == RECOMPUTE and int(self.m.p[c]) not in ops_done:
                ops_done.add(int(self.m.p[c]))
                total += float(self.cost[c])
        return total


# --------------------------------------------------------------------------------------------
# Copies: the FIFO schedules and the slack ledger
# --------------------------------------------------------------------------------------------
@dataclass
class CopySchedule:
    offload_done_op: dict[int, int]      # candidate -> op at whose end its D2H copy is done
    prefetch_op: dict[int, int]          # candidate -> op at whose start its H2D copy starts
    exposed_us: float                    # copy time the FIFOs could not hide (estimate)


def d2h_fifo(m: CostModel, swaps) -> tuple[np.ndarray, np.ndarray]:
    """(swaps in production order, the time each one's D2H copy is done): one FIFO, a copy
    starting when its producer ends or the copy ahead of it is done."""
    sw = np.array(sorted(swaps, key=lambda c: (m.p[c], c)), dtype=np.int64)
    # done_k = max(ready_k, done_{k-1}) + d_k, i.e. a running max of prefix sums
    ready, d = m.t_end[m.p[sw]], m.d2h_us[sw]
    csum = np.cumsum(d)
    return sw, np.maximum.accumulate(ready - (csum - d)) + csum


def h2d_just_in_time(m: CostModel, swaps, need: np.ndarray,
                     margin: float) -> tuple[np.ndarray, np.ndarray]:
    """(swaps latest need first, the time each one's H2D copy starts): one FIFO filled just in
    time, each copy (`margin` of it longer) ending when its tensor is needed or the copy after
    it starts, whichever is earlier."""
    sb = np.array(sorted(swaps, key=lambda c: (-need[c], -c)), dtype=np.int64)
    h = m.h2d_us[sb] * (1.0 + margin)
    hs = np.cumsum(h)
    # start_k = min(deadline_k, start_{k-1}) - h_k = min_{j<=k}(deadline_j + hs_j - h_j) - hs_k
    return sb, np.minimum.accumulate(m.t_start[need[sb]] + hs - h) - hs


def copy_schedule(m: CostModel, swaps: list[int], need: np.ndarray | None = None,
                  margin: float = 0.0) -> CopySchedule:
    """FIFO D2H in production order, just-in-time H2D in order of need, on the ideal timeline.

    `margin` (a fraction) issues each prefetch that much of its copy time earlier, to absorb
    what the static picture leaves out (stalls elsewhere, the duplex derate).
    """
    need = m.fb if need is None else need
    if not swaps:
        return CopySchedule({}, {}, 0.0)
    sw, done = d2h_fifo(m, swaps)
    done_ops = np.searchsorted(m.t_end, done - 1e-9, side="right")
    done_ops = np.maximum(np.minimum(done_ops, m.n - 1), m.lf[sw])
    done_op = dict(zip(sw.tolist(), done_ops.tolist()))
    late_d2h = max(0.0, float(done[-1]) - m.forward_end_us)
    t_b0 = m.forward_end_us
    sb, starts = h2d_just_in_time(m, swaps, need, margin)
    pf_ops = np.searchsorted(m.t_end, np.maximum(starts, t_b0), side="right")
    pf_ops = np.maximum(np.minimum(pf_ops, m.n - 1), m.nf)
    pf_op = dict(zip(sb.tolist(), pf_ops.tolist()))
    late_h2d = max(0.0, t_b0 - float(starts.min()))
    return CopySchedule(done_op, pf_op, late_d2h + late_h2d)


def prefetch_points(m: CostModel, state: State, margin: float) -> dict[int, int]:
    """Candidate -> op at which its prefetch is pinned (`Decision.prefetch_at`): the
    just-in-time point of `copy_schedule`, `margin` of the copy time earlier."""
    swaps = [c for c, a in enumerate(state.actions) if a == SWAP]
    if not swaps:
        return {}
    return copy_schedule(m, swaps, state.need, margin=margin).prefetch_op


class SlackLedger:
    """The two slack conditions of the module docstring, kept incrementally; `safety` is the
    share of the slack trusted."""

    def __init__(self, m: CostModel, safety: float):
        self.m = m
        nf, n = m.nf, m.n
        self.safety = safety
        # D2H: copies of everything produced at or after op j must fit in forward time after j
        self.cap_f = safety * (m.forward_end_us - m.t_end[:nf])
        self.dem_f = np.zeros(nf)
        # H2D: copies needed by op j (backward) must fit in backward time before j
        self.cap_b = safety * (m.t_start[nf:] - m.forward_end_us)
        self.dem_b = np.zeros(n - nf)

    def fits(self, c: int, need: int) -> bool:
        m = self.m
        p, j = int(m.p[c]), int(need) - m.nf
        if p >= m.nf or j < 0:
            return False
        if np.min(self.cap_f[:p + 1] - self.dem_f[:p + 1]) < m.d2h_us[c]:
            return False
        return bool(np.min(self.cap_b[j:] - self.dem_b[j:]) >= m.h2d_us[c])

    def add(self, c: int, need: int, sign: float = 1.0) -> None:
        m = self.m
        self.dem_f[:int(m.p[c]) + 1] += sign * m.d2h_us[c]
        self.dem_b[int(need) - m.nf:] += sign * m.h2d_us[c]


# --------------------------------------------------------------------------------------------
# Memory of a plan in the static picture
# --------------------------------------------------------------------------------------------
def memory(m: CostModel, state: State, sched: CopySchedule | None = None) -> np.ndarray:
    """Activation bytes per op for the actions in `state` (see the module docstring)."""
    n = m.n
    delta = np.zeros(n + 2, dtype=np.int64)
    code, need, size = state.code, state.need, m.size
    lo, fb = m.lf + 1, m.fb

    def add(mask, start, stop):
        mask = mask & (stop > start)
        np.add.at(delta, start[mask], size[mask])
        np.add.at(delta, stop[mask], -size[mask])

    add(code == KEEP_CODE, lo, fb)                  # kept: the whole gap
    ev = code != KEEP_CODE
    add(ev, need, fb)                               # evicted, back early for a chain
    sw = np.nonzero(code == SWAP_CODE)[0]
    if len(sw):
        if sched is None:
            sched = copy_schedule(m, sw.tolist(), need)
        done = np.array([sched.offload_done_op[c] for c in sw], dtype=np.int64)
        pf = np.array([sched.prefetch_op[c] for c in sw], dtype=np.int64)
        hi = need[sw]
        tail_end = np.minimum(done + 1, hi)
        head = np.maximum(np.maximum(pf, tail_end), lo[sw])
        for start, stop in ((lo[sw], tail_end), (head, hi)):
            ok = (stop > start) & (hi > lo[sw])
            np.add.at(delta, start[ok], size[sw][ok])
            np.add.at(delta, stop[ok], -size[sw][ok])
    temps_at: dict[int, set[int]] = {}
    for c in np.nonzero(code == RECOMPUTE_CODE)[0]: # recompute: chain temporaries, a moment
        if state.ch.temps[c] and lo[c] < need[c]:
            temps_at.setdefault(int(need[c]), set()).update(state.ch.temps[c])
    tensors = m.prof.tensors
    for at, ts in temps_at.items():
        e = sum(tensors[t].size_bytes for t in ts)
        delta[at] += e
        delta[at + 1] -= e
    return m.base + np.cumsum(delta)[:n]


# --------------------------------------------------------------------------------------------
# The recompute greedy shared by slackswap, optimal's repair and recompute-only
# --------------------------------------------------------------------------------------------
def _apply_recompute(m: CostModel, state: State, c: int, mem: np.ndarray,
                     temps_seen: dict[int, set[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Recompute c; return the updated memory and the ops where evicted inputs came back early."""
    mem = mem.copy()
    before = state.need.copy()
    state.set(c, RECOMPUTE)
    hi = int(state.need[c])
    mem[int(m.lf[c]) + 1:hi] -= m.size[c]
    if state.ch.temps[c] and hi < m.n:
        seen = temps_seen.get(hi, set())
        mem[hi] += sum(m.prof.tensors[t].size_bytes for t in state.ch.temps[c] if t not in seen)
    pulled = []
    for x in np.nonzero(state.need < before)[0]:     # evicted inputs now needed earlier
        if state.actions[x] != KEEP and x != c:
            lo, up = int(state.need[x]), int(before[x])
            mem[lo:up] += m.size[x]
            pulled.append(np.arange(lo, up))
    pulled_ops = np.concatenate(pulled) if pulled else np.zeros(0, dtype=np.int64)
    return mem, pulled_ops


def _note_temps(m: CostModel, state: State, c: int, temps_seen: dict[int, set[int]]) -> None:
    if state.ch.temps[c]:
        temps_seen.setdefault(int(state.need[c]), set()).update(state.ch.temps[c])


def recompute_until_fits(m: CostModel, state: State, budget_bytes: int,
                         mem: np.ndarray, allow: np.ndarray | None = None,
                         max_steps: int | None = None,
                         max_tries: int = StaticSettings.max_tries) -> tuple[np.ndarray, bool]:
    """Recompute kept candidates, cheapest per byte first, where memory exceeds the budget.

    Repeatedly takes the op where memory most exceeds the budget and, among kept candidates live
    across it (and `allow`), recomputes the one with the least added recompute time per byte.
    Only tensors live at an over-budget moment are evicted. Memory is updated incrementally
    (the freed gap, the chain's temporaries, inputs the chain pulls back early) and recomputed
    exactly every so often. `max_tries`: `StaticSettings.max_tries`. Returns (memory, fits).
    """
    mem = mem.copy()
    allow = np.ones(len(m.cands), dtype=bool) if allow is None else allow
    finite = np.isfinite(state.cost)
    steps = 0
    limit = max_steps if max_steps is not None else 4 * len(m.cands) + 10
    temps_seen: dict[int, set[int]] = {}
    for c, act in enumerate(state.actions):
        if act == RECOMPUTE:
            temps_seen.setdefault(int(state.need[c]), set()).update(state.ch.temps[c])
    while steps < limit:
        steps += 1
        i = int(np.argmax(mem))
        if mem[i] <= budget_bytes:
            mem = memory(m, state)             # exact, then confirm
            i = int(np.argmax(mem))
            if mem[i] <= budget_bytes:
                return mem, True
        # target the tightest over-budget op: the least coverable bytes beyond its excess
        # (an op that only a few tensors can relieve goes first, so cheap picks elsewhere do
        # not use up the options it needs)
        free_ok = (state.code == KEEP_CODE) & allow & finite
        lo = m.lf[free_ok] + 1
        hi = state.need[free_ok]
        ok = hi > lo
        cap = np.zeros(m.n + 1, dtype=np.int64)
        np.add.at(cap, lo[ok], m.size[free_ok][ok])
        np.add.at(cap, hi[ok], -m.size[free_ok][ok])
        cap = np.cumsum(cap)[:m.n]
        over = mem > budget_bytes
        excess = mem - budget_bytes
        room = np.where(over, cap - excess, np.iinfo(np.int64).max)
        tight = np.nonzero(room == room.min())[0]
        i = int(tight[np.argmax(excess[tight])])
        cover = free_ok & (m.lf < i) & (state.need > i)
        if not cover.any():
            return mem, False
        idx = np.nonzero(cover)[0]
        # cost per byte of the excess it removes: near the end a small tensor that just covers
        # the excess beats a big one that is cheaper per byte but frees more than needed
        per_byte = state.marginal_costs(idx) / np.maximum(np.minimum(m.size[idx], excess[i]), 1)
        # a total order (ties by candidate index), so no sort or selection algorithm, whatever
        # numpy's CPU dispatch picks, can choose differently among equal prices
        order = idx[np.lexsort((idx, per_byte))]
        fallback = None
        for c in order[:max_tries]:
            c = int(c)
            need_before = state.need.copy()
            new_mem, pulled = _apply_recompute(m, state, c, mem, temps_seen)
            # a chain that pulls evicted inputs back early must not open a new overflow there
            if len(pulled) == 0 or int(new_mem[pulled].max()) <= budget_bytes:
                mem = new_mem
                _note_temps(m, state, c, temps_seen)
                fallback = None
                break
            if fallback is None:
                fallback = c
            state.set(c, KEEP, need_before=need_before)
        else:
            if fallback is None:
                return memory(m, state), False
            mem, _ = _apply_recompute(m, state, fallback, mem, temps_seen)
            _note_temps(m, state, fallback, temps_seen)
    mem = memory(m, state)
    return mem, bool(mem.max(initial=0) <= budget_bytes)
