"""The profile and plan as frozen dataclasses (`Profile`, `Plan` and their parts), the
format names and versions, and the fingerprints that tie a plan to its profile. What a file
means is in the package docstring (`schema/__init__.py`); reading and writing are `load`,
`validate` and `write`.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable

from ..errors import FormatError, InputError

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
                                  "activation of its profile", hint=CORRUPT_HINT)
            if d.prefetch_at is not None and not profile.n_forward <= d.prefetch_at < len(profile.ops):
                raise FormatError(f"the plan prefetches tensor {d.tensor} at op {d.prefetch_at}, "
                                  "which is not a backward op of its profile", hint=CORRUPT_HINT)


CORRUPT_HINT = ("the file is damaged or was edited by hand: write it again with "
                 "`slackswap profile` or `slackswap plan`")
