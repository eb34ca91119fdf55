"""`slackswap apply`: turn a plan into a patched training module (one readable Python file).

How: re-trace the workload's training step into the same joint forward+backward graph the
profile came from (with fake tensors: nothing is allocated), check that it *is* the same graph
(its profile fingerprint equals the plan's), split it by the plan into a forward and a backward
step (`partition`), and write both as plain Python calling aten ops, with the plan's
`keep` / `offload` / `prefetch` / `wait` calls and recompute chains in place. Tensor names in
the file are the profile's tensor names (fx node names), so every line can be traced back to a
tensor id of the profile and a decision of the plan.

The emitted file imports only torch and one module of slackswap_cli's run side (`run/door.py`,
which loads the rest as it is used).
`patch(model)` patches the model in place (`run/eager/inplace.py`): the plan runs inside its own forward and
autograd's backward, from the table of `chains.runtime_table`. `step_module(model)` returns a
module sharing the model's parameters and buffers whose forward takes the workload's inputs and
returns the loss; the two written-out steps run inside one `torch.autograd.Function`
(`step.PatchedStep`), so `loss.backward()` fills `.grad` of the original parameters.
"""
from __future__ import annotations

import hashlib
import importlib.util
import pprint
from pathlib import Path
from typing import Any

import torch.utils._pytree as pytree

from .. import __version__
from ..chains import runtime_table
from ..errors import InputError, require_file
from ..schema import Action, Plan, Profile
from ..trace.aten import is_inplace_target
from ..trace.retrace import joint_fingerprint, trace_fake, trace_matching, trace_options
from ..workload_spec import resolve_workload_path
from .compiled.graph_plan import graph_table
from .generated import GENERATOR_VERSION, check_generated
from .written.code import UnknownConstant, partition, source_lines


def plan_fingerprint(plan: Plan) -> str:
    """Hash of what the patched module does: the decisions and prefetch points of a plan."""
    h = hashlib.sha256()
    h.update(plan.profile_fingerprint.encode())
    for d in sorted(plan.decisions, key=lambda d: d.tensor):
        h.update(f"{d.tensor}|{d.action}|{d.prefetch_at};".encode())
    for ev in plan.schedule:
        if ev.kind == "prefetch":
            h.update(f"p{ev.tensor}@{ev.issue_op};".encode())
    return h.hexdigest()[:16]


def apply_plan(plan: Plan, profile: Profile, model_path: str | None = None,
               entry: str | None = None, args: dict | None = None) -> str:
    """The source of the patched module that carries `plan` out on the workload of `profile`.

    The workload file is `model_path`, else the plan's `model_path`, else the profile's
    `workload.path`; `entry`/`args` default to the profile's. Raises InputError for an ONNX
    profile (nothing to patch), a plan made for another profile, or a plan that cannot be
    carried out; FingerprintMismatch when the workload now traces differently from its profile.
    """
    if profile.workload.get("source") == "onnx" or str(profile.workload.get("path", "")).endswith(".onnx"):
        raise InputError("an ONNX profile cannot be applied: there is no PyTorch training step to patch",
                         hint="profile the PyTorch workload (model.py) to get a plan `apply` can carry out")
    plan.check_profile(profile)
    path = model_path or plan.model_path or profile.workload.get("path")
    if not path:
        raise InputError("the profile does not record its workload file",
                         hint="pass the workload file with --model model.py")
    path = resolve_workload_path(path, near=plan.profile_path)
    if not Path(path).exists():
        raise InputError(f"workload file {path} does not exist",
                         hint="pass the workload file with --model model.py")
    entry = entry or profile.workload.get("entry") or "workload"
    args = dict(profile.workload.get("args") or {}) if args is None else dict(args)
    # trace_fp: what `step_module(model)` compares a fake re-trace of the user's model against
    joint, work, trace_fp = trace_matching(profile, str(path), entry, args)
    workload_ref = {"path": str(Path(path).resolve()), "entry": entry, "args": args,
                    "name": profile.workload.get("name", Path(path).stem)}
    try:
        return emit_module(joint, work, profile, plan, workload_ref=workload_ref,
                           trace_fingerprint=trace_fp)
    except UnknownConstant:
        # the step reads a tensor made inside the workload but outside the inputs (say labels a
        # loss_fn closes over): only a real trace knows its values, which the file then embeds
        joint, work = trace_fake(str(path), entry, args, profile.env.get("device"), real=True,
                                 **trace_options(profile))
        return emit_module(joint, work, profile, plan, workload_ref=workload_ref,
                           trace_fingerprint=trace_fp)


