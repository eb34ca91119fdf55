"""`optimal`: the same choices as a mixed-integer program, solved by HiGHS (highspy).

It exists to measure how far `slackswap` is from the best plan. What it models, exactly:

- **Choices.** For each saved activation root c: swap `w_c`, recompute `r_c` (binaries,
  `w_c + r_c <= 1`; keep otherwise). Outputs of random ops and tensors whose recompute chain
  hits a value nobody kept have `r_c = 0`.
- **Memory at every op that can exceed the budget**, in the static picture of `common`:
  keep-all bytes minus, for a swap, its size over its gap except the offload tail and the
  just-in-time prefetch head, and for a recompute,
  its size over its gap plus the chain's temporaries at its first backward use. Ops where
  the keep-all memory is under the budget are skipped; of ops with identical coefficients only
  the one with the most memory is kept (that row dominates the others).
- **Objective** = recompute time + exposed copy time. Recompute time is each candidate's chain
  (its producer plus the non-saved temporaries it needs, `common.build_chains`), paid once per
  producer op (a multi-output op re-run once makes all its outputs). Other candidates read by a
  chain are obtained whatever their action (the simulator fetches or recomputes them first), so
  they add no time. Exposed copy time is what the FIFOs cannot hide: one variable per
  direction bounds the excess of the D2H copies of everything produced from op j on over the
  forward time left after j, and of the H2D copies needed by backward op j over the backward
  time before it (the FIFO's delay).
- **Queueing in the windows.** A swap's offload tail and prefetch head are as long as its
  copy waits in the FIFOs behind the fallback plan's swaps (`_queued_windows`: slackswap's
  plan is made first). When the MILP's plan still overflows in the static model because its
  own copies queue longer, the windows are widened to its queue and the MILP solved again
  (`_solve_in_rounds`, while time is left; windows only widen).
- **Spill the simulator hides.** `eF` charges offloads that run past the end of forward,
  although the simulator pays for them only when memory or a prefetch waits on them. When a
  round's plan fits the static model, spills past forward's end and simulates without any
  stall, the next round does not charge that much spill (`free_spill_us`), its windows widen
  to that plan's queue, and HiGHS starts from that plan (a MIP start, so the round ends no
  worse than it in the model): a spill nothing waits on is charged by the first round only
  (docs/planning.md, 'Inside the planners', has the Llama-7B case).
- **Not modelled**: stalls that shift later ops, the duplex derate, the delay a swap adds to
  the copies queued behind it, and chains pulling evicted inputs back early (their memory).
  A plan that still overflows is repaired in the static model of `common` (extra recompute)
  and the simulator judges it; notes give the MILP's objective, its proven lower bound (on
  this model, not on the simulator: a plan can beat it) and gap, and how far the simulation
  of the MILP's own plan is from its objective (the model's error on that plan: column "MILP
  error" of `benchmarks/results/local_search.md`; a time limit can cut off the round that
  would stop charging a spill).
  The MILP's plan then gets
  slackswap's last pass, `polish` (moves of one or two
  decisions the simulator judges better). When the MILP has no answer in time, or the
  fallback planner's plan (slackswap's: the registry in `planners` passes it) simulates
  better than the repaired and polished MILP plan, that plan is returned (the notes say so),
  so `optimal` never simulates below `slackswap`. The
  bound that holds for every plan the simulator accepts is `bound.sound_bound`, an LP
  relaxation of the simulator's rules; `plan` computes it first and reports it in the notes
  ("sound bound: ...").

**Repeated layers.** Transformer blocks repeat: when the profile has more than
`untie_limit` candidates, candidates at the same position of identical blocks share one
variable within a group of consecutive blocks (the last two blocks each form their own group,
the rest split into up to `groups` chunks). The bound is then the bound of this tied model.

Limits and tuning are the fields of `OptimalSettings`.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable

import highspy
import numpy as np
from scipy.optimize import LinearConstraint
from scipy.sparse import coo_matrix

from ..hardware import HardwareSpec
from ..schema import Profile
from ..simulate import simulate
from .bound import run_quietly, sound_bound
from .common import (
    KEEP,
    RECOMPUTE,
    SWAP,
    CostModel,
    PlannerOutput,
    State,
    StaticSettings,
    build_chains,
    build_cost_model,
    d2h_fifo,
    h2d_just_in_time,
    memory,
    prefetch_points,
    recompute_until_fits,
)
from .polish import polish


@dataclass(frozen=True)
class OptimalSettings(StaticSettings):
    """The `optimal` planner's limits and tuning (and `StaticSettings`': `max_tries` for the
    repair, `prefetch_margin` for the memory windows and the prefetch points)."""

    time_limit_s: float = 60.0
    """Seconds the whole planner may take: sound bound, fallback plan, MILP, repair."""

    node_limit: int | None = 20_000
    """Branch-and-bound nodes HiGHS may explore: a deterministic cap on the search (the time
    limit is not). None: no cap."""

    untie_limit: int = 900
    """Profiles with more candidates than this tie identical blocks (module docstring)."""

    groups: int = 6
    """Groups of consecutive tied blocks, besides the last two blocks (each its own group)."""

    bound_share: float = 0.5
    """At most this share of the time limit goes to the sound bound (the Llama-7B sample at
    0.3 takes about 20 s)."""

    reserve_s: float = 2.0
    """Seconds kept back for the repair, the prefetch points and the simulations (at least;
    see `reserve_share`)."""

    reserve_share: float = 0.08
    """Share of the time limit kept back when that is more than `reserve_s`."""

    soft_share: float = 0.7
    """HiGHS's own time limit, as a share of the MILP's time: HiGHS checks it only now and
    then, so the solve also runs in a child process that is stopped at the full time."""

    mip_rel_gap: float = 1e-4
    """HiGHS stops when its incumbent is proven within this relative gap."""

    max_rounds: int = 3
    """MILP solves at most: a round after the first widens the memory windows of the last
    plan's swaps to their queued copies (`_solve_in_rounds`)."""

    max_slack_rows: int = 300
    """Positions sampled for each direction's slack rows (evenly, when there are more)."""

    start_from_fallback: bool = False
    """Give HiGHS the fallback planner's plan as its first incumbent (a MIP start). Later
    rounds always start from the round before's plan."""

    def _check_ranges(self) -> None:
        super()._check_ranges()
        self._require(self.time_limit_s > 0, "time_limit_s", "above 0")
        self._require(self.node_limit is None or self.node_limit >= 1, "node_limit",
                      "at least 1, or None")
        self._require(self.untie_limit >= 0, "untie_limit", "at least 0")
        self._require(self.groups >= 1, "groups", "at least 1")
        for name in ("bound_share", "reserve_share"):
            self._require(0 <= getattr(self, name) < 1, name, "at least 0 and below 1")
        self._require(self.reserve_s >= 0, "reserve_s", "at least 0")
        self._require(0 < self.soft_share <= 1, "soft_share", "above 0 and at most 1")
        self._require(0 <= self.mip_rel_gap < 1, "mip_rel_gap", "at least 0 and below 1")
        self._require(self.max_slack_rows >= 2, "max_slack_rows", "at least 2")
        self._require(self.max_rounds >= 1, "max_rounds", "at least 1")


