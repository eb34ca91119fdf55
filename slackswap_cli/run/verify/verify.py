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
recomputes the in-place run kept).

The jobs, one module each: `verify_steps` (the two models stepped and compared),
`verify_timeline` (memory op by op against the simulator), `verify_memory` (does it fit, why a
peak fails the budget), `verify_inplace` (the model patched in place); this module runs them in
order (`verify`) and assembles the `VerifyReport`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...budget import keep_all_of
from ...errors import InputError, SlackswapError
from ...schema import load_plan, load_profile
from ..emit import plan_fingerprint
from .inplace import check_in_place
from .memory import device_cause, inplace_memory_reason, memory_reason
from .steps import Compared, Pair, compare_steps, load_pair, value_reasons, warmup_step
from .timeline import (
    MeasuredStep,
    Timeline,
    aligned_timeline,
    measure_eager_step,
    measure_patched_step,
    recompute_calls,
)


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
    # activation memory over the step, measured op by op (run/verify/memtrace.py) on both devices
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


def find_plan(patched_path: str, meta: dict):
    """The plan a patched module was made from: a `*.json` next to it (or in the current
    directory) whose decisions hash to the module's `plan_fingerprint`; None if none does."""
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


def _plan_and_profile(patched_path: str, meta: dict, plan, profile):
    """The Plan the module was made from and its profile, where they are found and match the
    module (else None): the simulator's timeline needs both."""
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
    say = progress or (lambda _line: None)
    if steps < 1:
        raise InputError(f"steps must be at least 1, got {steps}")
    say(f"loading {patched_path} and its workload twice (original and patched)")
    s = load_pair(patched_path, model_path, entry, args, seed, check_trace)
    if warmup:
        say("warm-up step of each")
        warmup_step(s.orig.model, s.run_original)
        warmup_step(s.work.model, s.run_patched)
    say(f"comparing {steps} training step{'s' if steps > 1 else ''}: losses, gradients, buffers")
    c = compare_steps(s, steps, seed)
    # memory over time: one more step of each, under the memory tracker
    plan, profile = _plan_and_profile(patched_path, s.meta, plan, profile)
    s.opt_p.zero_grad(set_to_none=True)
    s.opt_o.zero_grad(set_to_none=True)
    torch.manual_seed(seed + 1 + steps)
    say("measuring activation memory op by op")
    ms = measure_patched_step(s.mod, s.patched, *s.p_call, profile)
    torch.manual_seed(seed + 1 + steps)
    peak_orig = measure_eager_step(s.orig.model, s.run_original)
    tl = aligned_timeline(ms, plan, profile, s.cuda)
    say(f"training the model patched in place (patch(model)) against eager, {steps} "
        f"step{'s' if steps > 1 else ''}")
    inplace = check_in_place(s.mod, s.path, s.entry, s.args, s.dev, seed, steps, s.loss_tol,
                              s.grad_tol, s.meta.get("autocast"))
    reasons = list(inplace.pop("reasons")) + value_reasons(s, c)
    budget = int(s.meta.get("budget_bytes") or 0)
    memory = memory_reason(ms, budget, tl.worst, device_cause(s.meta, s.device))
    reasons += [memory] if memory else []
    memory = inplace_memory_reason(inplace, budget, s.meta, s.device)
    reasons += [memory] if memory else []
    return _report(s, c, ms, tl, plan, profile, steps, budget, peak_orig, inplace, reasons,
                   patched_path)


def _report(s: Pair, c: Compared, ms: MeasuredStep, tl: Timeline, plan, profile, steps: int,
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
        measured_recompute_ops=recompute_calls(ms.rows, profile),
        inplace=inplace)
