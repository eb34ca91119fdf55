"""The discrete-event simulator: how long one training step takes under a plan, and how much
activation memory it needs at every moment.

Every planner is judged by this module, so it follows its rules (docs/design.md §6; in full:
docs/planning.md, 'Inside the simulator') literally and states each modelling choice here.

**Engines.** Three FIFO engines: *compute* (one stream: forward ops, then backward ops with
recompute ops inserted), *D2H* (offloads) and *H2D* (prefetches). A copy of `b` bytes takes
`hw.copy_us(b, dir, contended)`; it is *contended* while the other direction is busy (on a
duplex link). When the other direction starts or stops mid-copy, the copy's remaining fraction
continues at the new rate (progress-based: a copy 40% done when contention starts finishes the
remaining 60% at the contended duration). On a link that is not duplex the two directions
never run at once: one waits for the other.

**Memory** is activation memory exactly as `schema` defines it: bytes of live activation roots
(an alias counts through its root; inputs, parameters, buffers and gradients are outside it).
An op allocates its output roots when it starts and frees the roots whose last reader it is
when it ends; views allocate nothing. With every decision "keep" and no budget the simulated
peak equals `Profile.keep_all_peak_bytes` and the step takes exactly `ideal_us`.

**Decisions** (per saved activation root; an unmentioned one is kept):

- *keep*: resident from its producer until its last (backward) reader ends.
- *swap*: its D2H copy is queued when its producer ends; its device memory is freed when the
  copy is done **and** forward no longer reads it. In backward it is fetched back (H2D) and stays
  resident from the copy's start until its last reader ends. The H2D copy cannot start before
  the D2H copy finished.
- *recompute*: freed after its last forward reader. Before the first backward op that reads it
  (or an alias of it), its producer op is re-run, taking the producer's time (counted as
  recompute time). An input of that producer that is not resident then is produced first,
  recursively (a chain, run in forward order): a recomputable one is recomputed; a swapped one
  not yet fetched is fetched (its prefetch is then needed by that chain op); a kept or fetched
  tensor that already died and is not recomputable has its life extended until the chain ran;
  a non-saved, non-recomputable one (a random op's output backward does not save) makes the
  plan impossible (`InputError`). A recomputed tensor stays resident until its last reader,
  and so does every recompute-decision tensor a chain passes through: recomputing a run of
  consecutive evicted tensors brings the whole run back at the first use and holds each until
  its own last reader, as the backward graph of torch's partitioner does (each op re-run once).
  Chain temporaries (values backward does not save) are freed after the last chain op that
  reads them. A re-run op's other
  outputs are allocated for the op's duration and then freed, except those already resident
  (not allocated again) and those that are themselves to be recomputed later (kept, which
  saves a second recompute). A "recompute" decision on a non-recomputable tensor (a random
  op's output) is an `InputError`.

**Prefetch.** Prefetches are issued in backward (never before the first backward op),
in order of first need (first backward reader, or the chain op that needs it), one FIFO.
A prefetch is issued as early as memory allows but never so early that it pushes memory over
the budget at any later point before its use: from the static memory each upcoming compute task
needs (assuming every earlier prefetch arrives just in time) the simulator computes, for each
prefetch, the earliest task from which holding its bytes (and those of the prefetches ahead of
it) fits under the budget until its use; it also needs the current memory to have room. This
reservation is what keeps a greedy "grab memory early" rule from deadlocking. A
`Decision.prefetch_at` (a backward op id) means "not before compute reaches that op", that is
the first task of its recompute chain if it has one (the patched module issues the copy there
too); one later than the tensor's first need is moved to the first task of the op whose
tasks first read it (its chain, if the first reader is a recompute), where the patched module
issues it too. Being FIFO, a held-back prefetch holds back the ones behind it.

**Stalls.** Before a compute task starts, the prefetches it needs must have arrived (else it
waits: cause `late_prefetch`, or `memory_full` when the prefetch itself waits for memory) and
its allocation must fit under the budget (else it waits for an in-flight offload to free memory:
`memory_full`). If nothing in flight can ever free the memory, the plan is **infeasible**:
`feasible=False`, `reason` names the op and the bytes, and the simulation goes on without the
budget from there, so step time and peak describe the whole step (the peak then exceeds the
budget, showing by how much).

**Outputs.** step time = when compute ends the last backward task; retention = ideal / step
(at most 1); peak = the highest activation memory seen; `swapped_bytes` / `prefetched_bytes`
= bytes copied D2H / H2D; `recomputed_bytes` = bytes of activation roots re-produced by
recompute ops (chain temporaries included); one `ScheduleEvent` per offload, prefetch and
recompute op. `events` and `memory` (the timeline) are filled only with `record=True`.

**Static helpers.** `budget_floor_bytes` (no plan fits below it), `step_bound_us` (no plan
takes longer; `check_step_range` refuses a profile and hardware whose plans could hold times a
plan file cannot), `min_peak_bytes` (the least
peak of one plan; the plan is feasible exactly when it fits the budget), `static_costs` (that
peak and the plan's recompute time, the least overhead it can have) and `recompute_chains`
(what each backward op re-runs) need no timing and cost one pass over the task sequence.

**Speed.** Planners call `simulate` many times, so per-profile tables are cached on the
profile object, and the event loop (`_event_loop`) runs on plain lists and ints: what changes
on every task (time, memory, the task and prefetch cursors) lives in its local variables, and
a task that does no swap work costs no function call (docs/planning.md, 'Inside the
simulator', has the timings of this split against a call per task). What happens once per copy or per wait is
outside it (`_Copies`: both `_CopyEngine`s, starting and finishing copies; `_Waits`: why
compute waits, the stall totals,
giving up by raising `_GaveUp`), and so are a recompute task's bookkeeping and, with
`record`, each task's timeline event (`_task_done`), the setup (`simulate`: decisions, the
task program, the prefetch gates) and the result (`_Outcome`).
`benchmarks/simulate_speed.py --against OLD.py` times a change against an older copy.
"""
from __future__ import annotations