class _Stopped:
    """What the solve returns when it had to be stopped (no solution, no bound)."""
    x = None
    fun = None
    mip_dual_bound = None

    def __init__(self, message: str):
        self.message = message


def _windows(m: CostModel, prefetch_margin: float):
    """Offload-tail end and prefetch-head start (op ids) of each candidate, no queueing."""
    c_all = np.arange(len(m.cands))
    done_t = m.t_end[m.p] + m.d2h_us
    tail_end = np.searchsorted(m.t_end, done_t - 1e-9, side="left") + 1   # exclusive
    tail_end = np.maximum(tail_end, m.lf + 1)
    start_t = m.t_start[m.fb] - m.h2d_us * (1 + prefetch_margin)
    head = np.searchsorted(m.t_end, start_t, side="right")
    head = np.maximum(head, m.nf)
    tail_end = np.minimum(tail_end, m.fb)
    head = np.clip(np.maximum(head, tail_end), None, m.fb)
    return tail_end, head, c_all


def _groups(m: CostModel, untie_limit: int, groups: int) -> tuple[np.ndarray, int, str]:
    """Variable index of each candidate (tied across identical blocks when large)."""
    n = len(m.cands)
    if n <= untie_limit:
        return np.arange(n), n, "untied"
    by_layer: dict[int, list[int]] = defaultdict(list)
    for c, layer in enumerate(m.layer):
        if layer is not None:
            by_layer[layer].append(c)
    prof = m.prof

    def sig(cs):
        return tuple((int(m.size[c]), prof.ops[int(m.p[c])].target, bool(m.recomputable[c]))
                     for c in cs)
    layers = sorted(by_layer)
    sigs = {layer: sig(by_layer[layer]) for layer in layers}
    common_sig = max(set(sigs.values()), key=lambda s: sum(v == s for v in sigs.values()),
                     default=None)
    tied_layers = [layer for layer in layers if sigs[layer] == common_sig]
    if len(tied_layers) < 4:
        return np.arange(n), n, "untied (no repeated blocks)"
    # groups of consecutive tied blocks; the last two alone (they feed backward at once)
    head, tail = tied_layers[:-2], tied_layers[-2:]
    k = max(1, min(groups, len(head)))
    chunks = [list(a) for a in np.array_split(head, k) if len(a)] + [[t] for t in tail]
    var = np.full(n, -1)
    nv = 0
    for chunk in chunks:
        width = len(common_sig)
        for pos in range(width):
            for layer in chunk:
                var[by_layer[layer][pos]] = nv + pos
        nv += width
    for c in range(n):
        if var[c] < 0:
            var[c] = nv
            nv += 1
    return var, nv, f"tied: {len(tied_layers)} identical blocks in {len(chunks)} groups"


