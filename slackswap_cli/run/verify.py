"""`slackswap verify`: prove on the user's own model that a patched step computes the same thing.

Two copies of the workload's model start from the same weights. Each step, both run one
training step from the same RNG state (so dropout draws the same masks), then take the same
plain SGD update, so later steps start from updated weights. Compared per step: the loss, every
parameter's gradient and every floating-point buffer (BatchNorm running statistics).

Memory, measured for both the original and the patched step:

- CUDA: `torch.cuda.max_memory_allocated` during the step minus what was allocated before it
  (parameters, optimizer state). Gradients are allocated inside the step by both, so their
  bytes are subtracted to estimate the activation peak the budget refers to.
- CPU (no allocator statistics): the bytes held for backward at the end of forward. For the
  original, every tensor autograd saves passes through `saved_tensors_hooks`; storages are
  counted once, and parameters, buffers and inputs (which exist anyway) are left out. For the
  patched step, the runtime's store counts what it keeps on the device (kept storages, and
  swapped tensors still being copied); recomputed and swapped-out tensors hold nothing.

A module made from an autocast profile (`profile --autocast bf16|fp16`) runs the original's
forward and loss, and the in-place patch's, under `torch.autocast` of that dtype (backward
outside), as the profile traced them; the whole-step module holds the casts as ops.

Pass: loss within 1e-5 relative and gradients within 1e-4 relative (fp32; 1e-3/1e-2 for 16-bit
floats), buffers within the gradient tolerance, and measured memory at most 5% above the plan's
budget (the report names the quantity compared), for the whole-step module and for the model
patched in place (what training runs: the bytes it holds for backward after forward); an
in-place excess names its cause where it is known (a profile made for another device, planned
recomputes the replay kept).
"""
from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..budget import keep_all_of
from ..errors import FingerprintMismatch, InputError, ModelChanged
from ..schema import Action
from ..units import fmt_bytes

MEMORY_TOLERANCE = 0.05


@dataclass
class VerifyReport:
    patched: str
    workload: str
    device: str
    steps: int
    losses_original: list[float]
    losses_patched: list[float]
    max_loss_rel_diff: float
    max_grad_rel_diff: float
    worst_grad_param: str
    max_buffer_rel_diff: float
    loss_tolerance: float
    grad_tolerance: float
    memory_metric: str                 # what original/patched_peak_bytes measure
    original_peak_bytes: int
    patched_peak_bytes: int
    budget_bytes: int
    predicted_peak_bytes: int
    original_step_ms: float            # fastest of the steps (the first includes warm-up)
    patched_step_ms: float
    predicted_step_us: float
    swapped_bytes_per_step: int
    kept: int
    swapped: int
    recomputed: int
    passed: bool
    reasons: list[str] = field(default_factory=list)
    # activation memory over the step, measured op by op (run/memtrace.py) on both devices
    measured_peak_bytes: int = 0            # patched step
    measured_peak_at: str = ""              # the statement of the patched module at the peak
    measured_original_peak_bytes: int = 0   # eager step
    predicted_original_peak_bytes: int = 0  # keep-all peak of the profile
    # the plan's decisions re-simulated with the copies this device makes (CPU: synchronous);
    # on CUDA it is the plan's own prediction
    predicted_device_peak_bytes: int | None = None
    plan_found: bool = False
    timeline_matched: int = 0               # simulator tasks matched to measured calls
    timeline_tasks: int = 0
    timeline: list[dict] = field(default_factory=list)   # op, name, recompute, predicted, measured
    worst_divergence: dict | None = None
    # recompute time (meaningful with a profile measured on this device)
    extra_step_ms: list[float] = field(default_factory=list)   # patched - original, per step
    predicted_recompute_us: float | None = None
    profile_time_source: str = ""
    # ops re-run in backward (views re-derived from a restored root are free, not counted):
    # in the simulator's schedule and in the patched module's run
    predicted_recompute_ops: int | None = None
    measured_recompute_ops: int = 0
    # the in-place patch (`patch(model)`, what training runs) against eager, same steps
    inplace: dict | None = None


# --------------------------------------------------------------------------------------------
# Memory timelines: measured (memtrace) against predicted (the simulator), aligned by op
# --------------------------------------------------------------------------------------------
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


