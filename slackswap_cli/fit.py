"""`slackswap fit`: the whole device memory, and the batch size chosen with the plan.

For each batch of a sweep the workload is profiled (the torch side hands over the profile and
the facts of its parameters, `ModelFacts`), and here, without torch:

- **static memory** (`static_memory`): what stays on the device whatever the plan does, as
  torch allocates it:
  - parameters: each storage once (tied weights, one Parameter or several views of one
    storage, count once), in their own dtype;
  - gradients: one per trainable Parameter, its dtype and size (`AccumulateGrad` allocates
    `.grad` like the parameter);
  - optimizer state (torch/optim/adam.py, sgd.py): Adam/AdamW keep `exp_avg` and
    `exp_avg_sq` (`zeros_like(p)`: the parameter's dtype and size), plus `max_exp_avg_sq`
    with amsgrad, and a `step` counter, a 0-dim float32 tensor per parameter that torch keeps
    **on the CPU** unless `fused=True` or `capturable=True` (then on the parameter's device:
    `step_on_device`); SGD with momentum keeps `momentum_buffer` (a clone of the gradient),
    plain SGD nothing; frozen parameters (no grad) get no gradient and no state;
  - buffers (BatchNorm statistics, rotary tables) and the batch's input tensors;
  - **mixed precision** is counted as it is allocated: a model built in bf16 trains bf16
    parameters, gradients and Adam state (what torch.optim does); a float32 model under
    `torch.autocast` keeps float32 parameters, gradients and state (autocast casts
    activations, which the profile holds). fp32 master weights kept beside bf16 parameters
    (apex, DeepSpeed's bf16 optimizer) are not torch.optim's and are not counted: give them
    room with `--reserve`;
  - **sharding** (`shard` = FSDP2 / ZeRO-3 world size N): FSDP2 splits every parameter on
    dim 0 into N chunks and pads each rank's chunk to the first (largest) one, so rank 0 holds
    ceil(d0 / N) rows of parameters, gradients (views of the reduce-scatter output, padded
    alike) and optimizer state: the figures are rank 0's, the largest. Around them, the
    unsharded parameters of the largest block, twice (the block running and the next one
    prefetched), and of the root (the parameters outside the repeated blocks, embeddings and
    head, which FSDP2 keeps unsharded through the step). The unsharded gradients of one block
    before their reduce-scatter are transient and left to the reserve.
- **reserve** (`default_reserve`): memory kept free for the CUDA context, the allocator's
  fragmentation and workspaces: 1 GiB plus 5% of the device by default.
- the **activation budget** = device memory - static - reserve; the planner plans for it and
  the simulator judges the plan: retention, step time, samples/s (and tokens/s when an input
  has a sequence dimension: an integer input of shape (batch, seq, ...)).

The same sweep is run for what a user would do otherwise (`BASELINES`): keep everything (the
plain step: fits when its keep-all peak fits), full activation checkpointing
(`checkpoint-layers` with every block checkpointed, the `full-ac` planner's plan), torchtitan's
selective op AC (`torchtitan-sac`), Megatron's selective recompute (`megatron-selective`) and
`recompute-only` (torch.compile's memory budget). The best row of each is the feasible one
with the most samples/s.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .errors import InputError, SlackswapError
from .hardware import HardwareSpec
from .planners import DEFAULT_PLANNER, baselines, judge, make_plan
from .profile_scale import affine, derive
from .schema import Action, Decision, Plan, Profile
from .simulate import budget_floor_bytes, check_step_range
from .units import GIB, MIB, fmt_bytes

# optimizer -> (state tensors per trainable parameter, each like the parameter; has a step counter)
OPTIMIZERS: dict[str, tuple[int, bool]] = {
    "adamw": (2, True), "adam": (2, True),
    "adamw-amsgrad": (3, True), "adam-amsgrad": (3, True),
    "sgd": (0, False), "sgd-momentum": (1, False), "none": (0, False),
}
STEP_BYTES = 4            # `step`: torch.tensor(0.0) in float32 (float64 only as default dtype)
BASELINES = ("keep-all", "checkpoint-layers", "torchtitan-sac", "megatron-selective",
             "recompute-only")


@dataclass(frozen=True)
class ParamFact:
    """One Parameter (each once): its elements, bytes per element, the size of its first
    dimension (None for a 0-dim one), whether it trains, the bytes of its storage when it is
    the first Parameter seen on that storage (else 0) and the repeated block it is in."""
    numel: int
    itemsize: int
    dim0: int | None
    trainable: bool
    storage_bytes: int
    block: str | None = None


@dataclass(frozen=True)
class ModelFacts:
    params: tuple[ParamFact, ...]
    buffers_bytes: int = 0
    inputs_bytes: int = 0


@dataclass(frozen=True)
class StaticMemory:
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    buffers_bytes: int
    inputs_bytes: int
    unsharded_bytes: int

    @property
    def total(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.buffers_bytes + self.inputs_bytes + self.unsharded_bytes)


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise InputError(f"unknown optimizer '{name}'",
                         hint=f"optimizers: {', '.join(OPTIMIZERS)}")
    return name


def _shard_numel(p: ParamFact, shard: int) -> int:
    """Elements of rank 0's padded FSDP2 chunk: ceil(d0 / N) rows (the whole of a 0-dim one)."""
    if shard == 1 or not p.dim0:
        return p.numel
    return math.ceil(p.dim0 / shard) * (p.numel // p.dim0)


def static_memory(facts: ModelFacts, optimizer: str = "adamw", *, shard: int = 1,
                  step_on_device: bool = False) -> StaticMemory:
    """The static memory of one rank (see the module docstring)."""
    copies, has_step = OPTIMIZERS[check_optimizer(optimizer)]
    if shard < 1:
        raise InputError(f"--shard {shard} must be at least 1", hint="--shard 8 for 8 ranks")
    if shard == 1:
        params = sum(p.storage_bytes for p in facts.params)
    else:
        params = sum(_shard_numel(p, shard) * p.itemsize for p in facts.params)
    trained = [p for p in facts.params if p.trainable]
    grads = sum(_shard_numel(p, shard) * p.itemsize for p in trained)
    steps = STEP_BYTES * len(trained) if has_step and step_on_device else 0
    unsharded = 0
    if shard > 1:
        groups: dict[str | None, int] = {}
        for p in facts.params:
            groups[p.block] = groups.get(p.block, 0) + p.numel * p.itemsize
        root = groups.pop(None, 0)
        unsharded = root + 2 * max(groups.values(), default=0)
    return StaticMemory(params_bytes=params, grads_bytes=grads,
                        optimizer_bytes=copies * grads + steps,
                        buffers_bytes=facts.buffers_bytes, inputs_bytes=facts.inputs_bytes,
                        unsharded_bytes=unsharded)


def default_reserve(memory_bytes: int) -> int:
    """1 GiB (CUDA context, cuBLAS/cuDNN workspaces) plus 5% of the device (fragmentation)."""
    return GIB + memory_bytes // 20


def device_budget(total_bytes: int, free_bytes: int, torch_reserved_bytes: int,
                  static: StaticMemory, reserve_bytes: int | None = None) -> int:
    """The activation budget of a device as `fit` computes it (device memory - static memory
    - reserve), less what other processes hold on it: `total - free - torch_reserved` (the
    device's used bytes that are not this process's allocator's, which holds the model). The
    reserve is `default_reserve(total)` unless given. May be zero or negative: nothing left."""
    reserve = default_reserve(total_bytes) if reserve_bytes is None else reserve_bytes
    others = max(0, total_bytes - free_bytes - torch_reserved_bytes)
    return total_bytes - others - static.total - reserve


def parse_batches(text: str) -> list[int]:
    """`"8,1,2,4"` -> [1, 2, 4, 8]: positive integers, each once, smallest first."""
    hint = "a comma-separated list of positive integers, e.g. --batch 1,2,4,8,16"
    items = [x.strip() for x in str(text).split(",")]
    if not any(items):
        raise InputError("--batch is empty", hint=hint)
    out: list[int] = []
    for item in items:
        if not re.fullmatch(r"[+-]?[0-9]+", item):
            raise InputError(f"--batch {item!r} is not an integer", hint=hint)
        value = int(item)
        if value < 1:
            raise InputError(f"--batch {item!r} is not positive", hint=hint)
        if value not in out:
            out.append(value)
    return sorted(out)


def tokens_per_sample(profile: Profile, batch: int) -> int | None:
    """The sequence length when an integer input is (batch, seq, ...) (token ids), else None."""
    shapes = profile.workload.get("input_shapes") or {}
    dtypes = profile.workload.get("input_dtypes") or {}
    seqs = [s[1] for k, s in shapes.items()
            if len(s) >= 2 and s[0] == batch and str(dtypes.get(k, "")).startswith(("int", "uint"))]
    return max(seqs) if seqs else None


@dataclass(frozen=True)
class FitSettings:
    hardware: HardwareSpec
    memory_bytes: int
    reserve_bytes: int
    optimizer: str = "adamw"
    shard: int = 1
    step_on_device: bool = False
    planner: str = DEFAULT_PLANNER
    planner_options: dict = field(default_factory=dict)
    pipeline: dict = field(default_factory=dict)   # --pp and its flags as given (fit_pipeline)
    tp: int = 1         # --tp: the workload was built as one tensor parallel rank's local shard


@dataclass
class FitResult:
    rows: list[dict]
    baselines: dict[str, list[dict]]
    best_plan: Plan | None = None
    best_profile: Profile | None = None

    def to_json(self) -> dict:
        return {"rows": self.rows, "best": best_row(self.rows),
                "baselines": {name: {"rows": rows, "best": best_row(rows)}
                              for name, rows in self.baselines.items()}}


def best_row(rows: list[dict]) -> dict | None:
    """The feasible row with the most samples/s (the smaller batch on a tie)."""
    ok = [r for r in rows if r["feasible"]]
    return max(ok, key=lambda r: (r["samples_per_s"], -r["batch"])) if ok else None


def plan_kind(kind: str, prof: Profile, hw: HardwareSpec, budget: int, options: dict) -> Plan:
    if kind == "keep-all":
        keep = [Decision(tensor=t.id, action=Action.KEEP) for t in prof.saved_activations]
        return judge("keep-all", prof, hw, budget, keep)[0]
    if kind == "checkpoint-layers":      # full activation checkpointing: every block
        t0 = time.perf_counter()
        out = baselines.checkpoint_layers(prof, hw, budget, k=1)
        return judge(kind, prof, hw, budget, list(out.decisions), tuple(out.notes),
                     (time.perf_counter() - t0) * 1e3)[0]
    return make_plan(kind, prof, hw, budget, **options)


def plan_row(kind: str, batch: int, prof: Profile, static: StaticMemory, s: FitSettings,
             plan_fn: Callable[[Profile, HardwareSpec, int], Plan] | None = None
             ) -> tuple[dict, Plan | None]:
    """One row of the sweep: the budget left for activations, `kind`'s plan for it (made by
    `plan_fn(profile, hw, budget)` when given), and what the simulator predicts (None fields
    where nothing fits)."""
    budget = s.memory_bytes - static.total - s.reserve_bytes
    row = row_head(batch, kind, static, s)
    row.update(budget_bytes=budget, keep_all_peak_bytes=prof.keep_all_peak_bytes)
    if budget <= 0:
        return infeasible_row(row, f"static memory and reserve exceed the device by {fmt_bytes(-budget)}"), None
    floor = budget_floor_bytes(prof)
    if floor > budget:
        return infeasible_row(row, f"the activation floor {fmt_bytes(floor)} is above the budget "
                        f"{fmt_bytes(budget)}"), None
    check_step_range(prof, s.hardware, f"the profile at batch {batch}")   # else unloadable
    if kind == "keep-all" and prof.keep_all_peak_bytes > budget:
        return infeasible_row(row, f"the keep-all peak {fmt_bytes(prof.keep_all_peak_bytes)} is above "
                        f"the budget {fmt_bytes(budget)}"), None
    plan = (plan_fn(prof, s.hardware, budget) if plan_fn else
            plan_kind(kind, prof, s.hardware, budget, s.planner_options if kind == s.planner else {}))
    if not plan.feasible:
        return infeasible_row(row, plan.notes[-1] if plan.notes else "the plan does not fit"), plan
    p = plan.predicted
    rate = batch / p.step_us * 1e6
    seq = tokens_per_sample(prof, batch)
    row.update(feasible=True, retention=p.retention, step_us=p.step_us, samples_per_s=rate,
               tokens_per_s=rate * seq if seq else None, reason=None)
    return row, plan


def row_head(batch: int, kind: str, static: StaticMemory | None, s: FitSettings) -> dict:
    st = static
    return {"batch": batch, "static_bytes": st.total if st else None,
            "params_bytes": st.params_bytes if st else None,
            "grads_bytes": st.grads_bytes if st else None,
            "optimizer_bytes": st.optimizer_bytes if st else None,
            "buffers_bytes": st.buffers_bytes if st else None,
            "inputs_bytes": st.inputs_bytes if st else None,
            "unsharded_bytes": st.unsharded_bytes if st else None,
            "reserve_bytes": s.reserve_bytes, "budget_bytes": None, "keep_all_peak_bytes": None,
            "planner": kind, "feasible": False, "retention": None, "step_us": None,
            "samples_per_s": None, "tokens_per_s": None, "reason": None, "derived_from": None}


def infeasible_row(row: dict, reason: str) -> dict:
    row.update(feasible=False, reason=reason)
    return row


def check_static_fits(facts: ModelFacts, s: FitSettings) -> StaticMemory:
    """The static memory of one rank; InputError when it, with the reserve, leaves no room for
    activations (no batch can fit). Each hint names a value that leaves room: a --shard found by
    computing the sharded figures, a --memory, a --reserve."""
    static = static_memory(facts, s.optimizer, shard=s.shard, step_on_device=s.step_on_device)
    over = static.total + s.reserve_bytes - s.memory_bytes
    if over < 0:
        return static
    what = (f"the static memory alone ({fmt_bytes(static.total)}: parameters "
            f"{fmt_bytes(static.params_bytes)}, gradients {fmt_bytes(static.grads_bytes)}, "
            f"optimizer state {fmt_bytes(static.optimizer_bytes)}) plus the reserve "
            f"{fmt_bytes(s.reserve_bytes)} exceeds the device's {fmt_bytes(s.memory_bytes)} by "
            f"{fmt_bytes(over)}")
    if s.reserve_bytes >= s.memory_bytes:
        what = (f"the reserve alone ({fmt_bytes(s.reserve_bytes)}) exceeds the device's "
                f"{fmt_bytes(s.memory_bytes)}; " + what)
    raise InputError(what, hint=_static_hint(facts, static, s))


def _static_hint(facts: ModelFacts, static: StaticMemory, s: FitSettings) -> str:
    """What leaves room for activations, each a value that does (see check_static_fits)."""
    ways = []
    shard = _shards_needed(facts, s)
    if shard is not None:
        ways.append(f"shard it across ranks with --shard {shard} (FSDP2 / ZeRO-3)")
    room = s.memory_bytes - static.total
    if room > MIB:
        ways.append(f"keep less free with --reserve {room // MIB - 1}MiB")
    ways.append(f"give the device's real size with --memory (--memory "
                f"{_least_memory_mib(static, s)}MiB is the least that leaves room)")
    return "; or ".join(ways) + "; a lighter --optimizer (sgd, none) also saves memory"


def _least_memory_mib(static: StaticMemory, s: FitSettings) -> int:
    """The least whole MiB of --memory that leaves room for activations, whether the reserve
    stays as given or is the default (`default_reserve`, which grows with the device)."""
    def leaves_room(mib: int) -> bool:
        memory = mib * MIB
        return memory - max(s.reserve_bytes, default_reserve(memory)) > static.total
    most = -(-2 * (static.total + s.reserve_bytes + GIB) // MIB)   # leaves room: 5% < half
    return bisect.bisect_left(range(most + 1), True, key=leaves_room)


def _shards_needed(facts: ModelFacts, s: FitSettings, most: int = 4096) -> int | None:
    """The smallest power-of-two world size above the current one whose per-rank static memory
    leaves room under the reserve, or None where none up to `most` does."""
    shard = 2
    while shard <= most:
        if shard > s.shard:
            st = static_memory(facts, s.optimizer, shard=shard, step_on_device=s.step_on_device)
            if st.total + s.reserve_bytes < s.memory_bytes:
                return shard
        shard *= 2
    return None


ProfileAt = Callable[[int], tuple[Profile, ModelFacts]]


def _derived(traced: list, batch: int, hw: HardwareSpec, batch_arg: str | None):
    """(profile, facts) at `batch` from the last two traced batches (profile_scale.derive), or
    None where that is not exact or not asked for."""
    if batch_arg is None or len(traced) < 2:
        return None
    (a, pa, fa), (b, pb, fb) = traced[-2:]
    inputs = affine(fa.inputs_bytes, fb.inputs_bytes, a, b, batch)
    if fa.params != fb.params or fa.buffers_bytes != fb.buffers_bytes or inputs is None:
        return None
    prof = derive(pa, a, pb, b, batch, hw, batch_arg)
    return None if prof is None else (prof, dataclasses.replace(fa, inputs_bytes=inputs))


def profiles(batches: list[int], profile_at: ProfileAt, hw: HardwareSpec,
             derive_batch_arg: str | None = None, progress: Callable[[str], None] | None = None
             ) -> Iterator[tuple[int, Profile | None, ModelFacts | None, str]]:
    """(batch, profile, facts, how) for each batch: traced by `profile_at`, or with
    `derive_batch_arg` (the workload argument that sets the batch) derived from the last two
    traced batches where that is exact (`profile_scale.derive`). A batch whose trace fails
    yields (batch, None, None, the reason); an InputError ends the sweep.

    When `profile_at` has `submit(batch)` (a future of `profile_at(batch)`, traced in another
    process: `trace.static_memory.Profiler` with workers), the traces run ahead of the caller:
    the first two batches (always traced) start at once, and before a batch is yielded the next
    one is derived, or, where it cannot be, its trace is started, so it runs while the caller
    plans this one. Which batches are traced and derived is the same either way.
    """
    say = progress or (lambda _line: None)
    submit = getattr(profile_at, "submit", None)
    pending: dict = {}
    for batch in batches[:2] if submit else ():
        pending[batch] = submit(batch)
    traced: list = []
    ahead = None                               # the next batch's derived (profile, facts)
    for i, batch in enumerate(batches):
        tag = f"[{i + 1}/{len(batches)}] batch {batch}"
        got = ahead if ahead is not None else _derived(traced, batch, hw, derive_batch_arg)
        ahead = None
        if got is not None:
            how = f"derived from batches {traced[-2][0]} and {traced[-1][0]}"
            say(f"{tag}: {how}")
        else:
            say(f"{tag}: profiling")
            future = pending.pop(batch, None)
            try:
                prof, facts = future.result() if future is not None else profile_at(batch)
            except InputError:
                raise
            except Exception as exc:
                why = exc.message if isinstance(exc, SlackswapError) else f"{type(exc).__name__}: {exc}"
                how = f"profiling failed: {why.splitlines()[0][:300] if why else ''}"
                say(f"{tag}: {how}")
                got = (None, None)
            else:
                traced.append((batch, prof, facts))
                got, how = (prof, facts), "profiled"
        if submit and i + 1 < len(batches) and batches[i + 1] not in pending:
            ahead = _derived(traced, batches[i + 1], hw, derive_batch_arg)
            if ahead is None:
                pending[batches[i + 1]] = submit(batches[i + 1])
        yield batch, got[0], got[1], how


def sweep(batches: list[int], profile_at: ProfileAt, s: FitSettings,
          progress: Callable[[str], None] | None = None,
          derive_batch_arg: str | None = None,
          row_maker: Callable[[FitSettings, Profile], Callable] | None = None) -> FitResult:
    """Profile each batch (`profiles`), plan it with `s.planner` and every baseline.
    `row_maker(s, profile)`: the function that makes a row (`plan_row`'s signature), for a
    pipeline `fit_pipeline.row_maker`; `plan_row` without.

    A batch whose profile fails is a row with the reason, and the sweep goes on; the static
    memory is checked (`check_static_fits`) before any planning.
    """
    say = progress or (lambda _line: None)
    result = FitResult(rows=[], baselines={b: [] for b in BASELINES})
    best = None
    t0 = time.perf_counter()
    for batch, prof, facts, how in profiles(batches, profile_at, s.hardware, derive_batch_arg,
                                            say):
        if prof is None:
            for kind, rows in [(s.planner, result.rows), *result.baselines.items()]:
                rows.append(infeasible_row(row_head(batch, kind, None, s), how))
            t0 = time.perf_counter()
            continue
        static = check_static_fits(facts, s)
        t1 = time.perf_counter()
        row_of = row_maker(s, prof) if row_maker else plan_row
        row, plan = row_of(s.planner, batch, prof, static, s)
        derived = prof.summary.get("derived_from_batches")
        result.rows.append(dict(row, derived_from=derived))
        for kind, rows in result.baselines.items():
            rows.append(dict(row_of(kind, batch, prof, static, s)[0], derived_from=derived))
        if row["feasible"] and (best is None or (row["samples_per_s"], -batch) > best):
            best, result.best_plan, result.best_profile = (row["samples_per_s"], -batch), plan, prof
        rate = f"{row['samples_per_s']:.2f} samples/s" if row["feasible"] else row["reason"]
        i = len(result.rows)
        say(f"[{i}/{len(batches)}] batch {batch}: {how} in {t1 - t0:.1f} s, planned in "
            f"{time.perf_counter() - t1:.1f} s: {rate}")
        t0 = time.perf_counter()
    return result

