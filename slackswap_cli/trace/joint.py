"""Capture one whole training step (forward, loss, backward) as one aten-level FX graph.

How: `make_fx` traces a function that calls the model through `torch.func.functional_call`
with its parameters, buffers and inputs as arguments, turns the output into a scalar loss and
then calls `torch.autograd.grad(loss, params, grad_outputs=tangent)`. Autograd's backward ops
run under the tracer too, so the graph holds forward and backward in execution order, and the
forward values that backward reads are exactly the edges from forward nodes to backward nodes:
the saved activations.

Placeholders, in order: every parameter (`param_names`), every buffer (`buffer_names`), the
tensor leaves of the inputs (`input_spec`), and `tangent` (d loss / d loss, a scalar; the
patched module's backward feeds the incoming gradient there). Output: `(loss, grads)` where
`grads[i]` is the gradient of `param_names[grad_param_index[i]]`.

Phases: a node is `backward` when it was created after `autograd.grad` was entered.

Module paths: forward nodes get the innermost `nn.Module` that was running when the tracer
created them (global module hooks record the node count at every module entry and exit).
Backward nodes have no module on the stack; each takes the module of the latest forward node it
reads, else that of its first backward input (autograd runs a module's backward right after
the gradient of its output is ready, so this follows the chain of gradients).

In-place ops stay in the graph as they are (dropout's `bernoulli_`, `relu_`, BatchNorm's
running-statistics updates): their outputs alias the tensor they mutate. The profile marks a
mutated tensor as not recomputable, which is always safe.

`torch.utils.checkpoint` regions are traced as plain calls (`_inline_checkpoints`): a traced
graph cannot replay the generator state a checkpoint restores before its recompute, so its
recompute would draw fresh dropout masks. Each outermost region's nodes are noted, and its
re-run is then copied into the backward, its random results read from forward
(`_own_checkpoints`, trace/checkpointed.py): the graph holds what the checkpointed model holds. Any other `set_rng_state` inside a step that draws
random numbers is refused (`_watch_rng_restores`). `loss_fn(output, inputs)` gets the inputs
in the form the workload gave them (`workload_inputs`).

The model and inputs may be real tensors (the graph can then be run and timed: `measure`) or
FakeTensors created under a FakeTensorMode (nothing is allocated; costs come from a roofline).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint as ckpt
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from ..errors import InputError, SlackswapError, TraceError
from ..profile_build import dtype_name
from ..torch_api import PARTS, is_tested
from .costs import is_random_op
from .dtensor import as_dtensors, local_params
from .fake_build import eager_stance


@dataclass
class JointGraph:
    gm: fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    input_spec: Any                      # pytree spec of (args, kwargs)
    input_leaf_is_tensor: list[bool]     # for each pytree leaf of the inputs
    input_constants: list[Any]           # the non-tensor leaves, baked into the graph
    grad_param_index: list[int]          # indices into param_names of the returned gradients
    phase: dict[str, str] = field(default_factory=dict)    # node name -> forward/backward
    module: dict[str, str] = field(default_factory=dict)   # node name -> module path
    loss_node: str = ""
    fake: bool = False
    checkpoints_inlined: int = 0          # torch.utils.checkpoint regions traced as plain calls
    # each outermost region's forward nodes, by name, in order (`checkpointed.py` makes
    # the graph's backward recompute them, as the model's own checkpointing does)
    checkpoint_regions: list[list[str]] = field(default_factory=list)
    checkpoint_held: list[str] = field(default_factory=list)   # the regions' inputs
    value_dependent_sizes: bool = False   # traced for real: sizes fixed at this batch's values

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def placeholder_kinds(self) -> list[str]:
        """'parameter' / 'buffer' / 'input' / 'tangent' for each placeholder, in order."""
        n_in = sum(self.input_leaf_is_tensor)
        return (["parameter"] * len(self.param_names) + ["buffer"] * len(self.buffer_names)
                + ["input"] * n_in + ["tangent"])


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """A workload's inputs (tuple of positional args, dict of kwargs, or one tensor) -> (args, kwargs)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def workload_inputs(original: Any, args: tuple, kwargs: dict) -> Any:
    """The inputs rebuilt in the form the workload gave them (`split_inputs` undone).

    `loss_fn(output, inputs)` must see the workload's own `inputs` (a tuple, a list, a dict or
    one tensor), with the traced tensors in place of the originals.
    """
    if isinstance(original, dict):
        return kwargs
    if isinstance(original, tuple):
        return tuple(args)
    if isinstance(original, list):
        return list(args)
    return args[0]