import math
import operator
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from operator import sub
from typing import Mapping

from . import schema
from .chains import ACTION_CODES as _CODES
from .chains import KEEP_CODE, NOT_SAVED, RECOMPUTE_CODE, SWAP_CODE, Tables, lay_out
from .chains import tables as _tables
from .errors import InputError
from .hardware import HardwareSpec
from .units import fmt_bytes

_INF = float("inf")
MEMORY_FULL = "memory_full"
LATE_PREFETCH = "late_prefetch"


@dataclass(frozen=True)
class TimelineEvent:
    engine: str            # "compute" | "d2h" | "h2d"
    name: str
    kind: str              # "op" | "recompute" | "stall" | "offload" | "prefetch"
    start_us: float
    end_us: float
    op: int | None = None
    tensor: int | None = None
    cause: str | None = None


@dataclass(frozen=True)
class SimResult:
    feasible: bool
    reason: str | None
    predicted: schema.Predicted
    schedule: tuple[schema.ScheduleEvent, ...]
    events: tuple[TimelineEvent, ...]
    memory: tuple[tuple[float, int], ...]


def ideal_us(profile: schema.Profile) -> float:
    """Forward + backward compute time with unlimited memory (sum of op times)."""
    return _tables(profile).ideal_us


# --------------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------------
def _parse_decisions(prof: schema.Profile, tab: Tables,
                     decisions) -> tuple[list[int], dict[int, int]]:
    action = list(tab.default_action)
    prefetch_at: dict[int, int] = {}
    if decisions is None:
        return action, prefetch_at
    if isinstance(decisions, Mapping):
        items = [(k, v, None) for k, v in decisions.items()]
    else:
        items = []
        for d in decisions:
            if isinstance(d, schema.Decision):
                items.append((d.tensor, d.action, d.prefetch_at))
            else:
                raise InputError(f"decision {d!r} is not a schema.Decision",
                                 hint="pass a mapping tensor id -> action or Decision objects")
    for tid, act, pa in items:
        try:
            tid = operator.index(tid)
            pa = None if pa is None else operator.index(pa)
        except TypeError:
            raise InputError(f"decision names tensor {tid!r} (prefetch_at {pa!r}): "
                             "not an integer id", hint="tensor ids are integers") from None
        if not 0 <= tid < tab.n_t:
            raise InputError(f"decision names tensor {tid!r}, which does not exist",
                             hint="decisions refer to saved activation roots of this profile")
        if not tab.saved[tid]:
            raise InputError(f"decision names tensor {tid} ({prof.tensors[tid].name}), "
                             "which is not a saved activation root",
                             hint="only saved activation roots (profile.saved_activations) "
                                  "take keep/swap/recompute")
        code = _CODES.get(act)
        if code is None:
            raise InputError(f"tensor {tid} has action {act!r}",
                             hint="actions are keep, swap, recompute")
        if code == RECOMPUTE_CODE and not tab.recomputable[tid]:
            raise InputError(f"tensor {tid} ({prof.tensors[tid].name}) cannot be recomputed: "
                             f"it is the output of op {tab.producer[tid]} "
                             f"({prof.ops[tab.producer[tid]].target}), which is random or not "
                             "replayable", hint="keep or swap it instead")
        action[tid] = code
        if pa is not None:
            if code != SWAP_CODE:
                raise InputError(f"tensor {tid} has prefetch_at but action {act!r}",
                                 hint="prefetch_at applies to swapped tensors only")
            if not isinstance(pa, int) or not tab.n_fwd <= pa < tab.n_ops:
                raise InputError(f"tensor {tid} has prefetch_at {pa!r}, which is not a "
                                 "backward op", hint=f"backward ops are {tab.n_fwd}.."
                                                     f"{tab.n_ops - 1}")
            prefetch_at[tid] = pa
    return action, prefetch_at


