"""A sound upper bound on the retention any plan can reach: an LP that only loosens the simulator.

`optimal`'s MILP is a planning model (it can be beaten by a plan the simulator accepts); this
module answers a different question: *no* plan, whatever its decisions and prefetch pins, can
simulate feasibly (`simulate.simulate`, memory never above the budget) faster than
`ideal + S*`, where `S*` is the optimum of the linear program below. Retention is then at most
`ideal / (ideal + S*)`. Every row is a consequence of the simulator's rules (its module
docstring), relaxed; the argument for each is written next to it.

**Variables.** For each saved activation root c: `k_c, w_c, r_c` in [0, 1] (keep, swap,
recompute; `k + w + r = 1`). An integral plan sets one of them to 1, so the LP's feasible set
contains every plan: fractional values only add solutions (a relaxation). `r_c = 0` where the
simulator refuses recompute: a random op's output, or a chain that must re-run a random op
whose output backward does not save (`InputError`, so no such plan simulates). `y_o` in
[0, 1] for each op o some chain re-runs; `R >= 0`, recompute time; `Z_i >= 0`, the stall
time before original op i starts (non-decreasing in i), `Z_end` the total stall.

**Overhead.** The compute engine is serial and runs every op once plus the recompute tasks,
so `step = ideal + recompute time + stall time`; the LP minimises `S = R + Z_end`.
- Recompute (`R >= sum_o time_o * y_o`, `y_o >= r_c` for every op o in c's static chain):
  recomputing c re-runs its producer at least once (before its first backward use, or earlier
  in another chain that passes through c), and every forward value that op reads and backward
  does not save is dead in backward, so its producer is re-run as well, recursively (the static
  chain). Other saved inputs add nothing (they may be kept). Each re-run op is paid once, even
  if the simulator re-runs it several times: a loosening.
- Time: the simulated start of original op i is `ideal_start(i) + Z_i + (recompute before i)`,
  with no recompute in forward; between the starts of ops q < i at most
  `ideal_start(i) - ideal_start(q) + Z_i - Z_q + R` (the `R` only when i is in backward).

**Memory.** In a feasible simulation the memory at the start of each original op i (its
allocation included) is at most the budget B. Counted there, whatever the plan:
`L_i` = non-saved values live at i (producer <= i <= last reader) + saved roots that forward
still reads (p_c <= i <= lf_c) or backward already reads (fb_c <= i <= lu_c): a kept root is
resident to its last use, a swapped one is released only after its last forward reader and
fetched before its first backward reader, a recomputed one likewise. Saved roots in their gap
(lf_c < i < fb_c) add: kept, all of it; recomputed, nothing (a chain may bring it back early:
ignored, loosening); swapped, whatever is not yet off the device or already being fetched
back. Extra residency (chain temporaries, chains pulling inputs early, queueing) only adds
memory and is ignored.
- (a) `L_i + sum_gap size_c k_c <= B` at every op: swapped bytes counted as gone.
- (b) every op i: a swapped root in i's gap is gone only once its D2H copy is done. The D2H
  engine runs one copy at a time from time 0, so by the start of i it finished at most
  `bw_d2h * (ideal_start(i) + Z_i [+ R])` bytes: `L_i + sum_gap size_c (k_c + w_c) -
  bw_d2h (ideal_start(i) + Z_i [+ R]) <= B`.
- (b') every op i and a sample of earlier producer positions q: a root produced at or after q
  is copied no earlier than q's start, so of the gap's roots produced from q on at most
  `bw_d2h * (time between the starts of q and i)` bytes are gone (roots produced before q
  may all be gone): the row of (b) over those roots with that window.
- (c) backward i < j, a sample of j per i: a swapped c with i < fb_c <= j that is not
  resident at the start of i (its prefetch not yet issued: an issued prefetch holds its
  memory from issue) is copied whole between the starts of i and of j, one copy at a time:
  `L_i + sum_gap size_c k_c + sum_{i < fb_c <= j} size_c w_c - bw_h2d * (time between the
  starts of i and j) <= B`.
- (d) backward j: prefetches start in backward, after forward ended (no earlier than
  `forward_end + Z_{last forward op}`), and every swapped c with fb_c <= j has arrived before
  j starts: `sum_{fb_c <= j} size_c w_c <= bw_h2d * (time from forward's end to j's start)`.
- (e) recompute still to come. In backward, the time before op i includes only the
  recompute run before i, not all of `R`. At a sample of backward positions i (the first
  over-budget ones, where forward's offloads may still be running, then sparser) the LP has
  `A_i`, a lower bound on the recompute run after op i starts, and uses `R - A_i` in place of
  `R` in the time of (b) and (b') at i, and of (c) and (d) that end at i (recompute between
  two ops is at most the recompute before the later one). The argument: a recomputed root
  c still ahead (`fb_c > i`) is either resident at the start of i (a chain before i brought
  it back early and holds it to its last use: `e_{c,i} = 1`, adding `size_c` to the memory
  of every row at i) or is made after i starts by a chain that re-runs its whole static chain
  (its non-saved inputs are dead in backward: chain temporaries live only inside their
  chain). So `v_{o,i} >= r_c - e_{c,i}` for every op o of c's static chain, `e_{c,i} <= r_c`,
  and `A_i >= sum_o time_o v_{o,i}` (each op counted once: a loosening). An op in the chain of
  only one such root is folded into that root's term (`time_o (r_c - e_{c,i})`, the same
  LP with fewer rows).
- Latency: a copy takes `latency + bytes / bw` or longer (contention and half duplex only slow
  it), and the engines run one copy at a time, so copies of F bytes in all, none larger than
  `smax`, take at least `F / smax * latency + F / bw`: in (b)-(d) `bw` is the effective
  `1 / (1/bw + latency/smax)`, with `smax` the largest saved root in the row's gap (for (d),
  the largest of all).

Rows (e) are what make the bound tight on transformers: without them the LP lets the
offloads still queued at the end of forward run during all of backward's recompute, even at
the first backward op (docs/results.md, "Figures behind the planners' design", has the
figures of this section).

**Where it is loose.** On the ResNet-50 sample it stays a few tenths of a point above the
best plans. Tried, and no tighter: integer decisions (a MILP over the same rows), rows at every
window start, and rows with the D2H queue's order (a root is copied only after every swapped
root queued before it, copies of roots forward still reads take engine time too) at every
over-budget op. What the LP still leaves out: chain
temporaries and chains pulling inputs back early (ResNet's conv-BN-ReLU chains allocate
temporaries as large as the tensors they recompute), the duplex derate, and that each row
may assume its own set of finished copies.

Rows are only written at ops whose keep-all memory is over the budget (elsewhere they hold
for every plan), and any subset of rows is still a relaxation. Sums over gaps use cumulative
variables (bytes kept / swapped whose gap has opened, resp. closed, by position q), so the
LP has few nonzeros per row.

**Numerics.** HiGHS solves the LP to a relative tolerance of about 1e-7; the reported
overhead is lowered by `1e-6 * ideal` before it becomes a bound, so a rounding error can only
loosen it. The LP is solved by scipy's HiGHS (deterministic), silenced at the file-descriptor
level (`quiet_fds`); with a time limit it runs in a forked child stopped at the limit
(`run_quietly`). When the LP is infeasible, no plan fits the budget at all.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, vstack

from ..chains import candidate_chain
from ..chains import tables as chain_tables
from ..hardware import HardwareSpec
from ..schema import Profile

SAFETY = 1e-6          # relative to ideal time, subtracted from the LP's optimum
PAIRS_PER_ROW = 12     # sampled j's per backward row (c)
REFINED_ROWS = 16      # backward positions with rows (e)
COARSE_SHARE = 0.5     # of a time limit, at most, for the coarse LP (no rows (e)) run first


@dataclass(frozen=True)
class Bound:
    """`overhead_us` (S*, lowered by the safety margin) and `retention` (ideal / (ideal + S*))
    that no feasible plan beats; `fits=False` when no plan can meet the budget at all
    (`retention` is then None)."""
    fits: bool
    overhead_us: float | None
    retention: float | None
    ideal_us: float
    solve_s: float
    rows: int
    message: str


@contextmanager
def quiet_fds():
    """Send file descriptors 1 and 2 to /dev/null for the duration (C libraries such as HiGHS
    write there directly, past Python's sys.stdout)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    saved = []
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
                os.dup2(devnull, fd)
            except OSError:
                pass
        yield
    finally:
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def run_quietly(fn, kwargs: dict, limit_s: float | None = None):
    """`fn(**kwargs)` (a scipy HiGHS call, or a function making one) with file descriptors 1
    and 2 silenced and scipy's warnings about options passed to HiGHS verbatim ignored.

    With `limit_s` it runs in a forked child that is stopped after `limit_s` seconds (HiGHS
    checks its own time limit only now and then); it returns None when stopped. The result
    must pickle. Where fork is not available it runs here, unbounded.
    """
    if limit_s is not None:
        try:
            ctx = mp.get_context("fork")
        except ValueError:
            ctx = None
        if ctx is not None:
            recv, send = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_child, args=(fn, kwargs, send), daemon=True)
            child.start()
            send.close()
            try:
                if recv.poll(max(0.1, limit_s)):
                    try:
                        ok, value = recv.recv()
                    except EOFError:          # the child died (killed, out of memory)
                        return None
                    if not ok:
                        raise value            # a bug in the child: surface it here
                    return value
                return None
            finally:
                recv.close()
                if child.is_alive():
                    child.terminate()
                child.join()
    return _quiet_call(fn, kwargs)