def loss_from_output(output: Any, inputs: Any, loss_fn: Callable | None) -> torch.Tensor:
    """The scalar loss of one step: loss_fn(output, inputs), output.loss, or output itself."""
    if loss_fn is not None:
        try:
            inspect.signature(loss_fn).bind(output, inputs)
        except TypeError:
            raise InputError(f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!s} cannot be "
                             "called as loss_fn(output, inputs)",
                             hint="give it two parameters, e.g. `lambda out, inputs: ...`") from None
        except ValueError:
            pass   # a builtin without a signature: let the call speak for itself
        loss = loss_fn(output, inputs)
    elif isinstance(output, torch.Tensor):
        loss = output
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, dict) and output.get("loss") is not None:
        loss = output["loss"]
    else:
        raise TraceError(
            f"the model returned {type(output).__name__}, not a loss",
            hint="return a scalar loss from the model, give it labels so its output has `.loss`, "
                 "or return (model, inputs, loss_fn) from workload()")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TraceError(f"the loss must be a scalar tensor, got {shape}",
                         hint="reduce it (e.g. .mean()) in the model or in loss_fn")
    if not loss.requires_grad:
        raise TraceError("the loss does not require grad: nothing to train",
                         hint="check that the model has trainable parameters and is not run under no_grad")
    return loss