# --------------------------------------------------------------------------------------------
# The static program: compute tasks and their static memory
# --------------------------------------------------------------------------------------------
class _Program:
    """The compute task sequence and its memory bookkeeping, before any timing.

    Tasks 0..n_fwd-1 are the forward ops; backward tasks follow, with recompute tasks inserted.
    `alloc[t]` / `free[t]`: bytes allocated at the start / freed at the end of task t, except
    swapped tensors' forward release (`release[t]`, waits for the offload) and their backward
    residency, which starts when the prefetch is issued (`need[t]`: roots task t needs fetched).
    `req()[t]`: memory during task t if every prefetch arrived just in time and every offload
    had finished: the least memory task t can run with.
    """

    __slots__ = ("task_op", "task_owner", "n_rec", "alloc", "free", "release", "offload",
                 "need", "need_task", "queue", "rec_bytes", "rec_root", "special",
                 "_swap_in", "_fwd_release", "_req")

    def __init__(self, prof: schema.Profile, tab: Tables, action: list[int]):
        nf, n_ops = tab.n_fwd, tab.n_ops
        producer, size = tab.producer, tab.size
        last_use = tab.last_use
        lay = lay_out(prof, tab, action)
        task_op, task_owner, op_task = lay.task_op, lay.task_owner, lay.op_task
        need_task, ext, alloc_rec = lay.need_task, lay.ext, lay.chain_alloc
        mat_start, temps, rec_root = lay.made, lay.temps, lay.chain_root
        T = len(task_op)
        N = T
        # decision-independent part (values that are not saved activations), laid on tasks
        if alloc_rec:
            alloc = tab.base_alloc[:nf] + [0] * (N - nf)
            free = tab.base_free[:nf] + [0] * (N - nf)
            base_alloc, base_free = tab.base_alloc, tab.base_free
            for i in range(nf, n_ops):
                t = op_task[i]
                alloc[t] = base_alloc[i]
                free[t] = base_free[i]
        else:
            alloc = list(tab.base_alloc)
            free = list(tab.base_free)
        release: dict[int, list[int]] = {}
        offload: dict[int, list[int]] = {}
        need: dict[int, list[int]] = {}
        swap_in: dict[int, int] = {}
        fwd_release: dict[int, int] = {}
        lfu = tab.last_fwd_use
        for r in tab.saved_roots:
            p, s, a = producer[r], size[r], action[r]
            alloc[p] += s
            if a == KEEP_CODE:
                e = op_task[last_use[r]]
                if r in ext and ext[r] > e:
                    e = ext[r]
                free[e] += s
            elif a == RECOMPUTE_CODE:
                free[lfu[r]] += s
            else:
                f = lfu[r]
                fwd_release[f] = fwd_release.get(f, 0) + s
                if f in release:
                    release[f].append(r)
                else:
                    release[f] = [r]
                if p in offload:
                    offload[p].append(r)
                else:
                    offload[p] = [r]
                nt = need_task.get(r)
                if nt is not None:
                    swap_in[nt] = swap_in.get(nt, 0) + s
                    if nt in need:
                        need[nt].append(r)
                    else:
                        need[nt] = [r]
                    e = op_task[last_use[r]]
                    if r in ext and ext[r] > e:
                        e = ext[r]
                    free[e] += s
        for r, t in mat_start:
            free[op_task[last_use[r]]] += size[r]
        for r, t, e in temps:
            free[e] += size[r]
        for t, b in alloc_rec.items():
            alloc[t] += b
        special = bytearray(N)   # tasks with swap work: a quick test in the event loop
        for d in (release, offload, need):
            for t in d:
                special[t] = 1
        self.task_op, self.task_owner, self.n_rec = task_op, task_owner, len(alloc_rec)
        self.alloc, self.free, self.release, self.offload = alloc, free, release, offload
        self.need, self.need_task, self.special = need, need_task, special
        self.queue = sorted(need_task, key=lambda r: (need_task[r], r))
        self.rec_bytes = sum(alloc_rec.values())
        self.rec_root = rec_root
        self._swap_in, self._fwd_release, self._req = swap_in, fwd_release, None

    def req(self) -> list[int]:
        if self._req is None:
            inc = list(self.alloc)
            for t, s in self._swap_in.items():
                inc[t] += s
            dec = list(self.free)
            for t, s in self._fwd_release.items():
                dec[t] += s
            # memory during task t: everything allocated up to t, minus what ended before t
            self._req = list(accumulate(map(sub, inc, [0] + dec[:-1])))
        return self._req


def _earliest_issue(prog: _Program, size: list[int], budget: float, bwd_start: int) -> list[int]:
    """For each queued prefetch X: the first task from which issuing it keeps every task up to
    its need under the budget.

    With the prefetches ahead of X held from their issue until their need, memory during task
    k < need(X) is req[k] + C_X - P(k), where C_X is the total size of the queue up to and
    including X and P(k) that of the queued tensors needed at or before k. So X fits from task
    j on when g[k] = budget - req[k] + P(k) >= C_X for every k in [j, need(X)). The last k that
    fails is found on a stack of suffix minima of g (increasing values, increasing positions).
    """
    queue, need_task, req = prog.queue, prog.need_task, prog.req()
    out = []
    stack_k: list[int] = []
    stack_g: list[float] = []
    k = bwd_start
    p_k = 0
    qp = 0
    nq = len(queue)
    total = 0
    for x in queue:
        total += size[x]
        nx = need_task[x]
        while k < nx:
            while qp < nq and need_task[queue[qp]] <= k:
                p_k += size[queue[qp]]
                qp += 1
            g = budget - req[k] + p_k
            while stack_g and stack_g[-1] >= g:
                stack_g.pop()
                stack_k.pop()
            stack_g.append(g)
            stack_k.append(k)
            k += 1
        j = bisect_left(stack_g, total) - 1
        out.append(stack_k[j] + 1 if j >= 0 else bwd_start)
    return out


