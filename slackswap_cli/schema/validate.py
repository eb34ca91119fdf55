"""The checks a loaded profile or plan must pass beyond its JSON types: ids resolve, phases
are ordered, numbers are finite and bounded, derived fields agree (`validate_profile`,
`validate_plan`). `save` runs them too, so that no file the tool writes is one it refuses.
"""
from __future__ import annotations

import math

from ..errors import FormatError
from ..hardware import HardwareSpec
from .types import CORRUPT_HINT, KINDS, PHASES, TIME_SOURCES, Action, Plan, Profile, saved_flags


def require(cond: bool, source: str, message: str, hint: str | None = None) -> None:
    if not cond:
        raise FormatError(f"{source}: {message}", hint=hint or CORRUPT_HINT)


def is_int(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (
        isinstance(v, float) and v.is_integer())


# Bounds on numbers read from files: wide enough for any real step (an exabyte, a year), small
# enough that sums over a whole profile stay exact integers and finite times, and that every
# number can be written back (orjson refuses integers of 2**64 and above).
MAX_BYTES = 2**60                    # 1 EiB
MAX_US = 1e15                        # about 31 years
MAX_COUNT = 2**62                    # FLOPs, counts


def _finite_in(v, lo: float, hi: float) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and lo <= v <= hi)


def _int_in(v, lo: int, hi: int) -> bool:
    return is_int(v) and lo <= v <= hi


# summary fields the tool reads, with the check each must pass (others are kept as written)
_SUMMARY_CHECKS = {
    "peak_activation_bytes": ("a whole number of bytes", lambda v: _int_in(v, 0, MAX_BYTES)),
    "saved_bytes": ("a whole number of bytes", lambda v: _int_in(v, 0, MAX_BYTES)),
    "forward_us": ("a time in microseconds", lambda v: _finite_in(v, 0, MAX_US)),
    "backward_us": ("a time in microseconds", lambda v: _finite_in(v, 0, MAX_US)),
    "measured_step_us": ("a time in microseconds", lambda v: _finite_in(v, 0, MAX_US)),
    "op_sum_us": ("a time in microseconds", lambda v: _finite_in(v, 0, MAX_US)),
    "n_ops": ("a count", lambda v: _int_in(v, 0, MAX_COUNT)),
    "n_saved": ("a count", lambda v: _int_in(v, 0, MAX_COUNT)),
}


def validate_profile(prof: Profile, source: str = "profile") -> None:
    """Ids are positions, every reference resolves both ways, phases are ordered, aliases point
    at roots, numbers are finite and bounded, and the derived fields (`consumers`, `saved`, the
    keep-all peak) agree with the ops: a file edited by hand that breaks one of these would
    otherwise crash or mislead the planners far from the edit."""
    n_ops, n_t = len(prof.ops), len(prof.tensors)
    seen_backward = False
    producer_of: dict[int, int] = {}
    readers: list[list[int]] = [[] for _ in range(n_t)]
    for i, op in enumerate(prof.ops):
        require(op.id == i, source, f"ops[{i}] has id {op.id}; ids must equal positions")
        require(op.phase in PHASES, source, f"op {i} has phase {op.phase!r}")
        require(op.time_source in TIME_SOURCES, source, f"op {i} has time_source {op.time_source!r}")
        if op.phase == "backward":
            seen_backward = True
        require(not (seen_backward and op.phase == "forward"), source,
                 f"op {i} is a forward op after backward started")
        require(_finite_in(op.time_us, 0, MAX_US), source,
                 f"op {i} has time_us {op.time_us!r}: not a time in [0, {MAX_US:g}] us")
        require(_int_in(op.flops, 0, MAX_COUNT) and _int_in(op.bytes, 0, MAX_COUNT), source,
                 f"op {i} has a negative or out-of-range FLOP or byte count")
        for tid in (*op.inputs, *op.outputs):
            require(is_int(tid) and 0 <= tid < n_t, source,
                     f"op {i} refers to tensor {tid}, which does not exist")
        for tid in op.outputs:
            require(tid not in producer_of, source,
                     f"tensor {tid} is output by op {producer_of.get(tid)} and op {i}; "
                     "a tensor has one producer")
            producer_of[tid] = i
        for tid in dict.fromkeys(op.inputs):
            readers[tid].append(i)
    n_forward = prof.n_forward
    for j, t in enumerate(prof.tensors):
        require(t.id == j, source, f"tensors[{j}] has id {t.id}; ids must equal positions")
        require(t.kind in KINDS, source, f"tensor {j} has kind {t.kind!r}")
        require(_int_in(t.size_bytes, 0, MAX_BYTES), source,
                 f"tensor {j} has size_bytes {t.size_bytes!r}: not a size in [0, 2**60]")
        require(all(_int_in(d, 0, MAX_COUNT) for d in t.shape), source,
                 f"tensor {j} has shape {list(t.shape)!r:.60}: dimensions are non-negative integers")
        require(t.producer is None or is_int(t.producer) and 0 <= t.producer < n_ops, source,
                 f"tensor {j} has producer {t.producer}, which does not exist")
        for c in t.consumers:
            require(0 <= c < n_ops, source, f"tensor {j} has consumer {c}, which does not exist")
        require(producer_of.get(j) == t.producer, source,
                 f"tensor {j} names op {t.producer} as producer, but "
                 + (f"op {producer_of[j]} outputs it" if j in producer_of
                    else "no op outputs it"))
        require(list(t.consumers) == readers[j], source,
                 f"tensor {j} lists consumers {list(t.consumers)!r:.60}, but the ops reading it "
                 f"are {readers[j]!r:.60}")
        if t.alias_of is not None:
            require(is_int(t.alias_of) and 0 <= t.alias_of < n_t and t.alias_of != j, source,
                     f"tensor {j} aliases tensor {t.alias_of}, which does not exist")
            require(prof.tensors[t.alias_of].alias_of is None, source,
                     f"tensor {j} aliases {t.alias_of}, which is itself an alias; point at the root")
    # `saved` exactly as ProfileBuilder derives it (phases are ordered: checked above)
    saved = saved_flags(prof.tensors, [t.consumers for t in prof.tensors],
                        [i >= n_forward for i in range(n_ops)])
    for j, t in enumerate(prof.tensors):
        expected = saved[j]
        if t.saved != expected:
            why = ("no backward op reads it" + (" or an alias of it" if t.alias_of is None else "")
                   if not expected else "a backward op reads it")
            require(False, source, f"tensor {j} has saved={str(t.saved).lower()}, but {why}")
    _validate_summary(prof, source)
    require(isinstance(prof.fingerprint, str) and prof.fingerprint != "", source,
             "fingerprint is not a non-empty string")
    hw = prof.env.get("hardware")
    require(hw is None or isinstance(hw, (str, dict)), source,
             f"env.hardware is {hw!r:.60}, expected a hardware name, a hardware object or null")
    if isinstance(hw, dict):
        HardwareSpec.from_dict(hw, source=f"{source}: env.hardware")