def _quiet_call(fn, kwargs):
    with warnings.catch_warnings(), quiet_fds():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(**kwargs)


def _child(fn, kwargs, conn):
    try:
        try:
            conn.send((True, _quiet_call(fn, kwargs)))
        except Exception as exc:
            conn.send((False, exc))
    finally:
        conn.close()


class _Facts:
    """What the bound needs from a profile, with the simulator's definitions (roots, saved,
    first/last uses)."""

    def __init__(self, prof: Profile):
        ops, tensors = prof.ops, prof.tensors
        n, nf = len(ops), prof.n_forward
        tab = chain_tables(prof)          # the simulator's own root tables
        is_root, producer, saved = tab.is_root, tab.producer, tab.saved
        last, lfu, fbu = tab.last_use, tab.last_fwd_use, tab.first_bwd_use
        self.n, self.nf = n, nf
        self.time = np.array([float(o.time_us) for o in ops])
        self.t_start = np.concatenate([[0.0], np.cumsum(self.time)[:-1]]) if n else np.zeros(0)
        self.ideal = math.fsum(self.time)          # exactly rounded: no summation order
        self.fwd_end = math.fsum(self.time[:nf])
        self.cands = [j for j in range(len(tensors)) if saved[j]]
        c = self.cands
        self.size = np.array([tensors[j].size_bytes for j in c], dtype=float)
        self.p = np.array([producer[j] for j in c], dtype=np.int64)
        self.lf = np.array([lfu[j] for j in c], dtype=np.int64)
        self.fb = np.array([fbu[j] for j in c], dtype=np.int64)
        self.lu = np.array([last[j] for j in c], dtype=np.int64)
        # L_i: non-saved roots over their life, saved roots outside their gap
        delta = np.zeros(n + 1)
        for j in range(len(tensors)):
            if is_root[j] and not saved[j]:
                delta[producer[j]] += tensors[j].size_bytes
                delta[last[j] + 1] -= tensors[j].size_bytes
        gap = np.zeros(n + 1)
        for s, p, lf, fb, lu in zip(self.size, self.p, self.lf, self.fb, self.lu):
            delta[p] += s
            delta[lf + 1] -= s
            delta[fb] += s
            delta[lu + 1] -= s
            gap[lf + 1] += s
            gap[fb] -= s
        self.floor = np.cumsum(delta)[:n]
        self.keep_all = self.floor + np.cumsum(gap)[:n]
        # static chains: the ops recomputing each candidate must re-run (None: impossible)
        self.chain: list[tuple[int, ...] | None] = []
        for j in c:
            ch = candidate_chain(tab, j)
            self.chain.append(None if ch is None else tuple(sorted(ch.ops)))


