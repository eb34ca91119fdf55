"""`verify`'s memory timeline: the patched step measured op by op (`memtrace`), each aten call
named after the patched module's statement that made it, and aligned with the simulator's
prediction for the same decisions (on this device: CPU copies are synchronous), with the op
where the run held the most more than predicted. Also the eager step's peak, measured alike.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...hardware import HardwareSpec
from ...profile_build import recost
from ...schema import Action, Decision
from ...simulate import simulate
from .. import swap
from .memtrace import SKIP, MemTracker, caller_line

_DEF = re.compile(r"^\s*(\w+) = (?:aten|torch\.ops)\.")
_STORE = re.compile(r"_s\.(?:prefetch|wait|offload)\('(\w+)'")


@dataclass
class TimelineRow:
    """One op of the patched step: what the simulator predicted and what the run held."""
    op: int | None             # profile op id (None: a runtime call, e.g. a prefetch's copy)
    name: str                  # the op's (or the statement's) name
    recompute: bool            # a forward op re-run in backward
    predicted_bytes: int | None
    measured_bytes: int
    statement: str = ""
    target: str = ""           # the aten call this row measured (a statement may make several)


def synchronous_copies(hw):
    """`hw` with copies that take no time: how a CPU run (copies are synchronous there) moves
    swapped tensors. Memory accounting can then be compared without the GPU's copy timing."""
    return dataclasses.replace(hw, h2d_bytes_per_s=1e30, d2h_bytes_per_s=1e30,
                               copy_latency_us=0.0)


def predicted_timeline(profile, plan, hw, budget_bytes, *, issue_at_schedule: bool = False):
    """(per-task predicted memory [(op, recompute, bytes)], simulated peak) for `plan`'s
    decisions on `hw`. Memory during a task is the highest value the simulator recorded from
    its start to its end. Ops the profile times at 0 us (views) get 1e-6 us, so every task
    has an interval of its own (the schedule does not change by any measurable amount).
    `issue_at_schedule`: prefetches no earlier than where the plan's schedule issued them,
    which is where the patched module issues them."""
    ops = tuple(o if o.time_us > 0 else dataclasses.replace(o, time_us=1e-6) for o in profile.ops)
    prof = dataclasses.replace(profile, ops=ops)
    decisions = list(plan.decisions)
    if issue_at_schedule:
        issue = {e.tensor: e.issue_op for e in plan.schedule if e.kind == "prefetch"}
        decisions = [Decision(d.tensor, d.action, issue.get(d.tensor, d.prefetch_at))
                     if d.action == Action.SWAP else d for d in decisions]
    res = simulate(prof, decisions, hw, budget_bytes, record=True)
    mem = res.memory
    out = []
    j, cur = 0, 0
    for e in res.events:
        if e.engine != "compute" or e.kind not in ("op", "recompute"):
            continue
        while j < len(mem) and mem[j][0] <= e.start_us:
            cur = mem[j][1]
            j += 1
        m, k = cur, j
        while k < len(mem) and mem[k][0] < e.end_us:
            m = max(m, mem[k][1])
            k += 1
        out.append((e.op, e.kind == "recompute", m))
    return out, res.predicted.peak_bytes


@dataclass
class MeasuredStep:
    rows: list[TimelineRow]            # one per aten call of forward_step/backward_step
    peak_bytes: int
    peak_row: int
    tracker: object
    sample_rows: dict                  # tracker sample index -> index into rows