def budget_floor_bytes(profile: schema.Profile) -> int:
    """The smallest budget any plan can meet.

    Every saved activation swapped (a swap needs only the tensor itself back, while a recompute
    also needs its producer's inputs, so swapping is the least memory an eviction can leave):
    each saved root is resident only while forward reads it and from its first backward reader
    to its last, non-saved values live as they must. Its peak is met by the swap-everything plan
    when compute may wait for every copy, and no plan goes below it. What the model's own
    checkpoints hold (`summary["checkpoint_held"]`: trace/checkpointed.py) is kept.
    """
    tab = _tables(profile)
    if tab.floor_bytes is None:
        held = set(profile.summary.get("checkpoint_held") or ())   # (its checkpoints' own)
        action = [(KEEP_CODE if j in held else SWAP_CODE) if s else NOT_SAVED
                  for j, s in enumerate(tab.saved)]
        tab.floor_bytes = max(_Program(profile, tab, action).req(), default=0)
    return tab.floor_bytes


def step_bound_us(profile: schema.Profile, hw: HardwareSpec) -> float:
    """The longest step any plan of `profile` can take on `hw` (the time counterpart of
    `budget_floor_bytes`): every op once, every saved activation's chain re-run (a chain re-runs
    forward ops only, each once, so at most the forward time), and compute waiting for every
    copy both ways at the both-at-once rate (compute waits only while a copy runs)."""
    ideal = math.fsum(op.time_us for op in profile.ops)
    forward = math.fsum(op.time_us for op in profile.ops[:profile.n_forward])
    saved = profile.saved_activations
    copies = math.fsum(hw.copy_us(t.size_bytes, way, contended=True)
                       for t in saved for way in ("d2h", "h2d"))
    return ideal + len(saved) * forward + copies


def check_step_range(profile: schema.Profile, hw: HardwareSpec, source: str = "profile") -> None:
    """InputError when a plan of `profile` on `hw` could hold times past what a plan file
    records (`schema.MAX_US`): the plan would be written and then refused when read. Only
    absurd figures get here (rates of a few FLOP/s or bytes/s, op times of years)."""
    bound = step_bound_us(profile, hw)
    if bound <= schema.MAX_US:
        return
    ideal = math.fsum(op.time_us for op in profile.ops)
    raise InputError(
        f"{source} on hardware {hw.name}: a step could take up to {bound:.3g} us (its ideal "
        f"step {ideal:.3g} us), past the {schema.MAX_US:g} us a plan can record",
        hint="check the hardware's rates (peak_flops_per_s, fp32_flops_per_s, tf32_flops_per_s, "
             "hbm_bytes_per_s, h2d_bytes_per_s, d2h_bytes_per_s) against a real GPU's: "
             "`slackswap hardware a100-pcie4 --json` prints a preset's to start from; or the "
             "profile's op times, if they were edited by hand")


def min_peak_bytes(profile: schema.Profile, decisions) -> int:
    """The least activation peak `decisions` can run with: the highest memory any compute task
    needs when every offload is done and every prefetch arrives just in time.

    A plan is feasible under a budget exactly when this fits it: compute waits for copies
    rather than exceed the budget, and prefetches only take memory that no later task needs.
    It costs one static pass (no timing), so a planner can test feasibility cheaply.
    """
    return static_costs(profile, decisions).peak_bytes


@dataclass(frozen=True)
class StaticCosts:
    """What one static pass says about a plan (no timing)."""
    recompute_us: float        # time of every op its chains re-run
    peak_bytes: int            # `min_peak_bytes`
    forward_req: list          # least memory during each forward op (as `min_peak_bytes`)


def static_costs(profile: schema.Profile, decisions) -> StaticCosts:
    """`StaticCosts` of `decisions`. A stall-free simulation of the plan takes exactly
    `ideal_us + recompute_us`; no simulation of it is faster."""
    tab = _tables(profile)
    action, _ = _parse_decisions(profile, tab, decisions)
    prog = _Program(profile, tab, action)
    time, nf = tab.time, tab.n_fwd
    rec = sum(time[op] for op, owner in zip(prog.task_op[nf:], prog.task_owner[nf:])
              if op != owner)
    req = prog.req()
    return StaticCosts(rec, max(req, default=0), req[:nf])


def recompute_chains(profile: schema.Profile, decisions) -> dict[int, tuple[int, ...]]:
    """For each backward op preceded by recomputation: the ops re-run before it, in order.

    A long chain means a recomputed tensor's inputs were evicted too (often a block's input
    marked recompute, so the chain runs back into the block before it).
    """
    tab = _tables(profile)
    action, _ = _parse_decisions(profile, tab, decisions)
    return lay_out(profile, tab, action).chains(tab.n_fwd)