def _validate_summary(prof: Profile, source: str) -> None:
    for key, (what, ok) in _SUMMARY_CHECKS.items():
        if key in prof.summary:
            v = prof.summary[key]
            require(ok(v), source, f"summary.{key} is {v!r:.60}, expected {what}")
    peak = prof.summary.get("peak_activation_bytes")
    if peak is not None:
        derived = prof.keep_all_peak_bytes
        require(peak == derived, source,
                 f"summary.peak_activation_bytes is {peak}, but the ops and tensors give {derived}")


def validate_plan(plan: Plan, source: str = "plan") -> None:
    """One decision per tensor, finite bounded numbers, a valid hardware spec: every plan the
    tool writes passes this, and `save` checks it before writing (no `null` time in a file)."""
    seen: set[int] = set()
    for d in plan.decisions:
        require(_int_in(d.tensor, 0, MAX_COUNT), source,
                 f"a decision names tensor {d.tensor!r}, which is not a tensor id")
        require(d.tensor not in seen, source,
                 f"tensor {d.tensor} has two decisions; a plan decides each tensor once")
        seen.add(d.tensor)
        require(d.prefetch_at is None or _int_in(d.prefetch_at, 0, MAX_COUNT), source,
                 f"tensor {d.tensor} has prefetch_at {d.prefetch_at!r}, not an op id")
        require(d.prefetch_at is None or d.action == Action.SWAP, source,
                 f"tensor {d.tensor} has prefetch_at but action {d.action!r}; only a swap prefetches")
    for i, e in enumerate(plan.schedule):
        require(e.kind in ("offload", "prefetch", "recompute"), source,
                 f"schedule[{i}] has kind {e.kind!r}")
        require(_finite_in(e.start_us, 0, MAX_US) and _finite_in(e.end_us, e.start_us, MAX_US),
                 source, f"schedule[{i}] has times {e.start_us!r}..{e.end_us!r} us: not an "
                         f"interval within [0, {MAX_US:g}] us")
    pr = plan.predicted
    for name in ("step_us", "ideal_us", "stall_us", "recompute_us"):
        v = getattr(pr, name)
        require(_finite_in(v, 0, MAX_US), source, f"predicted.{name} is {v!r:.40}, "
                                                   f"expected a time in [0, {MAX_US:g}] us")
    require(_finite_in(pr.retention, 0, 1), source,
             f"predicted.retention is {pr.retention!r:.40}, expected a number in [0, 1]")
    for name in ("peak_bytes", "swapped_bytes", "prefetched_bytes", "recomputed_bytes"):
        v = getattr(pr, name)
        require(_int_in(v, 0, MAX_BYTES), source, f"predicted.{name} is {v!r:.40}, "
                                                   "expected a whole number of bytes")
    for cause, v in pr.stall_by_cause.items():
        require(_finite_in(v, 0, MAX_US), source,
                 f"predicted.stall_by_cause[{cause!r}] is {v!r:.40}, expected a time")
    require(_int_in(plan.budget_bytes, 1, MAX_BYTES), source,
             f"budget_bytes is {plan.budget_bytes!r:.40}, expected a positive number of bytes")
    f = plan.budget_fraction
    require(f is None or _finite_in(f, 0, 1) and f > 0, source,
             f"budget_fraction is {f!r:.40}, expected a number in (0, 1] or null")
    require(_finite_in(plan.solve_ms, 0, MAX_US), source,
             f"solve_ms is {plan.solve_ms!r:.40}, expected a finite time in milliseconds")
    HardwareSpec.from_dict(plan.hardware, source=f"{source}: hardware")
