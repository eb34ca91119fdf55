"""Plan again for input shapes the profile was not made at (the last short batch, dynamic
padding), or for another device than the one its tensors were on (a `--device fake` profile
made on a CPU-only machine, used on a GPU), from inside a patched model.

The live model is traced at the new shapes through a fake copy (its parameters and buffers as
FakeTensors on their own device: nothing is allocated, nothing of the real model is touched,
and a GPU's kernels are the ones traced on a GPU), the graph is costed
with the plan's hardware roofline, and the plan's planner is run at the plan's budget fraction
of the new keep-all peak (or its byte budget, when it was given in bytes). The result is the
table the in-place runtime follows (`chains.runtime_table`).

Left out: measured op times are not carried over (a re-plan is roofline-costed), and a model
already sharded by FSDP2 cannot be copied, so it keeps the profiled plan.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ...budget import fraction_bytes
from ...chains import runtime_table
from ...errors import InputError, TraceError
from ...hardware import HardwareSpec
from ...planners import DEFAULT_PLANNER, make_plan, quick_planner
from ...trace.aten import is_inplace_target
from ...trace.graph_profile import joint_to_profile
from ...trace.joint import capture_joint
from ...trace.workload import load_workload
from ..rng import forked_rng
from .branches import BranchesDiffer, eager_branches
from .tables import RunMeta

__all__ = ["replan_table", "VALUE_DEPENDENT", "VALUE_DEPENDENT_HINT"]

VALUE_DEPENDENT = ("this model's sizes depend on its values (its plan was made on a real "
                   "trace): a fake trace cannot plan it again")
VALUE_DEPENDENT_HINT = ("the guard holds the plan's budget on the new path; for a plan of its "
                        "own, profile a batch that takes it (plan_model(..., device=\"cpu\"))")


def replan_table(model: torch.nn.Module, original_forward, args, kwargs, meta, *,
                 values: list | None = None, budget_bytes: int | None = None
                 ) -> tuple[dict, str]:
    """(table, a line saying what was planned) for `model` called with `args`/`kwargs`.
    `values`: the values an eager call at these inputs read, in order: the trace takes its
    branches (`branches.eager_branches`). `budget_bytes`: plan into these bytes (default: the
    plan's fraction of the new keep-all peak, or its byte budget). `meta`: META, or its
    `tables.RunMeta`."""
    meta = RunMeta.of(meta)
    if meta.value_dependent:        # (refused at once: the trace would fail after seconds)
        raise TraceError(VALUE_DEPENDENT, hint=VALUE_DEPENDENT_HINT)
    if args and kwargs:
        raise InputError("the call mixes positional and keyword tensors",
                         hint="call the model with one kind to let slackswap re-plan")
    inputs = dict(kwargs) if kwargs else tuple(args)
    hw_dict = meta.hardware
    if not hw_dict:
        raise InputError("the patched module does not record its plan's hardware",
                         hint="regenerate it with `slackswap apply`")
    hw = HardwareSpec.from_dict(hw_dict)
    mode = FakeTensorMode(allow_non_fake_inputs=True)   # a loss_fn's real tensors: constants
    with forked_rng():      # NumPy's and Python's generators too (run/rng.py)
        shadow = fake_copy(model, mode)
        fake_inputs = pytree.tree_map(
            lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, inputs)
        loss_fn = None
        try:
            joint = _trace(shadow, fake_inputs, None, meta, values)
        except TraceError:
            loss_fn = _workload_loss_fn(meta)  # the output is no loss: the workload's loss_fn
            joint = _trace(shadow, fake_inputs, loss_fn, meta, values)
    env = {"torch_version": torch.__version__, "device": "fake", "hardware": hw.to_dict(),
           "target_device": meta.target_device or meta.device_type}
    prof = joint_to_profile(joint, workload={"name": meta.workload.get("name", "")},
                            env=env, hardware=hw, time_source="roofline")
    peak = prof.summary["peak_activation_bytes"]
    fraction = meta.budget_fraction
    budget = budget_bytes if budget_bytes is not None else (
        fraction_bytes(fraction, peak) if fraction else int(meta.budget_bytes))
    # a slow planner (a MILP takes a minute) is not run inside a training step
    planner = quick_planner(meta.planner or DEFAULT_PLANNER)
    plan = make_plan(planner, prof, hw, budget, fraction)
    what = (f"{planner} at {fraction:g} of the keep-all peak"
            if fraction and budget_bytes is None else f"{planner} at {budget} bytes")
    what += f", predicted retention {plan.predicted.retention:.1%}"
    if not plan.feasible:
        what += ", no plan fits: the closest one runs"
    table = runtime_table(prof, plan.decisions, is_inplace_target, plan.schedule)
    table["budget_bytes"] = budget         # (what the guard holds calls at these shapes to)
    return table, what


def _trace(shadow, fake_inputs, loss_fn, meta: RunMeta, values: list | None):
    """The joint graph of `shadow` on `fake_inputs`, along an eager call's branches when its
    `values` are given (`BranchesDiffer` when the trace reads others)."""
    ctx = contextlib.nullcontext() if values is None else eager_branches(shadow, values)
    try:
        with ctx:
            return capture_joint(shadow, fake_inputs, loss_fn, autocast=meta.autocast,
                                 target_device=meta.target_device)
    except TraceError as exc:
        if isinstance(exc.__cause__, BranchesDiffer):
            raise BranchesDiffer(str(exc)) from exc
        raise


def fake_copy(model: torch.nn.Module, mode, meta_on: str = "cpu") -> torch.nn.Module:
    """A copy of `model` whose parameters, buffers and tensors kept as module attributes are
    FakeTensors (an attribute detached from its graph), its forward its class's own (the
    patched forward stays with the real model). A tensor on the meta device (a model
    built under `torch.device("meta")`) becomes a FakeTensor on `meta_on` (`fake_of`)."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        fake = fake_of(mode, t, meta_on)
        memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else fake
    # tensors a module keeps as plain attributes (a recurrent state), which deepcopy
    # refuses where they are not graph leaves
    for m in model.modules():
        for t in vars(m).values():
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = fake_of(mode, t.detach(), meta_on)
    forward = model.__dict__.pop("forward", None)
    try:
        shadow = copy.deepcopy(model, memo)
    finally:
        if forward is not None:
            model.forward = forward
    return shadow


def fake_of(mode, tensor: torch.Tensor, meta_on: str = "cpu") -> torch.Tensor:
    """`tensor` as a FakeTensor of `mode`; one on the meta device as a FakeTensor on `meta_on`
    (meta tensors have no device the step would run on, and ops refuse to mix them with the
    inputs' device: the fake trace stands for the model materialised on `meta_on`)."""
    if tensor.device.type != "meta":
        return mode.from_tensor(tensor)
    with mode:
        return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype,
                                   device=meta_on)


def _workload_loss_fn(meta: RunMeta):
    if meta.loss_fn is not None:   # a plan made in the training process (run/api.py)
        return meta.loss_fn
    w = meta.workload
    if not w.get("path"):
        raise InputError("the model's output is no loss and the workload is unknown",
                         hint="regenerate the patched module with `slackswap apply`")
    work = load_workload(w["path"], w.get("entry", "workload"), w.get("args") or {},
                         fake_mode=FakeTensorMode())
    return work.loss_fn