def find_plan(patched_path: str, meta: dict):
    """The plan a patched module was made from: a `*.json` next to it (or in the current
    directory) whose decisions hash to the module's `plan_fingerprint`; None if none does."""
    from ..errors import SlackswapError
    from ..schema import load_plan
    from .emit import plan_fingerprint
    want = meta.get("plan_fingerprint")
    dirs = [Path(patched_path).resolve().parent, Path.cwd()]
    for d in dict.fromkeys(dirs):
        for f in sorted(d.glob("*.json")):
            try:
                with open(f, "rb") as fh:
                    if b"slackswap.plan" not in fh.read(200):
                        continue
                plan = load_plan(f)
            except (OSError, SlackswapError):
                continue
            if plan_fingerprint(plan) == want:
                return plan
    return None


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
    from ..schema import Decision
    from ..simulate import simulate
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
    from . import swap as runtime
    from .memtrace import SKIP, MemTracker, caller_line
    src = Path(mod.__file__).read_text().splitlines()
    codes = {mod.forward_step.__code__: "forward", mod.backward_step.__code__: "backward",
             runtime.HostPool.get.__code__: SKIP}
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


def _recompute_calls(rows, profile) -> int:
    """Ops re-run in backward: calls of a forward op's own function in a recompute statement
    (a statement's other calls, such as the clones that keep BatchNorm's running statistics
    from being updated twice, are not re-runs; nor are ops that only make views)."""
    if profile is None:
        return sum(1 for x in rows if x.recompute)
    return sum(1 for x in rows if x.recompute and not _is_view_op(profile, x.op)
               and (not x.target or x.target == profile.ops[x.op].target))


def _is_view_op(profile, op: int) -> bool:
    """Does op only make views (its outputs alias their inputs' storage: nothing re-run)?"""
    outs = profile.ops[op].outputs
    return bool(outs) and all(profile.tensors[t].alias_of is not None for t in outs)


def measure_eager_step(model, run) -> int:
    """Activation peak of one eager training step (`run()` returns the loss): the same
    accounting, gradients left out."""
    from .memtrace import MemTracker
    tracker = MemTracker()
    with tracker:
        run().backward()
    tracker.finish()
    tracker.exclude([p.grad for p in model.parameters() if p.grad is not None])
    return max(tracker.timeline(), default=0)


def _rel(a, b) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    scale = max(float(a.abs().max()) if a.numel() else 0.0, 1e-12)
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def _tolerances(dtype) -> tuple[float, float]:
    import torch
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-3, 1e-2
    return 1e-5, 1e-4


def saved_bytes_original(model, inputs, run_step, exclude) -> tuple[object, int]:
    """Run `run_step()` (the forward) under saved_tensors_hooks; bytes it saves for backward."""
    import torch

    from .swap import storage_bytes, storage_key
    skip = {storage_key(t) for t in exclude}
    seen: dict = {}

    def pack(t):
        key = storage_key(t)
        if key not in skip and t.device.type != "meta":
            seen[key] = storage_bytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_step()
    return out, sum(seen.values())


def _available_bytes(device: str) -> int | None:
    """Free memory where the step will run: the GPU's free bytes, or the host's MemAvailable."""
    import torch
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(meta: dict, device: str) -> None:
    """Refuse, before building anything, a verify this machine cannot hold.

    verify builds the model twice (original and patched) with their gradients and runs the
    original step with every activation kept. A module made from a `--device fake` profile of
    a large model would otherwise be built for real on the CPU and get the process killed by
    the kernel, without a word. The estimate is a floor (optimizer state, temporaries and the
    allocator come on top), so only a verify that cannot possibly fit is refused.
    """
    import math

    from ..profile_build import DTYPE_BYTES
    from ..trace.graph_profile import dtype_name
    param_bytes = sum(math.prod(shape) * DTYPE_BYTES.get(dtype_name(dtype), 4)
                      for _, shape, dtype in meta.get("params", ()))
    budget = int(meta.get("budget_bytes") or 0)
    fraction = meta.get("budget_fraction")
    peak = int((meta.get("predicted") or {}).get("peak_bytes") or 0)
    keep_all = meta.get("keep_all_peak_bytes") or (keep_all_of(budget, fraction) if fraction
                                                   else max(budget, peak))
    need = int(4 * param_bytes + keep_all)
    free = _available_bytes(device)
    if free is not None and need > free:
        raise InputError(
            f"verify needs at least {fmt_bytes(need)} on {device} (the model twice with its "
            f"gradients, {fmt_bytes(4 * param_bytes)}, and one step keeping every "
            f"activation, {fmt_bytes(keep_all)}), but only {fmt_bytes(free)} is free",
            hint="verify runs the real model: check a smaller configuration here (profile, plan "
                 "and apply it with smaller --arg values), or run verify on a machine that "
                 "holds the full one")