# --------------------------------------------------------------------------------------------
# The event loop
# --------------------------------------------------------------------------------------------
class _CopyEngine:
    """One copy direction (D2H or H2D): the copy in flight, if any, and how far it got.

    A copy's duration depends on whether the other direction is busy (`hw.copy_us(...,
    contended)`). When that changes mid-copy, `retime` banks the progress made at the old rate
    (`done`, a fraction) and runs the rest at the new one, so `end` is always the finish time
    under the current contention.
    """

    __slots__ = ("x", "start", "end", "done", "since", "dur", "dur_free", "dur_shared")

    def __init__(self):
        self.x = -1              # the tensor being copied, -1 when idle
        self.end = _INF
        self.start = self.done = self.since = self.dur = self.dur_free = self.dur_shared = 0.0

    def begin(self, x: int, now: float, copy_us, nbytes: int, direction: str, shared: bool):
        """Start copying root `x` (`nbytes`) at `now`; `copy_us` is `HardwareSpec.copy_us`,
        `shared` whether the other direction is busy."""
        self.x = x
        dur_free = self.dur_free = copy_us(nbytes, direction, False)
        dur_shared = self.dur_shared = copy_us(nbytes, direction, True)
        self.dur = dur_shared if shared else dur_free
        self.done = 0.0
        self.start = self.since = now
        self.end = now + self.dur

    def retime(self, now: float, shared: bool) -> None:
        """The other direction started (`shared`) or stopped: re-time the copy in flight."""
        if self.x >= 0 and self.dur_shared != self.dur_free:
            self.done += (now - self.since) / self.dur
            self.since = now
            self.dur = self.dur_shared if shared else self.dur_free
            self.end = now + max(0.0, 1.0 - self.done) * self.dur

    def finish(self) -> int:
        x = self.x
        self.x = -1
        self.end = _INF
        return x


def _issue_point(task_owner: list[int], t: int, N: int, mid_task: bool) -> int:
    """The backward op recorded as a prefetch's issue point (the schedule's `issue_op`, where
    the patched module issues the copy: right before that op's recompute chain). Issued at the
    start of an op's first task (or while compute waits there), that op; issued in the middle
    of a task or of a chain, the next op. The module then issues it no earlier than the
    simulator did (so it holds the copy's memory no longer than simulated), except where
    compute waited at that op for memory or copies: it issues it when compute gets there."""
    if t >= N:
        return task_owner[-1]
    owner = task_owner[t]
    if not mid_task and (t == 0 or task_owner[t - 1] != owner):
        return owner
    k = t + 1
    while k < N and task_owner[k] == owner:
        k += 1
    return task_owner[k] if k < N else owner


def _prefetch_gates(prog: _Program, tab: Tables, prefetch_at: dict[int, int],
                    budget_bytes: int | None) -> tuple[list[int], list[int]]:
    """For each queued prefetch, the first compute task at which it may be issued: by memory
    (`_earliest_issue`, none without a budget) and by its `prefetch_at` pin."""
    nf, queue = tab.n_fwd, prog.queue
    nq = len(queue)
    if budget_bytes is None or not nq:
        earliest = [nf] * nq
    else:
        earliest = _earliest_issue(prog, tab.size, float(budget_bytes), nf)
    pinned = [nf] * nq
    if prefetch_at:
        op_task: dict[int, int] = {}   # a pin means "not before compute reaches this op's chain"
                                       # (op -> its first task)
        for t in range(nf, len(prog.task_op)):
            op_task.setdefault(prog.task_owner[t], t)
        for qi, x in enumerate(queue):
            pa = prefetch_at.get(x)
            if pa is not None:
                # ... and at the latest before the chain of the op whose tasks first read it
                # (where the patched module issues a pin that comes after the first use)
                need = prog.need_task[x]
                pinned[qi] = min(op_task[pa], op_task[prog.task_owner[need]])
    return earliest, pinned


def _no_room(profile: schema.Profile, prog: _Program, tab: Tables, t: int, mem: int,
             budget: float, arrived: set[int]) -> str:
    """Why task t can never start: the bytes it needs against what the budget leaves."""
    ops, op, owner = profile.ops, prog.task_op[t], prog.task_owner[t]
    want = prog.alloc[t] + sum(tab.size[x] for x in prog.need.get(t, ()) if x not in arrived)
    what = (f"op {op} ({ops[op].name})" if owner == op else
            f"recomputing op {op} ({ops[op].name}) for op {owner}")
    return (f"{what} needs {fmt_bytes(want)} more activation memory but the "
            f"budget leaves {fmt_bytes(max(0.0, budget - mem))} "
            f"({fmt_bytes(mem)} of {fmt_bytes(budget)} in use)")


def _stall(cause: str, start: float, end: float, op: int) -> TimelineEvent:
    """Compute waited from `start` to `end` before op `op`, for `cause`."""
    return TimelineEvent("compute", f"stall ({cause})", "stall", start, end, op, None, cause)