def measure_patched_step(mod, patched, p_args, p_kwargs, profile=None) -> MeasuredStep:
    """Run one patched training step under `memtrace.MemTracker` and name every aten call
    after the statement of the patched module that made it (its line in forward_step or
    backward_step). Host buffers of the swap engine and calls outside the two steps
    (autograd's own bookkeeping) allocate no activation memory; the gradients the backward
    returns are taken off the timeline (the profile's `gradient` tensors)."""
    src = Path(mod.__file__).read_text().splitlines()
    codes = {mod.forward_step.__code__: "forward", mod.backward_step.__code__: "backward",
             swap.HostPool.get.__code__: SKIP}
    grads: list = []
    inner = patched.backward_fn

    def backward_fn(*a):
        g = inner(*a)
        grads.extend(x for x in g if x is not None)
        return g

    op_id = {o.name: o.id for o in profile.ops} if profile is not None else {}
    n_fwd = profile.n_forward if profile is not None else 0
    tracker = MemTracker(caller_line(codes, outside=SKIP))
    patched.backward_fn = backward_fn
    try:
        with tracker:
            loss = patched(*p_args, **p_kwargs)
            loss.backward()
    finally:
        patched.backward_fn = inner
    tracker.finish()
    tracker.exclude(grads)
    tl = tracker.timeline()
    rows: list[TimelineRow] = []
    sample_rows = {}
    for s, v in zip(tracker.samples, tl):
        if s.label is SKIP or s.label is None:
            continue
        phase, line = s.label
        stmt = src[line - 1].strip() if 0 < line <= len(src) else ""
        m = _DEF.match(stmt)
        name = m.group(1) if m else stmt.split("#")[0].strip()[:60]
        op = op_id.get(name) if m else None
        rec = phase == "backward" and op is not None and op < n_fwd
        sample_rows[s.index] = len(rows)
        rows.append(TimelineRow(op, name, rec, None, v, stmt, s.target))
    peak_row = max(range(len(rows)), key=lambda i: rows[i].measured_bytes, default=0)
    peak = rows[peak_row].measured_bytes if rows else 0
    return MeasuredStep(rows, peak, peak_row, tracker, sample_rows)


def align(predicted, measured: list[TimelineRow]) -> tuple[list[int | None], int]:
    """The simulator's memory for each measured row, and how many tasks found their row.

    Every profile op runs once in both, in the same order: those match by op id. A recompute
    task matches a re-run of the same op among the calls made before the same backward op
    (its owner), in order. A task the run never made, or a call the simulator does not model
    (a runtime copy, a re-run the simulator does not schedule), stays unmatched (None).
    """
    def owners(items):
        out, nxt = [None] * len(items), None
        for k in range(len(items) - 1, -1, -1):
            op, rec = items[k]
            if op is not None and not rec:
                nxt = op
            out[k] = nxt
        return out

    out: list[int | None] = [None] * len(measured)
    m_items = [(r.op, r.recompute) for r in measured]
    m_owner = owners(m_items)
    row_of = {op: k for k, (op, rec) in enumerate(m_items) if op is not None and not rec}
    rec_rows: dict = {}
    for k, (op, rec) in enumerate(m_items):
        if rec:
            rec_rows.setdefault(m_owner[k], []).append(k)
    p_owner = owners([(op, rec) for op, rec, _ in predicted])
    used: set[int] = set()
    matched = 0
    for (op, rec, m), owner in zip(predicted, p_owner):
        if not rec:
            k = row_of.get(op)
        else:
            k = next((k for k in rec_rows.get(owner, ()) if k not in used
                      and measured[k].op == op), None)
            if k is not None:   # in order: earlier re-runs of this segment are passed
                used.update(x for x in rec_rows[owner] if x <= k)
        if k is not None:
            out[k] = m
            matched += 1
    return out, matched


