"""slackswap from the training script: plan the model the script built, patch it, train.

    import slackswap_cli as slackswap
    plan = slackswap.plan_model(model, batch, budget=0.5)   # profile + plan, in this process
    slackswap.patch(model, plan)                             # or: model = slackswap.compile(model, plan)

`plan_model` is `slackswap profile` + `slackswap plan` on a live model: the same tracer
(`trace.profile_traced`, what `profile_workload` runs once it has loaded a workload file), the
same budget reading, hardware choice and planner run (`planning.py`, what `slackswap plan`
calls). Where the step is traced:

- `device="auto"`: on the model's device when it is CUDA, op times measured there; otherwise
  with fake tensors (a FakeTensor copy of the model: nothing allocated, the model untouched)
  and the roofline of `hardware`, random ops traced as the model's device draws them;
- `"cpu"` / `"cuda"`: measured on that device (the model must be on it); `"fake"`,
  `"fake:cpu"`, `"fake:cuda"`: as `slackswap profile --device` reads them.

Planning leaves the model as it was: parameters and buffers keep their values (a measured
trace's buffer updates, BatchNorm statistics, are undone), nothing gets a `.grad`, the random
number generators are restored, and nothing is written unless `Plan.save` is called.

`patch(model, plan)` is the emitted module's `patch` (run/eager/inplace.py, from the same META and
TABLE an emitted file holds) and `compile(model, plan)` its `compile_planned` (run/compiled/backend.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ..budget import first_feasible_budget, floor_message
from ..chains import runtime_table
from ..compile_limits import check_mode
from ..errors import InfeasibleError, InputError, SlackswapError, TraceError
from ..fit import check_optimizer, device_budget, static_memory
from ..hardware import HardwareSpec, load_hardware
from ..planners import planner_spec
from ..planning import infeasible_message, plan_inputs, plan_profile, save_with_profile
from ..schema import Plan as PlanFile
from ..schema import Profile
from ..trace import does_not_fit, profile_traced, split_device
from ..trace.aten import is_inplace_target
from ..trace.joint import autocast_name
from ..trace.static_memory import model_facts
from ..trace.workload import as_workload
from ..units import fmt_bytes
from ..workload_spec import Workload
from .compiled import backend as compiled
from .eager import inplace
from .eager.inplace import is_patched
from .eager.replan import fake_copy, fake_of
from .emit import patch_meta
from .notes import checkpointing_on, tell
from .rng import forked_rng
from .verify.check import CheckReport, check_step

__all__ = ["Plan", "plan_model", "patch", "unpatch", "compile", "check", "CheckReport"]


class Plan:
    """What `plan_model` returns: the profile, the plan (`schema.Plan`, what a plan file
    holds) and the tables the runtimes follow. `save(path)` writes the files the CLI reads.
    `note`: what the costs were priced for when that is not what a user may expect (a
    meta-device model's plan: a fake trace and a hardware preset's roofline), else None.
    `measured`: what `plan_model`'s measure found (`excess.Settled`), else None."""

    note: str | None = None
    measured = None     # plan_model's measure: an `excess.Settled`, or None (not measured)

    def __init__(self, profile: Profile, plan: PlanFile, meta: dict, table: dict,
                 graph_table: dict):
        self.profile, self.plan = profile, plan
        self.meta, self.table, self.graph_table = meta, table, graph_table

    feasible = property(lambda self: self.plan.feasible)
    predicted = property(lambda self: self.plan.predicted)
    budget_bytes = property(lambda self: self.plan.budget_bytes)
    planner = property(lambda self: self.plan.planner)
    decisions = property(lambda self: self.plan.decisions)

    def actions(self) -> dict[str, int]:
        """{"keep": n, "swap": n, "recompute": n} over the saved activations."""
        return dict(self.plan.action_counts(self.profile))

    def save(self, path) -> tuple[str, str]:
        """Write the plan to `path` (e.g. `model.plan.json`) and its profile next to it
        (`model.profile.json`), for `slackswap show / simulate / compare / apply`; returns
        (plan path, profile path). `apply` also needs the workload file: `--model FILE`."""
        prof_path = save_with_profile(self.plan, self.profile, Path(path))
        return str(path), str(prof_path)

    def __repr__(self) -> str:
        c = self.actions()
        return (f"<slackswap Plan {self.planner}: budget {self.budget_bytes} bytes, keep "
                f"{c.get('keep', 0)}, swap {c.get('swap', 0)}, recompute {c.get('recompute', 0)}, "
                f"feasible {self.feasible}, retention {self.predicted.retention:.1%}>")