def _check_in_place(mod, path, entry, args, dev, seed: int, steps: int, loss_tol: float,
                    grad_tol: float, autocast: str | None = None) -> dict:
    """`steps` SGD steps of a fresh eager model and of a fresh one patched in place, from the
    same seed: the largest loss and gradient differences, how much of the profile lined up,
    ops re-run and bytes held for backward after forward (CPU: storages, as `held_device_bytes`)."""
    import torch

    from ..trace.joint import autocast_region, loss_from_output, split_inputs
    from ..trace.workload import load_workload
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        models.append(load_workload(path, entry, args, device=dev))
    eager, work = models
    work.model.load_state_dict(eager.model.state_dict())
    mod.patch(work.model)
    work.model.forward.__slackswap__.measure_held = True     # (later calls too)
    opts = [torch.optim.SGD(w.model.parameters(), lr=1e-3) for w in models]
    max_loss = max_grad = 0.0
    held = 0
    calls = []         # per patched call: `PlanRun.report` and what it held after forward
    for k in range(steps):
        losses, grads = [], []
        for w, opt in zip(models, opts):
            w.model.train()
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(seed + 1 + k)
            a, kw = split_inputs(w.inputs)
            with autocast_region(autocast, _device_type(w.model)):   # as the profile traced
                loss = loss_from_output(w.model(*a, **kw), w.inputs, w.loss_fn)
            if w is work:      # what the step holds for backward, measured before it runs
                held = work.model.forward.__slackswap__.last_run.held_device_bytes()
                calls.append({**work.model.forward.__slackswap__.last_report,
                              "held_device_bytes": held})
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad for n, p in w.model.named_parameters()})
            with torch.no_grad():
                opt.step()
        max_loss = max(max_loss, _rel(*losses))
        max_grad = max([max_grad, *(_rel(g, grads[1][n]) for n, g in grads[0].items())])
    run = work.model.forward.__slackswap__.last_run
    reasons = []
    if max_loss > loss_tol or max_grad > grad_tol:
        reasons.append(f"the model patched in place differs from eager: loss by {max_loss:.2e}, "
                       f"gradients by {max_grad:.2e} (relative)")
    action = run.table["action"]
    return {"max_loss_rel_diff": max_loss, "max_grad_rel_diff": max_grad,
            "ops_lined_up": calls[-1]["lined_up"], "profile_forward_ops": calls[-1]["expected"],
            "guard_swaps": calls[-1]["guard_swaps"],
            "guard_swapped_bytes": calls[-1]["guard_swapped_bytes"], "calls": calls,
            "ops_rerun": run.rerun_ops, "roots_swapped": len(run.metas),
            "held_bytes_after_forward": held,
            "planned_recomputes": sum(1 for a in action.values() if a == Action.RECOMPUTE),
            "recomputes_kept": sum(1 for r, a in action.items()
                                   if a == Action.RECOMPUTE and run.usable.get(r) is False),
            "planned_swaps": sum(1 for a in action.values() if a == Action.SWAP),
            "reasons": reasons}


def _device_cause(meta: dict, device: str) -> str | None:
    """A profile made for another device than this run's: its saved bytes are that device's."""
    target = meta.get("target_device") or device
    if target == device:
        return None
    return (f"the profile was made for {target} (`--device fake` traces a CUDA GPU's dropout "
            f"and kernels) and this run is on {device}: profile with `--device fake:{device}` "
            f"or `--device {device}` for a plan to run here")