class _Layout:
    """The MILP's variables: [w (nv), r (nv), y (ny), eF, eB] (module docstring).

    `var[c]`: the variable index of candidate c (tied candidates share one); `ypos[k]`: the
    producer-run variable of the variable k of a multi-output op's first output (`lead`).
    """

    def __init__(self, m: CostModel, ch, var: np.ndarray, nv: int):
        n = len(m.cands)
        self.var, self.nv = var, nv
        self.rec_ok = np.isfinite(ch.cost)
        # one re-run of a multi-output producer makes all its outputs: its time is paid once,
        # through a variable y >= r of every sibling (keyed by the variable of the first sibling)
        self.lead = [min([c, *ch.siblings[c]]) for c in range(n)]
        ykeys = sorted({int(var[self.lead[c]]) for c in range(n) if self.rec_ok[c]})
        self.ypos = {k: j for j, k in enumerate(ykeys)}
        self.ny = ny = len(ykeys)
        self.N = 2 * nv + ny + 2
        self.iw, self.ir, self.iy = 0, nv, 2 * nv
        self.ieF, self.ieB = 2 * nv + ny, 2 * nv + ny + 1

    def objective(self, ch) -> np.ndarray:
        """Recompute time (once per producer run) plus the exposed copy time of each FIFO."""
        cost = np.zeros(self.N)
        chain_us = np.where(self.rec_ok, ch.cost, 0.0)
        for c in range(len(self.lead)):
            if self.rec_ok[c] and self.lead[c] == c:
                cost[self.iy + self.ypos[int(self.var[c])]] += chain_us[c]
        cost[self.ieF] = cost[self.ieB] = 1.0
        return cost

    def upper_bounds(self) -> np.ndarray:
        ub = np.ones(self.N)
        ub[self.ieF] = ub[self.ieB] = np.inf
        r_all_ok = np.ones(self.nv, dtype=bool)
        np.logical_and.at(r_all_ok, self.var, self.rec_ok)
        ub[self.ir:self.ir + self.nv] = r_all_ok.astype(float)   # a tied group recomputes
        return ub                                                 # only if all members can

    def integrality(self) -> np.ndarray:
        integrality = np.ones(self.N)
        integrality[self.ieF] = integrality[self.ieB] = 0
        integrality[self.iy:self.iy + self.ny] = 0   # y is integral at any optimum (it only pays)
        return integrality

    def values(self, actions: list) -> np.ndarray:
        """The integer variables of a plan (a MIP start); in a tied group the first
        candidate's action stands for the group."""
        x = np.zeros(self.N)
        done = set()
        for c, a in enumerate(actions):
            k = int(self.var[c])
            if k in done:
                continue
            done.add(k)
            if a == SWAP:
                x[self.iw + k] = 1.0
            elif a == RECOMPUTE and self.rec_ok[c]:
                x[self.ir + k] = 1.0
        for c in range(len(self.lead)):
            if self.rec_ok[c] and x[self.ir + self.var[c]]:
                x[self.iy + self.ypos[int(self.var[self.lead[c]])]] = 1.0
        return x

    def actions(self, x: np.ndarray) -> list:
        """Each candidate's action in a (rounded) solution."""
        out = []
        for c in range(len(self.lead)):
            if x[self.iw + self.var[c]]:
                out.append(SWAP)
            elif x[self.ir + self.var[c]] and self.rec_ok[c]:
                out.append(RECOMPUTE)
            else:
                out.append(KEEP)
        return out


