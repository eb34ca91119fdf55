"""What eager holds beyond the simulator under a plan, measured on the model itself.

The simulator frees a swapped or recomputed tensor after its last reader; eager Python holds
what it still names (a block's locals, the views `q, k, v` of a fused projection; a block's
input in the caller's loop) until the statement or function ends. So a patched step can peak
above the plan's predicted peak, and above its budget. `measured_peak` runs the plan on the
model once and measures it; `eager_excess` is what it holds beyond the prediction.

Both planners that run a live model use it: `plan_model` (`settle`: plans again below the
budget by the excess when the measured step does not fit it) and `plan_pipeline`
(`settle_stages`: the excess counts at the stage's peak, `stages.Boundary.eager`).

The measurement runs on the user's model, not on a copy (a copy doubles the parameters'
memory): the model is patched with the plan, trained for two calls (the first records the
plan; the second is the steady state training runs, and is the one measured: activation
storages op by op, `run/verify/memtrace.py`, the parameters' and inputs' gradients and the swap
engine's host buffers left out), and unpatched. Around it every parameter's `.grad` is put
back (the very tensor it was, or None), the buffers' values (BatchNorm's statistics) and
every random number generator (`run/rng.py`) are restored, and the training mode too; the
inputs are detached copies (no gradient reaches the caller's tensors). A forward that writes
its parameters in place cannot be undone without a copy: `plan_model`'s default measure then
warns and returns the plan unmeasured, `measure=True` raises `ParameterWritten`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ...errors import InputError, SlackswapError, TraceError
from ...trace.joint import autocast_region, loss_from_output, split_inputs, workload_inputs
from ..eager import inplace
from ..rng import rng_state, set_rng_state

__all__ = ["measured_peak", "measured_peaks", "simulated_peaks", "eager_excess", "settle",
           "settle_stages", "Settled"]


def measured_peak(model: torch.nn.Module, inputs: Any, loss_fn: Callable | None, plan) -> int:
    """The activation peak (bytes, forward and backward) of `model` patched with `plan` (an
    `api.Plan`) in its second training call on `inputs` (a workload's inputs: a tuple, a
    dict or a tensor); `loss_fn(output, inputs)` or the output's loss. The model is left as
    it was (the module docstring)."""
    return max(measured_peaks(model, inputs, loss_fn, plan))


def measured_peaks(model: torch.nn.Module, inputs: Any, loss_fn: Callable | None,
                   plan) -> tuple[int, int]:
    """`measured_peak`'s forward (the loss included) and backward peaks, apart."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    versions = [p._version for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng, was_training = rng_state(), model.training
    a, kw = pytree.tree_map(_fresh, split_inputs(inputs))
    given = workload_inputs(inputs, a, kw)
    leaves = [t for t in (*params, *pytree.tree_leaves((a, kw)))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    model.train()
    inplace.patch(model, plan.meta, plan.table)
    inplace.patched_state(model).notes.quiet = True
    try:
        for _ in range(2):
            _restore(buffers, rng)
            for t in leaves:
                t.grad = None
            peaks = _step_peaks(model, a, kw, given, loss_fn, plan.meta.get("autocast"),
                                leaves)
    except SlackswapError:
        raise
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        raise TraceError(f"measuring the plan: the patched step failed: "
                         f"{type(exc).__name__}: {text}",
                         hint="measure=False (plan_model, plan_pipeline) returns the plan "
                              "unmeasured; slackswap_cli.check(model, plan, inputs) then runs "
                              "it against eager and says where it fails") from None
    finally:
        inplace.unpatch(model)
        _restore(buffers, rng)
        model.train(was_training)
        for p, g in zip(params, grads):
            p.grad = g
    moved = [n for (n, p), v in zip(model.named_parameters(), versions) if p._version != v]
    if moved:
        raise ParameterWritten(f"measuring the plan: the model's forward writes its parameter "
                         f"{moved[0]} in place, which a measured step cannot undo",
                         hint="measure=False (plan_model, plan_pipeline): the plan as the "
                              "simulator judges it, unmeasured")
    return peaks


class ParameterWritten(InputError):
    """The measured step wrote a parameter in place (plan_model's default measure warns and
    returns the plan unmeasured; measure=True raises it)."""


def eager_excess(model: torch.nn.Module, inputs: Any, loss_fn: Callable | None, plan) -> int:
    """Bytes by which the patched step (`measured_peak`) peaks above the simulator's peak of
    `plan`, 0 when it does not."""
    return max(0, measured_peak(model, inputs, loss_fn, plan) - plan.predicted.peak_bytes)


def _fresh(x):
    return x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


def _restore(buffers: list, rng: tuple) -> None:
    with torch.no_grad():
        for b, value in buffers:
            b.copy_(value)
    set_rng_state(rng)


def _step_peaks(model, a, kw, given, loss_fn, autocast, leaves) -> tuple[int, int]:
    """One training call of the patched model: its forward and backward activation peaks,
    gradients left out (a hook on each leaf marks the gradient it receives as it arrives)."""
    from ...trace.storage import storage_object_key
    from .. import swap
    from .memtrace import SKIP, MemTracker, caller_line
    tracker = MemTracker(caller_line({swap.HostPool.get.__code__: SKIP}, outside=None))

    def grad_hook(g):
        i = tracker._live.get(storage_object_key(g))
        if i is not None and tracker.storages[i].nbytes > 0:
            tracker.storages[i].nbytes = -tracker.storages[i].nbytes - 1
    hooks = [t.register_hook(grad_hook) for t in leaves]
    device = next((p.device.type for p in model.parameters()), "cpu")
    try:
        with tracker:
            with autocast_region(autocast, device):
                loss = loss_from_output(model(*a, **kw), given, loss_fn)
            n_forward = len(tracker.samples)
            loss.backward()
            del loss
        tracker.finish()
    finally:
        for h in hooks:
            h.remove()
    timeline = tracker.timeline()
    return max(timeline[:n_forward], default=0), max(timeline[n_forward:], default=0)


def simulated_peaks(profile, plan, hw) -> tuple[int, int]:
    """The simulator's forward and backward activation peaks of `plan` (a `schema.Plan` of
    `profile`) on `hw`: its memory before and from the first backward op's start, each copy
    back issued no earlier than the plan's schedule issued it (`chains.copy_back_pins`, as
    the runtime issues it: a plan made below its budget keeps the budget asked for, at
    which the simulator alone would prefetch earlier)."""
    from ...chains import copy_back_pins
    from ...schema import Action, Decision
    from ...simulate import simulate
    pins = copy_back_pins(plan.decisions, plan.schedule)
    decisions = [Decision(d.tensor, d.action, pins.get(d.tensor, d.prefetch_at))
                 if d.action == Action.SWAP else d for d in plan.decisions]
    res = simulate(profile, decisions, hw, plan.budget_bytes, record=True)
    start = min((e.start_us for e in res.events if e.engine == "compute" and e.op is not None
                 and e.op >= profile.n_forward), default=float("inf"))
    fwd = max((m for t, m in res.memory if t < start), default=0)
    bwd = max((m for t, m in res.memory if t >= start), default=0)
    return fwd, bwd


@dataclasses.dataclass(frozen=True)
class Settled:
    """What `settle` measured: the plan's predicted and measured peaks (forward and backward
    together) as first planned and as returned, the budget the returned plan was made at (the
    budget less an excess where it planned again, else the budget) and the largest excess
    seen (measured over simulated: the whole step's peaks, and each phase's against its own)."""
    first_predicted: int
    first_measured: int
    predicted: int
    measured: int
    planned_at: int
    excess: int
    rounds: int         # plans measured
    seconds: float      # spent measuring and planning again


def settle(plan, budget_bytes: int, plan_at: Callable[[int], Any],
           measure: Callable[[Any], tuple[int, int]],
           simulated: Callable[[Any], tuple[int, int]]) -> tuple[Any, Settled]:
    """(the plan to use, what was measured). `measure(plan)` and `simulated(plan)`: its
    (forward, backward) peaks measured and simulated; `plan_at(bytes)` -> a plan made at
    that budget (feasible or not). A plan whose measured step fits `budget_bytes` is returned
    as it is (its decisions unchanged). Else plan again (twice at most) below the budget by
    an excess, keeping the plan that measures lowest: first by the measured peak's excess
    over the predicted peak; then by the largest excess of a phase over its own simulated
    peak (eager's over-hold is in forward, a block's locals, where the simulator's peak may
    be in backward: a plan made lower may then lower only its backward)."""
    started = time.perf_counter()
    got = measure(plan)
    peak, first = max(got), (plan.predicted.peak_bytes, max(got))
    whole = max(0, peak - plan.predicted.peak_bytes)
    phase = max(0, *(m - s for m, s in zip(got, simulated(plan))))
    at, best_at, rounds = budget_bytes, budget_bytes, 1
    for r in range(2):
        if peak <= budget_bytes:
            break
        tries = (whole, max(whole, phase)) if r == 0 else (max(whole, phase),)
        excess = next((e for e in tries if 0 < budget_bytes - e < at), None)
        if excess is None:
            break
        at = budget_bytes - excess
        candidate = plan_at(at)
        if not candidate.feasible:
            break
        got = measure(candidate)
        rounds += 1
        whole = max(whole, max(got) - candidate.predicted.peak_bytes)
        phase = max(phase, *(m - s for m, s in zip(got, simulated(candidate))))
        if max(got) < peak:
            plan, peak, best_at = candidate, max(got), at
    return plan, Settled(*first, plan.predicted.peak_bytes, peak, best_at, max(whole, phase),
                         rounds, time.perf_counter() - started)


def settle_stages(stages, order, profiles, per_rank, planner_fn, boundary, table, plans,
                  traced, plan_of, **kw):
    """`plan_pipeline`'s: plan again where the eager run of a stage's plan, measured on one
    microbatch, peaks above the simulator's prediction (`eager_excess`): the excess counts at
    that stage's peak (`Boundary.eager`), and the search runs again (twice at most).
    `plan_of(stage, raw plan)`: the `api.Plan` of a stage's plan; `kw`: for `plan_stages`."""
    from ...pipeline.stages import plan_stages
    for _ in range(2):
        excess = {s: eager_excess(*stages[s][:2], traced[s][2], plans[s])
                  for s in table.plans if plans.get(s) is not None}
        if not any(e > boundary[s].eager for s, e in excess.items()):
            break
        for s, e in excess.items():
            boundary[s] = boundary[s]._replace(eager=max(e, boundary[s].eager))
        table = plan_stages(order, profiles, per_rank, planner_fn, boundary, **kw)
        plans = {s: (None if p is None else plan_of(s, p)) for s, p in table.plans.items()}
    return table, plans