def _inplace_memory_reason(inplace: dict, budget: int, meta: dict, device: str) -> str | None:
    """Why the model patched in place holds more after forward than the plan's budget allows
    (None: within 5%), with the cause where it is known: a profile made for another device
    (a `--device fake` profile is CUDA's: its dropout masks and kernels' workspace are not a
    CPU's), or planned recomputes the replay kept (their chains did not line up or cannot be
    re-run)."""
    held = inplace["held_bytes_after_forward"]
    if not (budget > 0 and held > budget * (1 + MEMORY_TOLERANCE)):
        return None
    text = (f"the model patched in place (patch(model)) holds {fmt_bytes(held)} for backward "
            f"after forward, {held / budget:.2f}x the plan's budget of {fmt_bytes(budget)}")
    causes = [c for c in (_device_cause(meta, device),) if c]
    if inplace.get("recomputes_kept"):
        causes.append(f"{inplace['recomputes_kept']} of the plan's {inplace['planned_recomputes']} "
                      "recomputed tensors were kept, because the ops of their chains did not "
                      f"line up with the profile or cannot be re-run ({inplace['ops_lined_up']} "
                      f"of {inplace['profile_forward_ops']} forward ops lined up)")
    if not causes:
        causes.append("memory the profile does not see (kernels' workspace, or tensors the "
                      "model holds outside autograd)")
    return text + "; " + "; ".join(causes)


def _device_type(model) -> str:
    """The device type autocast keys on: the model's first parameter's (as the profile's)."""
    return next(model.parameters()).device.type


def _warmup(model, run) -> None:
    """One untimed step; weights, buffers, gradients and the RNG are put back afterwards."""
    import torch
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    run().backward()
    with torch.no_grad():
        model.load_state_dict(state)
    for p in model.parameters():
        p.grad = None
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)


@dataclass
class _Pair:
    """The original and the patched model of one verify run, ready to step."""
    mod: object                  # the patched module (apply's output), loaded
    meta: dict
    path: str                    # the workload
    entry: str
    args: dict
    device: str
    dev: object                  # load_workload's device (None: CPU)
    orig: object                 # the workloads (model, inputs, loss_fn)
    work: object
    patched: object              # mod.step_module(work.model)
    o_call: tuple                # (args, kwargs) of each model's inputs
    p_call: tuple
    opt_o: object
    opt_p: object
    loss_tol: float
    grad_tol: float

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def run_original(self):
        from ..trace.joint import autocast_region, loss_from_output
        a, kw = self.o_call
        with autocast_region(self.meta.get("autocast"), _device_type(self.orig.model)):
            return loss_from_output(self.orig.model(*a, **kw), self.orig.inputs,
                                    self.orig.loss_fn)

    def run_patched(self):
        a, kw = self.p_call
        return self.patched(*a, **kw)

    def sync(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def start(self) -> int:
        """Synchronise and open a measurement: the allocated bytes it starts from (CUDA)."""
        self.sync()
        if not self.cuda:
            return 0
        import torch
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self, base: int, model, held_bytes: int) -> int:
        """After the step: CUDA peak over it less gradients, or the CPU bytes held for backward."""
        if not self.cuda:
            return held_bytes
        import torch
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                    if p.grad is not None)
        return torch.cuda.max_memory_allocated() - base - grads


def _load_pair(patched_path: str, model_path: str | None, entry: str | None,
               args: dict | None, seed: int, check_trace: bool) -> _Pair:
    """Load the patched module and two copies of its workload from the same weights."""
    import torch

    from ..trace.joint import split_inputs
    from ..trace.workload import load_workload
    from .emit import load_patched
    mod = load_patched(patched_path)
    meta = mod.META
    w = meta["workload"]
    path = model_path or w["path"]
    entry = entry or w["entry"]
    args = dict(w["args"]) if args is None else dict(args)
    device = meta["device_type"]
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("the patched module was made for CUDA, but no GPU is visible",
                         hint="run verify on the machine the profile was made on")
    dev = None if device == "cpu" else device
    check_fits(meta, device)

    torch.manual_seed(seed)
    orig = load_workload(path, entry, args, device=dev)
    torch.manual_seed(seed)
    work = load_workload(path, entry, args, device=dev)
    work.model.load_state_dict(orig.model.state_dict())
    orig.model.train()
    work.model.train()
    try:
        patched = mod.step_module(work.model, check_trace=check_trace)
    except FingerprintMismatch as exc:     # a finding about the model, not a bad option
        raise ModelChanged(f"the model in {path} is not the one the plan was made for: "
                           f"{exc.message}", hint=exc.hint) from None
    p_call = split_inputs(work.inputs)
    o_call = split_inputs(orig.inputs)
    ref = next(iter(dict(orig.model.named_parameters()).values()))
    loss_tol, grad_tol = _tolerances(ref.dtype)
    opt_o = torch.optim.SGD(orig.model.parameters(), lr=1e-3)
    opt_p = torch.optim.SGD(work.model.parameters(), lr=1e-3)
    return _Pair(mod, meta, path, entry, args, device, dev, orig, work, patched, o_call, p_call,
                 opt_o, opt_p, loss_tol, grad_tol)