def emit_module(joint, work, profile: Profile, plan: Plan, *, workload_ref: dict,
                trace_fingerprint: str | None = None) -> str:
    """Write the patched module for an already traced joint graph (see `apply_plan`).

    `trace_fingerprint`: the profile fingerprint of a fake trace of the workload, which
    `step_module(model, check_trace=True)` compares a fake trace of the user's model against.
    """
    params = dict(work.model.named_parameters())
    device_type = next(iter(params.values())).device.type
    step = partition(joint.gm, joint.phase, profile, plan, device_type)
    meta = _meta(joint, work, profile, plan, step, device_type, workload_ref, trace_fingerprint)
    body = _BODY.format(fwd_args=", ".join(["_s", "_device", *step.forward_args]),
                        bwd_args=", ".join(["_s", "_device", *step.forward_args, step.tangent]),
                        forward=source_lines(step.forward), backward=source_lines(step.backward))
    return _header(joint, profile, plan, step, workload_ref, meta) + body


def _meta(joint, work, profile: Profile, plan: Plan, step, device_type: str,
          workload_ref: dict, trace_fingerprint: str | None) -> dict[str, Any]:
    """The emitted file's META: what `patch`, `step_module` and `verify` need to know."""
    return {**patch_meta(joint, work, profile, plan, device_type, workload_ref,
                         trace_fingerprint),
            "recomputed_ops_in_backward": step.recomputed_ops}


def patch_meta(joint, work, profile: Profile, plan: Plan, device_type: str,
               workload_ref: dict, trace_fingerprint: str | None = None) -> dict[str, Any]:
    """META without what the written-out step adds: all `patch` (run/eager/inplace.py) reads, for
    the emitted module and for the library's `slackswap_cli.patch(model, plan)`."""
    params = dict(work.model.named_parameters())
    buffers = dict(work.model.named_buffers())
    tensors = [n.meta.get("val") for n in joint.placeholders()]
    n_p, n_b = len(joint.param_names), len(joint.buffer_names)
    input_vals = tensors[n_p + n_b:-1]
    actions = plan.actions()
    return {
        "generator_version": GENERATOR_VERSION,
        "slackswap_version": __version__,
        "profile_fingerprint": profile.fingerprint,
        "trace_fingerprint": trace_fingerprint,
        "plan_fingerprint": plan_fingerprint(plan),
        "workload": workload_ref,
        "device_type": device_type,
        "params": [[n, list(p.shape), str(p.dtype)] for n, p in params.items()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in buffers.items()],
        "grad_param_index": list(joint.grad_param_index),
        "input_spec": pytree.treespec_dumps(joint.input_spec),
        "input_is_tensor": list(joint.input_leaf_is_tensor),
        "input_tensors": [[list(v.shape), str(v.dtype)] for v in input_vals],
        "input_constants": [repr(c) for c in joint.input_constants],
        "autocast": profile.workload.get("autocast"),
        # traced on real tensors with sizes fixed by this batch's values (nonzero, masks):
        # no fake trace of this model can plan again in the step (run/eager/replan.py)
        "value_dependent_sizes": bool(getattr(joint, "value_dependent_sizes", False)),
        "target_device": profile.env.get("target_device"),
        "hardware": plan.hardware,
        "keep_all_peak_bytes": profile.keep_all_peak_bytes,
        "budget_bytes": plan.budget_bytes,
        "budget_fraction": plan.budget_fraction,
        "planner": plan.planner,
        "predicted": {"peak_bytes": plan.predicted.peak_bytes, "step_us": plan.predicted.step_us,
                      "ideal_us": plan.predicted.ideal_us, "retention": plan.predicted.retention},
        # the plan's decisions, by tensor name (saved activation roots)
        **{key: [t.name for t in profile.saved_activations
                 if actions.get(t.id, Action.KEEP) == action]
           for key, action in (("kept", Action.KEEP), ("swapped", Action.SWAP),
                               ("recomputed", Action.RECOMPUTE))},
    }


def _notes(joint, plan: Plan) -> str:
    """The header's NOTE lines: a plan that does not fit, values baked into the file."""
    notes = ("" if plan.feasible else
             "\nNOTE: the simulator found that this plan does not fit its budget.")
    baked = [str(n.target) for n in joint.gm.graph.nodes if n.op == "get_attr"
             and getattr(getattr(joint.gm, str(n.target), None), "numel", lambda: 0)() > 0]
    if baked:
        notes += ("\nNOTE: the step reads tensors the workload made outside its inputs (say "
                  "labels a loss_fn\ncloses over); their traced values are written into this "
                  "file. Pass them as inputs\nto train on other data.")
    return notes