class _ModuleTracker:
    """Records, at every module entry/exit, how many graph nodes exist and which module is innermost."""

    def __init__(self, model: torch.nn.Module):
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stack: list[str] = []
        self.events: list[tuple[int, str]] = []  # (node count, innermost module after the event)
        self.handles = []

    def _count(self) -> int | None:
        mode = get_proxy_mode()
        return None if mode is None else len(mode.tracer.graph.nodes)

    def _pre(self, mod, args):
        n = self._count()
        if n is not None:
            self.stack.append(self.names.get(id(mod), self.stack[-1] if self.stack else ""))
            self.events.append((n, self.stack[-1]))

    def _post(self, mod, args, out):
        n = self._count()
        if n is not None and self.stack:
            self.stack.pop()
            self.events.append((n, self.stack[-1] if self.stack else ""))

    def __enter__(self):
        self.handles = [register_module_forward_pre_hook(self._pre),
                        register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def capture_joint(model: torch.nn.Module, inputs: Any, loss_fn: Callable | None = None, *,
                  autocast: str | None = None, target_device: str | None = None) -> JointGraph:
    """Trace forward + loss + backward of `model` on `inputs` into one FX graph.

    Real tensors give a runnable graph; FakeTensors (model and inputs built under one
    FakeTensorMode) give a graph with shapes only.

    `autocast` ("bf16" / "fp16"): forward and loss run under `torch.autocast` of the tensors'
    device type, as in `with torch.autocast(...): loss = ...; loss.backward()`; the casts it
    inserts are ops of the graph. `target_device` ("cuda" / "cpu", default "cuda"): the device a
    fake trace stands for, which decides how it traces dropout (`_cuda_dropout`); real traces
    always follow their own device.
    """
    params, layouts = local_params(dict(model.named_parameters()))   # DTensors: dtensor.py
    buffers = dict(model.named_buffers())
    param_names, buffer_names = list(params), list(buffers)
    grad_index = [i for i, n in enumerate(param_names) if params[n].requires_grad]
    if not grad_index:
        raise TraceError("the model has no trainable parameters",
                         hint="slackswap plans training steps: at least one parameter must require grad")
    args, kwargs = split_inputs(inputs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    tensor_leaves = [x for x, t in zip(leaves, is_tensor) if t]
    constants = [None if t else x for x, t in zip(leaves, is_tensor)]
    boundary: dict[str, int] = {}

    def step(param_list, buffer_list, input_list, tangent):
        it = iter(input_list)
        flat = [next(it) if t else c for t, c in zip(is_tensor, constants)]
        a, kw = pytree.tree_unflatten(flat, spec)
        state = {**as_dtensors(dict(zip(param_names, param_list)), layouts), **dict(zip(buffer_names, buffer_list))}
        with region:
            out = torch.func.functional_call(model, state, a, kw, strict=True)
            loss = loss_from_output(out, workload_inputs(inputs, a, kw), loss_fn)
        boundary["n"] = len(get_proxy_mode().tracer.graph.nodes)
        return loss, _param_grads(loss, [param_list[i] for i in grad_index], input_list, tangent)

    fake_mode = torch._guards.detect_fake_mode([*params.values(), *buffers.values(), *tensor_leaves])
    ref = next(iter(params.values()))
    region = autocast_region(autocast, ref.device.type)
    target = target_device or "cuda"
    if target not in TARGET_DEVICES:
        raise InputError(f"unknown target device '{target}'", hint="use cuda or cpu")
    was_training = model.training
    real_sizes = False
    model.train()
    try:
        emulate = fake_mode is not None and ref.device.type == "cpu" and target == "cuda"
        with _ModuleTracker(model) as tracker, _cuda_dropout(emulate), \
                _inline_checkpoints() as inlined, _watch_rng_restores() as restores, \
                _quiet_torch_logs(), _cpu_grouped_mm(), eager_stance():
            # eager_stance: a function the model compiled itself (torchtitan's compiled
            # flex_attention) is traced through its Python; make_fx refuses dynamo's frames
            traced = [list(params.values()), list(buffers.values()), tensor_leaves]
            if fake_mode is not None:
                with fake_mode:
                    tangent = torch.ones((), dtype=ref.dtype, device=ref.device)
                    gm = make_fx(step)(*traced, tangent)
            else:   # real tensors: through fake copies (see _trace_real_tensors)
                tangent = torch.ones((), dtype=ref.dtype, device=ref.device)
                gm, real_sizes = _trace_real_tensors(step, [*traced, tangent], tracker, boundary)
    except SlackswapError:   # already says what is wrong (a loss that is not a loss, ...)
        raise
    except Exception as exc:
        raise _explain(exc, fake=fake_mode is not None) from exc
    finally:
        model.train(was_training)

    joint = JointGraph(gm=gm, param_names=param_names, buffer_names=buffer_names, input_spec=spec,
                       input_leaf_is_tensor=is_tensor, input_constants=constants,
                       grad_param_index=grad_index, fake=fake_mode is not None,
                       checkpoints_inlined=inlined["n"], value_dependent_sizes=real_sizes,
                       checkpoint_regions=_region_nodes(gm, inlined["spans"]))
    _annotate(joint, tracker, boundary.get("n", 0))
    _own_checkpoints(joint)
    if restores:
        _refuse_rng_replay(joint, restores)
    return joint


def _own_checkpoints(joint: JointGraph) -> None:
    """The model's checkpointed regions re-run in the graph's backward, as their checkpoints
    re-run them (trace/checkpointed.py); `checkpoint_held`: what the checkpoints hold."""
    if joint.checkpoint_regions:
        from .checkpointed import recompute_regions
        joint.checkpoint_held = recompute_regions(joint.gm, joint.checkpoint_regions,
                                                  joint.phase, joint.module)


def _param_grads(loss, params: list, inputs: list, tangent) -> list:
    """The parameters' gradients. Inputs that take a gradient (a pipeline stage's received
    activations) get theirs too, as in eager, so that what backward saves for them is saved
    in the trace; theirs are not returned."""
    wanted = [x for x in inputs if x.requires_grad]
    grads = torch.autograd.grad(loss, params + wanted, grad_outputs=tangent.to(loss.dtype),
                                allow_unused=True)
    return list(grads[:len(params)])


TARGET_DEVICES = ("cuda", "cpu")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_AUTOCAST_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                   "half": "fp16"}


def autocast_name(value: Any) -> str | None:
    """None, "bf16"/"bfloat16"/torch.bfloat16 or "fp16"/"float16"/"half"/torch.float16 -> None, "bf16" or "fp16"."""
    if value is None or value is False:
        return None
    if isinstance(value, torch.dtype):
        value = dtype_name(value)
    name = _AUTOCAST_NAMES.get(str(value).lower()) if isinstance(value, (str, torch.dtype)) else None
    if name is None:
        raise InputError(f"unknown autocast dtype {value!r}",
                         hint="use bf16 or fp16 (torch.autocast's lower-precision dtype)")
    return name


def autocast_region(autocast: Any, device_type: str):
    """`torch.autocast(device_type, dtype)` for an autocast name, else a context that does nothing."""
    name = autocast_name(autocast)
    if name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[name])


