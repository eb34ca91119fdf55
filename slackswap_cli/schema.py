"""The two files everything else reads: the profile and the plan.

A **profile** (`slackswap.profile`, version 1) is one traced training step (forward, loss,
backward) at fixed shapes: the ops in execution order and the tensors between them.

- `ops[i].id == i`; forward ops come first, then backward. `inputs`/`outputs` are tensor ids.
- `tensors[j].id == j`. `kind` is `activation` (a value some op produced during the step),
  `input`, `parameter`, `buffer`, or `gradient` (a parameter's or input's gradient that the
  step returns: it lives in `.grad`, not in activation memory).
- `alias_of` points at the storage root (never at another alias): a view shares its root's
  bytes, so memory counts the root once and keeps it alive as long as any alias is in use.
- `saved` is true for a forward value read by a backward op; on a root it is true when the root
  or any of its aliases is read by backward. Saved activation roots are the planner's choices.
- `recomputable` is false for inputs, parameters, buffers and outputs of random ops (dropout).
  The recompute recipe of a tensor is its producer op: re-run it on the producer's inputs.

**Activation memory**, the quantity budgets and peaks refer to, is the bytes of live activation
roots (kind `activation`, `alias_of` null). A root is live from its producer's end until the end
of the last op that reads it or any of its aliases; a value nobody reads dies at its producer's
end. Parameters, inputs, buffers and gradients are outside it.

A **plan** (`slackswap.plan`, version 1) says for each saved activation root: keep, swap or
recompute; plus the schedule the simulator used and the numbers it predicted.

Both are frozen dataclasses, serialised with orjson. Loading checks format, version and that
every id refers to something that exists; writing is atomic (temp file, then rename).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import os
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import orjson

from .errors import FormatError, InputError, require_file

PROFILE_FORMAT = "slackswap.profile"
PLAN_FORMAT = "slackswap.plan"
PROFILE_VERSION = 1
PLAN_VERSION = 1

PHASES = ("forward", "backward")
KINDS = ("activation", "input", "parameter", "buffer", "gradient")


class Action(enum.StrEnum):
    """What a plan does with one saved activation root. A `str`: `Action.SWAP == "swap"`, it
    serialises as "swap", and plans loaded from JSON (plain strings) compare equal to it."""
    KEEP = "keep"              # resident from its producer to its last reader
    SWAP = "swap"              # copied to host after forward, fetched back for backward
    RECOMPUTE = "recompute"    # freed after forward, its producer re-run in backward


ACTIONS = tuple(Action)
TIME_SOURCES = ("measured", "roofline")


# --------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    id: int
    name: str                  # fx node name
    target: str                # e.g. "aten.mm.default"
    phase: str                 # "forward" | "backward"
    module: str                # module path, e.g. "transformer.h.3.mlp.c_fc" ("" if unknown)
    flops: int
    bytes: int                 # bytes read + written
    time_us: float
    time_source: str           # "measured" | "roofline"
    inputs: tuple[int, ...]    # tensor ids read
    outputs: tuple[int, ...]   # tensor ids written


@dataclass(frozen=True)
class Tensor:
    id: int
    name: str                  # fx node name (or "node.i" for the i-th output of a tuple)
    kind: str                  # see KINDS
    producer: int | None       # op id, None for inputs/parameters/buffers
    consumers: tuple[int, ...] # op ids, in execution order
    shape: tuple[int, ...]
    dtype: str                 # e.g. "bfloat16"
    size_bytes: int
    saved: bool
    recomputable: bool
    alias_of: int | None = None


@dataclass(frozen=True)
class Profile:
    fingerprint: str
    workload: dict             # name, path, entry, args, input_shapes, input_dtypes
    env: dict                  # torch_version, device, device_name, hardware (preset or None)
    summary: dict              # forward_us, backward_us, saved_bytes, peak_activation_bytes, ...
    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    format: str = PROFILE_FORMAT
    version: int = PROFILE_VERSION

    # -- derived views (cached: profiles are immutable) ------------------------------------
    @cached_property
    def n_forward(self) -> int:
        """Number of forward ops; ops[n_forward:] are backward."""
        return sum(1 for op in self.ops if op.phase == "forward")

    @cached_property
    def aliases(self) -> dict[int, tuple[int, ...]]:
        """root id -> ids of tensors that alias it (not including the root)."""
        out: dict[int, list[int]] = {}
        for t in self.tensors:
            if t.alias_of is not None:
                out.setdefault(t.alias_of, []).append(t.id)
        return {k: tuple(v) for k, v in out.items()}

    def root(self, tensor_id: int) -> int:
        alias = self.tensors[tensor_id].alias_of
        return tensor_id if alias is None else alias

    @cached_property
    def last_use(self) -> dict[int, int]:
        """activation root id -> op id at whose end it dies (producer if nobody reads it)."""
        out: dict[int, int] = {}
        for t in self.tensors:
            if t.kind != "activation" or t.alias_of is not None or t.producer is None:
                continue
            last = t.producer
            for tid in (t.id, *self.aliases.get(t.id, ())):
                if self.tensors[tid].consumers:
                    last = max(last, self.tensors[tid].consumers[-1])
            out[t.id] = last
        return out

    @cached_property
    def saved_activations(self) -> tuple[Tensor, ...]:
        """The planner's candidates: saved activation roots, in production order."""
        cands = [t for t in self.tensors
                 if t.kind == "activation" and t.alias_of is None and t.saved
                 and t.producer is not None]
        return tuple(sorted(cands, key=lambda t: (t.producer, t.id)))

    @cached_property
    def live_bytes_per_op(self) -> tuple[int, ...]:
        """Activation bytes live while each op runs, when every tensor is kept (the keep-all
        liveness; the simulator's is the same rule under a plan). A root counts from its
        producer op (inclusive: the op writes it) to `last_use` (inclusive: the op reads it)."""
        delta = [0] * (len(self.ops) + 1)
        for root, last in self.last_use.items():
            t = self.tensors[root]
            delta[t.producer] += t.size_bytes
            delta[last + 1] -= t.size_bytes
        live, out = 0, []
        for i in range(len(self.ops)):
            live += delta[i]
            out.append(live)
        return tuple(out)

    @cached_property
    def keep_all_peak_bytes(self) -> int:
        """The activation peak of the step when nothing is evicted: what a budget fraction is a
        fraction of (`summary["peak_activation_bytes"]` records it; loading checks they agree)."""
        return max(self.live_bytes_per_op, default=0)

    def first_backward_use(self, tensor_id: int) -> int | None:
        """First backward op reading the root `tensor_id` or any alias of it."""
        uses = [c for tid in (tensor_id, *self.aliases.get(tensor_id, ()))
                for c in self.tensors[tid].consumers if c >= self.n_forward]
        return min(uses) if uses else None

    def last_forward_use(self, tensor_id: int) -> int:
        """Last forward op reading the root or an alias (the producer if none)."""
        t = self.tensors[tensor_id]
        uses = [c for tid in (tensor_id, *self.aliases.get(tensor_id, ()))
                for c in self.tensors[tid].consumers if c < self.n_forward]
        return max(uses, default=t.producer if t.producer is not None else -1)

    def to_dict(self) -> dict:
        return {
            "format": self.format, "version": self.version, "fingerprint": self.fingerprint,
            "workload": self.workload, "env": self.env, "summary": self.summary,
            "ops": [dataclasses.asdict(o) for o in self.ops],
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
        }