def plan_model(model: torch.nn.Module, inputs: Any, *, budget, hardware=None,
               loss_fn: Callable | None = None, device: str = "auto",
               planner: str = "slackswap", autocast: str | None = None, optimizer="adamw",
               time_limit: float | None = None, for_compile: str | None = None,
               progress: Callable[[str], None] | None = None,
               measure: bool | None = None) -> Plan:
    """Profile one training step of `model` on `inputs` in this process and plan it.

    `inputs`: a tuple of positional arguments, a dict of keyword arguments or one tensor (as a
    workload returns them); `loss_fn(output, inputs)` when the output is not the loss (nor has
    a `.loss`). `budget`: what `slackswap plan --budget` takes (0.5, "50%", "20GiB", bytes),
    or "auto" on a CUDA device: what the device holds after the model, its gradients and the
    state of `optimizer` (a torch.optim optimizer or a `slackswap fit --optimizer` name), less
    fit's reserve. `hardware`: a preset, a JSON file or a HardwareSpec (the roofline of a fake
    trace, and the copy engine the plan is simulated on). `planner`, `autocast`, `time_limit`,
    `for_compile` ("model" or "per-block": a plan for `compile_planned`, what it cannot
    offload kept or recomputed): as the CLI's options. `measure`: run the plan once on the
    model and measure its step (`Plan.measured`); where eager peaks above the budget (it holds
    what Python still names longer than the simulator counts), plan again below the budget by
    that excess (run/verify/excess.py). None (default): when the step was traced on real tensors
    (device "cpu" or "cuda"), or with fake tensors for a tensor parallel model (DTensor
    parameters, real, on the plan's device type: every rank of the group plans at once, as it
    must anyway), and the plan is not `for_compile` (the measured run is
    `patch`'s); True: after a fake trace too, on the model itself (its parameters real, on
    the plan's device type); False: never. Raises SlackswapError subclasses: InputError (bad arguments),
    TraceError (the model cannot be traced), InfeasibleError (no plan fits; its `.plan` is
    the closest one)."""
    started = time.perf_counter()
    work = checked_workload(model, inputs, loss_fn)
    if is_patched(model):
        raise InputError("this model is already patched by slackswap, so its forward runs a plan",
                         hint="slackswap_cli.unpatch(model) first, then plan it again")
    planner_spec(planner)                       # an unknown planner before any tracing
    if for_compile is not None:
        check_mode(for_compile)                 # an unknown mode before any tracing
    autocast = autocast_name(autocast)
    how, target = where_traced(model, device)
    if budget == "auto" and how != "cuda":
        raise InputError("budget='auto' needs a CUDA device: it plans into the memory the GPU "
                         f"has free, and this model is profiled on {how}",
                         hint="give the budget as a fraction (0.5) or a size ('20GiB'), or "
                              "move the model to a GPU first")
    hw = hardware_of(hardware)
    with left_untouched(model):
        prof, joint, traced = profile_step(work, how, target, hw, autocast, progress, started)
    note = _meta_note(model, how, target, hw)
    if note is not None:
        warnings.warn(f"slackswap: {note}", stacklevel=2)
    own = checkpointing_on(model)
    if own is not None:     # (its regions re-run in the traced backward: trace/checkpointed.py)
        tell(own)
    if budget == "auto":
        budget = str(_auto_budget(model, work.inputs, optimizer))
    prof, hw, budget_bytes, fraction = plan_inputs(prof, budget, hw, "plan_model")
    result, _ = plan_profile(prof, hw, budget_bytes, fraction, planner, time_limit=time_limit,
                             started=started, for_compile=for_compile)
    out = plan_of(prof, result, joint, traced, loss_fn)
    out.note = note
    if not result.feasible:
        raise _infeasible(prof, planner, hw, budget_bytes, out)
    run_on = _measured_on(measure if for_compile is None else bool(measure), how, model,
                          work, traced, out)
    if run_on is not None:
        from .verify.excess import ParameterWritten
        try:
            out = _settled(out, run_on, prof, hw, planner, joint, traced, loss_fn,
                           dict(time_limit=time_limit, for_compile=for_compile))
        except ParameterWritten as exc:
            if measure:
                raise
            warnings.warn(f"slackswap: the plan is not measured: {exc}", stacklevel=2)
        out.note = note
    return out