class _Rows:
    """Constraint rows `lo <= A x <= hi`, added in blocks as COO triplets."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []
        self.n = 0

    def add(self, r_idx, c_idx, v, lo, hi) -> None:
        self.rows.append(np.asarray(r_idx) + self.n)
        self.cols.append(np.asarray(c_idx))
        self.vals.append(np.asarray(v, dtype=float))
        self.lo.append(np.asarray(lo, dtype=float))
        self.hi.append(np.asarray(hi, dtype=float))
        self.n += len(lo)

    def constraint(self, n_vars: int):
        A = coo_matrix((np.concatenate(self.vals),
                        (np.concatenate(self.rows), np.concatenate(self.cols))),
                       shape=(self.n, n_vars)).tocsr()
        return LinearConstraint(A, np.concatenate(self.lo), np.concatenate(self.hi))


def _choice_rows(rows: _Rows, lay: _Layout) -> None:
    """y_lead >= r_c for every recomputable candidate c, and w + r <= 1."""
    var, n = lay.var, len(lay.lead)
    pairs = sorted({(lay.ypos[int(var[lay.lead[c]])], int(var[c]))
                    for c in range(n) if lay.rec_ok[c]})
    if pairs:
        py = np.array([a for a, _ in pairs])
        pr = np.array([b for _, b in pairs])
        idx = np.arange(len(pairs))
        rows.add(np.r_[idx, idx], np.r_[lay.iy + py, lay.ir + pr],
                 np.r_[np.ones(len(pairs)), -np.ones(len(pairs))],
                 np.zeros(len(pairs)), np.full(len(pairs), np.inf))
    nv = lay.nv
    rows.add(np.r_[np.arange(nv), np.arange(nv)],
             np.r_[lay.iw + np.arange(nv), lay.ir + np.arange(nv)],
             np.ones(2 * nv), np.zeros(nv), np.ones(nv))


def _memory_ops(m: CostModel, budget_bytes: int, tail_end: np.ndarray,
                head: np.ndarray) -> np.ndarray:
    """The ops that get a memory row: between consecutive events (a gap, tail or head
    starting or ending), the over-budget op with the most keep-all memory (it dominates)."""
    over = m.live_keep > budget_bytes
    events = np.unique(np.r_[0, m.lf + 1, m.fb, m.fb + 1, tail_end, head, m.nf])
    events = events[(events >= 0) & (events < m.n)]
    run_max = np.maximum.reduceat(np.where(over, m.live_keep, -1), events)
    keep_runs = run_max > budget_bytes
    sel = []
    for start, stop_ok in zip(events[keep_runs], np.nonzero(keep_runs)[0]):
        end = events[stop_ok + 1] if stop_ok + 1 < len(events) else m.n
        seg = np.where(over[start:end], m.live_keep[start:end], -1)
        sel.append(start + int(np.argmax(seg)))
    return np.array(sorted(set(sel)), dtype=np.int64)


def _memory_rows(rows: _Rows, m: CostModel, budget_bytes: int, lay: _Layout, sel: np.ndarray,
                 tail_end: np.ndarray, head: np.ndarray, extra: np.ndarray) -> None:
    """live_keep[i] - savings <= budget at each op of `sel`: a recompute saves its size over
    its gap (its chain's temporaries cost `extra` at its first backward use), a swap its size
    outside the offload tail and the prefetch head."""
    if not len(sel):
        return
    r_i, c_i, v_i = [], [], []
    iw, ir, var = lay.iw, lay.ir, lay.var
    lo_gap, hi_gap = m.lf + 1, m.fb
    for c in range(len(m.cands)):
        s = float(m.size[c])
        a = np.searchsorted(sel, lo_gap[c])
        b = np.searchsorted(sel, hi_gap[c])
        if b > a:
            r_i.append(np.arange(a, b))
            c_i.append(np.full(b - a, ir + var[c]))
            v_i.append(np.full(b - a, -s))
            lo_s = max(a, np.searchsorted(sel, tail_end[c]))
            hi_s = min(b, np.searchsorted(sel, head[c]))
            if hi_s > lo_s:
                r_i.append(np.arange(lo_s, hi_s))
                c_i.append(np.full(hi_s - lo_s, iw + var[c]))
                v_i.append(np.full(hi_s - lo_s, -s))
        if extra[c]:
            j = np.searchsorted(sel, m.fb[c])
            if j < len(sel) and sel[j] == m.fb[c]:
                r_i.append(np.array([j]))
                c_i.append(np.array([ir + var[c]]))
                v_i.append(np.array([float(extra[c])]))
    if r_i:
        rows.add(np.concatenate(r_i), np.concatenate(c_i), np.concatenate(v_i),
                 np.full(len(sel), -np.inf), budget_bytes - m.live_keep[sel].astype(float))


def _sampled(pos: np.ndarray, max_rows: int) -> np.ndarray:
    if len(pos) > max_rows:
        return pos[np.linspace(0, len(pos) - 1, max_rows).astype(int)]
    return pos


def _slack_rows(rows: _Rows, m: CostModel, lay: _Layout, max_rows: int,
                free_spill_us: float = 0.0) -> None:
    """The FIFOs' exposed time: eF bounds how far the D2H copies of everything produced from
    op j on exceed the forward time left after j; eB how far the H2D copies needed by
    backward op j exceed the backward time before j (at most `max_rows` positions each)."""
    n, iw, var = len(m.cands), lay.iw, lay.var
    pos_f = _sampled(np.unique(m.p[m.p < m.nf]), max_rows)
    if len(pos_f):
        L = len(pos_f)
        r_i, c_i, v_i = [], [], []
        for c in range(n):
            k = np.searchsorted(pos_f, m.p[c], side="right")  # rows j with pos_f[j] <= p_c
            r_i.append(np.arange(k))
            c_i.append(np.full(k, iw + var[c]))
            v_i.append(np.full(k, m.d2h_us[c]))
        r_i.append(np.arange(L)); c_i.append(np.full(L, lay.ieF)); v_i.append(-np.ones(L))
        rows.add(np.concatenate(r_i), np.concatenate(c_i), np.concatenate(v_i),
                 np.full(L, -np.inf), m.forward_end_us + free_spill_us - m.t_end[pos_f])
    pos_b = _sampled(np.unique(m.fb), max_rows)
    if len(pos_b):
        L = len(pos_b)
        r_i, c_i, v_i = [], [], []
        for c in range(n):
            k = np.searchsorted(pos_b, m.fb[c], side="left")   # rows j with pos_b[j] >= fb_c
            r_i.append(np.arange(k, L))
            c_i.append(np.full(L - k, iw + var[c]))
            v_i.append(np.full(L - k, m.h2d_us[c]))
        r_i.append(np.arange(L)); c_i.append(np.full(L, lay.ieB)); v_i.append(-np.ones(L))
        rows.add(np.concatenate(r_i), np.concatenate(c_i), np.concatenate(v_i),
                 np.full(L, -np.inf), m.t_start[pos_b] - m.forward_end_us)


class _Solved:
    """What `_run_highs` returns (scipy.optimize.milp's fields that `solve` reads)."""

    def __init__(self, x, fun, mip_dual_bound, message):
        self.x, self.fun, self.mip_dual_bound, self.message = x, fun, mip_dual_bound, message


def _run_highs(lay: _Layout, cost: np.ndarray, constraint, left: float,
               settings: OptimalSettings, fork: bool, start: np.ndarray | None = None):
    """HiGHS (highspy) on the MILP, with `left` seconds (see `solve`); `_Stopped` when stopped.
    `start`: the integer variables' values of a plan HiGHS begins from (a MIP start: it
    completes the continuous ones itself, and ignores a start its model refuses)."""
    res = run_quietly(_highs, dict(lay=lay, cost=cost, constraint=constraint,
                                   time_limit=max(0.1, settings.soft_share * left),
                                   settings=settings, start=start),
                      max(0.1, left) if fork else None)
    return res if res is not None else _Stopped(f"stopped after the time limit ({left:.1f} s)")


def _highs(lay: _Layout, cost: np.ndarray, constraint, time_limit: float,
           settings: OptimalSettings, start: np.ndarray | None) -> _Solved:
    A = constraint.A.tocsr()
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = lay.N, A.shape[0]
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(lay.N)
    lp.col_upper_ = np.clip(lay.upper_bounds(), None, inf)
    lp.row_lower_ = np.clip(constraint.lb, -inf, None)
    lp.row_upper_ = np.clip(constraint.ub, None, inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = lay.N, A.shape[0]
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in lay.integrality()]
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(settings.mip_rel_gap))
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("threads", 1)
    if settings.node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(settings.node_limit))
    h.passModel(lp)
    if start is not None:
        idx = np.nonzero(lay.integrality())[0].astype(np.int32)
        h.setSolution(len(idx), idx, np.asarray(start, dtype=np.float64)[idx])
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    message = f"{h.modelStatusToString(status)}"
    has_x = info.primal_solution_status == 2        # a feasible solution
    x = np.asarray(h.getSolution().col_value) if has_x else None
    fun = float(info.objective_function_value) if has_x else None
    bound = float(info.mip_dual_bound)
    if not has_x and not bound > 0:
        bound = None        # stopped before its first LP: only the trivial bound 0
    return _Solved(x, fun, bound, message)