def saved_flags(tensors, consumers, is_backward: list[bool]) -> list[bool]:
    """`Tensor.saved` of every tensor, the one derivation (`ProfileBuilder` sets it,
    `validate_profile` checks it): a forward-produced activation read by a backward op; on a
    root, when it or any alias of it is. `tensors[j]` has `kind`, `producer` and `alias_of`,
    `consumers[j]` are the ops reading it, `is_backward[i]` says op i is a backward op."""
    direct = [t.kind == "activation" and t.producer is not None and not is_backward[t.producer]
              and any(is_backward[c] for c in consumers[j]) for j, t in enumerate(tensors)]
    root_saved = list(direct)
    for j, t in enumerate(tensors):
        if t.alias_of is not None and direct[j]:
            root_saved[t.alias_of] = True
    return [root_saved[j] if t.alias_of is None else direct[j] for j, t in enumerate(tensors)]


def op_fingerprint(ops: Iterable[Op], tensors: Iterable[Tensor]) -> str:
    """Hash of the op sequence (targets, phases, wiring) and tensor shapes/dtypes.

    Times, FLOPs and names are left out: re-profiling the same model on other hardware gives
    the same fingerprint, a changed model or input shape gives another.
    """
    h = hashlib.sha256()
    for op in ops:
        h.update(f"{op.target}|{op.phase}|{op.inputs}|{op.outputs};".encode())
    for t in tensors:
        h.update(f"{t.kind}|{t.shape}|{t.dtype}|{t.alias_of};".encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    tensor: int                      # saved activation root id
    action: str                      # an Action: "keep" | "swap" | "recompute"
    prefetch_at: int | None = None   # swap only: backward op id at whose start the prefetch may be
                                     # issued at the earliest (None: as early as memory allows)


@dataclass(frozen=True)
class ScheduleEvent:
    """One thing the simulator did for a tensor: an offload, a prefetch or a recompute."""
    kind: str            # "offload" | "prefetch" | "recompute"
    tensor: int
    issue_op: int        # op at whose start (prefetch, recompute) or end (offload) it was issued
    start_us: float
    end_us: float


@dataclass(frozen=True)
class Predicted:
    step_us: float
    ideal_us: float
    retention: float
    peak_bytes: int
    stall_us: float
    recompute_us: float
    swapped_bytes: int               # bytes copied device -> host
    prefetched_bytes: int            # bytes copied host -> device
    recomputed_bytes: int
    stall_by_cause: dict = field(default_factory=dict)  # cause -> us


@dataclass(frozen=True)
class Plan:
    profile_fingerprint: str
    planner: str
    hardware: dict                   # HardwareSpec.to_dict()
    budget_bytes: int
    budget_fraction: float | None
    feasible: bool
    decisions: tuple[Decision, ...]
    schedule: tuple[ScheduleEvent, ...]
    predicted: Predicted
    solve_ms: float = 0.0
    notes: tuple[str, ...] = ()      # planner remarks (MILP bound and gap, why infeasible, ...)
    profile_path: str | None = None
    model_path: str | None = None
    format: str = PLAN_FORMAT
    version: int = PLAN_VERSION

    def actions(self) -> dict[int, str]:
        return {d.tensor: d.action for d in self.decisions}

    def action_of(self, profile: Profile) -> dict[int, Action]:
        """Every saved activation root of `profile` -> its Action (keep where the plan has no
        decision for it)."""
        actions = self.actions()
        return {t.id: Action(actions.get(t.id, Action.KEEP)) for t in profile.saved_activations}

    def action_counts(self, profile: Profile) -> dict[str, int]:
        """Saved activation roots per action, {"keep": n, "swap": n, "recompute": n}: the one
        count `plan --json`, the patched module's header and the views show."""
        counts = {a.value: 0 for a in Action}
        for action in self.action_of(profile).values():
            counts[action.value] += 1
        return counts

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {"format": d.pop("format"), "version": d.pop("version"), **d}

    def check_profile(self, profile: Profile) -> None:
        """The plan belongs to `profile`: same fingerprint, and every decision names one of
        its saved activation roots (a swap's prefetch op is one of its backward ops)."""
        if profile.fingerprint != self.profile_fingerprint:
            raise InputError(
                f"plan was made for profile {self.profile_fingerprint}, "
                f"this profile is {profile.fingerprint}",
                hint="re-run `slackswap plan` on this profile")
        candidates = {t.id for t in profile.saved_activations}
        for d in self.decisions:
            if d.tensor not in candidates:
                raise FormatError(f"the plan decides tensor {d.tensor}, which is not a saved "
                                  "activation of its profile", hint=_CORRUPT_HINT)
            if d.prefetch_at is not None and not profile.n_forward <= d.prefetch_at < len(profile.ops):
                raise FormatError(f"the plan prefetches tensor {d.tensor} at op {d.prefetch_at}, "
                                  "which is not a backward op of its profile", hint=_CORRUPT_HINT)


# --------------------------------------------------------------------------------------------
# Loading and saving
# --------------------------------------------------------------------------------------------
_CORRUPT_HINT = ("the file is damaged or was edited by hand: write it again with "
                 "`slackswap profile` or `slackswap plan`")


def _require(cond: bool, source: str, message: str, hint: str | None = None) -> None:
    if not cond:
        raise FormatError(f"{source}: {message}", hint=hint or _CORRUPT_HINT)


def _is_int(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (
        isinstance(v, float) and v.is_integer())


_CHECKS = {
    "int": _is_int,
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
}
_CHECKS["tuple[int, ...]"] = lambda v: isinstance(v, tuple) and all(map(_is_int, v))
_CHECKS["tuple[str, ...]"] = lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v)
for _t in ("int", "float", "str"):
    _CHECKS[f"{_t} | None"] = (lambda c: lambda v: v is None or c(v))(_CHECKS[_t])
_TYPE_NAMES = {"tuple[int, ...]": "a list of integers", "tuple[str, ...]": "a list of strings",
               "dict": "an object", "int": "an integer", "float": "a number",
               "str": "a string", "bool": "true or false"}
_FIELD_CHECKS: dict[type, list] = {}


def _check_types(obj, source: str, what: str) -> None:
    """Every field of a schema dataclass holds the JSON type its annotation names: a file
    edited by hand (a string where a number belongs) is refused here, by name, instead of
    failing later deep inside the simulator or a renderer."""
    checks = _FIELD_CHECKS.get(type(obj))
    if checks is None:
        checks = _FIELD_CHECKS[type(obj)] = [
            (f.name, str(f.type), _CHECKS[str(f.type)]) for f in dataclasses.fields(obj)
            if str(f.type) in _CHECKS]
    for name, typ, ok in checks:
        value = getattr(obj, name)
        if not ok(value):
            base = typ.replace(" | None", "")
            expected = _TYPE_NAMES.get(base, base) + (" or null" if "None" in typ else "")
            raise FormatError(f"{source}: {what}.{name} is {value!r:.60}, expected {expected}",
                              hint=_CORRUPT_HINT)


def _malformed(source: str, exc: Exception) -> FormatError:
    """A field of the wrong type (a string where a number belongs, null ids...) surfaces as a
    TypeError/ValueError deep in construction or validation: name the file, not the line."""
    return FormatError(f"{source}: malformed content ({type(exc).__name__}: {exc})",
                       hint=_CORRUPT_HINT)


def _read_json(path: str | os.PathLike) -> Any:
    p = require_file(path, "file", hint="check the path",
                     dir_hint="pass a profile or plan JSON file inside it")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {p}: {exc.strerror or exc}",
                         hint="check the file's permissions") from None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise FormatError(f"{p} is not valid JSON ({exc})",
                          hint="pass a file written by `slackswap profile` or `slackswap plan`") from None