@contextlib.contextmanager
def _inline_checkpoints():
    """Trace `torch.utils.checkpoint` regions as plain calls; yields {"n": regions inlined,
    "spans": (tracer, first node, end node) of each outermost region}.

    A checkpointed region re-runs its forward in backward with the random-number generator
    restored to its state at the region's forward, so dropout draws the same mask twice. A
    traced graph cannot replay a generator state: the re-run would draw a fresh mask, and the
    patched step would compute other gradients than eager. Tracing the region as a plain call
    gives the values and gradients eager computes (checkpointing changes only what is held);
    what it holds is then put back by copying the region's re-run into the backward, random
    ops left out (`_own_checkpoints`).
    Both variants are inlined: non-reentrant (a generator around the call: torch 2.15's
    `checkpoint` calls `_checkpoint_without_reentrant_generator_impl`, 2.13's the name without
    `_impl`, which 2.15 keeps for other callers: both are replaced) and reentrant
    (`CheckpointFunction`, which runs the region without grad when no input needs one).
    """
    count = {"n": 0, "spans": [], "depth": 0}
    generators = {name: getattr(ckpt, name) for name in (
        "_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")
        if hasattr(ckpt, name)}
    function = ckpt.CheckpointFunction

    def plain_generator(fn, *args, **kwargs):
        with _span(count):
            yield

    class PlainCall:
        @staticmethod
        def apply(run_function, preserve_rng_state, *args):
            with _span(count):
                if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                    return run_function(*args)
                with torch.no_grad():
                    return run_function(*args)

    for name in generators:
        setattr(ckpt, name, plain_generator)
    ckpt.CheckpointFunction = PlainCall
    try:
        yield count
    finally:
        for name, generator in generators.items():
            setattr(ckpt, name, generator)
        ckpt.CheckpointFunction = function


@contextlib.contextmanager
def _span(count: dict):
    """One checkpointed region traced: counted, and, when outermost, the graph's node count
    at its start and end noted (`count["spans"]`)."""
    count["n"] += 1
    mode = get_proxy_mode()
    start = len(mode.tracer.graph.nodes) if mode is not None else None
    count["depth"] += 1
    try:
        yield
    finally:
        count["depth"] -= 1
    if start is not None and count["depth"] == 0:
        count["spans"].append((id(mode.tracer), start, len(mode.tracer.graph.nodes)))


def _region_nodes(gm: fx.GraphModule, spans: list[tuple[int, int, int]]) -> list[list[str]]:
    """The names of each span's call_function nodes (node counts of the traced graph,
    whose order the GraphModule keeps); the last trace's spans only (a fake trace that
    needed values is traced again for real)."""
    nodes = list(gm.graph.nodes)
    last = spans[-1][0] if spans else None
    return [[n.name for n in nodes[a:b] if n.op == "call_function"]
            for tracer, a, b in spans if tracer == last]