def _facts(prof: Profile) -> _Facts:
    f = prof.__dict__.get("_slackswap_bound_facts")
    if f is None:
        f = _Facts(prof)
        prof.__dict__["_slackswap_bound_facts"] = f    # profiles are immutable: cache is safe
    return f


def sound_bound(prof: Profile, hw: HardwareSpec, budget_bytes: int,
                time_limit_s: float | None = None) -> Bound:
    """The LP bound of the module docstring (cached per profile, hardware and budget).

    With `time_limit_s` the LP may stop unsolved (an unfinished LP proves nothing). So under a
    limit a coarser LP comes first, without rows (e) (still sound, looser, several times
    faster: docs/results.md), given at most `COARSE_SHARE` of the
    limit; the full LP gets the rest, and the coarse bound is returned, said in its message,
    when the full one does not finish. When neither finishes, `retention` is None."""
    key = (tuple(sorted(hw.to_dict().items())), int(budget_bytes))
    cache = prof.__dict__.setdefault("_slackswap_bounds", {})
    if key in cache:
        return cache[key]
    t0 = time.perf_counter()
    facts = _facts(prof)
    args = dict(f=facts, hw=hw, B=int(budget_bytes))
    coarse = None
    if time_limit_s is not None:
        limit = max(0.1, COARSE_SHARE * time_limit_s)
        coarse = run_quietly(_solve, dict(args, time_limit_s=limit, refined_rows=0), limit)
    left = None if time_limit_s is None else max(0.1, time_limit_s - (time.perf_counter() - t0))
    out = run_quietly(_solve, dict(args, time_limit_s=left), left)
    if out is not None and (out.retention is not None or not out.fits):
        cache[key] = out
        return out
    if coarse is not None and (coarse.retention is not None or not coarse.fits):
        return dataclasses.replace(coarse, message=coarse.message.replace(
            "sound bound:", "sound bound (coarse LP, without rows (e): the full LP did not "
            "finish in its time):", 1))
    if out is not None:
        return out
    return Bound(True, None, None, facts.ideal, time.perf_counter() - t0, 0,
                 f"sound bound not computed within its time ({time_limit_s:.1f} s)")


