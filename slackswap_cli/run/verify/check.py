"""The check in the training script: what `slackswap verify` gives the CLI, on the live model.

    report = slackswap.check(model, plan, inputs)   # before patch: raises CheckFailed
    slackswap.patch(model, plan, check=True)         # the same, on the first training batch

One step of the model as it is (eager) and two of the model patched with the plan (its first
call, recorded, and its second: the steady state, or the plan made again along the branches
the first call took, as training runs from then on), each from the same random-number state
and on the same samples: the loss, every parameter's gradient and the buffers after the step
(BatchNorm's statistics) must be bitwise equal to eager's, else `CheckFailed` names the call,
the first parameter (in `named_parameters` order) whose gradient differs and by how much
(verify's comparison: `verify_steps.differences`).

Where the plan is needed an eager step of the whole batch may not fit, so by default the check
runs on the first k samples of the batch (every input tensor whose first dimension is the
batch's is sliced), k the batch times the plan's budget fraction (at least 2): an eager step
of those holds about the plan's budget. The patched step at k samples runs the plan's own
decisions, lent to those shapes (run/eager/signatures.py), so its recomputes and swaps are the
plan's. `samples=None` checks the whole batch, `samples=k` the first k.

Nothing of the model changes: gradients come from `torch.autograd.grad` (no `.grad` is
written, no optimizer steps), the buffers are restored after each step, the random number
generators after both, the training mode after, and the temporary patch is undone. The eager
step's gradients are held on the host while the patched step runs (on a GPU: one copy of the
parameters' size there, none on the device).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ...errors import CheckFailed, InputError, SlackswapError, TraceError
from ...trace.joint import autocast_region, loss_from_output, split_inputs, workload_inputs
from ..eager import inplace
from ..rng import rng_state, set_rng_state
from .steps import device_type, differences

__all__ = ["CheckReport", "check_step", "first_samples"]


@dataclass
class CheckReport:
    """What a passed check ran: `samples` of the batch's `batch`, the `parameters` whose
    gradients were compared bitwise, the loss, what the patched step did of the plan
    (`ops_rerun`: forward ops re-run in backward; `roots_swapped`: saved tensors copied to
    the host; `lined_up`: the fraction of the profile's forward ops it lined up with) and
    the check's seconds."""
    samples: int
    batch: int
    parameters: int
    loss: float
    ops_rerun: int
    roots_swapped: int
    lined_up: float
    seconds: float


def first_samples(inputs, samples, fraction: float | None) -> tuple[object, int, int]:
    """(inputs cut to their first k samples, k, the batch): every tensor whose first
    dimension is the batch's (that of the first tensor with one) is sliced. `samples`:
    "auto" (the batch times `fraction`, at least 2), an int, or None (the whole batch)."""
    leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim()]
    batch = leaves[0].shape[0] if leaves else 1
    if samples is None:
        k = batch
    elif samples == "auto":
        k = max(2, math.floor(batch * (fraction or 1.0)))
    elif isinstance(samples, int) and not isinstance(samples, bool) and samples >= 1:
        k = samples
    else:
        raise InputError(f"samples={samples!r}: the samples to check are 'auto', a number of "
                         "samples (1 or more) or None (the whole batch)",
                         hint="check(model, plan, inputs, samples='auto')")
    k = min(k, batch)
    if k == batch:
        return inputs, k, batch

    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch:
            return x[:k]
        return x
    return pytree.tree_map(cut, inputs), k, batch


def _rng_state() -> tuple:
    return rng_state()          # torch's, NumPy's and Python's generators (run/rng.py)


def _set_rng(state: tuple) -> None:
    set_rng_state(state)


def _step(model, inputs, loss_fn, autocast, params: dict) -> tuple[torch.Tensor, dict]:
    """(loss, {name: gradient}) of one step of `model` on `inputs`; no `.grad` is written."""
    a, kw = split_inputs(inputs)
    with autocast_region(autocast, device_type(model)):
        loss = loss_from_output(model(*a, **kw), workload_inputs(inputs, a, kw), loss_fn)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return loss.detach(), dict(zip(params, grads))


def _host(t):
    return t if t is None or t.device.type == "cpu" else t.detach().to("cpu")