def _check_header(data: Any, fmt: str, version: int, source: str) -> None:
    what = "profile" if fmt == PROFILE_FORMAT else "plan"
    origin = "profiles come from `slackswap profile`, plans from `slackswap plan`"
    if not isinstance(data, dict):
        raise FormatError(f"{source} is not a slackswap {what}: it holds a JSON "
                          f"{type(data).__name__}, not an object", hint=origin)
    got = data.get("format")
    if got is None:
        raise FormatError(f'{source} is not a slackswap {what}: it has no "format" field',
                          hint=origin)
    _require(got == fmt, source, f"format is {got!r}, expected {fmt!r}", hint=origin)
    v = data.get("version")
    _require(isinstance(v, int), source, f"version {v!r} is not an integer")
    _require(v <= version, source, f"{fmt} version {v} is newer than this slackswap reads ({version})",
             hint="upgrade slackswap")
    _require(v >= 1, source, f"unknown {fmt} version {v}")


def _build(cls, raw: Any, source: str, what: str, tuples: tuple[str, ...] = ()):
    _require(isinstance(raw, dict), source, f"{what} is not an object")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = required - set(raw)
    _require(not missing, source, f"{what} lacks {', '.join(sorted(missing))}")
    kwargs = {k: v for k, v in raw.items() if k in names}
    for k in tuples:
        if k in kwargs:
            _require(isinstance(kwargs[k], list), source, f"{what}.{k} is not a list")
            kwargs[k] = tuple(kwargs[k])
    obj = cls(**kwargs)
    _check_types(obj, source, what)
    return obj