def _solve(f: _Facts, hw: HardwareSpec, B: int, time_limit_s: float | None = None,
           refined_rows: int | None = None) -> Bound:
    t0 = time.perf_counter()
    if not (f.keep_all > B).any():
        return Bound(True, 0.0, 1.0, f.ideal, time.perf_counter() - t0, 0,
                     "everything fits: no overhead needed")
    if f.floor.max(initial=0) > B:
        return Bound(False, None, None, f.ideal, time.perf_counter() - t0, 0,
                     "no plan fits: the memory every plan needs exceeds the budget")
    lp = _LP(f, hw, B, REFINED_ROWS if refined_rows is None else refined_rows)
    lp.choice_rows()
    lp.cumulative_rows()
    lp.recompute_to_come_rows()
    lp.offload_rows()
    lp.fetch_rows()
    res = lp.solve(time_limit_s)
    solve_s = time.perf_counter() - t0
    if res.status == 2:
        return Bound(False, None, None, f.ideal, solve_s, lp.nrow,
                     "no plan fits: the relaxation is infeasible")
    if res.status != 0:
        return Bound(True, None, None, f.ideal, solve_s, lp.nrow,
                     f"sound bound not computed: the LP stopped ({res.message})")
    s = max(0.0, float(res.fun) - SAFETY * f.ideal)
    ret = 1.0 if f.ideal + s <= 0 else f.ideal / (f.ideal + s)
    return Bound(True, s, ret, f.ideal, solve_s, lp.nrow,
                 f"sound bound: overhead >= {s:.1f} us, retention <= {ret:.4f} "
                 f"(LP: {len(f.cands)} tensors, {lp.nrow} rows, {solve_s:.1f} s)")