def patch(model: torch.nn.Module, plan: Plan, *, strict: bool = False,
          replan: bool = True, check: bool = False) -> torch.nn.Module:
    """Patch `model` in place to train under `plan` (the emitted module's `patch`); returns
    `model`. `unpatch(model)` undoes it. `check=True`: the first training call runs
    `check` on its inputs first (raising CheckFailed there when the plan's values differ);
    its CheckReport is then `model.forward.__slackswap__.check_report`."""
    _is_plan(plan, "patch")
    out = inplace.patch(model, plan.meta, plan.table, strict=strict, replan=replan)
    if check:
        state = inplace.patched_state(model)
        state.before_first = functools.partial(_check_first_call, state, plan)
    return out


def check(model: torch.nn.Module, plan: Plan, inputs: Any, *, samples="auto",
          loss_fn: Callable | None = None) -> CheckReport:
    """`slackswap verify` in the training script: one step of `model` eager against one
    step patched with `plan`, from the same random-number state, on the first samples of
    `inputs` (`samples`: "auto", the batch times the plan's budget fraction; K; None, the
    whole batch). Gradients, loss and buffers must be bitwise equal, else CheckFailed names the
    first parameter whose gradient differs and by how much. The model is left as it was;
    call it before `patch` (or use `patch(model, plan, check=True)`). `loss_fn`: default the
    one `plan_model` was given. Returns a CheckReport (run/verify/check.py)."""
    _is_plan(plan, "check")
    return check_step(model, plan.meta, plan.table, inputs, samples=samples, loss_fn=loss_fn)


def _check_first_call(state, plan: Plan, args, kwargs) -> None:
    """`patch(..., check=True)`: `check` on the first training call's inputs, the model's
    patch set aside meanwhile (nothing of it has run yet) and put back as it was."""
    model = state.model
    if args and kwargs:
        raise InputError("check=True: the model's first training call mixes positional and "
                         "keyword tensors", hint="call it with one kind, or call "
                         "slackswap_cli.check(model, plan, inputs) before patch")
    forward = model.__dict__["forward"]
    inplace.unpatch(model)
    try:
        state.check_report = check_step(model, plan.meta, plan.table,
                                        dict(kwargs) if kwargs else tuple(args))
    finally:
        model.forward = forward


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: the model's own forward again; returns `model`."""
    return inplace.unpatch(model)


def compile(model: torch.nn.Module, plan: Plan, *, block=None, per_block: bool = False,
            **torch_compile_kwargs):
    """`torch.compile(model, **torch_compile_kwargs)` with `plan` in its joint graphs (the
    emitted module's `compile_planned`, run/compiled/backend.py)."""
    _is_plan(plan, "compile")
    return compiled.compile_planned(model, plan.graph_table, block=block, per_block=per_block,
                                    **torch_compile_kwargs)