@dataclass
class _Compared:
    """What the compared steps found, step by step and at worst."""
    losses_o: list = field(default_factory=list)
    losses_p: list = field(default_factory=list)
    peaks_o: list = field(default_factory=list)
    peaks_p: list = field(default_factory=list)
    times_o: list = field(default_factory=list)
    times_p: list = field(default_factory=list)
    max_loss: float = 0.0
    max_grad: float = 0.0
    worst_param: str = ""
    max_buf: float = 0.0
    offloaded: int = 0


def _step_original(s: _Pair, seed: int, out: _Compared):
    """One step of the original model, timed; its loss (memory: into `out`)."""
    import torch
    import torch.utils._pytree as pytree
    orig = s.orig
    s.opt_o.zero_grad(set_to_none=True)
    exclude_o = [*orig.model.parameters(), *orig.model.buffers(),
                 *[x for x in pytree.tree_leaves(orig.inputs) if isinstance(x, torch.Tensor)]]
    base = s.start()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    loss_o, held_o = saved_bytes_original(orig.model, orig.inputs, s.run_original, exclude_o)
    loss_o.backward()
    s.sync()
    out.times_o.append((time.perf_counter() - t0) * 1e3)
    out.peaks_o.append(s.peak(base, orig.model, held_o))
    return loss_o


def _step_patched(s: _Pair, seed: int, out: _Compared):
    """One step of the patched step module, timed; its loss (memory, copies: into `out`)."""
    import torch
    s.opt_p.zero_grad(set_to_none=True)
    base = s.start()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    loss_p = s.run_patched()
    held_p = s.patched.held_bytes_after_forward
    store = s.patched.last_store() if s.patched.last_store is not None else None
    out.offloaded = store.offloaded_bytes if store is not None else 0
    loss_p.backward()
    s.sync()
    out.times_p.append((time.perf_counter() - t0) * 1e3)
    out.peaks_p.append(s.peak(base, s.work.model, held_p))
    return loss_p


def _compare(s: _Pair, loss_o, loss_p, out: _Compared) -> None:
    """Losses, gradients and buffers of the two models after one step (worst into `out`)."""
    import torch
    out.losses_o.append(float(loss_o.detach()))
    out.losses_p.append(float(loss_p.detach()))
    out.max_loss = max(out.max_loss, _rel(loss_o, loss_p))
    params_p = dict(s.work.model.named_parameters())
    for name, p in s.orig.model.named_parameters():
        d = _rel(p.grad, params_p[name].grad)
        if d > out.max_grad:
            out.max_grad, out.worst_param = d, name
    for (name, b), (_, b2) in zip(s.orig.model.named_buffers(), s.work.model.named_buffers()):
        if b.is_floating_point():
            out.max_buf = max(out.max_buf, _rel(b, b2))
        elif not torch.equal(b, b2):
            out.max_buf = max(out.max_buf, float("inf"))


def _compare_steps(s: _Pair, steps: int, seed: int) -> _Compared:
    """`steps` SGD steps of both models from the same RNG state, compared after each."""
    import torch
    out = _Compared()
    for k in range(steps):
        loss_o = _step_original(s, seed + 1 + k, out)
        loss_p = _step_patched(s, seed + 1 + k, out)
        _compare(s, loss_o, loss_p, out)
        with torch.no_grad():
            s.opt_o.step()
            s.opt_p.step()
    return out


def _plan_and_profile(patched_path: str, meta: dict, plan, profile):
    """The Plan the module was made from and its profile, where they are found and match the
    module (else None): the simulator's timeline needs both."""
    from ..schema import load_profile
    if plan is None:
        plan = find_plan(patched_path, meta)
    if plan is not None and profile is None and plan.profile_path \
            and Path(plan.profile_path).exists():
        profile = load_profile(plan.profile_path)
    if profile is not None and (plan is None
                                or profile.fingerprint != meta.get("profile_fingerprint")
                                or plan.profile_fingerprint != profile.fingerprint):
        profile = None
    return plan, profile