def _geometric(k0: int, step: int, n: int) -> list[int]:
    """Up to PAIRS_PER_ROW indices from k0 in direction `step` (+1/-1), at 0, 1, 3, 7, ...
    steps away, within [0, n)."""
    out, s = [], 0
    while len(out) < PAIRS_PER_ROW and 0 <= k0 + step * s < n:
        out.append(k0 + step * s)
        s = 2 * s + 1 if s else 1
    return out


class _LP:
    """The LP of the module docstring: positions, columns, and one method per family of rows.

    Bytes are in units of the budget. Columns: k, w, r (one per candidate), y (one per op some
    static chain re-runs), R, Zt, and per position of P the cumulative sums KI, KO, WI, WO, WP
    and the stall Z; then per refined position i of rows (e) A_i, e_{c,i} per candidate still
    ahead, v_{o,i} per op shared by their chains.
    """

    def __init__(self, f: _Facts, hw: HardwareSpec, B: int, refined_rows: int):
        self.f, nf, nc = f, f.nf, len(f.cands)
        self.refined_rows = refined_rows
        self.over = over = np.nonzero(f.keep_all > B)[0]
        scale = float(max(B, 1))
        self.size = size = f.size / scale
        self.bw_d_raw = hw.d2h_bytes_per_s * 1e-6 / scale   # budget units per us
        self.bw_h_raw = hw.h2d_bytes_per_s * 1e-6 / scale
        self.lat = max(0.0, float(hw.copy_latency_us))
        self.smax_row = {int(i): float(size[(f.lf < i) & (f.fb > i)].max(initial=0.0))
                         for i in over}
        self.bw_h_all = self.eff(self.bw_h_raw, float(size.max(initial=0.0)))
        self.cap = (B - f.floor) / scale                     # room left at each op
        # sampled j's for (c) and the positions of (d): first backward uses after each row
        fb_pos = np.unique(f.fb)
        self.pairs = [(int(i), int(fb_pos[k])) for i in over[over >= nf]
                      for k in _geometric(int(np.searchsorted(fb_pos, i, side="right")), 1,
                                          len(fb_pos))]
        # sampled q's for (b'): production positions before each row
        p_pos = np.unique(f.p)
        self.tails = [(int(p_pos[k]), int(i)) for i in over
                      for k in _geometric(int(np.searchsorted(p_pos, min(i, nf), side="left"))
                                          - 1, -1, len(p_pos))]
        P = np.unique(np.r_[over, fb_pos[fb_pos >= nf], [j for _, j in self.pairs],
                            [q for q, _ in self.tails], [nf - 1]]).astype(np.int64)
        self.P, self.at = P, {int(q): k for k, q in enumerate(P)}
        self.ops_used = sorted({o for ch in f.chain if ch for o in ch})
        self._columns(nc, len(self.ops_used), len(P))
        self.R, self.C, self.V, self.lo, self.hi = [], [], [], [], []
        self.nrow = 0

    def _columns(self, nc: int, ny: int, nP: int) -> None:
        f = self.f
        self.ik, self.iw, self.ir, self.iy = 0, nc, 2 * nc, 3 * nc
        self.iR, self.iZt = 3 * nc + ny, 3 * nc + ny + 1
        self.iKI = self.iZt + 1
        self.iKO, self.iWI, self.iWO = self.iKI + nP, self.iKI + 2 * nP, self.iKI + 3 * nP
        self.iZ, self.iWP = self.iKI + 4 * nP, self.iKI + 5 * nP
        N = self.iKI + 6 * nP
        self.Q = _refined_positions(self.over, f.nf, self.refined_rows)
        self.after = {int(i): N + k for k, i in enumerate(self.Q)}
        N += len(self.Q)
        self.e_cols: list[tuple[int, list[tuple[int, int]]]] = []   # i -> [(c, column)]
        self.v_cols: list[dict[int, int]] = []                       # i -> {op: column}
        for i in self.Q:
            future = [c for c in range(nc) if f.fb[c] > i and f.chain[c]]
            self.e_cols.append((int(i), [(c, N + k) for k, c in enumerate(future)]))
            N += len(future)
            users: dict[int, int] = {}
            for c in future:
                for o in f.chain[c]:
                    users[o] = users.get(o, 0) + 1
            shared = sorted(o for o, n in users.items() if n > 1)
            self.v_cols.append({o: N + k for k, o in enumerate(shared)})
            N += len(shared)
        self.early = {i: dict(cols) for i, cols in self.e_cols}   # i -> c -> e column
        self.N = N

    def eff(self, bw: float, smax: float) -> float:
        """Effective bandwidth: copies of at most `smax` each pay the latency per copy."""
        return bw if smax <= 0 or self.lat <= 0 else 1.0 / (1.0 / bw + self.lat / smax)

    def row(self, cols, vals, lb, ub) -> None:
        self.R.extend([self.nrow] * len(cols))
        self.C.extend(cols)
        self.V.extend(vals)
        self.lo.append(lb)
        self.hi.append(ub)
        self.nrow += 1

    def choice_rows(self) -> None:
        """k + w + r = 1; y_o >= r_c over c's static chain; R >= recompute time; Z rises."""
        f, row, nc = self.f, self.row, len(self.f.cands)
        ik, iw, ir, iy, iR, iZ = self.ik, self.iw, self.ir, self.iy, self.iR, self.iZ
        ypos = {o: q for q, o in enumerate(self.ops_used)}
        for c in range(nc):
            row([ik + c, iw + c, ir + c], [1.0, 1.0, 1.0], 1.0, 1.0)
        for c, ch in enumerate(f.chain):
            for o in ch or ():
                row([iy + ypos[o], ir + c], [1.0, -1.0], 0.0, np.inf)
        row([iR] + [iy + q for q in range(len(self.ops_used))],
            [1.0] + [-float(f.time[o]) for o in self.ops_used], 0.0, np.inf)
        nP = len(self.P)
        for q in range(1, nP):                    # stall before op P[q]: non-decreasing
            row([iZ + q, iZ + q - 1], [1.0, -1.0], 0.0, np.inf)
        row([self.iZt, iZ + nP - 1], [1.0, -1.0], 0.0, np.inf)

    def cumulative_rows(self) -> None:
        """Cumulative sums at positions P: opened (lf + 1 <= q) and closed (fb <= q) gaps,
        kept and swapped, and swapped roots produced before q (WP)."""
        f, P, size, nP = self.f, self.P, self.size, len(self.P)
        for base, first, key in ((self.iKI, self.ik, f.lf + 1), (self.iKO, self.ik, f.fb),
                                 (self.iWI, self.iw, f.lf + 1), (self.iWO, self.iw, f.fb),
                                 (self.iWP, self.iw, f.p + 1)):
            bucket = np.searchsorted(P, key, side="left")     # first position q >= key
            members: list[list[int]] = [[] for _ in range(nP)]
            for c, b in enumerate(bucket):
                if b < nP:
                    members[b].append(c)
            for q in range(nP):
                cols = [base + q] + ([base + q - 1] if q else []) + [first + c for c in members[q]]
                vals = [1.0] + ([-1.0] if q else []) + [-size[c] for c in members[q]]
                self.row(cols, vals, 0.0, 0.0)

    def recompute_to_come_rows(self) -> None:
        """(e): v_{o,i} >= r_c - e_{c,i}, e_{c,i} <= r_c, A_i >= sum_o time_o v_{o,i}."""
        f, ir, row = self.f, self.ir, self.row
        for (i, cols), vi in zip(self.e_cols, self.v_cols):
            cc = [self.after[i]] + list(vi.values())
            vv = [1.0] + [-float(f.time[o]) for o in vi]
            for c, ec in cols:
                own = 0.0                         # ops in c's chain alone: v_o = r_c - e_c
                for o in f.chain[c]:
                    if o in vi:
                        row([vi[o], ir + c, ec], [1.0, -1.0, 1.0], 0.0, np.inf)
                    else:
                        own += float(f.time[o])
                if own > 0:
                    cc += [ir + c, ec]
                    vv += [-own, own]
                row([ir + c, ec], [1.0, -1.0], 0.0, np.inf)
            row(cc, vv, 0.0, np.inf)

    def early_mem(self, i: int) -> tuple[list[int], list[float]]:
        """Recomputed roots brought back before refined position i: their bytes at i."""
        cols = self.early.get(int(i), {})
        return list(cols.values()), [float(self.size[c]) for c in cols]

    def recompute_before(self, i: int, bw: float) -> tuple[list[int], list[float]]:
        """`-bw * (recompute run before op i starts)`: nothing in forward, `R - A_i` at a
        refined position, `R` elsewhere."""
        if i < self.f.nf:
            return [], []
        if int(i) in self.after:
            return [self.iR, self.after[int(i)]], [-bw, bw]
        return [self.iR], [-bw]

    def offload_rows(self) -> None:
        """(a) memory with swaps gone, (b) offloads limited by D2H since time 0, (b') since a
        sampled producer position q."""
        f, at, cap = self.f, self.at, self.cap
        iKI, iKO, iWI, iWO, iZ = self.iKI, self.iKO, self.iWI, self.iWO, self.iZ
        for i in self.over:
            q = at[int(i)]
            ec, ev = self.early_mem(i)
            self.row([iKI + q, iKO + q] + ec, [1.0, -1.0] + ev, -np.inf, cap[i])
        for i in self.over:
            q = at[int(i)]
            bw_d = self.eff(self.bw_d_raw, self.smax_row[int(i)])
            rc, rv = self.recompute_before(i, bw_d)
            ec, ev = self.early_mem(i)
            self.row([iKI + q, iKO + q, iWI + q, iWO + q, iZ + q] + rc + ec,
                     [1.0, -1.0, 1.0, -1.0, -bw_d] + rv + ev, -np.inf,
                     cap[i] + bw_d * f.t_start[i])
        for q_op, i in self.tails:
            qq, qi = at[q_op], at[i]
            bw_d = self.eff(self.bw_d_raw, self.smax_row[i])
            rc, rv = self.recompute_before(i, bw_d)
            ec, ev = self.early_mem(i)
            cols, vals = self._made_from(q_op, i, qq, qi)
            self.row([iKI + qi, iKO + qi, iZ + qi, iZ + qq] + rc + ec + cols,
                     [1.0, -1.0, -bw_d, bw_d] + rv + ev + vals, -np.inf,
                     cap[i] + bw_d * (f.t_start[i] - f.t_start[q_op]))

    def _made_from(self, q_op: int, i: int, qq: int, qi: int):
        """Swapped bytes in i's gap produced from q on: directly, or as the gap's total less
        what was made before q, whichever has fewer terms."""
        f, size, iw = self.f, self.size, self.iw
        gap_i = (f.lf < i) & (f.fb > i)
        direct = np.nonzero(gap_i & (f.p >= q_op))[0]
        other = np.nonzero(~gap_i & (f.p < q_op))[0]
        if len(direct) <= len(other) + 5:
            return [iw + int(c) for c in direct], [float(size[c]) for c in direct]
        cols = [self.iWI + qi, self.iWO + qi, self.iWP + qq] + [iw + int(c) for c in other]
        return cols, [1.0, -1.0, -1.0] + [float(size[c]) for c in other]

    def fetch_rows(self) -> None:
        """(c) a prefetch not issued at i is copied between i and its need j; (d) everything
        fetched by j was copied after forward ended."""
        f, at, cap = self.f, self.at, self.cap
        iKI, iKO, iWO, iZ = self.iKI, self.iKO, self.iWO, self.iZ
        for i, j in self.pairs:
            qi, qj = at[i], at[j]
            bw_h = self.eff(self.bw_h_raw, self.smax_row[i])
            rc, rv = self.recompute_before(j, bw_h)
            ec, ev = self.early_mem(i)
            self.row([iKI + qi, iKO + qi, iWO + qj, iWO + qi, iZ + qj, iZ + qi] + rc + ec,
                     [1.0, -1.0, 1.0, -1.0, -bw_h, bw_h] + rv + ev,
                     -np.inf, cap[i] + bw_h * (f.t_start[j] - f.t_start[i]))
        qf, bw_h = at[f.nf - 1], self.bw_h_all
        for j in self.P[self.P >= f.nf]:
            q = at[int(j)]
            rc, rv = self.recompute_before(j, bw_h)
            self.row([iWO + q, iZ + q, iZ + qf] + rc, [1.0, -bw_h, bw_h] + rv, -np.inf,
                     bw_h * (f.t_start[j] - f.fwd_end))

    def solve(self, time_limit_s: float | None):
        """Minimise R + Zt with scipy's HiGHS (deterministic)."""
        f, N, nc = self.f, self.N, len(self.f.cands)
        A = coo_matrix((self.V, (self.R, self.C)), shape=(self.nrow, N)).tocsr()
        ub = np.full(N, np.inf)
        ub[:3 * nc + len(self.ops_used)] = 1.0
        for _, cols in self.e_cols:               # e in [0, 1]; v is at most 1 at the optimum
            ub[[ec for _, ec in cols]] = 1.0
        for vi in self.v_cols:
            ub[list(vi.values())] = 1.0
        for c, ch in enumerate(f.chain):
            if ch is None:
                ub[self.ir + c] = 0.0
        cost = np.zeros(N)
        cost[self.iR] = cost[self.iZt] = 1.0
        lo_a, hi_a = np.array(self.lo), np.array(self.hi)
        le = np.isfinite(hi_a) & ~np.isfinite(lo_a)
        eq = lo_a == hi_a
        ge = ~le & ~eq                            # lo <= row (hi = inf)
        options = {} if time_limit_s is None else {"time_limit": max(0.1, float(time_limit_s))}
        with quiet_fds():
            return linprog(cost, A_ub=_vstack(A[le], -A[ge]), b_ub=np.r_[hi_a[le], -lo_a[ge]],
                           A_eq=A[eq], b_eq=hi_a[eq], bounds=np.c_[np.zeros(N), ub],
                           method="highs", options=options)


def _refined_positions(over, nf: int, n: int) -> list[int]:
    """Backward row positions where the LP also bounds the recompute still to come (rows
    (e)): the first over-budget backward rows, where forward's copies may still be running,
    then every second, fourth, ... one."""
    bwd = [int(i) for i in over if i >= nf]
    out, s = [], 0
    while s < len(bwd) and len(out) < n:
        out.append(bwd[s])
        s = s + 1 if s < 8 else 2 * s
    return out


def _vstack(a, b):
    return vstack([a, b]).tocsr()