def profile_from_dict(data: Any, source: str = "profile") -> Profile:
    _check_header(data, PROFILE_FORMAT, PROFILE_VERSION, source)
    for key in ("fingerprint", "workload", "env", "summary", "ops", "tensors"):
        _require(key in data, source, f"missing key '{key}'")
    _require(isinstance(data["ops"], list) and isinstance(data["tensors"], list), source,
             "'ops' and 'tensors' must be lists")
    ops = tuple(_build(Op, o, source, f"ops[{i}]", ("inputs", "outputs"))
                for i, o in enumerate(data["ops"]))
    tensors = tuple(_build(Tensor, t, source, f"tensors[{i}]", ("consumers", "shape"))
                    for i, t in enumerate(data["tensors"]))
    prof = Profile(fingerprint=data["fingerprint"], workload=data["workload"], env=data["env"],
                   summary=data["summary"], ops=ops, tensors=tensors,
                   format=data["format"], version=data["version"])
    _check_types(prof, source, "profile")
    _require(len(ops) > 0, source, "the profile has no ops: there is nothing to plan")
    validate_profile(prof, source)
    return prof


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
    return _is_int(v) and lo <= v <= hi


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
        _require(op.id == i, source, f"ops[{i}] has id {op.id}; ids must equal positions")
        _require(op.phase in PHASES, source, f"op {i} has phase {op.phase!r}")
        _require(op.time_source in TIME_SOURCES, source, f"op {i} has time_source {op.time_source!r}")
        if op.phase == "backward":
            seen_backward = True
        _require(not (seen_backward and op.phase == "forward"), source,
                 f"op {i} is a forward op after backward started")
        _require(_finite_in(op.time_us, 0, MAX_US), source,
                 f"op {i} has time_us {op.time_us!r}: not a time in [0, {MAX_US:g}] us")
        _require(_int_in(op.flops, 0, MAX_COUNT) and _int_in(op.bytes, 0, MAX_COUNT), source,
                 f"op {i} has a negative or out-of-range FLOP or byte count")
        for tid in (*op.inputs, *op.outputs):
            _require(_is_int(tid) and 0 <= tid < n_t, source,
                     f"op {i} refers to tensor {tid}, which does not exist")
        for tid in op.outputs:
            _require(tid not in producer_of, source,
                     f"tensor {tid} is output by op {producer_of.get(tid)} and op {i}; "
                     "a tensor has one producer")
            producer_of[tid] = i
        for tid in dict.fromkeys(op.inputs):
            readers[tid].append(i)
    n_forward = prof.n_forward
    for j, t in enumerate(prof.tensors):
        _require(t.id == j, source, f"tensors[{j}] has id {t.id}; ids must equal positions")
        _require(t.kind in KINDS, source, f"tensor {j} has kind {t.kind!r}")
        _require(_int_in(t.size_bytes, 0, MAX_BYTES), source,
                 f"tensor {j} has size_bytes {t.size_bytes!r}: not a size in [0, 2**60]")
        _require(all(_int_in(d, 0, MAX_COUNT) for d in t.shape), source,
                 f"tensor {j} has shape {list(t.shape)!r:.60}: dimensions are non-negative integers")
        _require(t.producer is None or _is_int(t.producer) and 0 <= t.producer < n_ops, source,
                 f"tensor {j} has producer {t.producer}, which does not exist")
        for c in t.consumers:
            _require(0 <= c < n_ops, source, f"tensor {j} has consumer {c}, which does not exist")
        _require(producer_of.get(j) == t.producer, source,
                 f"tensor {j} names op {t.producer} as producer, but "
                 + (f"op {producer_of[j]} outputs it" if j in producer_of
                    else "no op outputs it"))
        _require(list(t.consumers) == readers[j], source,
                 f"tensor {j} lists consumers {list(t.consumers)!r:.60}, but the ops reading it "
                 f"are {readers[j]!r:.60}")
        if t.alias_of is not None:
            _require(_is_int(t.alias_of) and 0 <= t.alias_of < n_t and t.alias_of != j, source,
                     f"tensor {j} aliases tensor {t.alias_of}, which does not exist")
            _require(prof.tensors[t.alias_of].alias_of is None, source,
                     f"tensor {j} aliases {t.alias_of}, which is itself an alias; point at the root")
    # `saved` exactly as ProfileBuilder derives it (phases are ordered: checked above)
    saved = saved_flags(prof.tensors, [t.consumers for t in prof.tensors],
                        [i >= n_forward for i in range(n_ops)])
    for j, t in enumerate(prof.tensors):
        expected = saved[j]
        if t.saved != expected:
            why = ("no backward op reads it" + (" or an alias of it" if t.alias_of is None else "")
                   if not expected else "a backward op reads it")
            _require(False, source, f"tensor {j} has saved={str(t.saved).lower()}, but {why}")
    _validate_summary(prof, source)
    _require(isinstance(prof.fingerprint, str) and prof.fingerprint != "", source,
             "fingerprint is not a non-empty string")
    hw = prof.env.get("hardware")
    _require(hw is None or isinstance(hw, (str, dict)), source,
             f"env.hardware is {hw!r:.60}, expected a hardware name, a hardware object or null")
    if isinstance(hw, dict):
        from .hardware import HardwareSpec
        HardwareSpec.from_dict(hw, source=f"{source}: env.hardware")