def simulate(profile: schema.Profile, decisions, hw: HardwareSpec,
             budget_bytes: int | None = None, *, record: bool = True,
             give_up_stall_us: float | None = None, no_swap=(),
             no_recompute=()) -> SimResult | None:
    """Simulate one training step of `profile` under `decisions` on `hw`.

    `decisions`: a mapping tensor id -> "keep"|"swap"|"recompute", or Decision objects (which
    may carry `prefetch_at`); saved activations not mentioned are kept. `budget_bytes=None`
    means unlimited memory. With `record=False` the timeline (`events`, `memory`) is skipped.
    With `give_up_stall_us` the simulation returns None as soon as compute has stalled longer
    than that, or the plan turns out not to fit (for a search that only wants plans better
    than one it has: stalls only add to the step). `no_swap`, `no_recompute`: roots that may
    not be swapped, recomputed (what the compiled path cannot: `compile_limits`); a decision
    doing so is an InputError, as recomputing a random op's output is.
    """
    if budget_bytes is not None and not budget_bytes >= 0:
        raise InputError(f"budget {budget_bytes!r} is not a non-negative number of bytes",
                         hint="pass a budget in bytes, or None for unlimited memory")
    tab = _tables(profile)
    action, prefetch_at = _parse_decisions(profile, tab, decisions)
    for tids, code, what in ((no_swap, SWAP_CODE, "swapped"),
                             (no_recompute, RECOMPUTE_CODE, "recomputed")):
        for tid in tids:
            if 0 <= tid < len(action) and action[tid] == code:
                raise InputError(f"tensor {tid} ({profile.tensors[tid].name}) is {what}, but "
                                 "the compiled path cannot do that (compile_limits)",
                                 hint="plan with the slackswap planner, which honours it (or "
                                      "for eager: no --for-compile)")
    prog = _Program(profile, tab, action)
    gates = _prefetch_gates(prog, tab, prefetch_at, budget_bytes)
    out = _Outcome(record)
    budget = _INF if budget_bytes is None else float(budget_bytes)
    try:
        _event_loop(profile, tab, prog, hw, budget, gates, out, give_up_stall_us)
    except _GaveUp:
        return None
    return out.result(tab, prog)


class _GaveUp(Exception):
    """The event loop stops: compute stalled longer than `give_up_stall_us`, or the plan
    cannot fit (only raised when `give_up_stall_us` is given)."""


class _Outcome:
    """What the event loop hands over: the schedule, the timeline (with `record`), the stall,
    copy and recompute totals, the step time, the peak and the verdict; `result()` makes the
    SimResult."""

    __slots__ = ("record", "sched", "events", "memory", "stall_mem", "stall_late",
                 "swapped_bytes", "prefetched_bytes", "recompute_us", "feasible", "reason",
                 "step", "peak")

    def __init__(self, record: bool):
        self.record = record
        self.sched: list[tuple] = []
        self.events: list[TimelineEvent] = []
        self.memory: list[tuple[float, int]] = [(0.0, 0)] if record else []
        self.stall_mem = self.stall_late = self.recompute_us = self.step = 0.0
        self.swapped_bytes = self.prefetched_bytes = self.peak = 0
        self.feasible = True
        self.reason: str | None = None

    def result(self, tab: Tables, prog: _Program) -> SimResult:
        predicted = _predicted(self.step, tab.ideal_us, self.peak, self.stall_mem,
                               self.stall_late, self.recompute_us, self.swapped_bytes,
                               self.prefetched_bytes, prog.rec_bytes)
        schedule = tuple(schema.ScheduleEvent(k, x, i, s, e) for k, x, i, s, e in self.sched)
        return SimResult(feasible=self.feasible, reason=self.reason, predicted=predicted,
                         schedule=schedule, events=tuple(self.events), memory=tuple(self.memory))