def _bound_note(m: CostModel, res) -> str | None:
    """The MILP's objective and proven lower bound as notes (None: no finite bound)."""
    bound = getattr(res, "mip_dual_bound", None)
    if bound is None or not np.isfinite(bound):
        return None
    ideal = m.ideal_us
    at_most = (f"retention at most {ideal / (ideal + max(bound, 0.0)):.4f} in this model "
               "(not a bound on plans)")
    if res.x is None:
        return f"MILP proven lower bound {bound:.1f} us of overhead: {at_most}"
    obj = float(res.fun)
    gap = (obj - bound) / obj if obj > 0 else 0.0
    return (f"MILP objective {obj:.1f} us of overhead, proven lower bound {bound:.1f} us "
            f"(gap {100 * gap:.2f}%): {at_most}")


def solve(m: CostModel, budget_bytes: int, settings: OptimalSettings = OptimalSettings(),
          fork: bool = True, windows: tuple[np.ndarray, np.ndarray] | None = None,
          free_spill_us: float = 0.0, start: list | None = None):
    """Build and solve the MILP within `OptimalSettings.time_limit_s` (building included). Returns
    (actions, notes, objective in us of overhead); actions and objective are None when HiGHS
    found no solution. With `fork`, HiGHS runs
    in a child process stopped at the limit (`run_quietly`); without, in this process
    (silenced), stopped only by its own time limit. `windows`: (offload-tail end,
    prefetch-head start) of each candidate, instead of `_windows`' (no queueing)."""
    t_build = time.perf_counter()
    n = len(m.cands)
    if n == 0 or int(m.live_keep.max(initial=0)) <= budget_bytes:
        return [KEEP] * n, ["everything fits: nothing to solve"], 0.0
    var, nv, how = _groups(m, settings.untie_limit, settings.groups)
    tail_end, head = windows if windows is not None else _windows(m, settings.prefetch_margin)[:2]
    ch = build_chains(m)
    lay = _Layout(m, ch, var, nv)
    rows = _Rows()
    _choice_rows(rows, lay)
    sel = _memory_ops(m, budget_bytes, tail_end, head)
    _memory_rows(rows, m, budget_bytes, lay, sel, tail_end, head, ch.extra_bytes)
    _slack_rows(rows, m, lay, settings.max_slack_rows, free_spill_us)
    constraint = rows.constraint(lay.N)
    t0 = time.perf_counter()
    left = float(settings.time_limit_s) - (t0 - t_build)
    res = _run_highs(lay, lay.objective(ch), constraint, left, settings, fork,
                     None if start is None else lay.values(start))
    notes = [f"MILP {how}",
             f"MILP: {nv} choices x 2 binaries, {lay.ny} producer runs, {len(sel)} memory rows, "
             f"{constraint.A.nnz} nonzeros; HiGHS {time.perf_counter() - t0:.1f} s, "
             f"status: {res.message}"]
    bound_note = _bound_note(m, res)
    if res.x is None:
        notes += [bound_note] if bound_note else []
        return None, notes + ["MILP found no solution in time"], None
    notes += [bound_note] if bound_note else []
    return lay.actions(np.round(res.x).astype(int)), notes, float(res.fun)


