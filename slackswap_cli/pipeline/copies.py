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
`alone` (each rank back to back, without bubbles: less time for copies, so a plan that passes
alone passes with bubbles too). A forward takes the stage's forward time; one that would take
the rank over the limit without waiting (copies in flight counted) waits for memory as the
stage's own run does (`StageWork.fwd_waits`, exposed). A backward takes its compute with
recomputes (`bwd_us`); a split backward's halves ("I", "W") half of it each.

**Copies.** Each swap of a stage is, per microbatch, a copy to host queued when its producer
ends (`Swap.ready_us` after the forward starts) on the rank's D2H engine, and a copy back on
its H2D engine, both FIFO. A microbatch's copies back go one by one in order of need, each at
the start of the earliest action after its forward (not before the copy back issued before
it) from which holding it until the backward keeps every action's memory, counted without
copies, under the limit (`budget`; without one, the rank's peak without copies), else at
the backward's start, just in time (each as late as lets all arrive by their first use);
never before its copy to host is done. A backward starts when each
copy back is in by its first use (`Swap.need_us` after it starts): the wait is **exposed copy
time**. The two directions do not slow each other (a duplex link; a rank's engines are its
own).

**Memory** at every moment of an action: every other live (stage, microbatch) pair holds
`held_bytes` (its plan's, swapped bytes out) plus each of its swapped tensors on its way to
host or on its way back (a copy counts from its start, as in the simulator); the running
action its stage's memory over time in its own run (`Segments`: 64 spans, each at its most)
plus, for a forward, each of its swapped tensors whose copy to host ends later than there
(the engine was busy with other microbatches'), less, for a backward, each copy back not yet
issued; what finished backwards left until the step ends (`linger_bytes`). A stage whose
output is dropped once its send is waited (torch 2.15's PipelineStage under GPipe and 1F1B:
`Boundary.released`) holds it only until the rank's next backward begins
(`released_bytes`); a stage's per-step receive buffer (`Boundary.received`) is in its held
bytes and in the running action's own memory. The rank's peak is the largest. Receive
buffers kept all step (torch 2.13 and 2.14: `recv_bytes`, per rank) are beside the
activations: copies back fill the budget less them, and a rank fits where its peak and
them are under its budget (`RankJudged.fits`, as `RankRow.fits`). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from ..schema import Action, Plan, Profile
from .stages import STARTS, Boundary, Step, live_steps, stage_cost

__all__ = ["Swap", "StageWork", "RankJudged", "Judged", "stage_work", "judge"]

FIRST_USE = ("B", "I")          # the backward kinds that read the saved tensors first


class Swap(NamedTuple):
    """One swapped tensor of a stage, per microbatch."""
    bytes: int          # device bytes it frees while on host (0: the pipeline holds it anyway)
    d2h_us: float       # its copy to host
    h2d_us: float       # its copy back
    ready_us: float     # its producer's end, from the forward's start
    need_us: float      # its first use, from the backward's start
    alone_us: float     # when its copy to host ends in the stage's own run, from its start


Segments = tuple[tuple[float, float, int], ...]     # (from, to: from the action's start, bytes)


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
    fwd_alone_us: float | None = None       # as in its own run: waiting for copies to host
    fwd_alone_peak_bytes: int | None = None
    # its memory over time, per way of running (`Segments`; None: its peak throughout)
    fwd_mem: Segments | None = None
    fwd_alone_mem: Segments | None = None
    bwd_mem: Segments | None = None
    released_bytes: int = 0     # held only until the rank's next backward (module docstring)

    @property
    def fwd_waits(self) -> tuple[float, int]:
        """(its forward's time, its peak) when it waits for memory as in its own run."""
        return (self.fwd_us if self.fwd_alone_us is None else self.fwd_alone_us,
                self.fwd_peak_bytes if self.fwd_alone_peak_bytes is None
                else self.fwd_alone_peak_bytes)


@dataclass(frozen=True)
class RankJudged:
    rank: int
    end_us: float               # when its last action ends
    busy_us: float              # compute: its actions' times, waits not counted
    exposed_us: float           # compute waited for copies
    peak_bytes: int
    d2h_busy_us: float          # its engines' busy time
    h2d_busy_us: float
    budget_bytes: int = 0       # as given to `judge` (0: none)
    recv_bytes: int = 0         # its receive buffers, all step, beside `peak_bytes`

    @property
    def fits(self) -> bool:
        """Its peak with copies in flight and its receive buffers under its budget (no budget:
        fits), as `RankRow.fits`."""
        return self.budget_bytes <= 0 or self.peak_bytes + self.recv_bytes <= self.budget_bytes


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


def _segments(memory, lo: float, hi: float, add: int, n: int = 64) -> Segments:
    """The timeline over [lo, hi) in `n` equal spans, each at the most it reaches there (plus
    `add`): what the judge adds to what others hold, an upper bound within each span."""
    if hi <= lo:
        return ((0.0, 0.0, _peak_in(memory, lo, float("inf")) + add),)
    width = (hi - lo) / n
    best = [0] * n
    cur, k = 0, 0
    for t, m in memory:
        if t >= hi:
            break
        if t <= lo:
            cur = m
            continue
        while k < n and lo + (k + 1) * width <= t:
            best[k] = max(best[k], cur)
            k += 1
        cur = m
        if k < n:
            best[k] = max(best[k], m)
    for j in range(k, n):
        best[j] = max(best[j], cur)
    return tuple((j * width, (j + 1) * width, b + add) for j, b in enumerate(best))


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


def _forward_ends(prof: Profile) -> dict[int, float]:
    """forward op id -> when it ends, from the forward's start (no waits)."""
    ends, t = {}, 0.0
    for op in prof.ops[:prof.n_forward]:
        t += op.time_us
        ends[op.id] = t
    return ends


def stage_work(prof: Profile, plan: Plan | None, hw, boundary: Boundary = Boundary()
               ) -> StageWork:
    """`prof` under `plan` (None: keep everything) on `hw`, for the judge, from the stage run
    alone by the simulator three times: with the plan's copies and no budget (its forward
    without waiting: its memory, when each copy to host ends), with them under the plan's
    budget (its forward as in its own run, waiting for memory) and with its swaps kept (the
    backward's compute and its memory with every copy back in at its start, less in the judge
    each one not yet issued; when each swapped tensor is first read). The running action
    holds its per-step receive buffer (`Boundary.received`) beside its own memory."""
    from ..simulate import simulate
    cost = stage_cost(prof, plan, boundary)
    fwd = sum(op.time_us for op in prof.ops[:prof.n_forward])
    dropped = cost.boundary_held if cost.released else 0
    if plan is None or not plan.decisions:
        bwd = sum(op.time_us for op in prof.ops[prof.n_forward:])
        peak = cost.peak_bytes + cost.received_bytes
        return StageWork(fwd, bwd, cost.held_bytes, peak, peak + cost.boundary_bytes,
                         cost.linger_bytes, released_bytes=dropped)
    # pinned evictions, eager excess; the receive buffer
    extra = cost.peak_bytes - plan.predicted.peak_bytes + cost.received_bytes
    acts = {d.tensor: d.action for d in plan.decisions}
    kept = simulate(prof, {t: (Action.KEEP if a == Action.SWAP else a) for t, a in acts.items()},
                    hw, None, record=True)
    free = simulate(prof, plan.decisions, hw, None, record=True)
    own = simulate(prof, plan.decisions, hw, plan.budget_bytes, record=True)   # its forward
    own_end = max((e.end_us for e in own.events if e.engine == "compute"
                   and e.kind == "op" and e.op < prof.n_forward), default=0.0)
    swapped = [t for t, a in acts.items() if a == Action.SWAP]
    need = _first_need(prof, kept.events, fwd, swapped)
    alone = {ev.tensor: ev.end_us for ev in free.schedule if ev.kind == "offload"}
    ends = _forward_ends(prof)
    swaps = []
    for tid in sorted(swapped, key=lambda x: ends.get(prof.tensors[x].producer, 0.0)):
        size = prof.tensors[tid].size_bytes
        ready = ends.get(prof.tensors[tid].producer, 0.0)
        swaps.append(Swap(0 if tid in boundary.pinned else size, hw.copy_us(size, "d2h"),
                          hw.copy_us(size, "h2d"), ready, need.get(tid, 0.0),
                          alone.get(tid, ready)))
    back, inf = cost.boundary_bytes + extra, float("inf")
    return StageWork(fwd, kept.predicted.step_us - fwd, cost.held_bytes,
                     _peak_in(free.memory, 0.0, fwd) + extra,
                     _peak_in(kept.memory, fwd, inf) + back, cost.linger_bytes,
                     tuple(swaps), own_end, _peak_in(own.memory, 0.0, own_end) + extra,
                     _segments(free.memory, 0.0, fwd, extra),
                     _segments(own.memory, 0.0, own_end, extra),
                     _segments(kept.memory, fwd, kept.predicted.step_us, back), dropped)


def _pairs(steps: Sequence[Step]) -> tuple[dict, dict]:
    """(pair -> index of its forward, pair -> index of its first backward use)."""
    made, used = {}, {}
    for k, (kind, stage, mb) in enumerate(steps):
        if kind in STARTS:
            made.setdefault((stage, mb), k)
        elif kind in FIRST_USE:
            used.setdefault((stage, mb), k)
    return made, used


def _kept_outputs(steps: Sequence[Step]) -> list[frozenset]:
    """Per action: the pairs whose forward ran since the rank's last backward began, the
    only ones still holding an output dropped once its send is waited (`released_bytes`)."""
    out, sent = [], set()
    for kind, stage, mb in steps:
        if kind in FIRST_USE:
            sent.clear()
        out.append(frozenset(sent))
        if kind in STARTS:
            sent.add((stage, mb))
    return out


def _held(work: Mapping[int, StageWork], pair, kept: frozenset) -> int:
    """What a live pair that is not running holds (its output gone once released)."""
    w = work[pair[0]]
    return w.held_bytes - (0 if pair in kept else w.released_bytes)


def _static_need(steps: Sequence[Step], work: Mapping[int, StageWork], budget: int):
    """(per action: the others' held bytes, its own peak (a backward's before its copies
    back) and what lingers, no copies; the limit copies back may fill up to; the forwards that
    wait for memory as in their own run: those that would not fit the budget without)."""
    base, own_free, own_wait, lingering = [], [], [], 0
    for ((kind, stage, mb), live), kept in zip(live_steps(steps), _kept_outputs(steps)):
        w = work[stage]
        base.append(lingering + sum(_held(work, (s, m), kept) for s, m in live
                                    if (s, m) != (stage, mb)))
        bwd = w.bwd_peak_bytes - sum(sw.bytes for sw in w.swaps)
        own_free.append(w.fwd_peak_bytes if kind in STARTS else bwd)
        own_wait.append(w.fwd_waits[1] if kind in STARTS else bwd)
        if kind in FIRST_USE:
            lingering += w.linger_bytes
    need = [b + o for b, o in zip(base, own_free)]
    limit = budget if budget > 0 else max(need, default=0)
    waiting = {k for k, n in enumerate(need) if n > limit and own_wait[k] < own_free[k]}
    for k in waiting:
        need[k] = base[k] + own_wait[k]
    return need, limit, waiting


def _issue_points(steps: Sequence[Step], work: Mapping[int, StageWork], budget: int):
    """(action index -> the copies back, (pair, swap index), issued at its start, in issue
    order; the limit they fill up to). A pair's copies back go one by one in order of need,
    each at the earliest action after its forward (not before the one issued before it) from
    which holding it until its backward keeps every action under the limit, or else at its
    backward's start."""
    need, limit, _ = _static_need(steps, work, budget)
    made, used = _pairs(steps)
    issue: dict[int, list] = {}
    floor = 0
    for pair, b in sorted(used.items(), key=lambda kv: kv[1]):
        w = work[pair[0]]
        if not w.swaps or pair not in made:
            continue
        for i in sorted(range(len(w.swaps)), key=lambda x: w.swaps[x].need_us):
            size = w.swaps[i].bytes
            j = next((c for c in range(max(made[pair] + 1, floor), b)
                      if all(need[a] + size <= limit for a in range(c, b + 1))), b)
            for a in range(j, b + 1 if j < b else b):
                need[a] += size
            floor = j
            issue.setdefault(j, []).append((pair, i))
    return issue, limit


class _Rank:
    """One rank's engines and what its copies did (times by (stage, mb, swap index))."""

    def __init__(self):
        self.free = self.d2h = self.h2d = 0.0
        self.busy = self.exposed = self.d2h_busy = self.h2d_busy = 0.0
        self.d2h_end: dict = {}
        self.h2d_start: dict = {}
        self.h2d_end: dict = {}
        self.times: list[tuple[float, float]] = []
        self.waiting: set = set()

    def offload(self, pair, swaps: Sequence[Swap], start: float) -> None:
        for i, sw in enumerate(swaps):
            begin = max(start + sw.ready_us, self.d2h)
            self.d2h = self.d2h_end[(*pair, i)] = begin + sw.d2h_us
            self.d2h_busy += sw.d2h_us

    def fetch(self, pair, i: int, sw: Swap, now: float) -> None:
        """Issue the copy back of swap i of `pair` at `now` (it starts when the engine and
        its copy to host are done)."""
        begin = max(now, self.d2h_end[(*pair, i)], self.h2d)
        self.h2d_start[(*pair, i)] = begin
        self.h2d = self.h2d_end[(*pair, i)] = begin + sw.h2d_us
        self.h2d_busy += sw.h2d_us


def _duration(kind: str, w: StageWork) -> float:
    return w.fwd_us if kind in STARTS else w.bwd_us if kind == "B" else w.bwd_us / 2


def _just_in_time(r: _Rank, pair, swaps: Sequence[tuple[int, Swap]], ready: float) -> float:
    """Issue a backward's own copies back (in order of need) each as late as lets every one
    arrive by its first use if the backward starts at `ready` (the engine FIFO): what the
    stage's own run does when memory is short. Returns when the last was issued."""
    latest, starts = float("inf"), []
    for _, sw in reversed(swaps):
        latest = min(latest, sw.need_us) - sw.h2d_us
        starts.append(latest)
    last = ready
    for (i, sw), at in zip(swaps, reversed(starts)):
        last = max(last, ready + at)
        r.fetch(pair, i, sw, last)
    return last


def _act(r: _Rank, k: int, step: Step, ready: float, work, plan) -> float:
    """Run action k of a rank that may start at `ready`; returns its end (`plan`:
    `_plan_copies`). A forward that would take the rank over the limit without waiting waits
    for memory as in the stage's own run."""
    issue, used, limit, walk, linger, kept = plan
    kind, stage, mb = step
    w = work[stage]
    mine = [i for pair, i in issue.get(k, ()) if pair == (stage, mb)]
    after = _just_in_time(r, (stage, mb), [(i, w.swaps[i]) for i in mine], ready)
    for pair, i in issue.get(k, ()):
        if pair != (stage, mb):
            r.fetch(pair, i, work[pair[0]].swaps[i], after)
    start, took = ready, _duration(kind, w)
    if kind in FIRST_USE and used.get((stage, mb)) == k and w.swaps:
        start = max(ready, max(r.h2d_end[(stage, mb, i)] - sw.need_us
                               for i, sw in enumerate(w.swaps)))
    r.times.append((start, start + took))
    if kind in STARTS:
        r.offload((stage, mb), w.swaps, start)
        if (w.fwd_waits[1] < w.fwd_peak_bytes
                and _action_mem(r, k, walk[k], linger[k], work, False, kept[k]) > limit):
            took = w.fwd_waits[0]
            r.exposed += took - w.fwd_us
            r.waiting.add(k)
            r.times[k] = (start, start + took)
    r.exposed += start - ready
    r.busy += _duration(kind, w)
    r.free = start + took
    return r.free


def _plan_copies(steps, work, budget: int):
    """What `_act` needs of a rank: (index -> the copies back issued at its start, pair ->
    index of its first backward use, the memory limit, each action's step and live pairs,
    what lingers at each, the pairs still holding a released output at each)."""
    issue, limit = _issue_points(steps, work, budget)
    return (issue, _pairs(steps)[1], limit, list(live_steps(steps)), _lingering(steps, work),
            _kept_outputs(steps))


def _run(order, work, limits: Mapping[int, int], alone: bool) -> dict[int, _Rank]:
    """Every rank's actions in time order (cross-rank waits unless `alone`); `limits`: rank ->
    what its activations and copies may fill (0: no limit)."""
    done: dict[tuple[str, int, int], float] = {}
    n_stages = 1 + max((s for steps in order.values() for _, s, _ in steps), default=0)
    ranks = {r: _Rank() for r in order}
    plans = {r: _plan_copies(steps, work, limits[r]) for r, steps in order.items()}
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


def _others(r: _Rank, pair, swaps: Sequence[Swap], start: float, end: float,
            events: list) -> int:
    """Bytes of a live pair's swapped tensors on the device at `start`; `events` gains
    (time, change) for each that leaves (copy to host done) or comes back (copy back issued)
    before `end`."""
    total = 0
    for i, sw in enumerate(swaps):
        gone = r.d2h_end.get((*pair, i), 0.0)
        back = r.h2d_start.get((*pair, i))
        if gone > start:
            total += sw.bytes
            if gone < end:
                events.append((gone, -sw.bytes))
        if back is not None and back <= start:
            total += sw.bytes
        elif back is not None and back < end:
            events.append((back, sw.bytes))
    return total


def _own(w: StageWork, kind: str, waiting: bool) -> Segments:
    """The running action's memory over time (its peak throughout where not known)."""
    if kind in STARTS:
        segs, peak = ((w.fwd_alone_mem, w.fwd_waits[1]) if waiting
                      else (w.fwd_mem, w.fwd_peak_bytes))
    else:
        segs, peak = (w.bwd_mem if kind == "B" else None), w.bwd_peak_bytes
    return segs if segs else ((0.0, float("inf"), peak),)


def _action_peak(start: float, end: float, base: int, own: Segments, events: list) -> int:
    """The most of `base` + the events' changes so far + the running action's own memory,
    over [start, end)."""
    events.sort()
    points = sorted({start, *(start + a for a, _, _ in own if start + a < end),
                     *(t for t, _ in events)})
    best, cur, e, o = 0, base, 0, 0
    for x in points:
        while e < len(events) and events[e][0] <= x:
            cur += events[e][1]
            e += 1
        while o + 1 < len(own) and start + own[o][1] <= x:
            o += 1
        best = max(best, cur + own[o][2])
    return best


def _action_mem(r: _Rank, k: int, at, lingering: int, work, waiting: bool,
                kept: frozenset) -> int:
    """The rank's peak while action k runs (`at`: the step and the pairs live then; `kept`:
    `_kept_outputs`)."""
    (kind, stage, mb), live = at
    start, end = r.times[k]
    events: list = []
    mem = lingering
    for s, m in live:
        if (s, m) != (stage, mb):
            mem += _held(work, (s, m), kept) + _others(r, (s, m), work[s].swaps, start, end,
                                                       events)
    w = work[stage]
    if kind in STARTS:                  # its copies to host ending later than alone
        for i, sw in enumerate(w.swaps):
            late_from, done = start + sw.alone_us, r.d2h_end[(stage, mb, i)]
            if done > late_from + 1e-9 and late_from < end:
                events += [(late_from, sw.bytes), (done, -sw.bytes)]
    elif (stage, mb, 0) in r.h2d_start and kind in FIRST_USE:
        for i, sw in enumerate(w.swaps):    # its copies back not yet issued
            back = r.h2d_start[(stage, mb, i)]
            if back > start:
                mem -= sw.bytes
                events.append((back, sw.bytes))
    return _action_peak(start, end, mem, _own(w, kind, waiting), events)


def _lingering(steps: Sequence[Step], work) -> list[int]:
    """Per action: what the backwards before it left until the step ends."""
    out, total = [], 0
    for kind, stage, _ in steps:
        out.append(total)
        if kind in FIRST_USE:
            total += work[stage].linger_bytes
    return out


def _rank_peak(steps: Sequence[Step], work, r: _Rank) -> int:
    linger, kept = _lingering(steps, work), _kept_outputs(steps)
    return max((_action_mem(r, k, at, linger[k], work, k in r.waiting, kept[k])
                for k, at in enumerate(live_steps(steps))), default=0)


def judge(order: Mapping[int, Sequence[Step]], work: Mapping[int, StageWork],
          budget: Mapping[int, int] | int = 0, alone: bool = False,
          recv_bytes: Mapping[int, int] | None = None) -> Judged:
    """Each rank's time, peak and exposed copy time under the stages' `work` (module
    docstring). `budget`: per rank (or one for all) its memory, which copies back may fill
    ahead of their backward (0: what the rank needs anyway without them); `recv_bytes`: rank
    -> its receive buffers kept all step, taken off its budget (`RankJudged.fits`)."""
    budgets = {r: budget if isinstance(budget, int) else budget.get(r, 0) for r in order}
    recv = {r: (recv_bytes or {}).get(r, 0) for r in order}
    # a budget the receive buffers fill leaves the activations 1 byte: every copy back late
    ranks = _run(order, work, {r: max(1, b - recv[r]) if b > 0 else 0
                               for r, b in budgets.items()}, alone)
    out = {}
    for rank, steps in order.items():
        r = ranks[rank]
        out[rank] = RankJudged(rank, r.free, r.busy, r.exposed, _rank_peak(steps, work, r),
                               r.d2h_busy, r.h2d_busy, budgets[rank], recv[rank])
    return Judged(max((j.end_us for j in out.values()), default=0.0), out)