def _validate_summary(prof: Profile, source: str) -> None:
    for key, (what, ok) in _SUMMARY_CHECKS.items():
        if key in prof.summary:
            v = prof.summary[key]
            _require(ok(v), source, f"summary.{key} is {v!r:.60}, expected {what}")
    peak = prof.summary.get("peak_activation_bytes")
    if peak is not None:
        derived = prof.keep_all_peak_bytes
        _require(peak == derived, source,
                 f"summary.peak_activation_bytes is {peak}, but the ops and tensors give {derived}")


def load_profile(path: str | os.PathLike) -> Profile:
    data = _read_json(path)
    try:
        return profile_from_dict(data, source=str(path))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise _malformed(str(path), exc) from None


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    _check_header(data, PLAN_FORMAT, PLAN_VERSION, source)
    for key in ("profile_fingerprint", "planner", "hardware", "budget_bytes", "feasible",
                "decisions", "predicted"):
        _require(key in data, source, f"missing key '{key}'")
    for key in ("decisions", "schedule"):
        _require(isinstance(data.get(key, []), list), source, f"'{key}' must be a list")
    decisions = tuple(_build(Decision, d, source, f"decisions[{i}]")
                      for i, d in enumerate(data["decisions"]))
    for d in decisions:
        _require(d.action in ACTIONS, source, f"tensor {d.tensor} has action {d.action!r}",
                 hint=f"actions are {', '.join(ACTIONS)}")
    schedule = tuple(_build(ScheduleEvent, e, source, f"schedule[{i}]")
                     for i, e in enumerate(data.get("schedule", [])))
    predicted = _build(Predicted, data["predicted"], source, "predicted")
    kwargs = {k: data[k] for k in ("profile_fingerprint", "planner", "hardware", "budget_bytes",
                                   "feasible")}
    _require(isinstance(data.get("notes", []), list), source, "notes is not a list")
    plan = Plan(**kwargs, budget_fraction=data.get("budget_fraction"), decisions=decisions,
                schedule=schedule, predicted=predicted, solve_ms=data.get("solve_ms", 0.0),
                notes=tuple(data.get("notes", ())), profile_path=data.get("profile_path"),
                model_path=data.get("model_path"), format=data["format"],
                version=data["version"])
    _check_types(plan, source, "plan")
    validate_plan(plan, source)
    return plan