def _event_loop(profile: schema.Profile, tab: Tables, prog: _Program, hw: HardwareSpec,
                budget: float, gates: tuple[list[int], list[int]], out: _Outcome,
                give_up: float | None) -> None:
    """Run the step's events in time order, filling `out`; raises `_GaveUp` when it gives up
    (`give_up`: compute stalled longer than that, or the plan cannot fit). What changes on
    every task is local; what happens once per copy or per wait is in `_Copies` and `_Waits`."""
    size, nf = tab.size, tab.n_fwd
    task_op, task_owner, alloc, free = prog.task_op, prog.task_owner, prog.alloc, prog.free
    need, special, queue = prog.need, prog.special, prog.queue
    N, nq, has_rec, (earliest, pa_task) = len(task_op), len(queue), prog.n_rec > 0, gates
    dur = [tab.time[o] for o in task_op]
    duplex, record, memory = hw.duplex, out.record, out.memory
    link = _Copies(tab, profile.tensors, hw, out)
    d2h, h2d, dq, arrived, off_done = link.d2h, link.h2d, link.dq, link.arrived, link.off_done
    waits = _Waits(out, link, profile, prog, tab, give_up)
    now = comp_start = recompute_us = 0.0
    comp_end, t, qi, mem, peak, h_issue, comp_busy, waiting = _INF, 0, 0, 0, 0, -1, False, False
    while True:
        # -- compute: start the next task if its prefetches are in and its memory fits -------
        if not comp_busy and t < N:
            missing = _first_missing(need[t], arrived) if special[t] and t in need else -1
            a = alloc[t]
            if missing < 0 and mem + a <= budget:
                if waiting:
                    waiting = waits.stop(now, task_owner[t])
                mem += a
                if mem > peak:
                    peak = mem
                if record and a:
                    memory.append((now, mem))
                comp_busy, comp_start, comp_end = True, now, now + dur[t]
        # -- D2H: next offload; H2D: next prefetch, when its offload is done and memory allows
        if dq and d2h.x < 0 and (duplex or h2d.x < 0):
            link.start_offload(now)
        if (qi < nq and h2d.x < 0 and (duplex or d2h.x < 0) and queue[qi] in off_done
                and t >= earliest[qi] and t >= pa_task[qi] and mem + size[queue[qi]] <= budget):
            x = queue[qi]
            qi, mem = qi + 1, mem + size[x]
            peak = max(peak, mem)
            h_issue = _issue_point(task_owner, t, N, comp_busy and comp_start < now)
            link.start_prefetch(x, now, mem)
        # -- advance to the next event; compute waiting: why, and is there a way out? ------------
        d_end, h_end = d2h.end, h2d.end
        nxt = comp_end
        if d_end < nxt:
            nxt = d_end
        if h_end < nxt:
            nxt = h_end
        if not comp_busy:
            if t >= N:
                break
            waiting = True
            if waits.idle(now, nxt, t, missing, qi, mem, budget):
                budget = _INF              # nothing in flight can free memory: it cannot fit
                continue
        now = nxt
        # -- completions -----------------------------------------------------------------------
        if h_end == now:
            link.prefetch_done(now, h_issue)
        if d2h.end == now:                 # (as re-timed just now)
            mem = link.offload_done(now, mem)
        if comp_end == now:
            is_rec = has_rec and t >= nf and task_owner[t] != task_op[t]
            if is_rec or record:
                recompute_us += _task_done(out, profile.ops, prog, t, is_rec, comp_start, now,
                                           dur[t])
            f = free[t]
            if special[t]:
                f += link.release_and_offload(prog, t)
            if f:
                mem -= f
                if record:
                    memory.append((now, mem))
            t, comp_busy, comp_end = t + 1, False, _INF
    out.step, out.peak, out.recompute_us = (now if N else 0.0), peak, recompute_us


def _first_missing(roots: list[int], arrived: set[int]) -> int:
    """The first of `roots` (prefetched roots a task needs) not arrived yet, else -1."""
    for x in roots:
        if x not in arrived:
            return x
    return -1


def _task_done(out: _Outcome, ops, prog: _Program, t: int, is_rec: bool, start: float,
               end: float, dur: float) -> float:
    """Task t ran from `start` to `end`: a recompute goes into the schedule, and with
    `record` the task into the timeline. Returns its recompute time (`dur`, or 0)."""
    op, owner = prog.task_op[t], prog.task_owner[t]
    root = prog.rec_root[t] if is_rec else None
    if is_rec:
        out.sched.append(("recompute", root, owner, start, end))
    if out.record:
        out.events.append(_compute_event(ops, op, owner, is_rec, root, start, end))
    return dur if is_rec else 0.0


class _Waits:
    """Compute waiting: since when and why; adds the stall time to `out` and, with `record`,
    one stall event per wait."""

    __slots__ = ("cause", "since", "out", "link", "profile", "prog", "tab", "give_up")

    def __init__(self, out: _Outcome, link: _Copies, profile: schema.Profile, prog: _Program,
                 tab: Tables, give_up: float | None):
        self.cause: str | None = None
        self.since = 0.0
        self.out, self.link, self.give_up = out, link, give_up
        self.profile, self.prog, self.tab = profile, prog, tab

    def stop(self, now: float, op: int) -> bool:
        """Compute goes on (or waits for another cause) at `now`, before op `op`; False (no
        longer waiting)."""
        if self.out.record and now > self.since:
            self.out.events.append(_stall(self.cause, self.since, now, op))
        self.cause = None
        return False

    def idle(self, now: float, nxt: float, t: int, missing: int, qi: int, mem: int,
             budget: float) -> bool:
        """Compute cannot start task t at `now` (`missing`: a prefetch it needs that has not
        arrived, else -1) and waits until `nxt`, the next event. True when there is none:
        nothing in flight can free memory, the plan cannot fit (the verdict goes into `out`).
        Raises `_GaveUp` where the loop is to give up."""
        h2d, queue, size = self.link.h2d, self.prog.queue, self.tab.size
        cause = (LATE_PREFETCH if missing >= 0 and not (   # unless the prefetch waits for memory
            h2d.x < 0 and qi < len(queue) and queue[qi] == missing
            and missing in self.link.off_done and mem + size[missing] > budget) else MEMORY_FULL)
        if nxt == _INF:
            if self.give_up is not None:
                raise _GaveUp
            self.out.feasible = False
            self.out.reason = _no_room(self.profile, self.prog, self.tab, t, mem, budget,
                                       self.link.arrived)
            if self.cause is None:         # a wait already running keeps its start and cause
                self.cause, self.since = cause, now
            return True
        self.wait(cause, now, self.prog.task_owner[t], nxt - now)
        return False

    def wait(self, cause: str, now: float, op: int, us: float) -> None:
        """Compute waits `us` from `now` before op `op` for `cause`; raises `_GaveUp` once
        the stalls add up to more than `give_up`."""
        if cause != self.cause:
            if self.cause is not None:
                self.stop(now, op)
            self.cause, self.since = cause, now
        out = self.out
        if cause == MEMORY_FULL:
            out.stall_mem += us
        else:
            out.stall_late += us
        if self.give_up is not None and out.stall_mem + out.stall_late > self.give_up:
            raise _GaveUp