@contextlib.contextmanager
def _watch_rng_restores():
    """Record every `set_rng_state` the traced step makes (yields the list of callers).

    Code that restores a generator state inside the step means to draw the same random
    numbers twice (a hand-written recompute). The graph holds the draws but not the restore.
    """
    calls: list[str] = []
    patched = []
    for mod in (torch, torch.random, getattr(torch, "cuda", None)):
        original = getattr(mod, "set_rng_state", None) if mod is not None else None
        if original is None:
            continue

        def wrapper(*a, _original=original, _name=f"{mod.__name__}.set_rng_state", **kw):
            if get_proxy_mode() is not None:
                calls.append(_name)
            return _original(*a, **kw)

        patched.append((mod, original))
        mod.set_rng_state = wrapper
    try:
        yield calls
    finally:
        for mod, original in patched:
            mod.set_rng_state = original


def _refuse_rng_replay(joint: JointGraph, restores: list[str]) -> None:
    """A step that restores the generator state and draws random numbers cannot be replayed."""
    random_ops = [n.name for n in joint.gm.graph.nodes
                  if n.op == "call_function" and hasattr(n.target, "_schema") and is_random_op(n)]
    if random_ops:
        raise TraceError(
            f"the step restores the random-number generator state ({restores[0]}) and draws "
            f"random numbers ({random_ops[0]}): a traced graph cannot replay a generator state, "
            "so a patched step would draw other numbers than eager",
            hint="recompute through torch.utils.checkpoint (slackswap traces its regions as plain "
                 "calls) or drop the hand-written recompute: the plan decides what to recompute")


_QUIET_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.proxy_tensor",
                  "torch.fx.experimental.symbolic_shapes")


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch logs a failing op's traceback (22 lines) before raising; the caller reports the
    error itself, in one line, so torch's loggers say nothing while the step is traced."""
    loggers = [logging.getLogger(n) for n in _QUIET_LOGGERS]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was


_GROUPED_MM_TORCH = "/".join(PARTS["grouped_mm_lift"].tested)


@contextlib.contextmanager
def _cpu_grouped_mm():
    """Let `aten._grouped_mm` of fp32/fp16 tensors through its shape rule while tracing.

    Mixture-of-experts layers (Hugging Face Mixtral's default experts) call `_grouped_mm`,
    whose CPU kernel takes fp32, fp16 and bf16, but whose meta kernel (the shape rule fake
    tensors run) checks CUDA's rule, bf16 only, so any fp32 model fails to trace. For
    operands of one float dtype without scales, bias or another output dtype, the output is
    made by the meta kernel's own helper; everything else takes torch's rule unchanged (the
    rule runs on meta tensors, which do not say which device they stand for: a CUDA run of an
    fp32 `_grouped_mm` fails in eager as it would without slackswap). The
    helper and the rule are private to torch (`torch._meta_registrations`): the lift applies
    on torch 2.13.x (tested) only, and fails safe (torch's error) elsewhere; torch 2.15's own
    rule takes fp32 and fp16, so it needs none (`torch_api.PARTS["grouped_mm_lift"]`).
    """
    import torch._meta_registrations as meta_reg  # private: loaded only for the lift
    original = getattr(meta_reg, "_meta_grouped_mm_common", None)
    make_out = getattr(meta_reg, "_create_grouped_mm_output_tensor", None)
    if original is None or make_out is None or not is_tested("grouped_mm_lift"):
        yield
        return

    def common(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
               out_dtype=None, use_fast_accum=False):
        if (scale_a is None and scale_b is None and bias is None and scale_result is None
                and mat_a.dtype == mat_b.dtype
                and mat_a.dtype in (torch.float32, torch.float16)
                and out_dtype in (None, mat_a.dtype) and mat_a.dim() in (2, 3)
                and mat_b.dim() in (2, 3)):
            return make_out(mat_a, mat_b, offs, None)
        return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype,
                        use_fast_accum)

    meta_reg._meta_grouped_mm_common = common
    try:
        yield
    finally:
        meta_reg._meta_grouped_mm_common = original


