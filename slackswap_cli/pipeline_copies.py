"""The rank-level judge: a pipeline schedule's actions with the stages' swaps as copies on
each rank's two copy engines, shared by every microbatch in flight.

A stage's plan is made, and simulated, for one microbatch alone: its copies to host hide
under that microbatch's forward, its copies back under its backward. Under a pipeline the
rank runs other microbatches' actions between a microbatch's forward and its backward, and
sits idle in bubbles, so the copies have more time, but the engines are shared. This module
runs the schedule as discrete events and says what the copies cost there.

**Actions.** Each rank runs its steps (kind, stage, microbatch) in the schedule's order; a
forward waits for the same microbatch's forward on the stage before, a backward for its
backward on the stage after (as `pipeline_step.timeline`; sends take no time), unless
`alone` (each rank back to back, without bubbles: less time for copies and for offloads to
finish, so a plan that passes alone passes with bubbles too). A forward takes the stage's
forward time in its own run (`StageWork.fwd_us`: memory waits included, and counted as
exposed), a backward its backward compute with recomputes (`bwd_us`, without copy waits);
a split backward's halves ("I", "W") half of it each.

**Copies.** Each swap of a stage is, per microbatch, a copy to host queued when its producer
ends (`Swap.ready_us` after the forward starts) on the rank's D2H engine, and a copy back on
its H2D engine, both FIFO, one microbatch's copies after the other's. The copies back for a
microbatch's backward are issued together, in the order of the backwards, at the start of
the earliest action (after its forward) from which holding them until the backward keeps
every action's memory under `budget` (counted without copies to host still in flight:
transient), no earlier than the copies back issued before them and never before the copy to
host is done. A backward starts only when each of its copies back has arrived by its first
use (`Swap.need_us` after the backward starts): the wait is **exposed copy time**, with the
forwards' memory waits. The two directions do not slow each other (a duplex link; a rank's
engines are its own).

**Memory** per action: every other live (stage, microbatch) pair holds `held_bytes` (its
plan's, swapped bytes out) plus each of its swapped tensors still on the device (copy to host
not done when the action starts) or back on it (copy back started before the action ends);
the running forward reaches its stage's forward peak in its own run, plus its swapped tensors
whose copy to host ends later than there (the engine was busy with other microbatches'); a
running backward its backward peak with every copy back arrived at its start
(`bwd_peak_bytes`); what finished backwards left until the step ends (`linger_bytes`). The
rank's peak is the largest. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from .pipeline import STARTS, Boundary, Step, _walk, stage_cost
from .schema import Action, Plan, Profile

__all__ = ["Swap", "StageWork", "RankJudged", "Judged", "stage_work", "judge"]

BACKWARDS = ("B", "I", "W")
FIRST_USE = ("B", "I")          # the backward kinds that read the saved tensors first


class Swap(NamedTuple):
    """One swapped tensor of a stage, per microbatch."""
    bytes: int          # device bytes it frees while on host (0: the pipeline holds it anyway)
    d2h_us: float       # its copy to host
    h2d_us: float       # its copy back
    ready_us: float     # its producer's end, from the forward's start
    need_us: float      # its first use, from the backward's start
    alone_us: float     # when its copy to host ends in the stage's own run, from its start


@dataclass(frozen=True)
class StageWork:
    """A stage under a plan, per microbatch, as the judge runs it (module docstring)."""
    fwd_us: float
    bwd_us: float               # its compute, recomputes included, its copies back all in
    held_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int         # with its copies back all in at its start
    linger_bytes: int = 0
    swaps: tuple[Swap, ...] = ()
    fwd_wait_us: float = 0.0    # of fwd_us: waits for memory in its own run (copies to host)
    bwd_alone_us: float | None = None       # as in its own run: copies back from its start
    bwd_alone_peak_bytes: int | None = None

    @property
    def alone_us(self) -> float:
        return self.bwd_us if self.bwd_alone_us is None else self.bwd_alone_us

    @property
    def alone_peak(self) -> int:
        return (self.bwd_peak_bytes if self.bwd_alone_peak_bytes is None
                else self.bwd_alone_peak_bytes)


@dataclass(frozen=True)
class RankJudged:
    rank: int
    end_us: float               # when its last action ends
    busy_us: float              # compute: its actions' times, waits not counted
    exposed_us: float           # compute waited for copies
    peak_bytes: int
    d2h_busy_us: float          # its engines' busy time
    h2d_busy_us: float


@dataclass(frozen=True)
class Judged:
    step_us: float
    ranks: dict[int, RankJudged] = field(default_factory=dict)


def _peak_in(memory, lo: float, hi: float) -> int:
    """The largest memory of a simulator timeline over [lo, hi), the value in force at lo
    included."""
    best = 0
    for t, m in memory:
        if t >= hi:
            break
        if t <= lo:
            best = m                # the value in force at lo (the last one at or before it)
        else:
            best = max(best, m)
    return best


def _first_need(prof: Profile, events, fwd_end: float, roots) -> dict[int, float]:
    """root -> the time (from the backward's start) of the first compute task reading it."""
    want = set(roots)
    out: dict[int, float] = {}
    for ev in events:
        if ev.engine != "compute" or ev.op is None or ev.start_us < fwd_end or not want:
            continue
        for tid in prof.ops[ev.op].inputs:
            r = prof.root(tid)
            if r in want:
                out[r] = ev.start_us - fwd_end
                want.discard(r)
    return out


def stage_work(prof: Profile, plan: Plan | None, hw, boundary: Boundary = Boundary()
               ) -> StageWork:
    """`prof` under `plan` (None: keep everything) on `hw`, for the judge: the stage run alone
    twice by the simulator, with the plan's copies (its forward: time, memory waits, peak,
    when each copy to host ends) and with its swaps kept (the backward's compute and its peak
    with every copy back in at its start; when each swapped tensor is first read)."""
    from .simulate import simulate
    cost = stage_cost(prof, plan, boundary)
    fwd = sum(op.time_us for op in prof.ops[:prof.n_forward])
    if plan is None or not plan.decisions:
        bwd = sum(op.time_us for op in prof.ops[prof.n_forward:])
        peak = cost.peak_bytes
        return StageWork(fwd, bwd, cost.held_bytes, peak, peak + cost.boundary_bytes,
                         cost.linger_bytes)
    extra = cost.peak_bytes - plan.predicted.peak_bytes     # pinned evictions, eager excess
    acts = {d.tensor: d.action for d in plan.decisions}
    kept = simulate(prof, {t: (Action.KEEP if a == Action.SWAP else a) for t, a in acts.items()},
                    hw, None, record=True)
    real = simulate(prof, plan.decisions, hw, plan.budget_bytes, record=True)
    fwd_end = max((e.end_us for e in real.events if e.engine == "compute"
                   and e.kind != "stall" and e.op is not None and e.op < prof.n_forward),
                  default=0.0)
    swapped = [t for t, a in acts.items() if a == Action.SWAP]
    need = _first_need(prof, kept.events, fwd, swapped)
    alone = {ev.tensor: ev.end_us for ev in real.schedule if ev.kind == "offload"}
    ends, t = {}, 0.0
    for op in prof.ops[:prof.n_forward]:
        t += op.time_us
        ends[op.id] = t
    swaps = []
    for tid in sorted(swapped, key=lambda x: ends.get(prof.tensors[x].producer, 0.0)):
        size = prof.tensors[tid].size_bytes
        ready = ends.get(prof.tensors[tid].producer, 0.0)
        swaps.append(Swap(0 if tid in boundary.pinned else size, hw.copy_us(size, "d2h"),
                          hw.copy_us(size, "h2d"), ready, need.get(tid, 0.0),
                          alone.get(tid, ready)))
    fwd_peak = _peak_in(real.memory, 0.0, fwd_end) + extra
    bwd_peak = _peak_in(kept.memory, fwd, float("inf")) + extra + cost.boundary_bytes
    alone_peak = _peak_in(real.memory, fwd_end, float("inf")) + extra + cost.boundary_bytes
    return StageWork(fwd_end, kept.predicted.step_us - fwd, cost.held_bytes, fwd_peak,
                     bwd_peak, cost.linger_bytes, tuple(swaps), max(0.0, fwd_end - fwd),
                     real.predicted.step_us - fwd_end, alone_peak)


def _pairs(steps: Sequence[Step]) -> tuple[dict, dict]:
    """(pair -> index of its forward, pair -> index of its first backward use)."""
    made, used = {}, {}
    for k, (kind, stage, mb) in enumerate(steps):
        if kind in STARTS:
            made.setdefault((stage, mb), k)
        elif kind in FIRST_USE:
            used.setdefault((stage, mb), k)
    return made, used


def _static_need(steps: Sequence[Step], work: Mapping[int, StageWork]) -> list[int]:
    """Per action: the others' held bytes, its own peak (a backward's as in its own run) and
    what lingers; no copies."""
    need, lingering = [], 0
    for (kind, stage, mb), live in _walk(steps):
        others = sum(work[s].held_bytes for s, m in live if (s, m) != (stage, mb))
        own = work[stage].fwd_peak_bytes if kind in STARTS else work[stage].alone_peak
        need.append(others + own + lingering)
        if kind in FIRST_USE:
            lingering += work[stage].linger_bytes
    return need


def _issue_points(steps: Sequence[Step], work: Mapping[int, StageWork],
                  budget: int) -> dict[tuple[int, int], int]:
    """pair -> the index of the action at whose start its copies back are issued (its first
    backward's own index: issued there, as in the stage's own run)."""
    need = _static_need(steps, work)
    limit = budget if budget > 0 else max(need, default=0)
    made, used = _pairs(steps)
    out: dict[tuple[int, int], int] = {}
    floor = 0
    for pair, b in sorted(used.items(), key=lambda kv: kv[1]):
        w = work[pair[0]]
        if not w.swaps or pair not in made:
            continue
        size = sum(sw.bytes for sw in w.swaps)
        own = need[b] - w.alone_peak + w.bwd_peak_bytes      # all in at its start
        j = b
        if own <= limit:
            for cand in range(max(made[pair] + 1, floor), b):
                if all(need[a] + size <= limit for a in range(cand, b)):
                    j = cand
                    break
        if j < b:
            for a in range(j, b):
                need[a] += size
            need[b] = own
        floor = j
        out[pair] = j
    return out


class _Rank:
    """One rank's engines and what its copies did (times by (stage, mb, swap index))."""

    def __init__(self):
        self.free = self.d2h = self.h2d = 0.0
        self.busy = self.exposed = self.d2h_busy = self.h2d_busy = 0.0
        self.d2h_end: dict = {}
        self.h2d_start: dict = {}
        self.h2d_end: dict = {}
        self.times: list[tuple[float, float]] = []
        self.late: set = set()

    def offload(self, pair, swaps: Sequence[Swap], start: float) -> None:
        for i, sw in enumerate(swaps):
            begin = max(start + sw.ready_us, self.d2h)
            self.d2h = self.d2h_end[(*pair, i)] = begin + sw.d2h_us
            self.d2h_busy += sw.d2h_us

    def fetch(self, pair, swaps: Sequence[Swap], now: float) -> None:
        for i, sw in enumerate(swaps):
            begin = max(now, self.d2h_end[(*pair, i)], self.h2d)
            self.h2d_start[(*pair, i)] = begin
            self.h2d = self.h2d_end[(*pair, i)] = begin + sw.h2d_us
            self.h2d_busy += sw.h2d_us


def _duration(kind: str, w: StageWork) -> float:
    return w.fwd_us if kind in STARTS else w.bwd_us if kind == "B" else w.bwd_us / 2


def _act(r: _Rank, k: int, step: Step, ready: float, work, plan) -> float:
    """Run action k of a rank that may start at `ready`; returns its end. `plan`: (index ->
    the pairs whose copies back are issued there, pair -> index of its first backward use,
    the pairs whose copies back are issued at that backward, as in the stage's own run)."""
    issue, used, late = plan
    kind, stage, mb = step
    w = work[stage]
    for pair in issue.get(k, ()):
        r.fetch(pair, work[pair[0]].swaps, ready)
    start, took = ready, _duration(kind, w)
    first = kind in FIRST_USE and used.get((stage, mb)) == k and bool(w.swaps)
    if first and (stage, mb) in late:
        start = max(ready, r.h2d)           # its copies back as in its own run, from its start
        r.fetch((stage, mb), w.swaps, start)
        wait = w.alone_us - w.bwd_us
        took += wait if kind == "B" else wait / 2
        r.exposed += wait
    elif first:
        start = max(ready, max(r.h2d_end[(stage, mb, i)] - sw.need_us
                               for i, sw in enumerate(w.swaps)))
    if kind in STARTS:
        r.offload((stage, mb), w.swaps, start)
        r.exposed += w.fwd_wait_us
    r.exposed += start - ready
    r.busy += _duration(kind, w) - (w.fwd_wait_us if kind in STARTS else 0.0)
    r.free = start + took
    r.times.append((start, r.free))
    return r.free


def _plan_copies(steps, work, budget: int):
    points = _issue_points(steps, work, budget)
    used = _pairs(steps)[1]
    issue: dict[int, list] = {}
    for pair, j in sorted(points.items(), key=lambda kv: kv[1]):
        if j < used[pair]:
            issue.setdefault(j, []).append(pair)
    return issue, used, {p for p, j in points.items() if j == used[p]}


def _run(order, work, budget, alone: bool) -> dict[int, _Rank]:
    """Every rank's actions in time order (cross-rank waits unless `alone`)."""
    done: dict[tuple[str, int, int], float] = {}
    n_stages = 1 + max((s for steps in order.values() for _, s, _ in steps), default=0)
    ranks = {r: _Rank() for r in order}
    plans = {r: _plan_copies(steps, work, budget if isinstance(budget, int)
                             else budget.get(r, 0)) for r, steps in order.items()}
    for r, p in plans.items():
        ranks[r].late = p[2]
    left = sum(len(s) for s in order.values())
    while left:
        moved = False
        for rank, steps in order.items():
            r = ranks[rank]
            while len(r.times) < len(steps):
                kind, stage, mb = steps[len(r.times)]
                dep = (None if alone else ("F", stage - 1, mb) if kind == "F" and stage > 0
                       else ("B", stage + 1, mb) if kind in FIRST_USE and stage < n_stages - 1
                       else None)
                if dep is not None and dep not in done:
                    break
                end = _act(r, len(r.times), steps[len(r.times)],
                           max(r.free, done.get(dep, 0.0)), work, plans[rank])
                if kind in STARTS or kind in FIRST_USE:
                    done["F" if kind in STARTS else "B", stage, mb] = end
                left -= 1
                moved = True
        if not moved:
            raise ValueError("the schedule's order waits on a step no rank runs: "
                             "this is a bug in slackswap")
    return ranks


def _on_device(r: _Rank, pair, swaps: Sequence[Swap], start: float, end: float) -> int:
    """Bytes of a live pair's swapped tensors on the device during [start, end)."""
    total = 0
    for i, sw in enumerate(swaps):
        key = (*pair, i)
        back = r.h2d_start.get(key)
        if r.d2h_end.get(key, 0.0) > start or (back is not None and back < end):
            total += sw.bytes
    return total


def _rank_peak(steps: Sequence[Step], work, r: _Rank) -> int:
    best, lingering = 0, 0
    for k, ((kind, stage, mb), live) in enumerate(_walk(steps)):
        start, end = r.times[k]
        mem = lingering
        for s, m in live:
            if (s, m) != (stage, mb):
                mem += work[s].held_bytes + _on_device(r, (s, m), work[s].swaps, start, end)
        w = work[stage]
        if kind in STARTS:
            mem += w.fwd_peak_bytes + sum(
                sw.bytes for i, sw in enumerate(w.swaps)
                if r.d2h_end[(stage, mb, i)] - start > sw.alone_us + 1e-9)
        else:
            mem += w.alone_peak if (stage, mb) in r.late else w.bwd_peak_bytes
        best = max(best, mem)
        if kind in FIRST_USE:
            lingering += w.linger_bytes
    return best


def judge(order: Mapping[int, Sequence[Step]], work: Mapping[int, StageWork],
          budget: Mapping[int, int] | int = 0, alone: bool = False) -> Judged:
    """Each rank's time, peak and exposed copy time under the stages' `work` (module
    docstring). `budget`: per rank (or one for all) the memory copies back may fill ahead of
    their backward (0: what the rank needs anyway without them)."""
    ranks = _run(order, work, budget, alone)
    out = {}
    for rank, steps in order.items():
        r = ranks[rank]
        out[rank] = RankJudged(rank, r.free, r.busy, r.exposed, _rank_peak(steps, work, r),
                               r.d2h_busy, r.h2d_busy)
    return Judged(max((j.end_us for j in out.values()), default=0.0), out)