def _is_plan(plan, what: str) -> None:
    if not isinstance(plan, Plan):
        raise InputError(f"{what}() takes the Plan that plan_model returned, not a "
                         f"{type(plan).__name__}",
                         hint="plan = slackswap_cli.plan_model(model, inputs, budget=0.5)")


def checked_workload(model, inputs, loss_fn) -> Workload:
    """The model and inputs as a Workload, refused plainly when they are not what a step
    needs (the workload loader's own checks)."""
    try:
        return as_workload(Workload(model, inputs, loss_fn), "plan_model")
    except TraceError as exc:
        raise InputError(exc.message.replace("plan_model() returned", "plan_model() got"),
                         hint="plan_model(model, inputs, budget=...): inputs a tuple of "
                              "positional arguments, a dict of keyword arguments or a tensor"
                         ) from None


def where_traced(model: torch.nn.Module, device: str) -> tuple[str, str]:
    """(how the step is traced: "fake", "cpu" or "cuda"; the device the plan is for)."""
    how, target = split_device(device)
    first = next(iter(model.parameters()), None)
    on = first.device.type if first is not None else "cpu"
    if on == "meta":
        return _meta_where(how, target, device)
    if how == "auto":
        return ("cuda", "cuda") if on == "cuda" else ("fake", on)
    if how == "fake":
        return how, target
    if how != on:
        raise InputError(f"device={device!r}, but the model's parameters are on {on}",
                         hint=f"move the model with model.to({device!r}) first, or pass "
                              f"device='fake:{on}' for a roofline estimate")
    if how == "cuda" and not torch.cuda.is_available():     # pragma: no cover - CUDA only
        raise InputError("device='cuda', but torch sees no CUDA device", hint="use device='cpu'")
    return how, how


def _meta_where(how: str, target: str | None, device: str) -> tuple[str, str]:
    """A model built on the meta device (described, not yet materialised) is traced with
    fake tensors: `device="auto"` for the device this machine would train on (CUDA when torch
    sees one, else the CPU), `"fake:..."` as asked. Its step cannot be measured."""
    if how == "auto":
        return "fake", "cuda" if torch.cuda.is_available() else "cpu"
    if how == "fake":
        return how, target
    raise InputError(f"device={device!r}, but the model's parameters are on the meta device: "
                     "they have no values, so its step cannot be run and measured",
                     hint="plan it as it is with device='auto' (a fake trace, its costs the "
                          "roofline of `hardware`), or materialise it first "
                          f"(model.to_empty(device={how!r}), then initialise its weights)")


def _meta_note(model: torch.nn.Module, how: str, target: str, hw) -> str | None:
    """What a plan of a meta-device model was priced for (None for any other model)."""
    first = next(iter(model.parameters()), None)
    if first is None or first.device.type != "meta" or how != "fake":
        return None
    return (f"the model is on the meta device: its step was traced with fake tensors for "
            f"{target} and every op priced by the roofline of the {hw.name!r} hardware preset "
            f"({hw.description or 'no description'}), not measured; pass hardware= the preset "
            "of the device it will train on (`slackswap hardware` lists them)")


def hardware_of(hardware):
    return hardware if isinstance(hardware, HardwareSpec) else load_hardware(hardware)