@contextlib.contextmanager
def _cuda_dropout(enabled: bool):
    """Trace dropout as CUDA runs it: one fused `native_dropout` with a 1-byte bool mask.

    On a CPU, `F.dropout` decomposes into `bernoulli_` on a mask of the input's dtype (2 bytes
    per element in bf16); on CUDA the fused kernel saves a bool mask. The two also round
    differently in bf16, so a plan must draw dropout the way the device it runs on does.
    A fake-tensor trace (its tensors are fake CPU tensors) stands for the device the profile is
    for: `target_device="cuda"` (the default) takes the CUDA path, `"cpu"` keeps the CPU one.
    Real traces keep the device's own path, so a patched step draws the same random numbers as
    eager.
    """
    if not enabled:
        yield
        return
    original = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and input.numel() > 0:
            out = torch.native_dropout(input, p, True)[0]
            return input.copy_(out) if inplace else out
        return original(input, p, training, inplace)

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


def _annotate(joint: JointGraph, tracker: _ModuleTracker, boundary: int) -> None:
    nodes = list(joint.gm.graph.nodes)
    events = tracker.events
    ev, current = 0, ""
    for i, node in enumerate(nodes):
        while ev < len(events) and events[ev][0] <= i:
            current = events[ev][1]
            ev += 1
        if node.op in ("placeholder", "output"):
            continue
        joint.phase[node.name] = "forward" if i < boundary else "backward"
        joint.module[node.name] = current if i < boundary else ""
    out = next(n for n in reversed(nodes) if n.op == "output")
    loss = out.args[0][0]
    joint.loss_node = loss.name
    # backward nodes: module of the latest forward node read, else of the latest backward input
    position = {node.name: i for i, node in enumerate(nodes)}
    for node in nodes:
        if joint.phase.get(node.name) != "backward":
            continue
        ins = sorted(node.all_input_nodes, key=lambda a: position[a.name], reverse=True)
        fwd = [a for a in ins if joint.phase.get(a.name) == "forward" and joint.module.get(a.name)]
        bwd = [a for a in ins if joint.phase.get(a.name) == "backward" and joint.module.get(a.name)]
        for a in fwd[:1] or bwd[:1]:
            joint.module[node.name] = joint.module[a.name]


def _trace_real_tensors(step, args: list, tracker, boundary: dict) -> tuple[fx.GraphModule, bool]:
    """(graph, traced for real?) of `step` on real tensors.

    Real tensors are traced through fake copies (tracing_mode="fake"): the graph is the same
    as a --device fake trace of the same model (libraries such as transformers branch on "am
    I being traced?"), and each value's meta["val"] shares storage with the values it
    aliases; the graph module still runs on the real tensors. Where sizes depend on values
    (MoE routing: nonzero, torch.where), the real step is traced instead, which fixes them at
    this batch's (`_trace_real`)."""
    try:
        gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
        if _symbolic_sizes(gm):
            raise RuntimeError("data-dependent output sizes")
        return gm, False
    except Exception as exc:
        if not needs_values(exc):
            raise
    tracker.events.clear()
    boundary.clear()
    return _trace_real(step, args), True


def _symbolic_sizes(gm: fx.GraphModule) -> bool:
    """Does any value of the graph have a size fixed only at run time (an unbacked symbol)?"""
    for n in gm.graph.nodes:
        for v in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape):
                return True
    return False