def bound_retention(profile: Profile, hw: HardwareSpec, budget_bytes: int) -> float | None:
    """The sound bound `plan` computed first (cached on the profile; None when it had no
    time): the registry reports it beside the plan (`plan --json`, `compare`)."""
    return sound_bound(profile, hw, budget_bytes, time_limit_s=0.0).retention


def plan(profile: Profile, hw: HardwareSpec, budget_bytes: int,
         settings: OptimalSettings = OptimalSettings(), *, fallback: Callable):
    """The `optimal` planner: solve the MILP, repair what the static model still finds over,
    and return it unless the `fallback` planner's plan (the registry passes slackswap's)
    simulates better (then that, said in the notes).

    `OptimalSettings.time_limit_s` bounds the whole planner: the sound bound (`bound.py`, at most
    `bound_share` of it), the fallback's plan, the MILP (what is left, less a reserve for the
    repair and the simulations after it). HiGHS runs with a fixed seed on one thread, so two
    runs give the same plan unless the time limit, rather than the gap or `node_limit`, ends
    the search (the notes say which). Profiles with more than `untie_limit` candidates tie
    identical blocks into `groups` groups (see the module docstring).
    """
    s = settings
    t0 = time.perf_counter()
    deadline = t0 + float(s.time_limit_s)
    m = build_cost_model(profile, hw)
    notes: list[str] = []
    b = sound_bound(profile, hw, budget_bytes,
                    time_limit_s=max(0.5, s.bound_share * (deadline - time.perf_counter())))
    notes.append(b.message)
    # the fallback's plan (simulator-checked) is the fallback and the plan to beat
    fallback_out = fallback(profile, hw, budget_bytes)
    fallback_dec = list(getattr(fallback_out, "decisions", fallback_out))
    reserve = max(s.reserve_s, s.reserve_share * s.time_limit_s)
    index = {t: c for c, t in enumerate(m.cands)}
    seed_actions = [KEEP] * len(m.cands)
    for d in fallback_dec:
        if d.tensor in index:
            seed_actions[index[d.tensor]] = d.action
    seed = [c for c, a in enumerate(seed_actions) if a == SWAP]
    actions, objective, state = _solve_in_rounds(m, budget_bytes, s, deadline - reserve, notes,
                                                 seed, seed_actions)
    if actions is None:
        notes.append("using slackswap's plan instead")
        return PlannerOutput(fallback_dec, tuple(notes))
    mem = memory(m, state)
    if mem.max(initial=0) > budget_bytes:
        _, fits = recompute_until_fits(m, state, budget_bytes, mem, max_tries=s.max_tries)
        notes.append("repaired the MILP plan with extra recompute where the static model "
                     "(with copy queueing) still exceeded the budget")
    mine = state.decisions(prefetch_points(m, state, s.prefetch_margin))
    res = _simulate(profile, mine, hw, budget_bytes)
    notes.append(_agreement(objective, _key(res), m.ideal_us))
    # the simulator's polish (as slackswap's last pass), then the better of the two plans
    polished = polish(profile, hw, budget_bytes, mine, res, work_ops=s.polish_work_ops)
    if polished.moves:
        notes.append(polished.note(res, "the MILP's plan "))
        mine, res = list(polished.decisions), polished.result
    # an incumbent cut short by the time limit can be poor: the simulator picks
    if _key(_simulate(profile, fallback_dec, hw, budget_bytes)) > _key(res):
        notes.append("slackswap's plan simulates better than the MILP's: using it")
        return PlannerOutput(fallback_dec, tuple(notes))
    return PlannerOutput(mine, tuple(notes))