@contextlib.contextmanager
def left_untouched(model: torch.nn.Module):
    """Random number generators restored, and the buffers' values too (a measured trace runs
    BatchNorm's statistics updates), when the block ends."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with forked_rng():      # NumPy's and Python's generators too (run/rng.py)
            yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def profile_step(work: Workload, how: str, target: str, hw, autocast, progress, started):
    """(profile, joint graph, the traced Workload): the step traced as `how` says."""
    header = {"name": type(work.model).__name__, "path": None, "entry": None, "args": {}}
    if how == "fake":
        # real tensors the step meets outside the model and its inputs (the labels a loss_fn
        # closes over, a tensor attribute that is no buffer) are converted as ops read them
        # and traced as constants, as a real trace does (joint._trace_real_tensors); the
        # user's closure and model stay as they are
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        meta_on = "cuda" if target == "cuda" and torch.cuda.is_available() else "cpu"
        traced = Workload(fake_copy(work.model, mode, meta_on), pytree.tree_map(
            lambda x: fake_of(mode, x, meta_on) if isinstance(x, torch.Tensor) else x,
            work.inputs), work.loss_fn)
    else:
        dev = torch.device(how)
        traced = Workload(work.model, pytree.tree_map(
            lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, work.inputs),
            work.loss_fn)
    try:
        prof, joint = profile_traced(traced, header, device=how, target=target,
                                     hardware=hw if how == "fake" else None, autocast=autocast,
                                     progress=progress, started=started)
    except SlackswapError:
        raise
    except torch.OutOfMemoryError as exc:     # pragma: no cover - CUDA only
        raise does_not_fit(how, exc) from None
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        raise TraceError(f"tracing {header['name']}'s training step failed: "
                         f"{type(exc).__name__}: {text}",
                         hint="check that `loss = model(...)` (or loss_fn) trains eagerly on "
                              "these inputs; device='cpu' traces with real tensors") from None
    return prof, joint, traced


def plan_of(prof: Profile, result: PlanFile, joint, traced: Workload, loss_fn) -> Plan:
    """The Plan with the tables `patch` and `compile` follow (an emitted module's META, TABLE
    and GRAPH_TABLE)."""
    from .compiled.graph_plan import graph_table  # here: Plan has a field of this name
    device_type = next(iter(dict(traced.model.named_parameters()).values())).device.type
    ref = {"path": None, "entry": None, "args": {}, "name": prof.workload.get("name", "")}
    meta = patch_meta(joint, traced, prof, result, device_type, ref)
    if loss_fn is not None:
        meta["loss_fn"] = loss_fn        # for a re-plan at other shapes (run/eager/replan.py)
    return Plan(prof, result, meta,
                runtime_table(prof, result.decisions, is_inplace_target, result.schedule),
                graph_table(prof, result))


def _measured_on(measure, how: str, model, work: Workload, traced: Workload,
                 plan: Plan) -> Workload | None:
    """The workload `measure` runs the plan on (the model itself), or None: not measured. By
    default a fake trace is measured for a tensor parallel model: its library may branch
    otherwise under fake tensors than in eager (transformers builds an attention mask there),
    so its first call plans again along eager's branches, and eager's peak is known only by
    running it."""
    if measure is None:
        if how != "fake":
            return traced
        return work if _tensor_parallel_here(model, plan) else None
    if not measure:
        return None
    if how != "fake":
        return traced
    first = next(iter(model.parameters()), None)
    on = first.device.type if first is not None else "cpu"
    if on != plan.meta["device_type"]:
        raise InputError(f"measure=True: the plan is for {plan.meta['device_type']} and the "
                         f"model's parameters are on {on}, so its step cannot be measured",
                         hint="measure=None (the default) plans without measuring after a fake "
                              "trace; or move the model to the device the plan is for")
    return work


def _tensor_parallel_here(model, plan: Plan) -> bool:
    """A model with DTensor parameters whose local shards are real and on the plan's device
    type (so its step can run here)."""
    from .parallel.dtensor import uses_dtensor
    if not uses_dtensor(model):
        return False
    first = next(iter(model.parameters()), None)
    local = getattr(first, "_local_tensor", first)
    return (local is not None and not local.is_meta
            and not isinstance(local, torch._subclasses.FakeTensor)
            and local.device.type == plan.meta["device_type"])


def _settled(out: Plan, run_on: Workload, prof: Profile, hw, planner: str, joint,
             traced: Workload, loss_fn, options: dict) -> Plan:
    """`out` measured on the model (`excess.settle`): where its step peaks above the budget,
    planned again below it by what eager held beyond the simulator. A plan made so keeps the
    budget asked for (what the runtime holds a call to) and says in its notes what it was
    planned at; `Plan.measured` holds what was measured."""
    from .verify.excess import measured_peaks, settle, simulated_peaks
    budget, fraction = out.budget_bytes, out.plan.budget_fraction

    def plan_at(at: int) -> Plan:
        result, _ = plan_profile(prof, hw, at, None, planner, **options)
        result = dataclasses.replace(
            result, budget_bytes=budget, budget_fraction=fraction, notes=(*result.notes, (
                f"planned at {at} bytes, the budget less what eager was measured to hold "
                "beyond the simulator (plan_model's measure)")))
        return plan_of(prof, result, joint, traced, loss_fn)

    plan, measured = settle(out, budget, plan_at,
                            lambda p: measured_peaks(run_on.model, run_on.inputs, loss_fn, p),
                            lambda p: simulated_peaks(prof, p.plan, hw))
    plan.measured = measured
    if measured.measured > budget:
        warnings.warn(f"slackswap: the plan's measured step peaks at {measured.measured} "
                      f"bytes of activations, above the budget of {budget} (the simulator "
                      f"predicts {measured.predicted}: eager holds what Python still names "
                      "longer); no plan below the budget measured under it. A budget of "
                      f"{measured.measured} bytes or more fits this step as measured",
                      stacklevel=3)
    return plan


def _auto_budget(model: torch.nn.Module, inputs, optimizer) -> int:  # pragma: no cover - CUDA
    """budget="auto": the device's memory less the static memory `fit` counts (parameters,
    gradients, optimizer state, buffers, the batch), less fit's reserve and what other
    processes hold (`fit.device_budget`)."""
    name, on_device = optimizer_name(optimizer)
    dev = next(model.parameters()).device
    free, total = torch.cuda.mem_get_info(dev)
    static = static_memory(model_facts(model, inputs), name, step_on_device=on_device)
    budget = device_budget(total, free, torch.cuda.memory_reserved(dev), static)
    if budget <= 1:
        raise InfeasibleError(
            f"budget='auto': {torch.cuda.get_device_name(dev)} has {fmt_bytes(total)}, and "
            f"parameters, gradients and {name} state take {fmt_bytes(static.total)} of it "
            "with fit's reserve: nothing is left for activations",
            hint="use a lighter optimizer, shard the model (FSDP), or give a budget in bytes")
    return budget


def optimizer_name(optimizer) -> tuple[str, bool]:
    """(fit's name of `optimizer`, whether its step counters live on the device): a name is
    checked as `--optimizer` is; a torch.optim Adam/AdamW/SGD instance is read."""
    if isinstance(optimizer, str):
        return check_optimizer(optimizer), False
    if optimizer is None:
        return "none", False
    kind = type(optimizer).__name__.lower()
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    on_device = bool(group.get("fused") or group.get("capturable"))
    if kind in ("adam", "adamw"):
        return kind + ("-amsgrad" if group.get("amsgrad") else ""), on_device
    if kind == "sgd":
        return ("sgd-momentum" if group.get("momentum") else "sgd"), False
    raise InputError(f"budget='auto' cannot count the state of a {type(optimizer).__name__}",
                     hint="pass optimizer= one of adamw, adam, sgd, sgd-momentum, none (the "
                          "closest), or give the budget in bytes")


def _infeasible(prof: Profile, planner: str, hw, budget_bytes: int, out: Plan) -> InfeasibleError:
    """No plan fits: `slackswap plan`'s message and hint, the closest plan attached."""
    below = floor_message(budget_bytes, prof)
    reach = (first_feasible_budget(prof, hw, planner)
             if below is None and planner_spec(planner).quick else None)
    message, hint = infeasible_message(prof, planner, below, reach)
    exc = InfeasibleError(message, hint=hint.replace("--planner ", "planner=")
                          .replace("--budget", "budget"))
    exc.plan = out
    return exc