def _trace_real(step, args: list) -> fx.GraphModule:
    """Trace `step` on real tensors (`tracing_mode="real"`): sizes that depend on values, and
    values Python reads (`.item()`, a branch on a tensor), are those of this batch. make_fx then records them as unbacked symbols in `meta["val"]`; the
    graph is run once more from the same random-number state, and each node's `meta["val"]`
    becomes a FakeTensor of its real value (concrete sizes, storages shared as the run shares
    them: one converter for the whole run).
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        # values read in Python (`.item()`, `if expert_hit:`) are this batch's, as the sizes
        gm = make_fx(step, tracing_mode="real", _error_on_data_dependent_ops=False)(*args)
    flat = pytree.tree_leaves(args)
    fake = FakeTensorMode(allow_non_fake_inputs=True)

    def to_fake(t):     # one converter: storages shared in the run are shared by the fakes
        return fake.from_tensor(t.detach(), static_shapes=True)

    class Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op not in ("output",):
                n.meta["val"] = pytree.tree_map_only(torch.Tensor, to_fake, out)
            return out

    with torch.no_grad():   # values kept to the end: a freed storage's address is not reused
        Record(gm, garbage_collect_values=False).run(*flat)
    return gm


def needs_values(exc: BaseException) -> bool:
    """Did tracing fail because a size or a branch depends on tensor values (nonzero,
    torch.where routing, .item())? Fake tensors have no values; a real trace does."""
    text = f"{type(exc).__name__}: {exc}"
    name = type(exc).__name__
    return ("DataDependent" in name or "DynamicOutputShape" in name or "data-dependent" in text
            or "GuardOnDataDependent" in text or "dynamic output shape" in text.lower())


_VALUES_HINT = ("profile with --device cpu (or --device cuda): a real trace takes the sizes of "
                "the profiled batch (say its expert routing); the plan then runs on later "
                "batches exactly, the ops whose sizes differ left unplanned")


def value_site(exc: BaseException) -> str:
    """Where the traced step read a tensor's value: `file.py:12: the line` of the innermost
    frame outside torch and slackswap that led to `exc` (or to an exception it wraps), "in
    backward: ..." when only autograd's engine did (a gradient whose size depends on
    values), else ""."""
    torch_dir = str(Path(torch.__file__).parent) + os.sep
    ours = str(Path(__file__).resolve().parents[1]) + os.sep
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    backward = False
    for e in reversed(chain):                       # the innermost exception first
        frames = traceback.extract_tb(e.__traceback__)
        backward = backward or any(f.name == "_engine_run_backward" for f in frames)
        mine = [f for f in frames if not f.filename.startswith((torch_dir, ours))]
        if mine:
            f = mine[-1]
            return f"at {Path(f.filename).name}:{f.lineno}: {(f.line or '').strip()[:120]}"
    if backward:
        return ("in backward: a gradient whose size depends on values (such as that of an "
                "index or an assignment with a boolean mask)")
    return ""


def _explain(exc: Exception, fake: bool = True) -> TraceError:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0][:400]
    if needs_values(exc):
        site = value_site(exc)
        first = f"{first}, {site}" if site else first
        return TraceError(
            "the step is data-dependent: its sizes or control flow depend on tensor values "
            f"(such as expert routing in a mixture of experts), which fake tensors (--device "
            f"fake) do not have "
            f"({first})" if fake else f"the step is data-dependent in a way a trace cannot "
                                      f"capture ({first})",
            hint=_VALUES_HINT if fake else "run the workload eagerly to check it trains")
    if "Expected inputs of BF16 type" in text:
        return TraceError(f"tracing the training step failed: {first}",
                          hint=f"torch's shape rule for _grouped_mm takes bf16 only; slackswap "
                               f"lifts it for fp32/fp16 on torch {_GROUPED_MM_TORCH}.x "
                               f"only (this is {torch.__version__}): build the model in bf16, "
                               "or choose the experts' eager implementation and --device cpu")
    return TraceError(f"tracing the training step failed: {first}",
                      hint="run the workload eagerly to check it trains (loss.backward()); "
                           "ops that call into Python or C++ extensions opaque to torch cannot be traced")