def _solve_in_rounds(m: CostModel, budget_bytes: int, s: OptimalSettings, until: float,
                     notes: list[str], seed_swaps: list[int], seed_actions: list | None = None):
    """The MILP, solved again while its plan overflows in the static model because its copies
    queue: each round widens the memory windows of the plan's swaps to where the FIFOs put
    them (offload tails end when the queued copy does, prefetch heads start when the queued
    copy must), so the next plan pays for that memory. Windows only widen, so the rounds end;
    each round may take the time left (a later round runs only when an earlier one finished
    early). The first round's windows already queue behind `seed_swaps` (the fallback
    plan's swaps), and it starts from `seed_actions` with `start_from_fallback`.
    A round whose plan fits but whose offloads run past the end of forward while its
    simulation shows no stall leads to one more round that leaves that spill uncharged,
    starts from that plan and is kept only if it simulates no worse (module docstring).
    Returns (actions, objective, static State) of the round kept."""
    tail_end, head, _ = _windows(m, s.prefetch_margin)
    if seed_swaps:
        t_q, h_q = _queued_windows(m, seed_swaps, s.prefetch_margin)
        tail_end = np.maximum(tail_end, t_q)
        head = np.maximum(np.minimum(head, h_q), tail_end)
    best = (None, None, None)
    free = 0.0
    spilled = None      # the simulation of the plan whose spill the next round leaves free
    start = seed_actions if s.start_from_fallback else None
    for k in range(s.max_rounds):
        left = until - time.perf_counter()
        if k and left < 1.0:
            notes.append("no time left for another round with the copies' queueing")
            break
        milp_s = max(0.5, left)
        # the whole solve (building the MILP included) runs in a child stopped at milp_s
        out = run_quietly(solve, dict(m=m, budget_bytes=budget_bytes,
                                      settings=replace(s, time_limit_s=milp_s), fork=False,
                                      windows=(tail_end, head), free_spill_us=free,
                                      start=start), milp_s)
        actions, more, objective = out if out is not None else (
            None, [f"MILP stopped after its time ({milp_s:.1f} s) with no answer"], None)
        notes.extend(f"round {k + 1}: {n}" if k else n for n in more)
        if actions is None:
            break
        state = State(m, actions)
        for c, a in enumerate(actions):     # a chain the MILP could not see through
            if a == RECOMPUTE and not np.isfinite(state.cost[c]):
                state.set(c, KEEP)
        swaps = [c for c, a in enumerate(state.actions) if a == SWAP]
        fits = memory(m, state).max(initial=0) <= budget_bytes
        judged = _judge(m, state, budget_bytes, s) if fits and (free or swaps) else None
        if spilled is not None and (judged is None or judged[:2] < spilled[:2]):
            notes.append(f"round {k + 1}'s plan simulates worse than round {k}'s: keeping "
                         f"round {k}'s")
            break
        best = (actions, objective, state)
        start = list(state.actions)
        if fits:
            spill = _harmless_spill(m, swaps, judged)
            if spill is None or spill <= free + 1e-6 or k + 1 >= s.max_rounds:
                break
            free, spilled = spill, judged
        t_new, h_new = _queued_windows(m, swaps, s.prefetch_margin)
        wider = (t_new > tail_end) | (h_new < head)
        widened = int(wider.sum())
        tail_end = np.maximum(tail_end, t_new)
        head = np.maximum(np.minimum(head, h_new), tail_end)
        if fits:
            notes.append(f"round {k + 1}'s offloads run {free:.1f} us past the end of forward "
                         "and its simulation waits for none of them: the next round does not "
                         f"charge that spill (memory windows of {widened} candidates widened "
                         "to its copies' queue)")
        elif widened:
            notes.append(f"round {k + 1}'s plan overflows with its copies queued: the memory "
                         f"windows of {widened} candidates widened to that queue")
        else:
            break
    return best