def worst_divergence(ms: MeasuredStep, profile) -> dict | None:
    """The aligned op where the run held the most more than predicted, and the live tensors
    there, largest first, each with the op after which the profile says it is dead."""
    rows = ms.rows
    cand = [k for k, r in enumerate(rows) if r.predicted_bytes is not None]
    if not cand:
        return None
    k = max(cand, key=lambda i: rows[i].measured_bytes - rows[i].predicted_bytes)
    r = rows[k]
    # where backward stands: the op this row is (or is recomputed for: the next original op)
    at_op = next((x.op for x in rows[k:] if x.op is not None and not x.recompute), None)
    sample = next(s for s, row in ms.sample_rows.items() if row == k)
    ids = {t.name: t.id for t in profile.tensors} if profile is not None else {}
    last = profile.last_use if profile is not None else {}
    tensors = []
    for st in ms.tracker.live_at(sample)[:6]:
        stmt = st.label
        name = "?"
        if isinstance(stmt, tuple):
            text = ms.rows[ms.sample_rows[st.born]].statement if st.born in ms.sample_rows else ""
            m = _DEF.match(text) or _STORE.search(text)
            name = m.group(1) if m else text[:40]
        tid = ids.get(name)
        root = profile.root(tid) if tid is not None else None
        lu = last.get(root) if root is not None else None
        entry = {"tensor": name, "bytes": st.nbytes, "allocated_by": st.target}
        if lu is not None:
            entry["profile_last_use"] = lu
            entry["profile_last_use_name"] = profile.ops[lu].name
            entry["held_past_last_use"] = at_op is not None and lu < at_op
        tensors.append(entry)
    return {"op": r.op, "name": r.name, "recompute": r.recompute, "statement": r.statement,
            "measured_bytes": r.measured_bytes, "predicted_bytes": r.predicted_bytes,
            "excess_bytes": r.measured_bytes - r.predicted_bytes, "live_tensors": tensors}


def recompute_calls(rows, profile) -> int:
    """Ops re-run in backward: calls of a forward op's own function in a recompute statement
    (a statement's other calls, such as the clones that keep BatchNorm's running statistics
    from being updated twice, are not re-runs; nor are ops that only make views)."""
    if profile is None:
        return sum(1 for x in rows if x.recompute)
    return sum(1 for x in rows if x.recompute and not is_view_op(profile, x.op)
               and (not x.target or x.target == profile.ops[x.op].target))


def is_view_op(profile, op: int) -> bool:
    """Does op only make views (its outputs alias their inputs' storage: nothing re-run)?"""
    outs = profile.ops[op].outputs
    return bool(outs) and all(profile.tensors[t].alias_of is not None for t in outs)


def measure_eager_step(model, run) -> int:
    """Activation peak of one eager training step (`run()` returns the loss): the same
    accounting, gradients left out."""
    tracker = MemTracker()
    with tracker:
        run().backward()
    tracker.finish()
    tracker.exclude([p.grad for p in model.parameters() if p.grad is not None])
    return max(tracker.timeline(), default=0)


@dataclass
class Timeline:
    """The measured memory timeline, aligned with the simulator's where a profile was found."""
    rows: list = field(default_factory=list)
    worst: dict | None = None
    device_peak: int | None = None
    matched: int = 0
    n_tasks: int = 0
    pred_rec_ops: int | None = None


def aligned_timeline(ms: MeasuredStep, plan, profile, cuda: bool) -> Timeline:
    """Each measured row with the plan's predicted bytes and this device's (CPU: synchronous
    copies), when the profile is known; the measured bytes alone otherwise."""
    if profile is None:
        return Timeline(rows=[{"op": r.op, "name": r.name, "recompute": r.recompute,
                                "measured_bytes": r.measured_bytes, "predicted_bytes": None,
                                "predicted_device_bytes": None} for r in ms.rows])
    hw = HardwareSpec.from_dict(plan.hardware, "plan hardware")
    prof = recost(profile, hw)
    pred_plan, _ = predicted_timeline(prof, plan, hw, plan.budget_bytes)
    if cuda:
        pred_dev, device_peak = pred_plan, plan.predicted.peak_bytes
    else:
        pred_dev, device_peak = predicted_timeline(prof, plan, synchronous_copies(hw), None,
                                                   issue_at_schedule=True)
    on_plan, _ = align(pred_plan, ms.rows)
    on_dev, matched = align(pred_dev, ms.rows)
    out = Timeline(device_peak=device_peak, matched=matched, n_tasks=len(pred_dev))
    out.pred_rec_ops = sum(1 for op, rec, _ in pred_dev if rec and not is_view_op(profile, op))
    for r, a, b in zip(ms.rows, on_plan, on_dev):
        r.predicted_bytes = b
        out.rows.append({"op": r.op, "name": r.name, "recompute": r.recompute,
                         "measured_bytes": r.measured_bytes, "predicted_bytes": a,
                         "predicted_device_bytes": b})
    out.worst = worst_divergence(ms, profile)
    return out