class _Copies:
    """The copy side of the loop: both engines, the offload queue, which roots have arrived,
    which offloads are done, and which swapped roots forward no longer reads (`fwd_over`).
    Starting and finishing copies fills `out`; each happens once per copy."""

    __slots__ = ("d2h", "h2d", "dq", "arrived", "off_done", "fwd_over", "copy_us", "size",
                 "producer", "tensors", "out")

    def __init__(self, tab: Tables, tensors, hw: HardwareSpec, out: _Outcome):
        self.d2h, self.h2d, self.dq = _CopyEngine(), _CopyEngine(), deque()
        self.arrived: set[int] = set()
        self.off_done: set[int] = set()
        self.fwd_over: set[int] = set()
        self.copy_us, self.size, self.producer = hw.copy_us, tab.size, tab.producer
        self.tensors, self.out = tensors, out

    def start_offload(self, now: float) -> None:
        x = self.dq.popleft()
        self.d2h.begin(x, now, self.copy_us, self.size[x], "d2h", self.h2d.x >= 0)
        self.h2d.retime(now, True)          # a running prefetch slows down from now on

    def start_prefetch(self, x: int, now: float, mem: int) -> None:
        """Issue the prefetch of root `x` at `now`; `mem`: memory with its bytes held."""
        if self.out.record:
            self.out.memory.append((now, mem))
        self.h2d.begin(x, now, self.copy_us, self.size[x], "h2d", self.d2h.x >= 0)
        self.d2h.retime(now, True)

    def prefetch_done(self, now: float, h_issue: int) -> None:
        h2d, out = self.h2d, self.out
        start = h2d.start
        x = h2d.finish()
        self.arrived.add(x)
        out.prefetched_bytes += self.size[x]
        out.sched.append(("prefetch", x, h_issue, start, now))
        if out.record:
            out.events.append(_copy_event("h2d", self.tensors[x].name, x, start, now, h_issue))
        self.d2h.retime(now, False)         # the running offload speeds up again

    def offload_done(self, now: float, mem: int) -> int:
        """Finish the offload in flight; returns memory `mem` less the root's bytes if forward
        is done reading it (they are freed now), else `mem`."""
        d2h, out, size, producer = self.d2h, self.out, self.size, self.producer
        start = d2h.start
        x = d2h.finish()
        self.off_done.add(x)
        out.swapped_bytes += size[x]
        out.sched.append(("offload", x, producer[x], start, now))
        if out.record:
            out.events.append(_copy_event("d2h", self.tensors[x].name, x, start, now,
                                          producer[x]))
        self.h2d.retime(now, False)
        if x not in self.fwd_over:
            return mem
        mem -= size[x]
        if out.record:
            out.memory.append((now, mem))
        return mem

    def release_and_offload(self, prog: _Program, t: int) -> int:
        """Task t ended: swapped roots forward no longer reads are freed when their offload is
        done (else when it ends: `fwd_over`); offloads of roots it produced are queued.
        Returns the bytes freed now."""
        f = 0
        rl = prog.release.get(t)
        if rl is not None:
            for x in rl:
                if x in self.off_done:
                    f += self.size[x]
                else:
                    self.fwd_over.add(x)
        ol = prog.offload.get(t)
        if ol is not None:
            self.dq.extend(ol)
        return f


def _predicted(step, ideal, peak, stall_mem, stall_late, recompute_us, swapped, prefetched,
               recomputed) -> schema.Predicted:
    by_cause = {}
    if stall_mem > 0:
        by_cause[MEMORY_FULL] = stall_mem
    if stall_late > 0:
        by_cause[LATE_PREFETCH] = stall_late
    return schema.Predicted(
        step_us=step, ideal_us=ideal, retention=1.0 if step <= 0 else min(1.0, ideal / step),
        peak_bytes=int(peak), stall_us=stall_mem + stall_late, recompute_us=recompute_us,
        swapped_bytes=swapped, prefetched_bytes=prefetched, recomputed_bytes=recomputed,
        stall_by_cause=by_cause)


def _copy_event(engine: str, name: str, x: int, start: float, end: float,
                op: int) -> TimelineEvent:
    kind = "prefetch" if engine == "h2d" else "offload"
    return TimelineEvent(engine, f"{kind} {name}", kind, start, end, op, x, None)


def _compute_event(ops, op: int, owner: int, is_rec: bool, root, start: float,
                   end: float) -> TimelineEvent:
    if is_rec:
        return TimelineEvent("compute", f"recompute {ops[op].name}", "recompute", start, end,
                             op, root, f"for op {owner} ({ops[owner].name})")
    return TimelineEvent("compute", ops[op].name, "op", start, end, op, None, None)