def _judge(m: CostModel, state: State, budget_bytes: int, s: OptimalSettings) -> tuple:
    """The simulation of a static plan: (feasible, retention, no stall)."""
    res = _simulate(m.prof, state.decisions(prefetch_points(m, state, s.prefetch_margin)),
                    m.hw, budget_bytes)
    return (res.feasible, res.predicted.retention, res.predicted.stall_us <= 0)


def _harmless_spill(m: CostModel, swaps: list[int], judged: tuple | None) -> float | None:
    """How far the plan's offloads run past the end of forward in the static FIFO, when its
    simulation (`judged`) fits and shows no stall at all, so nothing waited on them; None
    otherwise."""
    if not swaps or judged is None or not (judged[0] and judged[2]):
        return None
    _, done = d2h_fifo(m, swaps)
    spill = float(done.max()) - m.forward_end_us
    return spill if spill > 0 else None


def _queued_windows(m: CostModel, swaps: list[int], margin: float):
    """Each candidate's (offload-tail end, prefetch-head start) were it swapped along with
    `swaps`: its D2H copy waits behind the swaps produced up to its producer (FIFO), its H2D
    copy must end before the swaps needed after it start (just in time, latest first; the
    prefetch `margin` as in `_windows`). For the swaps themselves this is `copy_schedule`'s
    queue; for the others it leaves out the delay they would add to later copies."""
    if not swaps:
        return _windows(m, margin)[:2]
    sw, done = d2h_fifo(m, swaps)
    k = np.searchsorted(m.p[sw], m.p, side="right") - 1          # last swap produced <= p_c
    before = np.where(k >= 0, done[np.maximum(k, 0)], -np.inf)
    # a swap of the plan waits behind those produced before it only (done already has it)
    before[sw] = np.r_[-np.inf, done[:-1]]
    done_c = np.maximum(m.t_end[m.p], before) + m.d2h_us
    tail_end = np.searchsorted(m.t_end, done_c - 1e-9, side="right") + 1
    tail_end = np.minimum(np.maximum(tail_end, m.lf + 1), m.fb)
    # H2D: a copy ends before the copies of the swaps needed after it start
    sb, starts = h2d_just_in_time(m, swaps, m.fb, margin)
    later = np.searchsorted(-m.fb[sb], -m.fb, side="left")       # swaps needed after fb_c
    after = np.where(later > 0, starts[np.maximum(later - 1, 0)], np.inf)
    start_c = np.minimum(m.t_start[m.fb], after) - m.h2d_us * (1.0 + margin)
    head = np.searchsorted(m.t_end, np.maximum(start_c, m.forward_end_us), side="right")
    head = np.minimum(np.maximum(head, m.nf), m.fb)
    return tail_end, np.maximum(head, tail_end)


def _agreement(objective: float | None, judged: tuple[bool, float], ideal: float) -> str:
    """How far the MILP's model is from the simulator on the MILP's own plan."""
    feasible, retention = judged
    sim = ideal / retention - ideal if retention > 0 else float("inf")
    if not feasible:
        return f"the MILP's plan does not fit in simulation (it simulates at {sim:.1f} us)"
    if objective is None:
        return f"the MILP's plan simulates at {sim:.1f} us of overhead"
    off = (sim - objective) / max(objective, 1e-9 * ideal)
    return (f"the MILP's plan simulates at {sim:.1f} us of overhead, its objective says "
            f"{objective:.1f} us ({100 * off:+.2f}%)")


def _simulate(profile, decisions, hw, budget_bytes):
    return simulate(profile, decisions, hw, budget_bytes, record=False)


def _key(res) -> tuple[bool, float]:
    return (res.feasible, res.predicted.retention)