def _header(joint, profile: Profile, plan: Plan, step, workload_ref: dict, meta: dict) -> str:
    """The emitted file up to its functions: docstring, imports, META, the plan's tables and
    the placeholder names."""

    n_p, n_b = len(joint.param_names), len(joint.buffer_names)
    names = {"params": joint.param_names, "buffers": joint.buffer_names}
    ph = step.forward_args
    mapping = [f"#   {ph[i]:<16} parameter {names['params'][i]}" for i in range(n_p)]
    mapping += [f"#   {ph[n_p + i]:<16} buffer {names['buffers'][i]}" for i in range(n_b)]
    mapping += [f"#   {ph[n_p + n_b + i]:<16} input {i}" for i in range(len(ph) - n_p - n_b)]
    frac = f" ({plan.budget_fraction:g} of the keep-all peak)" if plan.budget_fraction else ""
    n_saved = len(profile.saved_activations)
    counts = plan.action_counts(profile)
    infeasible = _notes(joint, plan)
    table = runtime_table(profile, plan.decisions, is_inplace_target, plan.schedule)
    return f'''\
"""Patched training step of workload '{workload_ref["name"]}', written by `slackswap apply`.

Plan: planner {plan.planner}, activation budget {plan.budget_bytes} bytes{frac}; of {n_saved} saved
activations it keeps {counts[Action.KEEP]}, swaps {counts[Action.SWAP]} to host memory and recomputes {counts[Action.RECOMPUTE]}.
Predicted: peak {plan.predicted.peak_bytes} bytes, step {plan.predicted.step_us:.1f} us (ideal {plan.predicted.ideal_us:.1f} us).{infeasible}

Use it in training, compiled (GPU users, the fast path):

    from {{this module}} import compile_planned
    model = compile_planned(model)  # torch.compile with the plan in the joint graph
    # or per block, torchtitan style: compile_planned(model, per_block=True)

or in eager (one line added):

    from {{this module}} import patch
    patch(model)                   # in place: the same model object, its hooks, DDP, Trainer
    loss = model(*inputs)          # (or whatever the model returns) trains under the plan
    loss.backward(); optimizer.step()

`patch` carries the plan out inside the model's own forward (slackswap_cli/run/eager/inplace.py) using
TABLE below: ops that do not line up with the profile (another input shape, a wrapper's own
ops) run as eager runs them, never with other values. `unpatch(model)` undoes it.

`step_module(model)` instead runs the whole traced step (forward_step and backward_step below,
the plan written out as code, names = the profile's tensor names) as one autograd node; it runs
only the workload it was made for, and `slackswap verify` uses it to check the plan bit by bit.
"""
import torch
from slackswap_cli.run import door
from slackswap_cli.run.door import GraphRow, OpRow

aten = torch.ops.aten

META = {pprint.pformat(meta, width=100, sort_dicts=False)}

# The plan as `patch` carries it out (see slackswap_cli/run/eager/inplace.py): the forward ops it
# aligns the model's with (OpRow: slackswap_cli/table_rows.py), each saved root's action, and the
# recompute chains (the simulator's; the keys: slackswap_cli/chains.py runtime_table).
TABLE = {pprint.pformat(table, width=100, compact=True)}

# The plan per forward op, for the graph runtimes (slackswap_cli/run/compiled/graph_plan.py):
# compile_planned and sac_policy line the ops they see up with these rows (GraphRow).
GRAPH_TABLE = {pprint.pformat(graph_table(profile, plan), width=100, compact=True)}

# Placeholders:
{chr(10).join(mapping)}
'''