def check_step(model: torch.nn.Module, meta: dict, table: dict, inputs, *,
               samples="auto", loss_fn=None) -> CheckReport:
    """One step eager against the first two calls patched with (`meta`, `table`) on the
    first samples of `inputs` (the module docstring); raises CheckFailed when they differ."""
    model = inplace.unwrap(model)     # a DDP wrapper's model, checked without its comms
    if inplace.is_patched(model):
        raise InputError("check() takes the model before patch: this one is patched already",
                         hint="check(model, plan, inputs) before patch(model, plan), or "
                              "patch(model, plan, check=True) to check the first training batch")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise InputError("check() runs the model, and its parameters are on the meta device "
                         "(no values)", hint="materialise it first: model.to_empty(device=...) "
                         "and initialise its weights, then check(model, plan, inputs)")
    started = time.perf_counter()
    loss_fn = loss_fn if loss_fn is not None else meta.get("loss_fn")
    fraction = meta.get("budget_fraction") or (
        meta["budget_bytes"] / meta["keep_all_peak_bytes"]
        if meta.get("keep_all_peak_bytes") else None)
    part, k, batch = first_samples(inputs, samples, fraction)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng, was_training = _rng_state(), model.training
    model.train()
    try:
        eager = _eager(model, part, loss_fn, meta, params, k, batch)
        inplace.patch(model, meta, table)
        inplace.patched_state(model).notes.quiet = True    # its figures: the CheckReport
        try:
            run, report = _patched_calls(model, part, loss_fn, meta, params, (buffers, rng),
                                         eager, _which(k, batch))
        finally:
            inplace.unpatch(model)
    finally:
        _restore(buffers, rng)
        model.train(was_training)
    return CheckReport(samples=k, batch=batch, parameters=len(params), loss=float(eager[0]),
                       ops_rerun=run.rerun_ops if run is not None else 0,
                       roots_swapped=len(run.metas) if run is not None else 0,
                       lined_up=float(report.get("fraction", 0.0)),
                       seconds=time.perf_counter() - started)


def _patched_calls(model, part, loss_fn, meta, params, before, eager, where: str):
    """The patched model's first call (recorded) and second (its steady state, or the plan
    made again along the branches the first took), each from the state `before` (buffers,
    random-number generators) and compared with `eager`; (the first call's run, its report)."""
    run = report = None
    for call in ("first", "second"):
        _restore(*before)
        try:
            loss, grads = _step(model, part, loss_fn, meta.get("autocast"), params)
        except SlackswapError:
            raise
        except Exception as exc:
            raise CheckFailed(f"check on {where}: the patched model's {call} call failed where "
                              f"eager ran: {_failure(exc)}", hint=_HINT) from None
        if run is None:
            state = inplace.patched_state(model)
            run, report = state.last_run, state.last_report or {}
        bufs = {n: b.detach() for n, b in model.named_buffers()}
        _compare(*eager, loss, grads, bufs, f"{where}, the patched model's {call} call")
    return run, report


def _restore(buffers: list, rng: tuple) -> None:
    with torch.no_grad():
        for b, value in buffers:
            b.copy_(value)
    _set_rng(rng)


def _failure(exc: Exception) -> str:
    """`Type: first line of the message` (300 characters at most), for a step that raised."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def _which(k: int, batch: int) -> str:
    return "the whole batch" if k == batch else f"the first {k} of {batch} samples"


def _eager(model, part, loss_fn, meta, params, k, batch):
    """The eager step: (loss, gradients on the host, buffers after it)."""
    try:
        loss, grads = _step(model, part, loss_fn, meta.get("autocast"), params)
    except SlackswapError:
        raise
    except Exception as exc:
        if k < batch:
            raise InputError(f"check: the model's eager step on {_which(k, batch)} failed: "
                             f"{_failure(exc)}",
                             hint="pass samples=None to check the whole batch (a loss_fn that "
                                  "closes over the whole batch's labels needs it), or "
                                  "samples=K for another slice") from None
        raise TraceError(f"check: the model's eager step failed: {_failure(exc)}",
                         hint="check that the step trains without slackswap on these inputs"
                         ) from None
    return loss, {n: _host(g) for n, g in grads.items()}, {
        n: _host(b.detach().clone()) for n, b in model.named_buffers()}


_HINT = ("the plan does not give eager's values on this model: a bug in slackswap, not in "
         "the model. Train it unpatched (slackswap_cli.unpatch(model)) and report the model; "
         "a plan from planner='swap-all' (no recomputes) shows whether recomputing is the cause")


def _compare(loss_e, grads_e, bufs_e, loss_p, grads_p, bufs_p, where: str) -> None:
    """Raise CheckFailed at the first gradient (then the loss, then a buffer) that is not
    bitwise equal."""
    found = differences(grads_e, grads_p)
    loss = differences({"loss": loss_e.cpu()}, {"loss": loss_p})
    if found:
        name, d = found[0]
        worst = max(found, key=lambda x: x[1])
        more = "" if len(found) == 1 else (
            f" (and {len(found) - 1} more parameters, most {worst[0]}: {worst[1]:.3g})")
        raise CheckFailed(f"check on {where}: the gradient of {name} differs from eager by "
                          f"{d:.3g} of its largest value{more}; loss eager {float(loss_e):.9g}, "
                          f"patched {float(loss_p):.9g}", hint=_HINT)
    if loss:
        raise CheckFailed(f"check on {where}: the loss differs from eager: {float(loss_e):.9g} "
                          f"against {float(loss_p):.9g} patched (relative {loss[0][1]:.3g})",
                          hint=_HINT)
    bufs = differences(bufs_e, bufs_p)
    if bufs:
        raise CheckFailed(f"check on {where}: buffer {bufs[0][0]} differs from eager after the "
                          f"step by {bufs[0][1]:.3g} of its largest value", hint=_HINT)