def validate_plan(plan: Plan, source: str = "plan") -> None:
    """One decision per tensor, finite bounded numbers, a valid hardware spec: every plan the
    tool writes passes this, and `save` checks it before writing (no `null` time in a file)."""
    seen: set[int] = set()
    for d in plan.decisions:
        _require(_int_in(d.tensor, 0, MAX_COUNT), source,
                 f"a decision names tensor {d.tensor!r}, which is not a tensor id")
        _require(d.tensor not in seen, source,
                 f"tensor {d.tensor} has two decisions; a plan decides each tensor once")
        seen.add(d.tensor)
        _require(d.prefetch_at is None or _int_in(d.prefetch_at, 0, MAX_COUNT), source,
                 f"tensor {d.tensor} has prefetch_at {d.prefetch_at!r}, not an op id")
        _require(d.prefetch_at is None or d.action == Action.SWAP, source,
                 f"tensor {d.tensor} has prefetch_at but action {d.action!r}; only a swap prefetches")
    for i, e in enumerate(plan.schedule):
        _require(e.kind in ("offload", "prefetch", "recompute"), source,
                 f"schedule[{i}] has kind {e.kind!r}")
        _require(_finite_in(e.start_us, 0, MAX_US) and _finite_in(e.end_us, e.start_us, MAX_US),
                 source, f"schedule[{i}] has times {e.start_us!r}..{e.end_us!r} us: not an "
                         f"interval within [0, {MAX_US:g}] us")
    pr = plan.predicted
    for name in ("step_us", "ideal_us", "stall_us", "recompute_us"):
        v = getattr(pr, name)
        _require(_finite_in(v, 0, MAX_US), source, f"predicted.{name} is {v!r:.40}, "
                                                   f"expected a time in [0, {MAX_US:g}] us")
    _require(_finite_in(pr.retention, 0, 1), source,
             f"predicted.retention is {pr.retention!r:.40}, expected a number in [0, 1]")
    for name in ("peak_bytes", "swapped_bytes", "prefetched_bytes", "recomputed_bytes"):
        v = getattr(pr, name)
        _require(_int_in(v, 0, MAX_BYTES), source, f"predicted.{name} is {v!r:.40}, "
                                                   "expected a whole number of bytes")
    for cause, v in pr.stall_by_cause.items():
        _require(_finite_in(v, 0, MAX_US), source,
                 f"predicted.stall_by_cause[{cause!r}] is {v!r:.40}, expected a time")
    _require(_int_in(plan.budget_bytes, 1, MAX_BYTES), source,
             f"budget_bytes is {plan.budget_bytes!r:.40}, expected a positive number of bytes")
    f = plan.budget_fraction
    _require(f is None or _finite_in(f, 0, 1) and f > 0, source,
             f"budget_fraction is {f!r:.40}, expected a number in (0, 1] or null")
    _require(_finite_in(plan.solve_ms, 0, MAX_US), source,
             f"solve_ms is {plan.solve_ms!r:.40}, expected a finite time in milliseconds")
    from .hardware import HardwareSpec
    HardwareSpec.from_dict(plan.hardware, source=f"{source}: hardware")