# The emitted file's functions ({fwd_args}, {bwd_args}: the step's arguments; {forward},
# {backward}: the two steps' code).
_BODY = '''

def forward_step({fwd_args}):
    """Forward and loss; keeps, offloads or drops each saved activation as the plan says."""
{forward}


def backward_step({bwd_args}):
    """Backward; takes kept tensors, waits for swapped ones, recomputes the rest before use."""
{backward}


def patch(model, strict=False):
    """Patch `model` in place so its training forward runs the plan; returns `model` itself.

    In train mode with grad enabled, `model(...)` returns what it returned before and its
    backward keeps, swaps and recomputes as planned; in eval mode or under no_grad it is the
    original forward. Module hooks, DDP and optimizers see the same model. `unpatch(model)`
    restores it. Other input shapes (or another device) are planned for on the fly, once
    each; `strict=True` refuses them instead.
    """
    return door.patch(model, META, TABLE, strict=strict)


def unpatch(model):
    """Undo `patch`."""
    return door.unpatch(model)


def compile_planned(model, block=None, per_block=False, **torch_compile_kwargs):
    """`torch.compile(model, **torch_compile_kwargs)` with the plan applied in the captured
    joint graphs: kept activations saved, recomputed ones recomputed in backward, swapped ones
    offloaded to the host (on CUDA on a side stream, prefetched). backend="inductor" (the
    default) or "aot_eager". Per block (torchtitan style): `compile_planned(block, block=i)`
    on repeated block i, or `compile_planned(model, per_block=True)` to compile every block in
    place (slackswap_cli/run/compiled/backend.py).
    """
    return door.compile_planned(model, GRAPH_TABLE, block=block, per_block=per_block,
                                **torch_compile_kwargs)


def sac_policy(block_index):
    """The plan of repeated block `block_index` as a selective-checkpoint policy (one per
    checkpointed call); a swapped tensor is saved (slackswap_cli/run/compiled/sac.py)."""
    return door.sac_policy(GRAPH_TABLE, block_index)


def context_fn(block_index):
    """`checkpoint(block, x, use_reentrant=False, context_fn=context_fn(i))`: the plan of
    block i, in eager or under torch.compile."""
    return door.context_fn(GRAPH_TABLE, block_index)


def step_module(model, check_trace=True):
    """A module that runs `model`'s whole training step under the plan as one autograd node:
    `step_module(model)(*inputs)` returns the loss (see the module docstring).

    check_trace: re-trace the model once with fake tensors and refuse it if its graph differs
    from the profile's (a changed model or torch version).
    """
    return door.step_module(model, META, forward_step, backward_step, check_trace=check_trace)
'''


def load_patched(path: str):
    """Import a patched module file (a fresh module object each call)."""
    p = require_file(path, "patched module", hint="write one with `slackswap apply`",
                     dir_hint="pass the .py file `slackswap apply -o` wrote")
    # look before importing: executing a file that is not ours (a training script passed by
    # mistake) would run its top-level code
    try:
        head = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {p} as Python source ({type(exc).__name__})",
                         hint="pass the .py file `slackswap apply -o` wrote") from None
    if "written by `slackswap apply`" not in head or "\nMETA = " not in head:
        raise InputError(f"{p} is not a module written by `slackswap apply`",
                         hint="pass the file `slackswap apply -o` wrote")
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:10]
    spec = importlib.util.spec_from_file_location(f"slackswap_patched_{digest}", p)
    if spec is None or spec.loader is None:
        raise InputError(f"{p} cannot be imported as Python",
                         hint="pass the .py file `slackswap apply -o` wrote")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise InputError(f"importing {p} failed: {type(exc).__name__}: {exc}",
                         hint="regenerate it with `slackswap apply`") from None
    if not hasattr(module, "patch") or not hasattr(module, "META"):
        raise InputError(f"{p} is not a module written by `slackswap apply`",
                         hint="pass the file `slackswap apply -o` wrote")
    _check_meta(p, module)
    check_generated(module.META)
    return module


_META_KEYS = ("workload", "device_type", "params", "buffers", "input_spec")
_WORKLOAD_KEYS = ("path", "entry", "args")


def _check_meta(p: Path, module) -> None:
    """A patched module whose META (or functions) was edited away cannot be run or verified."""
    meta = module.META
    missing = ([k for k in _META_KEYS if k not in meta] if isinstance(meta, dict)
               else list(_META_KEYS))
    w = meta.get("workload") if isinstance(meta, dict) else None
    if isinstance(w, dict):
        missing += [f"workload.{k}" for k in _WORKLOAD_KEYS if k not in w]
    elif "workload" not in missing:
        missing.append("workload")
    missing += [f"{f}()" for f in ("step_module", "unpatch") if not callable(getattr(module, f, None))]
    if missing:
        raise InputError(f"{p} lacks what `slackswap apply` writes: {', '.join(missing[:6])} "
                         f"({'META is empty' if meta == {} else 'edited or truncated'})",
                         hint="write it again with `slackswap apply PLAN.json -o FILE`")


__all__ = ["apply_plan", "emit_module", "patch_meta", "plan_fingerprint", "trace_fake", "joint_fingerprint",
           "load_patched"]