@dataclass
class _Timeline:
    """The measured memory timeline, aligned with the simulator's where a profile was found."""
    rows: list = field(default_factory=list)
    worst: dict | None = None
    device_peak: int | None = None
    matched: int = 0
    n_tasks: int = 0
    pred_rec_ops: int | None = None


def _timeline(ms: MeasuredStep, plan, profile, cuda: bool) -> _Timeline:
    """Each measured row with the plan's predicted bytes and this device's (CPU: synchronous
    copies), when the profile is known; the measured bytes alone otherwise."""
    from ..hardware import HardwareSpec
    from ..profile_build import recost
    if profile is None:
        return _Timeline(rows=[{"op": r.op, "name": r.name, "recompute": r.recompute,
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
    out = _Timeline(device_peak=device_peak, matched=matched, n_tasks=len(pred_dev))
    out.pred_rec_ops = sum(1 for op, rec, _ in pred_dev if rec and not _is_view_op(profile, op))
    for r, a, b in zip(ms.rows, on_plan, on_dev):
        r.predicted_bytes = b
        out.rows.append({"op": r.op, "name": r.name, "recompute": r.recompute,
                         "measured_bytes": r.measured_bytes, "predicted_bytes": a,
                         "predicted_device_bytes": b})
    out.worst = worst_divergence(ms, profile)
    return out


def _value_reasons(s: _Pair, c: _Compared) -> list[str]:
    reasons = []
    if c.max_loss > s.loss_tol:
        reasons.append(f"loss differs by {c.max_loss:.2e} (relative), tolerance {s.loss_tol:g}")
    if c.max_grad > s.grad_tol:
        reasons.append(f"gradient of {c.worst_param} differs by {c.max_grad:.2e} (relative), "
                       f"tolerance {s.grad_tol:g}")
    if c.max_buf > s.grad_tol:
        reasons.append(f"buffers differ by {c.max_buf:.2e} (relative), tolerance {s.grad_tol:g}")
    return reasons


def _memory_reason(ms: MeasuredStep, budget: int, worst: dict | None,
                   cause: str | None = None) -> str | None:
    """Why the measured peak fails the budget (None: it does not), naming the statement and
    the tensors held past their last use where the simulator's timeline says so."""
    if not (budget > 0 and ms.peak_bytes > budget * (1 + MEMORY_TOLERANCE)):
        return None
    at = ms.rows[ms.peak_row].statement.split("#")[0].strip() if ms.rows else "?"
    why = ""
    if worst is not None:
        held = [t for t in worst["live_tensors"] if t.get("held_past_last_use")]
        names = ", ".join(f"{t['tensor']} ({fmt_bytes(t['bytes'])}, dead after op "
                          f"{t['profile_last_use']} {t['profile_last_use_name']})"
                          for t in held[:4])
        why = (f"; largest excess over the simulator: {fmt_bytes(worst['excess_bytes'])} at "
               f"op {worst['op']} ({worst['name']})"
               + (f", held past their last use: {names}" if names else ""))
    return (f"measured activation peak {fmt_bytes(ms.peak_bytes)} ({ms.peak_bytes} "
            f"bytes) at `{at[:80]}` is more than 5% above the plan's budget of "
            f"{fmt_bytes(budget)}" + why + (f"; {cause}" if cause else ""))


def verify(patched_path: str, model_path: str | None = None, entry: str | None = None,
           args: dict | None = None, steps: int = 1, seed: int = 0,
           check_trace: bool = True, warmup: bool = True, plan=None,
           profile=None, progress=None) -> VerifyReport:
    """Run the original and the patched training step `steps` times and compare them.

    `warmup` first runs one untimed step of each and restores weights, buffers and RNG state,
    so step times do not include one-off costs (allocator growth, kernel selection).
    `plan`: the Plan the module was made from (default: found next to the module by
    `find_plan`) and `profile` its profile (default: the one the plan records); with them,
    the measured memory timeline is aligned with the simulator's. `progress(line)` receives
    status lines (for stderr).
    """
    import torch

    say = progress or (lambda _line: None)
    if steps < 1:
        raise InputError(f"steps must be at least 1, got {steps}")
    say(f"loading {patched_path} and its workload twice (original and patched)")
    s = _load_pair(patched_path, model_path, entry, args, seed, check_trace)
    if warmup:
        say("warm-up step of each")
        _warmup(s.orig.model, s.run_original)
        _warmup(s.work.model, s.run_patched)
    say(f"comparing {steps} training step{'s' if steps > 1 else ''}: losses, gradients, buffers")
    c = _compare_steps(s, steps, seed)
    # memory over time: one more step of each, under the memory tracker
    plan, profile = _plan_and_profile(patched_path, s.meta, plan, profile)
    s.opt_p.zero_grad(set_to_none=True)
    s.opt_o.zero_grad(set_to_none=True)
    torch.manual_seed(seed + 1 + steps)
    say("measuring activation memory op by op")
    ms = measure_patched_step(s.mod, s.patched, *s.p_call, profile)
    torch.manual_seed(seed + 1 + steps)
    peak_orig = measure_eager_step(s.orig.model, s.run_original)
    tl = _timeline(ms, plan, profile, s.cuda)
    say(f"training the model patched in place (patch(model)) against eager, {steps} "
        f"step{'s' if steps > 1 else ''}")
    inplace = _check_in_place(s.mod, s.path, s.entry, s.args, s.dev, seed, steps, s.loss_tol,
                              s.grad_tol, s.meta.get("autocast"))
    reasons = list(inplace.pop("reasons")) + _value_reasons(s, c)
    budget = int(s.meta.get("budget_bytes") or 0)
    memory = _memory_reason(ms, budget, tl.worst, _device_cause(s.meta, s.device))
    reasons += [memory] if memory else []
    memory = _inplace_memory_reason(inplace, budget, s.meta, s.device)
    reasons += [memory] if memory else []
    return _report(s, c, ms, tl, plan, profile, steps, budget, peak_orig, inplace, reasons,
                   patched_path)


def _report(s: _Pair, c: _Compared, ms: MeasuredStep, tl: _Timeline, plan, profile, steps: int,
            budget: int, peak_orig: int, inplace: dict, reasons: list[str],
            patched_path: str) -> VerifyReport:
    meta = s.meta
    pred = meta.get("predicted", {})
    fraction = meta.get("budget_fraction")
    keep_all = (profile.keep_all_peak_bytes if profile is not None
                else int(meta.get("keep_all_peak_bytes") or 0)
                or (keep_all_of(budget, fraction) if fraction else 0))
    metric = ("cuda max_memory_allocated above the step's start, gradients subtracted" if s.cuda
              else "bytes held for backward at the end of forward (cpu)")
    return VerifyReport(
        patched=str(patched_path), workload=str(s.path), device=s.device, steps=steps,
        losses_original=c.losses_o, losses_patched=c.losses_p, max_loss_rel_diff=c.max_loss,
        max_grad_rel_diff=c.max_grad, worst_grad_param=c.worst_param,
        max_buffer_rel_diff=c.max_buf, loss_tolerance=s.loss_tol, grad_tolerance=s.grad_tol,
        memory_metric=metric, original_peak_bytes=int(max(c.peaks_o)),
        patched_peak_bytes=int(max(c.peaks_p)), budget_bytes=budget,
        predicted_peak_bytes=int(pred.get("peak_bytes", 0)),
        original_step_ms=min(c.times_o), patched_step_ms=min(c.times_p),
        predicted_step_us=float(pred.get("step_us", 0.0)),
        swapped_bytes_per_step=int(c.offloaded), kept=len(meta.get("kept", ())),
        swapped=len(meta.get("swapped", ())), recomputed=len(meta.get("recomputed", ())),
        passed=not reasons, reasons=reasons, measured_peak_bytes=int(ms.peak_bytes),
        measured_peak_at=(ms.rows[ms.peak_row].statement.split("#")[0].strip()
                          if ms.rows else ""),
        measured_original_peak_bytes=int(peak_orig), predicted_original_peak_bytes=keep_all,
        predicted_device_peak_bytes=None if tl.device_peak is None else int(tl.device_peak),
        plan_found=profile is not None, timeline_matched=tl.matched, timeline_tasks=tl.n_tasks,
        timeline=tl.rows, worst_divergence=tl.worst,
        extra_step_ms=[p - o for o, p in zip(c.times_o, c.times_p)],
        predicted_recompute_us=(plan.predicted.recompute_us if plan is not None else None),
        profile_time_source=(profile.summary.get("time_source", "") if profile is not None
                             else ""),
        predicted_recompute_ops=tl.pred_rec_ops,
        measured_recompute_ops=_recompute_calls(ms.rows, profile),
        inplace=inplace)