def load_plan(path: str | os.PathLike) -> Plan:
    data = _read_json(path)
    try:
        return plan_from_dict(data, source=str(path))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise _malformed(str(path), exc) from None


def sniff_format(path: str | os.PathLike) -> str:
    """'slackswap.profile' or 'slackswap.plan' (for `show`, which takes either)."""
    data = _read_json(path)
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt not in (PROFILE_FORMAT, PLAN_FORMAT):
        found = (f"its format is {fmt!r}" if fmt is not None else
                 'it has no "format" field' if isinstance(data, dict) else
                 f"it holds a JSON {type(data).__name__}")
        raise FormatError(f"{path} is not a slackswap profile or plan: {found}",
                          hint="profiles come from `slackswap profile`, plans from `slackswap plan`")
    return fmt


def dumps(obj: Any) -> bytes:
    if dataclasses.is_dataclass(obj) and hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file beside `path`, then rename: no half-written file is ever left."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as exc:
        raise InputError(f"cannot write {p}: {exc.strerror or exc}",
                         hint="choose an output path in a directory you can write to") from None
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would (or keep the
        # mode of the file it replaces), so profiles and plans can be shared like other files
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, _target_mode(p))
        os.replace(tmp, p)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"cannot write {p}: {exc.strerror or exc}",
                             hint="choose an output path in a directory you can write to, "
                                  "with free space") from None
        raise


def _target_mode(p: Path) -> int:
    try:
        return p.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def save(obj: Profile | Plan, path: str | os.PathLike) -> None:
    """Write a profile or plan atomically, after checking that the bytes read back: a value the
    loaders would refuse (a non-finite time from extreme hardware numbers, say) is reported
    here, and no file the tool writes is one it cannot read again."""
    data = dumps(obj)
    reload = profile_from_dict if isinstance(obj, Profile) else plan_from_dict
    try:
        reload(orjson.loads(data), source=f"the {type(obj).__name__.lower()} to write to {path}")
    except FormatError as exc:
        raise InputError(f"{exc.message}; nothing was written",
                         hint="check the hardware numbers and the inputs this was made from "
                              "for extreme values") from None
    write_atomic(path, data)
